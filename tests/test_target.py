import pytest
import torch

from loopspec.errors import LoopspecError
from loopspec.model.target import default_target_layer_ids
from loopspec.weights import load_target_dir

from conftest import FAMILIES, save_tiny_target


def hf_reference(directory, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    return out.logits, out.hidden_states


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_taps_match_transformers(family, tiny_targets):
    directory = tiny_targets[family]
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_hidden = hf_reference(directory, ids)
    target = load_target_dir(directory)
    layer_ids = [0, 2, 5]  # 5 is the last layer: HF's hidden_states[L] is final-normed
    target.set_taps(layer_ids)
    out = target(ids, target.new_cache(64))
    assert (out.logits - ref_logits).abs().max() <= 1e-4
    ref_taps = torch.cat([ref_hidden[l + 1] for l in layer_ids], dim=-1)
    assert out.taps.shape == (1, 40, 3 * 64)
    assert (out.taps - ref_taps).abs().max() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_decoding_and_rollback_match_full_forward(family, tiny_targets):
    target = load_target_dir(tiny_targets[family])
    target.set_taps([1, 3])
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(2))
    full = target(ids, target.new_cache(64))
    cache = target.new_cache(64)
    first = target(ids[:, :20], cache)
    junk = target(torch.randint(0, 128, (1, 7)), cache)  # speculative tokens that get rejected
    assert junk.logits.shape[1] == 7 and cache.lengths[0] == 27
    cache.rollback([20])
    rest = [target(ids[:, i:i + 1], cache) for i in range(20, 25)]
    tail = target(ids[:, 25:], cache)
    logits = torch.cat([first.logits] + [r.logits for r in rest] + [tail.logits], dim=1)
    taps = torch.cat([first.taps] + [r.taps for r in rest] + [tail.taps], dim=1)
    assert (logits - full.logits).abs().max() <= 1e-4
    assert (taps - full.taps).abs().max() <= 1e-4


def test_tied_and_untied_embeddings(tmp_path):
    for tie in (True, False):
        d = save_tiny_target("qwen2", tmp_path / str(tie), tie=tie)
        target = load_target_dir(d)
        assert (target.lm_head.weight is target.embed_tokens.weight) == tie
        ids = torch.arange(10)[None]
        ref, _ = hf_reference(d, ids)
        assert (target(ids, target.new_cache(16)).logits - ref).abs().max() <= 1e-4


def test_default_tap_formula():
    assert default_target_layer_ids(30) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 1) == [15]


def test_bad_checkpoints(tmp_path, tiny_targets):
    with pytest.raises(LoopspecError, match="does not exist"):
        load_target_dir(tmp_path / "nope")
    d = save_tiny_target("llama", tmp_path / "corrupt")
    f = next(d.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(LoopspecError, match="corrupt"):
        load_target_dir(d)
    target = load_target_dir(tiny_targets["llama"])
    with pytest.raises(LoopspecError, match="out of range"):
        target.set_taps([6])
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(LoopspecError, match="unsupported architecture"):
        load_target_dir(tmp_path / "gpt")
