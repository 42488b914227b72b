import pytest
import torch

from loopspec.errors import LoopspecError
from loopspec.model.kv_cache import KVCache, SlotGrowth
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
    rest = [target(ids[:, i : i + 1], cache) for i in range(20, 25)]
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


def test_a_growing_cache_holds_what_a_static_one_holds():
    """Appends, rollbacks, a tree commit and a row swap, crossing several steps of a SlotGrowth both
    ways: every row's valid slots equal a static cache's; the buffer follows the rows' need."""
    growth = SlotGrowth(step=8, limit=70, shrink_after=2)
    static, grown = KVCache(2, 3, 2, 64, 4), KVCache(2, 3, 2, 64, 4, growth=growth)
    assert grown.slots == 8 and static.slots == 64
    g = torch.Generator().manual_seed(0)

    def both(op, *args):
        for cache in (static, grown):
            getattr(cache, op)(*args)

    for step, (rows, counts) in enumerate(
        [([0, 1, 2], [5, 3, 7]), ([0, 1], [9, 9]), ([2], [20]), ([0, 1, 2], [4, 6, 1])]
    ):
        T = max(counts)
        k, v = torch.randn(2, len(rows), 2, T, 4, generator=g), torch.randn(2, len(rows), 2, T, 4, generator=g)
        both("append", k, v, rows, counts)
        assert grown.slots % 8 == 0 and grown.slots >= int(grown.lengths.max())
    both("commit", [10, 10], [[0, 2, 3], [0, 1]])
    both("swap_rows", 0, 2)
    assert grown.lengths.tolist() == static.lengths.tolist()
    for row, n in enumerate(grown.lengths.tolist()):
        assert torch.equal(grown.k[:, row, :, :n], static.k[:, row, :, :n])
        assert torch.equal(grown.v[:, row, :, :n], static.v[:, row, :, :n])
    key, value = grown.dense_prefix([0, 1], int(grown.lengths[:2].max()) + 3)
    assert all(layer.is_contiguous() and layer.data_ptr() == grown.k[i].data_ptr() for i, layer in enumerate(key))
    assert key.shape[3] == grown.slots and value.shape[3] == grown.slots
    wide = grown.slots
    both("rollback", [2, 1, 0])  # the long rows ended: the buffer narrows on the next call, keeping what is valid
    kept = grown.k[:, 0, :, :2].clone()
    grown.dense_prefix([0], 4)
    assert grown.slots == 8 < wide and torch.equal(grown.k[:, 0, :, :2], kept)
    with pytest.raises(LoopspecError, match="widest"):
        grown.dense_prefix([0], 71)


def test_slot_growth_rounds_up_to_its_step_and_narrows_only_by_a_margin():
    growth = SlotGrowth(step=32, limit=1040)
    assert growth.fit(258, 32) == 288 and growth.fit(288, 288) == 288 and growth.fit(289, 288) == 320
    assert growth.fit(1030, 1024) == 1040  # never past the engines' widest past
    assert growth.fit(200, 320) == 320  # within shrink_after steps: kept
    assert growth.fit(20, 320) == 32
