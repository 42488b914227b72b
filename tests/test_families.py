"""The target families beyond dense Llama/Qwen: Qwen3-MoE (routed experts) and gpt-oss (experts with
biases and a clamped SwiGLU, attention sinks, sliding-window layers between full ones, YaRN RoPE).

transformers' own implementation of each family is the oracle: tiny random configs built here, with
lively weights, over a prompt long enough to cross the sliding window; logits and every tap compared
at fp64 and fp32; decoding one token at a time, a verification rolled back, and rows batched beside
others compute what one forward over the whole sequence computes."""

import json

import pytest
import torch

from loopspec.errors import LoopspecError
from loopspec.model.dflash import DrafterConfig
from loopspec.model.families import FAMILIES, export_refusal
from loopspec.engines.torch_engine import TorchEngine
from loopspec.settings import DecodingSettings as Method
from loopspec.weights import load_target_dir, read_safetensors_dir, write_safetensors

from conftest import agreeing_drafter, batched_greedy_equals_plain, repeating_prompts

WINDOW = 8


def tiny_family_config(family: str, **overrides):
    from transformers import GptOssConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        eos_token_id=2,
        bos_token_id=1,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if family == "qwen3_moe":  # layer 1 dense (mlp_only_layers), the others 4 experts, 2 per token
        return Qwen3MoeConfig(
            **common,
            intermediate_size=48,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    return GptOssConfig(
        **common,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 64,
            "truncate": False,
        },
    )


def save_family_target(family: str, directory, seed: int = 0):
    """A random transformers model of `family` with lively weights, saved as an HF checkpoint."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_family_config(family)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "sinks" in name:
                p.copy_(torch.randn_like(p))
            elif "bias" in name:
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed" in name or "lm_head" in name:
                p.copy_(0.5 * torch.randn_like(p))
            else:  # lively: the greedy text follows the context; routers spread tokens over the experts
                p.copy_(
                    torch.randn_like(p) / p.shape[-1] ** 0.5 * (3.0 if "router" in name or "gate.w" in name else 1.5)
                )
    model.save_pretrained(str(directory))
    return directory


NEW_FAMILIES = ["qwen3_moe", "gpt_oss"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: save_family_target(f, root / f, seed=i) for i, f in enumerate(NEW_FAMILIES)}


def hf_outputs(directory, ids, dtype):
    from transformers import AutoModelForCausalLM

    # the eager experts loop (the grouped kernel takes no fp64); attention in the model's dtype (the
    # eager path of most families takes its softmax in fp32; gpt-oss's, with sinks, in the model's)
    attention = "eager" if json.loads((directory / "config.json").read_text())["model_type"] == "gpt_oss" else "sdpa"
    hf = AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=dtype, experts_implementation="eager", attn_implementation=attention
    ).eval()
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    return out.logits, out.hidden_states


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_logits_and_taps_match_transformers(family, dtype, tolerance, family_dirs):
    ids = torch.randint(0, 128, (1, 3 * WINDOW + 5), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_hidden = hf_outputs(family_dirs[family], ids, dtype)
    target = load_target_dir(family_dirs[family], dtype=dtype)
    taps = [0, 1, 2, 3]  # 3 is the last layer: HF's hidden_states[L] is final-normed
    target.set_taps(taps)
    out = target(ids, target.new_cache(64))
    scale = ref_logits.abs().max()
    assert scale > 1.0  # lively: logits far from uniform
    assert (out.logits - ref_logits).abs().max() <= tolerance * scale
    ref_taps = torch.cat([ref_hidden[i + 1] for i in taps], dim=-1)
    assert (out.taps - ref_taps).abs().max() <= tolerance * ref_taps.abs().max()


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_stepwise_decoding_and_rollback_match_one_forward(family, family_dirs):
    """Token by token, a rejected verification rolled back, then a chunk: the logits of one forward
    over the whole sequence — across the sliding window's edge, with the experts routed per token."""
    target = load_target_dir(family_dirs[family], dtype=torch.float64)
    target.set_taps([1, 2])
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(2))
    full = target(ids, target.new_cache(64))
    cache = target.new_cache(64)
    first = target(ids[:, :6], cache)
    parts = [first]
    for i in range(6, 20):
        junk = target(torch.randint(0, 128, (1, 5)), cache)  # a verification whose drafts are all rejected
        assert junk.logits.shape[1] == 5
        cache.rollback([i])
        parts.append(target(ids[:, i : i + 1], cache))
    parts.append(target(ids[:, 20:], cache))
    logits = torch.cat([p.logits for p in parts], dim=1)
    taps = torch.cat([p.taps for p in parts], dim=1)
    assert (logits - full.logits).abs().max() <= 1e-9 * full.logits.abs().max()
    assert (taps - full.taps).abs().max() <= 1e-9 * full.taps.abs().max()


