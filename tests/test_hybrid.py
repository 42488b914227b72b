"""The hybrid target families Qwen3.5, Qwen3.5-MoE and Qwen3-Next: Gated DeltaNet linear-attention
layers between gated full-attention layers, with a recurrent state that a rejected verification must
roll back exactly (Qwen3.5-MoE: routed experts and a gated shared expert as every feed-forward;
Qwen3-Next: the same on the layers its config picks, its linear-attention projections fused per
key-head group).

transformers' implementation is the oracle, on tiny random configs built here with lively weights
over a prompt longer than its delta-rule chunk (64 tokens). Its torch paths run the delta rule in
fp32 whatever the model's dtype, and its prefill takes the chunked form while its one-token decoding
takes the recurrent one; loopspec runs the recurrent form everywhere, with the same fp32 steps, so an
fp64 model matches transformers' one-token decoding to 1e-9 and its chunked prefill to fp32's
rounding."""

import json

import pytest
import torch

from loopspec.errors import LoopspecError
from loopspec.model import qwen3_5
from loopspec.model.dflash import DrafterConfig
from loopspec.model.families import FAMILIES, export_refusal
from loopspec.model.target import RotaryTable
from loopspec.runtime.decoder import Decoder
from loopspec.engines.torch_engine import TorchEngine
from loopspec.settings import DecodingSettings as Method
from loopspec.weights import load_target_dir, read_safetensors_dir, write_safetensors

from conftest import agreeing_drafter, batched_greedy_equals_plain, repeating_prompts

LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
PROMPT = 80  # past transformers' delta-rule chunk of 64 tokens


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Width-64 models run fastest on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_text_config(family: str = "qwen3_5", **changes):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    fields = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_conv_kernel_dim=4,
        layer_types=LAYER_TYPES,
        max_position_embeddings=512,
        eos_token_id=2,
        bos_token_id=1,
        tie_word_embeddings=False,
    )
    if family == "qwen3_5_moe":  # 4 experts, 2 per token, and the shared one
        return Qwen3_5MoeTextConfig(
            **fields,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            **changes,
        )
    if family == "qwen3_next":  # layer 0 dense (mlp_only_layers), layers 1-3 the experts and the shared one
        return Qwen3NextConfig(
            **fields,
            intermediate_size=96,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            **changes,
        )
    return Qwen3_5TextConfig(
        **{**fields, "intermediate_size": 96, **changes}
    )  # partial rotary 0.25: RoPE on 8 of 32 dims


