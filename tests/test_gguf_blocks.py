"""The target's GGUF blocks exported for ONNX Runtime (engines/gguf_export.py): Q4_1 as MatMulNBits
plus the minimum's correction term, Q8_0 as an 8-bit block product. A tiny llama target is
quantized in-test with the `gguf` package (Q4_1 matrices, Q8_0 tied embedding) and its checkpoint
rewritten to the blocks' fp32 expansion, the reference."""

import json
import shutil
import warnings

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'loopspec[onnx]'")
pytest.importorskip("onnx", reason="needs onnx: pip install 'loopspec[onnx]'")
gguf = pytest.importorskip("gguf", reason="needs gguf: pip install gguf (a core dependency)")

from loopspec.cli import main  # noqa: E402
from loopspec.engines.gguf_export import BlockLinear, block_target  # noqa: E402
from loopspec.convert.onnx_export import convert_onnx  # noqa: E402
from loopspec.engines.export import linear  # noqa: E402
from loopspec.engines.specs import TARGET_VERIFY  # noqa: E402
from loopspec.errors import LoopspecError  # noqa: E402
from loopspec.gguf_blocks import quantize_blocks, read_tensors, target_blocks  # noqa: E402
from loopspec.model.dflash import Drafter, DrafterConfig  # noqa: E402
from loopspec.runtime.decoder import generate  # noqa: E402
from loopspec.engines.ort_engine import OrtEngine  # noqa: E402
from loopspec.settings import DecodingSettings  # noqa: E402
from loopspec.weights import load_target_dir, read_safetensors_dir, write_safetensors  # noqa: E402

from conftest import accepted_drafts, agreeing_drafter, save_tiny_target, save_tiny_tokenizer  # noqa: E402