def test_a_window_that_is_ignored_is_caught(family_dirs):
    """Planted: the sliding-window layers see every key. The logits then leave transformers' past the
    window (and equal them inside it), so the parity test above cannot pass without the window."""
    target = load_target_dir(family_dirs["gpt_oss"], dtype=torch.float64)
    ids = torch.randint(0, 128, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(1))
    ref, _ = hf_outputs(family_dirs["gpt_oss"], ids, torch.float64)
    from loopspec.model.kv_cache import KVCache

    for layer in target.layers:
        layer.self_attn.window = None
    cfg = target.cfg  # the whole past kept for every layer, as a full-attention target's
    out = target(ids, KVCache(cfg.num_layers, 1, cfg.num_kv_heads, 64, cfg.head_dim, dtype=torch.float64)).logits
    assert (out[:, :WINDOW] - ref[:, :WINDOW]).abs().max() <= 1e-9 * ref.abs().max()
    assert (out[:, WINDOW:] - ref[:, WINDOW:]).abs().max() > 1e-3


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_routing_does_not_depend_on_the_batch(family, family_dirs):
    """Each row's tokens pick the same experts with the same weights alone and beside other rows of
    other lengths (ragged, padded), and its logits are its own."""
    target = load_target_dir(family_dirs[family])
    experts = next(l.mlp for l in target.layers if hasattr(l.mlp, "route"))
    seen = []
    experts.register_forward_hook(lambda m, args, out: seen.append(m.route(args[0].reshape(-1, args[0].shape[-1]))))
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 128, (n,), generator=g) for n in (17, 5, 11)]
    alone = []
    for r in rows:
        seen.clear()
        out = target(r[None], target.new_cache(64))
        alone.append((out.logits[0], seen[0]))
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = r
    seen.clear()
    batched = target(ids, target.new_cache(64, rows=3), counts=torch.tensor([len(r) for r in rows]))
    picked, weights = (t.view(len(rows), width, -1) for t in seen[0])
    used = set()
    for b, r in enumerate(rows):
        n = len(r)
        assert torch.equal(picked[b, :n], alone[b][1][0])
        assert torch.allclose(weights[b, :n], alone[b][1][1], atol=1e-6)
        assert (batched.logits[b, :n] - alone[b][0]).abs().max() <= 1e-4
        used |= set(picked[b, :n].flatten().tolist())
    assert used == set(range(4))  # every expert ran for some token: the routing was exercised


METHODS = {
    "ar": Method(),
    "dflash": Method("dflash", block_size=5),
    "dloop": Method("dloop", block_size=5, max_stages=3, gate_threshold=-1e9),
    "tree": Method("dflash", block_size=5, tree_budget=8, suffix=True),
    "suffix": Method("suffix", block_size=6),
}
PROMPTS = [torch.randint(3, 120, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 9, 15, 22)]