def lively_(model, seed: int, short_memory: bool = False):
    """Weights that make the greedy text follow the context: decays of about 0.6 to 0.9 per token,
    norms away from their identity, matrices scaled up. `short_memory`: decays of about 0.2 to 0.5 and
    a faint attention output, so that the next token depends mostly on the last few (a text that
    repeats an n-gram then tends to repeat what followed it, as the suffix index drafts)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.randn_like(p) * 0.5 + (0.5 if short_memory else -1.5))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif "linear_attn.norm" in name:  # the gated norm scales by its weight
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name:  # the others by (1 + weight)
                p.copy_(0.2 * torch.randn_like(p))
            elif "conv1d" in name:
                p.copy_(torch.randn_like(p) / 2)
            elif "embed" in name or "lm_head" in name:
                p.copy_(0.5 * torch.randn_like(p))
            else:
                faint = 0.1 if short_memory and "self_attn.o_proj" in name else 1.0
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 * 1.5 * faint)
    return model


def save_hybrid_target(directory, seed: int = 0, short_memory: bool = False, family: str = "qwen3_5"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_text_config(family)).eval()
    lively_(model, seed, short_memory).save_pretrained(str(directory))
    return directory


FAMILIES_HERE = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {f: save_hybrid_target(root / f, seed=i, family=f) for i, f in enumerate(FAMILIES_HERE)}


@pytest.fixture(scope="module")
def hybrid_dir(hybrid_dirs):
    return hybrid_dirs["qwen3_5"]


def hf_model(directory, dtype):
    from transformers import AutoModelForCausalLM

    # the eager experts loop: the grouped kernel takes no fp64
    return AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=dtype, attn_implementation="sdpa", experts_implementation="eager"
    ).eval()


@torch.no_grad()
def hf_one_token_decoding(directory, ids, dtype):
    """transformers decoding ids one token at a time → logits [1, T, V], hidden states (per layer
    [1, T, H]). Its cache starts with zero states marked as present, so that every token takes its
    recurrent path (its first call would otherwise take the chunked one)."""
    from transformers import DynamicCache

    hf = hf_model(directory, dtype)
    cache = DynamicCache(config=hf.config)
    for i, layer in enumerate(hf.model.layers):
        if hf.config.layer_types[i] == "linear_attention":
            mixer = layer.linear_attn
            cache.update_conv_state(torch.zeros(1, mixer.conv_dim, mixer.conv_kernel_size, dtype=dtype), i)
            cache.update_recurrent_state(torch.zeros(1, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim), i)
    steps = [
        hf(ids[:, t : t + 1], past_key_values=cache, use_cache=True, output_hidden_states=True)
        for t in range(ids.shape[1])
    ]
    hidden = [torch.cat([s.hidden_states[i] for s in steps], dim=1) for i in range(len(steps[0].hidden_states))]
    return torch.cat([s.logits for s in steps], dim=1), hidden


@torch.no_grad()
def hf_prefill(directory, ids, dtype):
    out = hf_model(directory, dtype)(ids, output_hidden_states=True)
    return out.logits, out.hidden_states


def prompt_ids(n=PROMPT, seed=1):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def relative(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize(
    "dtype,oracle,tolerance", [(torch.float64, hf_one_token_decoding, 1e-9), (torch.float32, hf_prefill, 1e-5)]
)
@pytest.mark.parametrize("family", FAMILIES_HERE)
def test_logits_and_taps_match_transformers(family, dtype, oracle, tolerance, hybrid_dirs):
    ids = prompt_ids()
    ref_logits, ref_hidden = oracle(hybrid_dirs[family], ids, dtype)
    target = load_target_dir(hybrid_dirs[family], dtype=dtype)
    assert target.cfg.family == family
    taps = [0, 1, 2, 3]  # 3 is the last layer: HF's hidden_states[L] is final-normed
    target.set_taps(taps)
    out = target(ids, target.new_cache(128))
    assert ref_logits.abs().max() > 1.0  # lively: logits far from uniform
    assert relative(out.logits, ref_logits) <= tolerance
    assert relative(out.taps, torch.cat([ref_hidden[i + 1] for i in taps], dim=-1)) <= tolerance


def test_fp64_prefill_is_transformers_chunked_prefill_up_to_its_fp32_delta_rule(hybrid_dir):
    """transformers' own prefill (the chunked delta rule, in fp32) and its one-token decoding differ by
    fp32's rounding; loopspec is the second to 1e-9 (above), hence the first to fp32's rounding."""
    ids = prompt_ids()
    ref, _ = hf_prefill(hybrid_dir, ids, torch.float64)
    target = load_target_dir(hybrid_dir, dtype=torch.float64)
    assert 1e-9 < relative(target(ids, target.new_cache(128)).logits, ref) <= 1e-5


def test_text_positions_make_multimodal_rope_plain_rope_over_the_rotary_dims():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    config = tiny_text_config(
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        }
    )
    mrope = Qwen3_5TextRotaryEmbedding(config)
    positions = torch.arange(40)[None, None, :].expand(3, 1, -1)  # text: one position in all three sections
    cos, sin = mrope(torch.zeros(1, dtype=torch.float32), positions)
    table = RotaryTable(8, 10000.0, None, 64)
    assert torch.equal(cos[0], table.cos[:40]) and torch.equal(sin[0], table.sin[:40])
    image = positions.clone()
    image[1] += 7  # an image token's height section: multimodal positions are not plain RoPE
    assert not torch.equal(mrope(torch.zeros(1), image)[0][0], table.cos[:40])


def speculative_replay(target, ids, junk_seed: int = 3) -> float:
    """Decode `ids` as speculative decoding does — verifications of real tokens followed by rejected
    junk, rolled back to what was accepted — and compare with one forward: the largest relative
    difference of logits and taps."""
    full = target(ids, target.new_cache(128))
    cache = target.new_cache(128)
    parts = [target(ids[:, :6], cache)]
    g = torch.Generator().manual_seed(junk_seed)
    i, accepted = 6, 0
    while i < 40:  # verifications of 5 tokens: `accepted` real ones, then junk that is rejected
        junk = torch.randint(0, 128, (1, 5 - accepted), generator=g)
        out = target(torch.cat([ids[:, i : i + accepted], junk], dim=1), cache)
        cache.rollback([i + accepted])
        if accepted:
            parts.append(type(out)(out.logits[:, :accepted], out.taps[:, :accepted]))
        i, accepted = i + accepted, (accepted + 1) % 4
    parts.append(target(ids[:, i:], cache))
    logits = torch.cat([p.logits for p in parts], dim=1)
    taps = torch.cat([p.taps for p in parts], dim=1)
    return max(relative(logits, full.logits), relative(taps, full.taps))


def fp64_target_of(directory):
    target = load_target_dir(directory, dtype=torch.float64)
    target.set_taps([1, 3])
    return target


@pytest.fixture(scope="module")
def fp64_target(hybrid_dir):
    return fp64_target_of(hybrid_dir)


@pytest.mark.parametrize("family", FAMILIES_HERE)
def test_stepwise_decoding_and_rollback_match_one_forward(family, hybrid_dirs):
    assert speculative_replay(fp64_target_of(hybrid_dirs[family]), prompt_ids()) <= 1e-9


def test_qwen3_next_projections_read_in_checkpoint_order_are_caught(hybrid_dirs, monkeypatch):
    """Planted: in_proj_qkvz read as q, k, v, z laid end to end (and in_proj_ba as b then a) rather
    than per key-head group: the logits leave transformers' far behind."""

    def end_to_end(qkvz, ba, cfg, prefix):
        dims = cfg.linear_attention
        return torch.cat([*qkvz.split((dims.key_dim, dims.key_dim, dims.value_dim, dims.value_dim)), ba])

    ids = prompt_ids()
    ref, _ = hf_prefill(hybrid_dirs["qwen3_next"], ids, torch.float32)
    monkeypatch.setattr(qwen3_5, "ungroup_qwen3_next_projections", end_to_end)
    target = load_target_dir(hybrid_dirs["qwen3_next"])
    assert relative(target(ids, target.new_cache(128)).logits, ref) > 1e-2