Q = gguf.GGMLQuantizationType
PRECISIONS = ("gguf-fp32act", "gguf-int8act")


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (what its converter writes): the inverse of the reader's."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_order(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order undone (HF's rotate-half), written here apart from the reader's."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# HF name (model. and the layer prefix dropped) → llama.cpp's tensor name (gguf's MODEL_TENSORS)
GGUF_NAMES = {
    "embed_tokens": "token_embd",
    "norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
PERMUTED_BY_LLAMA_CPP = {"llama"}  # its converter reorders q/k rows for these architectures only


def llama3_rope_factors(head_dim: int, rope: dict) -> np.ndarray:
    """llama.cpp's rope_freqs for a llama3-scaled RoPE: per frequency, what divides it (1 for the
    high frequencies, `factor` for the low ones, a smooth blend between)."""
    freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for wavelen in 2 * np.pi / freqs:
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_tiny_gguf(target_dir, path, bad_type=None, types=None, arch=None, tokenizer=None):
    """The HF checkpoint in `target_dir` → a GGUF of its family as llama.cpp's converter writes one:
    the architecture's metadata, Q4_1 matrices, Q8_0 token_embd, F32 norms and biases, q/k rows
    permuted for llama, rope_freqs for a llama3 RoPE, output.weight unless the head is tied;
    `types(layer, name)` → another GGUF type name per matrix (K-quants written by
    tests/gguf_encoders.py). The checkpoint is then rewritten to the GGUF's expansion (gguf's own
    dequantize), so the fp32 reference is exactly what the blocks hold. `arch`: another
    general.architecture; `tokenizer(writer)`: writes tokenizer.ggml.* metadata."""
    from gguf_encoders import quantize_k

    cfg = json.loads((target_dir / "config.json").read_text())
    family = cfg["model_type"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0)}
    state = {k: v.float().numpy() for k, v in read_safetensors_dir(target_dir).items()}
    writer = gguf.GGUFWriter(str(path), arch or family)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(rope["rope_theta"])
    if cfg.get("head_dim") is not None:  # llama.cpp writes the head size where the config names one
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if family == "llama":
        writer.add_rope_dimension_count(head_dim)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    if tokenizer is not None:
        tokenizer(writer)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, rope))
    expanded = {}
    for hf_name, w in state.items():
        name, _, suffix = hf_name.removeprefix("model.").rpartition(".")
        if name == "lm_head" and cfg["tie_word_embeddings"]:
            continue
        layer, _, rest = name.partition("layers.")[2].partition(".") if name.startswith("layers.") else ("", "", name)
        gguf_name = (f"blk.{layer}." if layer else "") + GGUF_NAMES[rest] + "." + suffix
        qk_heads = (
            {"self_attn.q_proj": heads, "self_attn.k_proj": kv_heads}.get(rest)
            if family in PERMUTED_BY_LLAMA_CPP
            else None
        )
        stored = llama_cpp_permute(w, qk_heads) if qk_heads else w
        kind = Q.F32 if w.ndim == 1 else Q.Q8_0 if rest == "embed_tokens" else Q.Q4_1
        if bad_type is not None and rest == "mlp.down_proj":
            kind = bad_type
        if types is not None and w.ndim == 2:
            kind = Q[types(layer, rest)]
        data = quantize_k(stored, kind.name) if kind.name.endswith("_K") else gguf.quants.quantize(stored, kind)
        data = data.reshape(stored.shape[0], -1) if w.ndim == 2 else data
        writer.add_tensor(gguf_name, data, raw_dtype=kind)  # data: the byte rows
        back = gguf.quants.dequantize(data, kind).reshape(stored.shape)
        expanded[hf_name] = torch.from_numpy(
            np.ascontiguousarray(hf_order(back, qk_heads) if qk_heads else back, np.float32)
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if "lm_head.weight" in state and cfg["tie_word_embeddings"]:
        expanded["lm_head.weight"] = expanded["model.embed_tokens.weight"]
    for f in target_dir.glob("*.safetensors"):
        f.unlink()
    write_safetensors(expanded, target_dir / "model.safetensors")
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(target dir holding the expansion, its GGUF, a drafter dir) for a tiny llama; the drafter is
    trained to draft the target's continuation of IDENTITY_PROMPT (its drafts are accepted)."""
    root = tmp_path_factory.mktemp("gguf")
    target_dir = save_tiny_target("llama", root / "target", seed=3)
    save_tiny_tokenizer(target_dir)
    path = write_tiny_gguf(target_dir, root / "tiny.Q4_1.gguf")
    target = load_target_dir(target_dir)
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=5, mask_token_id=127)
    agreeing_drafter(target, [IDENTITY_PROMPT], cfg).save(root / "drafter", dtype=torch.float32)
    return target_dir, path, root / "drafter"