@pytest.fixture(scope="module")
def engines(family_dirs):
    out = {}
    for family in NEW_FAMILIES:
        target = load_target_dir(family_dirs[family])
        cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=5, mask_token_id=127)
        out[family] = TorchEngine(target, agreeing_drafter(target, PROMPTS, cfg), max_context=160)
    return out


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_speculative_decoding_equals_plain_decoding(family, name, engines):
    """Greedy: every method, its rows batched together, commits plain decoding's tokens; the drafter
    agrees with the target, so most of them are accepted drafts. The suffix index drafts from the
    text itself: its prompts repeat their beginning after what the target continued it with."""
    engine = engines[family]
    prompts = repeating_prompts(engine, PROMPTS) if name == "suffix" else PROMPTS
    accepted = batched_greedy_equals_plain(engine, prompts, METHODS[name])
    # measured: 100-131 accepted of 160 tokens with the drafter, 3 with the suffix index alone
    assert accepted >= {"ar": 0, "suffix": 1}.get(name, 60)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_exported_engines_refuse_the_family_in_one_line(family, family_dirs):
    cfg = load_target_dir(family_dirs[family]).cfg
    assert not FAMILIES[family].exported
    message = export_refusal(cfg, "onnxruntime")
    assert family in message and "--backend torch" in message and "\n" not in message


def test_bad_family_checkpoints_are_refused_in_one_line(family_dirs, tmp_path):
    for family, drop in (
        ("qwen3_moe", "model.layers.2.mlp.experts.3.up_proj.weight"),
        ("gpt_oss", "model.layers.0.self_attn.sinks"),
    ):
        d = tmp_path / family
        d.mkdir()
        (d / "config.json").write_text((family_dirs[family] / "config.json").read_text())
        state = read_safetensors_dir(family_dirs[family])
        del state[drop]
        write_safetensors(state, d / "model.safetensors")
        with pytest.raises(LoopspecError, match="lacks tensor") as e:
            load_target_dir(d)
        assert drop.removeprefix("model.") in str(e.value) and "\n" not in str(e.value)
    for family, change, match in (
        ("gpt_oss", {"layer_types": ["sliding_attention"]}, "layer_types"),
        ("gpt_oss", {"layer_types": ["full_attention", "local", "full_attention", "full_attention"]}, "layer_types"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "experts per token"),
        ("qwen3_moe", {"num_experts": 0, "num_local_experts": 0}, "num_experts"),
    ):
        d = tmp_path / f"{family}-{len(str(change))}"
        d.mkdir()
        config = json.loads((family_dirs[family] / "config.json").read_text())
        config.update(change)
        (d / "config.json").write_text(json.dumps(config))
        with pytest.raises(LoopspecError, match=match):
            load_target_dir(d)