def test_a_snapshot_taken_one_position_late_is_caught(fp64_target, monkeypatch):
    """Planted: the state after token t is kept as the state after t - 1 tokens, so a rollback
    restores the state one token ahead. The replay above then leaves one forward's logits."""
    monkeypatch.setattr(qwen3_5, "snapshot_slot", lambda token: token)
    assert speculative_replay(fp64_target, prompt_ids()) > 1e-3


def test_a_rollback_outside_the_latest_forward_is_refused_in_one_line(fp64_target):
    cache = fp64_target.new_cache(64)
    fp64_target(prompt_ids(10), cache)
    fp64_target(prompt_ids(3, seed=2), cache)
    cache.rollback([5])  # inside the first forward, which the second replaced
    with pytest.raises(LoopspecError, match="not kept") as e:
        fp64_target(prompt_ids(1), cache)
    assert "\n" not in str(e.value)
    prefill = fp64_target.new_cache(64)
    fp64_target(prompt_ids(10), prefill, last_logits_only=True)  # a prefill keeps no state inside it
    prefill.rollback([4])
    with pytest.raises(LoopspecError, match="not kept"):
        fp64_target(prompt_ids(1), prefill)
    prefill.rollback([0])  # length 0 is the zero state: a new request starts there
    assert (
        relative(
            fp64_target(prompt_ids(10), prefill).logits, fp64_target(prompt_ids(10), fp64_target.new_cache(64)).logits
        )
        == 0
    )


def test_padding_never_advances_a_rows_state(fp64_target):
    """Ragged rows batched (right-padded) and then continued, a pair of rows swapped between: each row's
    logits are those it has alone, so its padding left its states untouched."""
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 128, (n,), generator=g) for n in (17, 5, 11)]
    more = [torch.randint(0, 128, (n,), generator=g) for n in (2, 4, 1)]
    alone = []
    for r, m in zip(rows, more):
        cache = fp64_target.new_cache(64)
        alone.append((fp64_target(r[None], cache).logits[0], fp64_target(m[None], cache).logits[0]))

    def padded(seqs):
        ids = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, : len(s)] = s
        return ids, torch.tensor([len(s) for s in seqs])

    cache = fp64_target.new_cache(64, rows=3)
    ids, counts = padded(rows)
    with torch.inference_mode():  # as the engines run; the swap below runs outside it
        first = fp64_target(ids, cache, counts=counts).logits
    assert cache.state_lengths.tolist() == [17, 5, 11]
    cache.swap_rows(0, 2)
    order = [2, 1, 0]  # the rows' places after the swap
    ids, counts = padded([more[b] for b in order])
    second = fp64_target(ids, cache, counts=counts).logits
    for b, (r, m) in enumerate(zip(rows, more)):
        assert relative(first[b, : len(r)], alone[b][0]) <= 1e-9
        assert relative(second[order.index(b), : len(m)], alone[b][1]) <= 1e-9