IDENTITY_PROMPT = torch.randint(3, 120, (9,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def exported(tiny_gguf, tmp_path_factory):
    """{precision: (artifact dir, validation report)} of the tiny pair."""
    target_dir, path, drafter_dir = tiny_gguf
    target, drafter = load_target_dir(target_dir), Drafter.load(drafter_dir)
    out = {}
    for precision in PRECISIONS:
        onnx_dir = tmp_path_factory.mktemp("onnx") / precision
        _, report = convert_onnx(
            target,
            drafter,
            onnx_dir,
            target_dir=target_dir,
            drafter_dir=drafter_dir,
            precision=precision,
            gguf_path=path,
            num_threads=1,
        )
        out[precision] = (onnx_dir, report)
    return out


def tiny_blocks(tiny_gguf):
    return target_blocks(tiny_gguf[1])


class OneProduct(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return linear(x, self.module)


def run_one_product(module, x: np.ndarray, path) -> np.ndarray:
    """One exported product (the TorchScript exporter, as engines/export.py) run by ONNX Runtime."""
    import onnxruntime as ort

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            OneProduct(module).eval(),
            (torch.from_numpy(x),),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch", 1: "tokens"}},
        )
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_blocks_expand_to_the_checkpoint_and_minimums_are_not_codes(tiny_gguf):
    blocks = tiny_blocks(tiny_gguf)
    target = load_target_dir(tiny_gguf[0])
    state = target.state_dict()
    assert {b.kind for b in blocks.values() if len(b.shape) == 2} == {"Q4_1", "Q8_0"}
    assert {b.kind for b in blocks.values() if len(b.shape) == 1} == {"F32"}  # the norms
    for name, matrix in blocks.items():
        assert np.array_equal(matrix.dequantize(), state[name].numpy()), name  # q/k rows back in HF order
    m = blocks["layers.0.mlp.down_proj.weight"]
    ratio = m.product().minimums / m.product().scales
    # what the correction term is for: a minimum that no zero-point code of the scale can express
    assert np.abs(ratio - np.round(ratio)).max() > 0.1


@pytest.mark.parametrize(
    "name", ["layers.0.mlp.gate_up_proj.weight", "layers.0.mlp.down_proj.weight", "layers.1.self_attn.qkv_proj.weight"]
)
def test_one_q4_1_product_equals_the_fp32_expansion(tiny_gguf, name, tmp_path):
    matrix = tiny_blocks(tiny_gguf)[name]
    w = matrix.dequantize()  # [N, K]
    x = np.random.default_rng(0).standard_normal((2, 3, w.shape[1])).astype(np.float32)
    ref = x @ w.T
    scale = np.abs(ref).max()
    exact = run_one_product(BlockLinear(matrix.product(), accuracy_level=1), x, tmp_path / "q4.onnx")
    assert np.abs(exact - ref).max() / scale < 1e-5
    # without the minimum's term the product would be far off: the correction carries real weight
    assert np.abs((x @ (w - np.repeat(matrix.product().minimums, 32, axis=1)).T) - ref).max() / scale > 0.1
    int8 = run_one_product(BlockLinear(matrix.product(), accuracy_level=4), x, tmp_path / "q4i.onnx")
    assert 1e-6 < np.abs(int8 - ref).max() / scale < 5e-2  # int8 activations: close, not equal
    eager = BlockLinear(matrix.product(), accuracy_level=1)(torch.from_numpy(x)).numpy()
    assert np.abs(eager - ref).max() / scale < 1e-6


def test_one_q8_0_product_is_the_8_bit_block_product(tiny_gguf, tmp_path):
    matrix = tiny_blocks(tiny_gguf)["lm_head.weight"]
    assert matrix.kind == "Q8_0"
    w = matrix.dequantize()
    x = np.random.default_rng(1).standard_normal((1, 4, w.shape[1])).astype(np.float32)
    ref = x @ w.T
    got = run_one_product(BlockLinear(matrix.product(), accuracy_level=4), x, tmp_path / "q8.onnx")
    assert np.abs(got - ref).max() / np.abs(ref).max() < 5e-2
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_quantize_blocks_writes_what_the_gguf_package_reads(kind):
    w = np.random.default_rng(5).standard_normal((6, 96)).astype(np.float32) * np.linspace(0.1, 3, 96)
    matrix = quantize_blocks(w, kind)
    assert matrix.kind == kind and matrix.shape == w.shape
    back = gguf.quants.dequantize(matrix.blocks.reshape(6, -1), Q[kind]).reshape(w.shape)  # the reader's expansion
    assert np.array_equal(matrix.dequantize(), back)
    # round to nearest: every weight within half a step of its block, give or take the fp16 rounding of
    # the scale and minimum (truncating codes would leave up to a whole step)
    steps = np.abs(w).reshape(6, 3, 32).max(-1) / 127 if kind == "Q8_0" else np.ptp(w.reshape(6, 3, 32), axis=-1) / 15
    assert (np.abs(back - w).reshape(6, 3, 32) <= steps[..., None] * 0.52).all()
    # weights the blocks hold exactly come back exactly
    assert np.array_equal(quantize_blocks(back, kind).dequantize(), back)


def test_quantize_blocks_refuses_what_has_no_blocks():
    with pytest.raises(LoopspecError, match="multiple of 32"):
        quantize_blocks(np.zeros((4, 48), np.float32), "Q8_0")
    with pytest.raises(LoopspecError, match="Q5_K"):
        quantize_blocks(np.zeros((4, 64), np.float32), "Q5_K")


def test_the_graphs_hold_the_blocks_and_the_manifest_names_them(exported):
    import onnx

    counts = {}
    for precision, (onnx_dir, report) in exported.items():
        manifest = json.loads((onnx_dir / "manifest.json").read_text())
        assert manifest["precision"] == precision and report["passed"], report
        assert manifest["settings"]["arithmetic"]["matmulnbits_accuracy_level"] == (1 if "fp32" in precision else 4)
        assert manifest["settings"]["weights"]["file"]["files"]  # the GGUF's sha256
        assert manifest["settings"]["attention_values"] == "one product over [past; new]"
        graph = onnx.load(str(onnx_dir / "target_verify.onnx"), load_external_data=False).graph
        nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
        bits = sorted(next(a.i for a in n.attribute if a.name == "bits") for n in nbits)
        counts[precision] = bits
        for engine in ("drafter_context", "drafter_context_hidden", "drafter_block"):
            g = onnx.load(str(onnx_dir / f"{engine}.onnx"), load_external_data=False).graph
            counts[precision, engine] = sorted(
                next(a.i for a in n.attribute if a.name == "bits") for n in g.node if n.op_type == "MatMulNBits"
            )
    n_layers = json.loads((exported["gguf-fp32act"][0] / "target" / "config.json").read_text())["num_hidden_layers"]
    assert counts["gguf-fp32act"] == [4] * (4 * n_layers)  # Q8_0 lm_head as its exact fp32 expansion
    assert counts["gguf-int8act"] == [4] * (4 * n_layers) + [8]  # and as the 8-bit block product
    # the drafter: fp32 with fp32 activations; with int8 activations its own Q8_0 blocks (per layer q/k/v
    # fused, o, gate/up fused, down; the draft head the GGUF's Q8_0 lm_head rows; fc and the fused K/V)
    drafter_cfg = json.loads((exported["gguf-int8act"][0] / "drafter" / "config.json").read_text())
    assert drafter_cfg["num_hidden_layers"] == 1 and drafter_cfg["intermediate_size"] % 32 == 0
    for engine in ("drafter_context", "drafter_context_hidden", "drafter_block"):
        assert counts["gguf-fp32act", engine] == []
    assert counts["gguf-int8act", "drafter_block"] == [8] * (4 + 1)
    assert counts["gguf-int8act", "drafter_context"] == [8] * 2
    assert counts["gguf-int8act", "drafter_context_hidden"] == [8]
    account = json.loads((exported["gguf-int8act"][0] / "manifest.json").read_text())["settings"]["drafter"]
    assert account["products"].startswith(
        "7 Q8_0"
    )  # fc, q, k, v, o, gate_up, down and "lm_head (Q8_0)" in account["draft_head"]


def test_fp32_activations_match_the_fp32_reference(exported):
    _, report = exported["gguf-fp32act"]
    errors = report["engines"][TARGET_VERIFY]["errors"]
    assert errors["logits"] < 1e-4 and report["greedy_identical"] and report["verify_equals_plain"]
    _, report = exported["gguf-int8act"]
    # a different model: its logits deviate measurably from fp32 (reported), within the loose bound;
    # one verification computes what its plain decoding computes (one value product, see `attend`)
    assert 1e-5 < report["engines"][TARGET_VERIFY]["errors"]["logits"] < 0.25
    assert report["verify_equals_plain"] and report["verify_plain_agreement"] == 1.0
    # its drafter is a quantized one too: off the fp32 drafter measurably, within the same bound
    for engine in ("drafter_context", "drafter_block"):
        assert (
            1e-5 < report["engines"][engine]["errors"]["hidden" if engine == "drafter_block" else "context_key"] < 0.25
        )
        assert report["engines"][engine]["tolerance"] == 0.25


@pytest.mark.parametrize("precision", PRECISIONS)
def test_ar_dflash_dloop_identical_on_the_block_engines(exported, precision):
    onnx_dir, _ = exported[precision]
    engine = OrtEngine(onnx_dir, 160, num_threads=1)
    prompt = IDENTITY_PROMPT
    ar = generate(engine, prompt, max_new_tokens=40)
    assert len(ar.tokens) == 40
    # draft trees too, on int8 activations included (the order-free softmax: tests/test_invariance.py)
    assert not engine.chains_only
    for settings in (
        DecodingSettings("dflash", 5),
        DecodingSettings("dloop", 5, 3, -1e9),
        DecodingSettings("suffix", 6),
        DecodingSettings("dflash", 5, tree_budget=8, suffix=True),
    ):
        result = generate(engine, prompt, settings, max_new_tokens=40)
        assert result.tokens == ar.tokens, settings
        assert accepted_drafts([result]) >= 20, (settings, accepted_drafts([result]))  # measured 31 to 36 of 40
        if settings.method == "dloop":
            assert max(result.stats.stages_per_round) == 3


def test_block_target_leaves_the_reference_alone(tiny_gguf):
    target = load_target_dir(tiny_gguf[0])
    copy, counts = block_target(target, tiny_blocks(tiny_gguf), "gguf-int8act")
    assert isinstance(copy.layers[0].mlp.down_proj, BlockLinear) and isinstance(copy.lm_head, BlockLinear)
    assert (copy.layers[0].mlp.down_proj.bits, copy.lm_head.bits) == (4, 8)
    assert isinstance(target.layers[0].mlp.down_proj, nn.Linear) and isinstance(target.lm_head, nn.Linear)
    assert counts == {"Q4_1 as 4-bit BlockLinear": 4 * target.cfg.num_layers, "Q8_0 as 8-bit BlockLinear": 1}


def test_bad_input_is_one_clear_error(tiny_gguf, tmp_path, capsys):
    target_dir, path, _ = tiny_gguf
    other = tmp_path / "other"
    shutil.copytree(target_dir, other)
    bad = write_tiny_gguf(other, tmp_path / "bf16.gguf", bad_type=Q.BF16)
    with pytest.raises(LoopspecError, match="is BF16; the GGUF block engine computes with Q4_0, .*--precision fp32"):
        read_tensors(bad)
    target = load_target_dir(target_dir)
    fresh = save_tiny_target("llama", tmp_path / "fresh", seed=9)  # not the GGUF's weights
    with pytest.raises(LoopspecError, match="does not expand to the target's weight"):
        block_target(load_target_dir(fresh), tiny_blocks(tiny_gguf), "gguf-fp32act")
    with pytest.raises(LoopspecError, match="unknown GGUF block precision"):
        block_target(target, tiny_blocks(tiny_gguf), "q4")
    from loopspec.engines.trt_engine import check_precision_supported

    with pytest.raises(LoopspecError, match="MatMulNBits, which TensorRT does not run"):
        check_precision_supported("gguf-int8act", (10, 0))
    capsys.readouterr()  # the tiny checkpoints' own progress output
    assert (
        main(
            [
                "convert",
                "onnx",
                "--target",
                str(target_dir),
                "--drafter",
                "none",
                "--precision",
                "gguf-int8act",
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "need a GGUF target" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_the_runtime_picks_and_names_the_precision(tiny_gguf, exported, tmp_path, capsys):
    """auto: the GGUF's blocks with int8 activations in the fused step graph on ONNX Runtime for a GGUF
    target, fp32 elsewhere; an explicit block precision needs ONNX Runtime and a GGUF; artifacts keep
    their own precision."""
    from loopspec.runtime.pipeline import cached_ort_engine, load_pipeline, resolve_precision

    target_dir, path, drafter_dir = tiny_gguf
    assert resolve_precision("auto", "onnxruntime", str(path)) == "gguf-fused"
    assert resolve_precision("auto", "onnxruntime", "default") == "gguf-fused"
    assert resolve_precision("gguf-int8act", "onnxruntime", str(path)) == "gguf-int8act"
    assert resolve_precision("auto", "torch", str(path)) == "fp32"
    assert resolve_precision("auto", "onnxruntime", str(target_dir)) == "fp32"
    assert resolve_precision("gguf-fp32act", "onnxruntime", str(path)) == "gguf-fp32act"
    with pytest.raises(LoopspecError, match="runs on ONNX Runtime"):
        resolve_precision("gguf-int8act", "torch", str(path))
    with pytest.raises(LoopspecError, match="need a GGUF target"):
        resolve_precision("gguf-int8act", "onnxruntime", str(target_dir))
    with pytest.raises(LoopspecError, match="unknown precision 'int4'"):
        resolve_precision("int4", "onnxruntime", str(path))
    # the cached export over the GGUF's blocks: exported once, then reused
    target, drafter = load_target_dir(target_dir), Drafter.load(drafter_dir)
    engine = cached_ort_engine(target, drafter, target_dir, drafter_dir, 160, 1, "gguf-int8act", str(path))
    assert (engine.precision, engine.chains_only) == ("gguf-int8act", False)  # trees are exact there too
    capsys.readouterr()
    again = cached_ort_engine(target, drafter, target_dir, drafter_dir, 160, 1, "gguf-int8act", str(path))
    assert again.artifact_dir == engine.artifact_dir and "exporting" not in capsys.readouterr().err
    prompt = torch.randint(3, 120, (9,), generator=torch.Generator().manual_seed(7)).tolist()
    reference = OrtEngine(exported["gguf-int8act"][0], 160, num_threads=1)  # convert onnx's export
    assert generate(engine, prompt, max_new_tokens=24).tokens == generate(reference, prompt, max_new_tokens=24).tokens
    # an artifact directory carries its precision: a different one named is refused
    onnx_dir = exported["gguf-int8act"][0]
    assert load_pipeline(backend="onnxruntime", onnx_dir=onnx_dir, precision="auto").engine.precision == "gguf-int8act"
    with pytest.raises(LoopspecError, match="holds gguf-int8act engines, not fp32"):
        load_pipeline(backend="onnxruntime", onnx_dir=onnx_dir, precision="fp32")


@pytest.mark.e2e
def test_default_target_over_its_gguf_blocks(tmp_path):
    """The embedded SmolLM2 GGUF through the command line, both arithmetics: validated, and greedy
    `dloop` equal to `ar` on each engine (fp32 activations: also equal to the fp32 reference)."""
    from loopspec.runtime.pipeline import load_pipeline

    prompt = None
    outputs = {}
    for precision in PRECISIONS:
        out = tmp_path / precision
        assert (
            main(
                [
                    "convert",
                    "onnx",
                    "--target",
                    "default",
                    "--drafter",
                    "default",
                    "--precision",
                    precision,
                    "--out",
                    str(out),
                    "--threads",
                    "1",
                ]
            )
            == 0
        )
        assert json.loads((out / "manifest.json").read_text())["validation"]["passed"]
        pipe = load_pipeline(backend="onnxruntime", onnx_dir=out, num_threads=1)
        prompt = prompt or pipe.encode("Write a Python function that reverses a string.")
        ar = pipe.run(prompt, pipe.settings("ar"), max_new_tokens=48)
        dloop = pipe.run(prompt, pipe.settings("dloop"), max_new_tokens=48)  # the tuned setting (int8: chain + suffix)
        assert dloop.tokens == ar.tokens and sum(dloop.stats.accepted_per_round) > 0  # drafts were accepted
        assert dloop.settings.suffix and (dloop.settings.tree_budget == 0) == (precision == "gguf-int8act")
        tree = pipe.run(prompt, pipe.settings("dloop", tree_budget=8, suffix=True), max_new_tokens=48)
        assert tree.tokens == ar.tokens and max(tree.stats.nodes_per_round) > 3  # trees on both arithmetics
        outputs[precision] = ar.tokens
    reference = load_pipeline("default", "none", backend="torch", num_threads=1)
    assert outputs["gguf-fp32act"] == reference.run(prompt, reference.settings("ar"), max_new_tokens=48).tokens