def test_backends_follow_the_family(family_dirs, tmp_path):
    """'auto' runs a MoE target on PyTorch; naming the ONNX Runtime backend, or exporting it, is
    refused in one line before anything is written; a published MXFP4 checkpoint is refused with what
    to do instead."""
    from loopspec.convert.onnx_export import convert_onnx
    from loopspec.runtime.pipeline import EngineChoice

    pytest.importorskip("onnx", reason="needs onnx: pip install 'loopspec[onnx]'")
    directory = family_dirs["qwen3_moe"]
    assert EngineChoice(target=str(directory), drafter="none").backend == "torch"
    with pytest.raises(LoopspecError, match="onnxruntime engine is not built for qwen3_moe"):
        EngineChoice(target=str(directory), drafter="none", backend="onnxruntime")
    with pytest.raises(LoopspecError, match="ONNX engine is not built for gpt_oss"):
        convert_onnx(
            load_target_dir(family_dirs["gpt_oss"]),
            None,
            tmp_path / "out",
            target_dir=family_dirs["gpt_oss"],
            max_context=64,
            validate=False,
        )
    assert not (tmp_path / "out").exists()
    mxfp4 = tmp_path / "mxfp4"
    mxfp4.mkdir()
    config = json.loads((family_dirs["gpt_oss"] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (mxfp4 / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoopspecError, match="MXFP4 expert weights; load it dequantized"):
        load_target_dir(mxfp4)


def test_bundles_name_the_family_for_every_reader(family_dirs, tmp_path):
    """A serving bundle of a MoE target keeps its config and adds the keys transformers-4 readers take
    (`num_experts` for Qwen3-MoE, `rope_scaling` for gpt-oss's YaRN) beside transformers 5's, so each
    engine builds the same model; the llama.cpp bundle, which serves a GGUF, refuses a directory."""
    from conftest import save_tiny_tokenizer
    from loopspec.convert.bundles import build_bundle
    from loopspec.model.dflash import Drafter

    for family in NEW_FAMILIES:
        target_dir = tmp_path / f"{family}-target"
        target_dir.mkdir()
        for f in family_dirs[family].iterdir():
            (target_dir / f.name).write_bytes(f.read_bytes())
        save_tiny_tokenizer(target_dir)
        cfg = DrafterConfig.for_target(load_target_dir(target_dir).cfg, num_layers=1, block_size=4, mask_token_id=127)
        Drafter(cfg).save(tmp_path / f"{family}-drafter")
        out = tmp_path / f"{family}-bundle"
        build_bundle(str(target_dir), str(tmp_path / f"{family}-drafter"), out, "trtllm,vllm,sglang")
        source = json.loads((target_dir / "config.json").read_text())
        exported = json.loads((out / "target" / "config.json").read_text())
        assert exported["model_type"] == family and {k: exported[k] for k in source if k != "dtype"} == {
            k: v for k, v in source.items() if k != "dtype"
        }
        if family == "qwen3_moe":
            assert exported["num_experts"] == source["num_local_experts"] == 4
        else:
            assert exported["rope_scaling"]["rope_type"] == "yarn" and exported["rope_scaling"]["factor"] == 32.0
        assert load_target_dir(out / "target").cfg == load_target_dir(target_dir).cfg
        with pytest.raises(LoopspecError, match="serves a GGUF target"):
            build_bundle(str(target_dir), str(tmp_path / f"{family}-drafter"), tmp_path / "cpp", "llamacpp")


LAW_FAMILIES = NEW_FAMILIES + ["qwen3_5"]


@pytest.fixture(scope="module")
def law_engines(tmp_path_factory):
    """{family: an engine over a vocabulary-8 target of the family with a random drafter}: the exact
    law of a short continuation is computable by enumeration."""
    from test_distribution import MASK, V
    from transformers import AutoModelForCausalLM

    from loopspec.model.dflash import Drafter

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a vocabulary-8 model runs fastest on one thread
    out = {}
    for i, family in enumerate(LAW_FAMILIES):
        if family == "qwen3_5":  # a hybrid as tests/test_hybrid.py builds them: one linear-attention layer, one full
            from test_hybrid import tiny_text_config

            config = tiny_text_config(
                vocab_size=V,
                eos_token_id=None,
                hidden_size=32,
                num_hidden_layers=2,
                layer_types=["linear_attention", "full_attention"],
            )
        else:
            config = tiny_family_config(family, vocab_size=V, hidden_size=32, num_hidden_layers=2, eos_token_id=None)
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():  # moderate entropies: the context matters, no token dominates
            for name, p in model.named_parameters():
                if "embed" in name:
                    p.normal_(0.0, 1.0)
                elif "lm_head" in name:
                    p.normal_(0.0, 0.35)
                elif "router" in name or "gate.weight" in name:
                    p.normal_(0.0, 1.0)
        directory = tmp_path_factory.mktemp(family)
        model.save_pretrained(str(directory))
        target = load_target_dir(directory)
        drafter = Drafter(DrafterConfig.for_target(target.cfg, num_layers=1, block_size=4, mask_token_id=MASK)).eval()
        out[family] = TorchEngine(target, drafter, max_context=16)
    yield out
    torch.set_num_threads(threads)


@pytest.mark.parametrize("family", LAW_FAMILIES)
def test_sampling_at_temperature_one_follows_the_target_law(family, law_engines):
    """T = 1: the 3-token continuations that speculative decoding commits (the first round verifies
    one draft, accepted in some runs and rejected in others) pass a chi-square test against the
    target's exact law; the same loop sampling at T = 0.7 (the negative control) is rejected."""
    from test_distribution import P_FAIL, P_PASS, PROMPT, RUNS, T1, exact_distribution, gof_pvalue, sample_counts, seeds

    from loopspec.decoding import SamplingParams

    engine = law_engines[family]
    exact = exact_distribution(engine.target, PROMPT, 3, T1)
    assert float(exact.max()) < 0.2  # no continuation dominates: the test has power
    counts, rounds = sample_counts(engine, 3, T1, block_size=4, seeds=seeds(20))
    accepted = sum(r[0] for r in rounds)
    assert 0.1 * RUNS < accepted < 0.9 * RUNS, accepted
    assert gof_pvalue(counts, exact, min_cells=40) > P_PASS
    counts, _ = sample_counts(engine, 3, SamplingParams(temperature=0.7), block_size=4, seeds=seeds(21, RUNS // 2))
    assert gof_pvalue(counts, exact) < P_FAIL


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_dense_families_match_transformers_past_the_original_context(family, dtype, tolerance, tiny_targets):
    """The dense families at the same bounds, over 100 positions: the tiny Llama's RoPE is Llama-3.1's
    (`rope_type: llama3`, original context 64), so positions past it are compared too."""
    directory = tiny_targets[family]
    if family == "llama":
        rope = json.loads((directory / "config.json").read_text())["rope_parameters"]
        assert rope["rope_type"] == "llama3" and rope["original_max_position_embeddings"] == 64
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(4))
    ref_logits, ref_hidden = hf_outputs(directory, ids, dtype)
    target = load_target_dir(directory, dtype=dtype)
    target.set_taps([0, 3, 5])
    out = target(ids, target.new_cache(128))
    assert (out.logits - ref_logits).abs().max() <= tolerance * ref_logits.abs().max()
    ref_taps = torch.cat([ref_hidden[i + 1] for i in (0, 3, 5)], dim=-1)
    assert (out.taps - ref_taps).abs().max() <= tolerance * ref_taps.abs().max()


def test_sliding_layers_keep_their_window_only(family_dirs):
    """gpt-oss's sliding layers keep a ring of window - 1 + 64 slots per row, whatever the context;
    its full layers keep the context. A prefill longer than the ring, decoding after it, verifications
    rolled back and rows of other lengths batched beside it compute what one forward over the whole
    sequence computes (fp64)."""
    from loopspec.model.kv_cache import WindowedCache

    target = load_target_dir(family_dirs["gpt_oss"], dtype=torch.float64)
    cache = target.new_cache(256, rows=2)
    assert isinstance(cache, WindowedCache)
    assert cache.ring_k.shape[:4] == (2, 2, 2, WINDOW - 1 + 64) and cache.k.shape[0] == 2  # 2 sliding, 2 full layers
    ids = torch.randint(0, 128, (1, 140), generator=torch.Generator().manual_seed(5))
    full = target(ids, target.new_cache(256)).logits
    parts = [target(ids[:, :100], cache).logits]  # 100 > the ring's 71 slots
    for i in range(100, 120):
        target(torch.randint(0, 128, (1, 6)), cache)  # a rejected verification
        cache.rollback([i])
        parts.append(target(ids[:, i : i + 1], cache).logits)
    other = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(6))
    target(other, cache, first_row=1)
    batch = torch.zeros(2, 20, dtype=torch.long)
    batch[0], batch[1, :3] = ids[0, 120:], other[0, :3]
    parts.append(target(batch, cache, counts=torch.tensor([20, 3])).logits[:1])
    out = torch.cat(parts, dim=1)
    assert (out - full).abs().max() <= 1e-9 * full.abs().max()


def test_a_window_rolled_back_past_its_ring_is_refused(family_dirs):
    """Planted: a ring too short for the verification it holds (room for 2 new tokens, not 6). Rolling
    back into that verification would need positions it overwrote: refused in one line, never read."""
    from loopspec.model.kv_cache import WindowedCache

    target = load_target_dir(family_dirs["gpt_oss"])
    sliding = [target.cfg.layer_type(i) == "sliding_attention" for i in range(target.cfg.num_layers)]
    cache = WindowedCache(sliding, WINDOW, 1, target.cfg.num_kv_heads, 64, target.cfg.head_dim, verify_span=2)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(7))
    target(ids, cache)
    target(torch.randint(0, 128, (1, 6)), cache)
    cache.rollback([21])
    with pytest.raises(LoopspecError, match="past what its sliding-window layers keep"):
        target(ids[:, :1], cache)