# measured accepted drafts of 160 tokens: Qwen3.5-MoE dloop 135, as on Qwen3.5 (every draft the budget
# allows); Qwen3-Next dflash 124, dloop 136
MOE_FLOORS = {
    ("qwen3_5_moe", "dloop"): 90,
    ("qwen3_next", "ar"): 0,
    ("qwen3_next", "dflash"): 90,
    ("qwen3_next", "dloop"): 90,
}

METHODS = {
    "ar": Method(),
    "dflash": Method("dflash", block_size=5),
    "dloop": Method("dloop", block_size=5, max_stages=3, gate_threshold=-1e9),
    "suffix": Method("suffix", block_size=6),
}
PROMPTS = [torch.randint(3, 120, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 9, 15, 22)]


def engine_with_agreeing_drafter(directory):
    target = load_target_dir(directory)
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=5, mask_token_id=127)
    return TorchEngine(target, agreeing_drafter(target, PROMPTS, cfg), max_context=160)


@pytest.fixture(scope="module")
def engine(hybrid_dir):
    return engine_with_agreeing_drafter(hybrid_dir)


@pytest.fixture(scope="module")
def short_memory_engine(tmp_path_factory):
    """A target whose next token follows its last few (the suffix index's drafts are then accepted at
    times: the lively target continues a repeated n-gram otherwise than before, every time)."""
    directory = save_hybrid_target(tmp_path_factory.mktemp("qwen3_5-short") / "target", short_memory=True)
    return TorchEngine(load_target_dir(directory), None, max_context=160)


@pytest.mark.parametrize("name", list(METHODS))
def test_speculative_decoding_equals_plain_decoding(name, engine, short_memory_engine):
    """Greedy: every method, its rows batched together, commits plain decoding's tokens, many of them
    accepted drafts (the drafter agrees with the target), so that each round rolls the rejected tail
    of a verification back out of the recurrent states and keeps the accepted head."""
    prompts = PROMPTS
    if name == "suffix":  # the suffix index drafts from the text: the prompts repeat their beginning
        engine = short_memory_engine
        prompts = repeating_prompts(engine, PROMPTS)
    accepted = batched_greedy_equals_plain(engine, prompts, METHODS[name])
    # measured, of 160 tokens: dflash 124 accepted drafts, dloop 135 (every draft the token budget
    # allows: the drafter was trained on these texts), suffix 32 (on the lively target: 0)
    assert accepted >= {"ar": 0, "suffix": 16}.get(name, 90)


@pytest.fixture(scope="module")
def moe_engines(hybrid_dirs):
    return {f: engine_with_agreeing_drafter(hybrid_dirs[f]) for f in ("qwen3_5_moe", "qwen3_next")}


@pytest.mark.parametrize("family,name", list(MOE_FLOORS))
def test_the_moe_families_decode_speculatively_as_plainly(family, name, moe_engines):
    """Qwen3.5-MoE and Qwen3-Next: the experts routed per token under verification and rollback alike
    (Qwen3-Next: its ungrouped projections too)."""
    engine = moe_engines[family]
    assert batched_greedy_equals_plain(engine, PROMPTS, METHODS[name]) >= MOE_FLOORS[family, name]


def test_a_tree_request_is_refused_in_one_line(engine):
    assert engine.chains_only and not FAMILIES["qwen3_5"].trees
    with pytest.raises(LoopspecError, match="verifies chains exactly") as e:
        Decoder(engine, Method("dflash", block_size=5, tree_budget=8, suffix=True))
    assert "qwen3_5" in str(e.value) and "linear-attention" in str(e.value) and "\n" not in str(e.value)
    cache = engine.target.new_cache(32)
    with pytest.raises(LoopspecError, match="chains"):
        cache.commit([0], [[0, 2]])  # a tree path that skips a node
    siblings = torch.tensor([[[True, False, False], [True, True, False], [True, False, True]]])
    with pytest.raises(LoopspecError, match="not draft trees"):
        engine.target(torch.tensor([[5, 6, 7]]), cache, tree_mask=siblings)


@pytest.mark.parametrize("family", FAMILIES_HERE)
def test_exported_engines_refuse_the_family_in_one_line(family, hybrid_dirs):
    cfg = load_target_dir(hybrid_dirs[family]).cfg
    assert cfg.family == family and not FAMILIES[family].exported and not FAMILIES[family].trees
    message = export_refusal(cfg, "onnxruntime")
    assert family in message and "--backend torch" in message and "\n" not in message


def test_the_multimodal_checkpoint_loads_its_language_model(hybrid_dir, tmp_path):
    """The published form: Qwen3_5ForConditionalGeneration, the decoder's config under text_config and
    its tensors under model.language_model. (the vision tower's are not read)."""
    from transformers import AutoModelForCausalLM, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=64,
        patch_size=2,
        temporal_patch_size=1,
        spatial_merge_size=1,
        num_position_embeddings=16,
    )
    config = Qwen3_5Config(text_config=tiny_text_config().to_dict(), vision_config=vision, tie_word_embeddings=False)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    text = AutoModelForCausalLM.from_pretrained(str(hybrid_dir), dtype=torch.float32)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.save_pretrained(str(tmp_path / "mm"))
    assert json.loads((tmp_path / "mm" / "config.json").read_text())["model_type"] == "qwen3_5"
    assert any(k.startswith("model.visual.") for k in read_safetensors_dir(tmp_path / "mm"))
    ids = prompt_ids()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    target = load_target_dir(tmp_path / "mm")
    assert relative(target(ids, target.new_cache(128)).logits, ref) <= 1e-5
    alone = load_target_dir(hybrid_dir).state_dict()
    assert all(torch.equal(v, alone[k]) for k, v in target.state_dict().items())


def test_bad_checkpoints_are_refused_in_one_line(hybrid_dir, hybrid_dirs, tmp_path):
    for family, drop in (
        ("qwen3_5", "model.layers.1.linear_attn.A_log"),
        ("qwen3_5", "model.layers.3.linear_attn.conv1d.weight"),
        ("qwen3_5_moe", "model.layers.2.mlp.shared_expert_gate.weight"),
        ("qwen3_next", "model.layers.1.linear_attn.in_proj_qkvz.weight"),
        ("qwen3_next", "model.layers.3.linear_attn.in_proj_ba.weight"),
        ("qwen3_next", "model.layers.2.mlp.experts.3.up_proj.weight"),
    ):
        d = tmp_path / drop.split(".")[-2]
        d.mkdir()
        (d / "config.json").write_text((hybrid_dirs[family] / "config.json").read_text())
        state = read_safetensors_dir(hybrid_dirs[family])
        del state[drop]
        write_safetensors(state, d / "model.safetensors")
        with pytest.raises(LoopspecError, match="lacks tensor") as e:
            load_target_dir(d)
        assert drop.removeprefix("model.") in str(e.value) and "\n" not in str(e.value)
    swapped = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
    for change, match in (
        ({"layer_types": LAYER_TYPES[:3]}, "layer_types"),
        ({"layer_types": LAYER_TYPES[:3] + ["sliding_attention"]}, "layer_types"),
        ({"layer_types": swapped}, "lacks tensor 'layers.1.self_attn"),
        ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
        ({"linear_key_head_dim": None}, "linear_key_head_dim"),
    ):
        d = tmp_path / f"config-{len(str(change))}-{match[:6]}"
        d.mkdir()
        config = json.loads((hybrid_dir / "config.json").read_text())
        config.update(change)
        (d / "config.json").write_text(json.dumps(config))
        (d / "model.safetensors").symlink_to(hybrid_dir / "model.safetensors")
        with pytest.raises(LoopspecError, match=match) as e:
            load_target_dir(d)
        assert "\n" not in str(e.value)
    wider = tmp_path / "qwen3_next-wider"  # key heads of 32 dims: the fused projection's rows fall short
    wider.mkdir()
    config = json.loads((hybrid_dirs["qwen3_next"] / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "linear_key_head_dim": 32}))
    (wider / "model.safetensors").symlink_to(hybrid_dirs["qwen3_next"] / "model.safetensors")
    with pytest.raises(LoopspecError, match=r"in_proj_qkvz.weight has shape \[192, 64\], not \[256, 64\]") as e:
        load_target_dir(wider)
    assert "\n" not in str(e.value)
