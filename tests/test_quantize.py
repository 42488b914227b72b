"""modelopt FP8 / NVFP4 quantization: calibration, checkpoints, ONNX graphs, ONNX Runtime runs of FP8,
the PyTorch emulation of NVFP4 (hand-computed cases, a tiny drafter's bounded error), NVFP4 graphs
refused where they cannot run, bad input."""

import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("modelopt.torch.quantization", reason="needs modelopt: pip install 'loopspec[quant]'")
onnx = pytest.importorskip("onnx", reason="needs onnx: pip install 'loopspec[onnx]'")
pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'loopspec[onnx]'")

from loopspec.cli import main  # noqa: E402
from loopspec.convert import quant_checkpoint as CK  # noqa: E402
from loopspec.convert import quantize as Q  # noqa: E402
from loopspec.convert.qdq import check_onnx  # noqa: E402
from loopspec.errors import LoopspecError  # noqa: E402
from loopspec.model.dflash import Drafter  # noqa: E402
from loopspec.weights import load_target_dir, load_tokenizer, read_safetensors  # noqa: E402

from conftest import save_trained_like_drafter  # noqa: E402

MAX_CONTEXT = "256"
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the e2m1 magnitudes, codes 0..7 (bit 3: sign)


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip() and "quantizers" not in line]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def trained_like_pair(tiny_pair, tmp_path_factory):
    """The tiny target with a drafter whose matrices are aligned with their inputs as trained ones are
    (conftest.save_trained_like_drafter: why a purely random drafter cannot pass FP8 validation)."""
    target_dir, drafter_dir = tiny_pair
    return target_dir, save_trained_like_drafter(target_dir, drafter_dir, tmp_path_factory.mktemp("drafter") / "d")


@pytest.fixture(scope="module")
def pair(trained_like_pair):
    target_dir, drafter_dir = trained_like_pair
    target = load_target_dir(target_dir)
    sequences = Q.calibration_sequences(
        target, load_tokenizer(target_dir), Q.read_calib_prompts(None), 3, new_tokens=24
    )
    return target_dir, drafter_dir, target, Drafter.load(drafter_dir), sequences


@pytest.fixture(scope="module")
def fp8_out(trained_like_pair, tmp_path_factory):
    """`loopspec convert quantize --precision fp8` on the tiny pair (drafter only), with the product's
    own validation: a rejected output would exit 2."""
    target_dir, drafter_dir = trained_like_pair
    out = tmp_path_factory.mktemp("fp8") / "q"
    code = main(
        [
            "convert",
            "quantize",
            "--precision",
            "fp8",
            "--target",
            str(target_dir),
            "--drafter",
            str(drafter_dir),
            "--out",
            str(out),
            "--calib-size",
            "3",
            "--max-context",
            MAX_CONTEXT,
        ]
    )
    assert code == 0
    return out


@pytest.fixture(scope="module")
def nvfp4_out(pair, tmp_path_factory):
    """NVFP4 calibration of drafter and target, checkpoints and ONNX graphs; the drafter measured through
    the PyTorch emulation of NVFP4 (its graphs are not runnable here)."""
    target_dir, drafter_dir = pair[:2]
    out = tmp_path_factory.mktemp("nvfp4") / "q"
    report = Q.quantize_pair(
        target=str(target_dir),
        drafter=str(drafter_dir),
        out_dir=out,
        precision="nvfp4",
        calib_size=2,
        target_too=True,
        max_context=int(MAX_CONTEXT),
    )
    return out, report


# ---- calibration ----------------------------------------------------------------------------------


def test_fp8_calibration_changes_outputs_within_tolerance(pair):
    _, _, target, drafter, sequences = pair
    quantized = Q.quantize_drafter(drafter, target, sequences, "fp8")
    assert drafter.fc.__class__ is torch.nn.Linear  # the reference stays unquantized
    for name, module in quantized.named_modules():
        if name.endswith(("input_quantizer", "weight_quantizer")):
            assert module.is_enabled and float(module.amax) > 0, name
    attn = quantized.layers[0].self_attn  # q/k/v share one input and one weight scale (fused in deployment)
    assert float(attn.q_proj.input_quantizer.amax) == float(attn.k_proj.input_quantizer.amax)
    assert float(attn.q_proj.weight_quantizer.amax) == float(attn.v_proj.weight_quantizer.amax)

    seq = sequences[0]
    taps = target(torch.tensor([seq.tokens]), target.new_cache(len(seq.tokens))).taps
    block = target.embed_tokens(torch.tensor([[seq.tokens[-1]] + [127] * 5]))
    positions = torch.arange(len(seq.tokens), len(seq.tokens) + 6)
    with torch.no_grad():
        outs = []
        for model in (drafter, quantized):
            k, v = Q._layer_kv(model, model.features(taps), torch.arange(len(seq.tokens)))
            outs.append(model(block, positions, k, v))
    error = float((outs[0] - outs[1]).abs().max() / outs[0].abs().max())
    assert 1e-4 < error < 0.1  # FP8 changes the outputs, a little


def test_calibration_prompts_from_file_and_bad_files(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"turns": ["first", "second"]}\n\n{"turns": ["third"]}\n')
    assert Q.read_calib_prompts(good) == ["first", "third"]
    assert len(Q.read_calib_prompts(None)) == len(Q.DEFAULT_CALIB_PROMPTS)
    with pytest.raises(LoopspecError, match="does not exist"):
        Q.read_calib_prompts(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "no turns"}\n')
    with pytest.raises(LoopspecError, match=r"bad.jsonl:1: expected a JSON object with a 'turns' list"):
        Q.read_calib_prompts(bad)
    with pytest.raises(LoopspecError, match="unknown quantization precision 'int4'"):
        Q.modelopt_config("int4")


# ---- FP8: checkpoint, ONNX, ONNX Runtime ----------------------------------------------------------


def test_fp8_checkpoint_layout(fp8_out, pair):
    drafter = pair[3]
    ckpt = fp8_out / "drafter"
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["mask_token_id"] == 127
    assert config["quantization_config"]["quant_method"] == "modelopt"
    assert config["quantization_config"]["quant_algo"] == "FP8"
    quant = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "FP8" and quant["kv_cache_quant_algo"] is None
    state = read_safetensors(ckpt / "model.safetensors")
    assert "embed_tokens.weight" not in state and "lm_head.weight" not in state
    assert state["norm.weight"].dtype == torch.bfloat16
    for proj in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ):
        w, scale = state[f"layers.0.{proj}.weight"], state[f"layers.0.{proj}.weight_scale"]
        assert w.dtype == torch.float8_e4m3fn and scale.dim() == 0 and scale.dtype == torch.float32
        assert state[f"layers.0.{proj}.input_scale"].dim() == 0
    # the fused gate_up_proj is split back into gate/up rows; dequantized weights ≈ the fp32 weights
    gate_up = drafter.layers[0].mlp.gate_up_proj.weight
    for name, rows in (("gate_proj", gate_up[:96]), ("up_proj", gate_up[96:]), ("fc", drafter.fc.weight)):
        key = f"layers.0.mlp.{name}" if name != "fc" else "fc"
        restored = state[key + ".weight"].float() * state[key + ".weight_scale"]
        assert (restored - rows).abs().max() <= rows.abs().max() / 8  # e4m3: 3 mantissa bits
    assert CK.check_checkpoint(ckpt)["quant_algo"] == "FP8"
    with pytest.raises(LoopspecError, match="FP8 checkpoint for TensorRT-LLM"):
        Drafter.load(ckpt)  # fp32 modules would misread float8 weights


def test_fp8_onnx_has_float8_qdq_and_ort_runs_it_within_the_fp8_tolerance(fp8_out, pair):
    from loopspec.convert.validate import PROMPT_TEXTS

    target_dir, _, target, drafter, _ = pair
    manifest = json.loads((fp8_out / "onnx" / "manifest.json").read_text())
    assert manifest["stage"] == "quantized" and manifest["precision"] == "fp8"
    assert manifest["settings"]["quantized_engines"] == ["drafter_context", "drafter_context_hidden", "drafter_block"]
    block = onnx.load(str(fp8_out / "onnx" / "drafter_block.onnx"))
    assert {o.domain: o.version for o in block.opset_import}[""] >= 19
    ops = [n.op_type for n in block.graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops
    assert any(i.data_type == onnx.TensorProto.FLOAT8E4M3FN and len(i.dims) == 2 for i in block.graph.initializer)
    checks = check_onnx(fp8_out / "onnx")
    # one drafter layer: qkv (fused by the export wrapper), o, gate_up, down; the context graph: fc + fused k/v
    assert checks["drafter_block"]["quantized_weights"] == 4 and checks["drafter_context"]["quantized_weights"] == 2

    report = json.loads((fp8_out / "quantize.json").read_text())
    validation = report["validation"]
    assert validation["passed"] and report["failed_checks"] == []
    # the product's FP8 tolerance, written out here: 5 % of each output's scale (draft ids aside: two
    # logits within the tolerance may swap ranks, which the τ check covers), τ within 10 %
    assert validation["tolerance"]["relative"] == 0.05 and validation["tolerance"]["tau_drop"] == 0.10
    for engine in ("drafter_context", "drafter_context_hidden", "drafter_block"):
        errors = validation["engines"][engine]["errors"]
        assert errors and all(0 < e <= 0.05 for name, e in errors.items() if name != "draft_ids"), (engine, errors)
    assert validation["engines"]["target_verify"]["errors"]["logits"] <= 1e-4  # the target is not quantized
    assert validation["greedy_identical"] and validation["acceptance"]["relative_drop"] <= 0.10
    held_out = Q.calibration_sequences(target, load_tokenizer(target_dir), list(PROMPT_TEXTS), len(PROMPT_TEXTS))
    logits = Q.drafter_logit_error(fp8_out / "onnx", target, drafter, held_out)  # ONNX Runtime FP8 vs fp32 PyTorch
    assert logits["positions"] > 0 and 0 < logits["max_abs"] <= 0.05 * logits["logit_scale"]
    # top-1 flips happen where two logits lie within FP8's rounding of each other (0.88 agreement
    # measured on this drafter); the product gates drafts by τ (above), not by this share
    assert logits["top1_agreement"] >= 0.8


def test_fp8_engines_generate_exactly_what_ar_generates(fp8_out):
    from loopspec.runtime.pipeline import load_pipeline

    pipe = load_pipeline(backend="onnxruntime", onnx_dir=fp8_out / "onnx")
    ids = pipe.encode("The quick brown fox")
    ar = pipe.run(ids, pipe.settings("ar"), max_new_tokens=24).tokens
    for method in ("dflash", "dloop"):
        result = pipe.run(ids, pipe.settings(method, adaptive=False), max_new_tokens=24)
        assert result.tokens == ar, method
        assert result.stats.verifications > 0 and result.stats.acceptance_length >= 1


# ---- NVFP4: the PyTorch emulation, structure, and refused where its graphs would run -----------------


def test_nvfp4_emulation_on_hand_computed_values():
    """Worked by hand from the format (e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; block of 16; e4m3
    block scale amax / (6 · tensor scale); nearest value, ties to the even code, saturation at 6)."""
    from loopspec.convert.qdq import nvfp4_dequantize, nvfp4_qdq

    # tensor scale 0.5: block amax 6 → block scale 6 / (6 · 0.5) = 2, one e2m1 unit is worth 2 · 0.5 = 1
    block = torch.tensor([0.2, 0.26, 0.75, 1.25, 1.8, 2.5, 2.6, 3.5, 5.0, 5.1, -0.74, -6.0, 0.0, -1.76, 4.4, 6.0])
    want = torch.tensor([0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 3.0, 4.0, 4.0, 6.0, -0.5, -6.0, 0.0, -2.0, 4.0, 6.0])
    # (0.75 → 1, 1.25 → 1, 2.5 → 2, 3.5 → 4, 5 → 4: ties to the even code; 0.26 → 0.5, 5.1 → 6: nearest)
    scale_2 = torch.tensor(0.5)
    assert torch.equal(nvfp4_qdq(block[None], scale_2)[0], want)
    # a second block 3× larger gets block scale 6 (an e4m3 value): the same codes, worth 3 each
    two = torch.cat([block, 3 * block])[None]
    assert torch.equal(nvfp4_qdq(two, scale_2)[0], torch.cat([want, 3 * want]))
    # block amax 6.9 → block scale 2.3, which e4m3 rounds to 2.25 (3 mantissa bits: 2, 2.25, 2.5 ...):
    # a unit is 1.125, so 6.9 → 6.13 units → saturates at 6 → 6.75; 1.2 → 1.07 units → 1 → 1.125
    odd = torch.zeros(1, 16)
    odd[0, 0], odd[0, 1] = 6.9, 1.2
    out = nvfp4_qdq(odd, scale_2)[0]
    assert out[0].item() == 6.75 and out[1].item() == 1.125 and not out[2:].any()
    # packed weights: bytes 0x72 → codes 2 (1.0, low nibble first) and 7 (6.0); 0x9F → 15 (-6.0), 9 (-0.5)
    packed = torch.tensor([[0x72, 0x9F, 0, 0, 0, 0, 0, 0]], dtype=torch.uint8)
    block_scale = torch.tensor([[2.0]]).to(torch.float8_e4m3fn)
    weight = nvfp4_dequantize(packed, block_scale, torch.tensor(0.25))  # a unit is 2 · 0.25 = 0.5
    assert torch.equal(weight, torch.tensor([[0.5, 3.0, -3.0, -0.25] + [0.0] * 12]))


def test_nvfp4_linear_is_close_to_fp32_and_not_equal(pair):
    """One calibrated NVFP4 linear of the tiny drafter, emulated, against its fp32 linear on inputs
    inside its calibrated range."""
    from loopspec.convert.qdq import Nvfp4Linear

    target_dir, drafter_dir, target, drafter, sequences = pair
    calibrated = Q.quantize_drafter(drafter, target, sequences, "nvfp4")
    weights = Q.quantized_weights(calibrated)
    q = weights["layers.0.mlp.down_proj"]
    original = drafter.layers[0].mlp.down_proj
    calibrated_amax = float(q.input_scale) * 6 * 448  # input_scale = amax / (6 · 448): inputs inside that range
    x = torch.randn(12, original.in_features, generator=torch.Generator().manual_seed(0)) * calibrated_amax / 4
    got, want = Nvfp4Linear.from_quantized(q)(x), original(x)
    error = (got - want).abs().max() / want.abs().max()
    assert 0 < error < 0.25  # 4-bit arithmetic: really rounded, and still the same linear


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in/2] (low nibble first) → e2m1 values [out, in]."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    return torch.where(codes >= 8, -1.0, 1.0) * E2M1[codes & 7]


def test_nvfp4_checkpoints_hold_packed_weights_and_scales(nvfp4_out, pair):
    out, report = nvfp4_out
    drafter = pair[3]
    assert report["numerics"] == Q.NVFP4_EMULATED
    for sub in ("drafter", "target"):
        assert CK.check_checkpoint(out / sub)["quant_algo"] == "NVFP4"
        quant = json.loads((out / sub / "hf_quant_config.json").read_text())["quantization"]
        assert quant["quant_algo"] == "NVFP4" and quant["group_size"] == 16
        assert json.loads((out / sub / "config.json").read_text())["quantization_config"]["quant_algo"] == "NVFP4"
    state = read_safetensors(out / "drafter" / "model.safetensors")
    w, scale = state["layers.0.self_attn.q_proj.weight"], state["layers.0.self_attn.q_proj.weight_scale"]
    scale_2 = state["layers.0.self_attn.q_proj.weight_scale_2"]
    assert w.dtype == torch.uint8 and tuple(w.shape) == (64, 32)  # [out, in/2]
    assert scale.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (64, 4)  # [out, in/16]
    assert scale_2.dtype == torch.float32 and scale_2.dim() == 0
    assert state["layers.0.self_attn.q_proj.input_scale"].dim() == 0
    # the packing decodes back to the weight: value × block scale × global scale
    restored = unpack_e2m1(w) * scale.float().repeat_interleave(16, dim=1) * scale_2
    original = drafter.layers[0].self_attn.q_proj.weight
    assert (restored - original).abs().max() <= original.abs().max() / 4
    from loopspec.convert.qdq import nvfp4_dequantize

    assert torch.equal(nvfp4_dequantize(w, scale, scale_2), restored)  # the emulation decodes modelopt's packing
    target_state = read_safetensors(out / "target" / "model.safetensors")
    assert target_state["model.layers.0.self_attn.k_proj.weight"].dtype == torch.uint8
    assert target_state["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert (out / "target" / "tokenizer.json").is_file()
    assert (
        "model.embed_tokens"
        in json.loads((out / "target" / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    )


def test_nvfp4_drafter_error_is_bounded_on_the_cpu(nvfp4_out):
    """`convert quantize --precision nvfp4` measured the emulated drafter against fp32 (as FP8 is
    measured through ONNX Runtime): a real but bounded logit error, top-1 drafts mostly kept, τ checked."""
    out, report = nvfp4_out
    e = report["emulated"]
    assert e["positions"] > 50 and e["anchors"] > 50
    assert 0 < e["max_abs"] < 0.3 * e["logit_scale"] and e["mean_abs"] < 0.05 * e["logit_scale"]
    # 4-bit weights and activations move the top-1 where the runner-up is close: this fixture's drafter
    # has small logits (scale ≈ 0.42, margins of a few hundredths), and 87.7 % of its drafts keep their
    # top-1 (the default pair's trained drafter: 82.4 %, scripts/quant_accuracy.py); chance is 1/V
    assert e["top1_agreement"] >= 0.8
    assert e["passed"] and e["tau_relative_drop"] <= e["tau_drop_limit"] == 0.15
    assert report["failed_checks"] == []
    saved = json.loads((out / Q.REPORT).read_text())
    assert saved["emulated"] == e
    assert "emulated drafter logits vs fp32" in Q.format_quantize_report(report, out)


def test_nvfp4_onnx_graphs(nvfp4_out):
    out, report = nvfp4_out
    assert set(report["onnx"]) == {"drafter_context", "drafter_context_hidden", "drafter_block", "target_verify"}
    block = onnx.load(str(out / "onnx" / "drafter_block.onnx"))
    assert {o.domain: o.version for o in block.opset_import}[""] >= 23
    weights = [i for i in block.graph.initializer if i.data_type == onnx.TensorProto.FLOAT4E2M1]
    assert weights and all(len(i.raw_data) * 2 == int(np.prod(i.dims)) for i in weights)  # two values per byte
    assert "TRT_FP4DynamicQuantize" in {n.op_type for n in block.graph.node}
    blocked = [
        n
        for n in block.graph.node
        if n.op_type == "DequantizeLinear" and any(a.name == "block_size" and a.i == 16 for a in n.attribute)
    ]
    assert len(blocked) >= len(weights)


def test_nvfp4_is_refused_where_it_would_run(nvfp4_out, capsys):
    from loopspec.convert.validate import validate_onnx
    from loopspec.engines.ort_engine import OrtEngine

    out, _ = nvfp4_out
    with pytest.raises(LoopspecError, match=r"NVFP4 numerics need a Blackwell GPU \(TensorRT\); not run here"):
        OrtEngine(out / "onnx")
    with pytest.raises(LoopspecError, match="Blackwell"):
        validate_onnx(out / "onnx", None, None, "nvfp4")
    code, _, err = run(
        capsys,
        "generate",
        "--prompt",
        "hi",
        "--backend",
        "onnxruntime",
        "--onnx-dir",
        str(out / "onnx"),
        "--max-new-tokens",
        "4",
    )
    assert code == 2 and "NVFP4 numerics need a Blackwell GPU" in one_error_line(err)


# ---- the target's checkpoint for serving bundles, and bad input -------------------------------------


def test_quantize_target_checkpoint(tiny_pair, tmp_path):
    target_dir, _ = tiny_pair
    out = Q.quantize_target_checkpoint(target_dir, tmp_path / "t", "fp8", calib_size=1)
    assert CK.check_checkpoint(out)["quantized"] == 6 * 7  # q, k, v, o, gate, up, down per layer
    with pytest.raises(LoopspecError, match="FP8 checkpoint"):
        load_target_dir(out)


def test_cli_bad_input_exits_2_with_one_line(tiny_pair, tmp_path, capsys):
    target_dir, drafter_dir = tiny_pair
    base = ["convert", "quantize", "--target", str(target_dir), "--drafter", str(drafter_dir)]
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    cases = [
        (["--precision", "int4", "--out", str(tmp_path / "a")], "unknown quantization precision 'int4'"),
        (
            ["--precision", "fp8", "--out", str(tmp_path / "b"), "--calib-prompts", str(tmp_path / "none.jsonl")],
            "calibration prompt file does not exist",
        ),
        (["--precision", "fp8", "--out", str(occupied)], "not a quantize output directory"),
    ]
    for extra, message in cases:
        code, _, err = run(capsys, *base, *extra)
        assert code == 2 and message in one_error_line(err), err
    code, _, err = run(
        capsys,
        "convert",
        "quantize",
        "--precision",
        "fp8",
        "--target",
        str(target_dir),
        "--drafter",
        "none",
        "--out",
        str(tmp_path / "c"),
    )
    assert code == 2 and "needs a drafter" in one_error_line(err)
    assert (occupied / "notes.txt").read_text() == "mine"


def test_cli_failed_validation_exits_2_and_keeps_the_previous_output(tiny_pair, fp8_out, tmp_path, capsys, monkeypatch):
    target_dir, drafter_dir = tiny_pair
    out = tmp_path / "q"
    shutil.copytree(fp8_out, out)  # an earlier output, which a rejected run must not touch
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    real_weights = Q.quantized_weights

    def sign_flipped(model):  # a broken export: the drafter's MLP weights reach the ONNX graphs negated
        weights = real_weights(model)
        for name, w in weights.items():
            if ".mlp." in name:
                w.weight = (-w.weight.float()).to(w.weight.dtype)  # exact in float8: only the sign bit
        return weights

    monkeypatch.setattr(Q, "quantized_weights", sign_flipped)
    code, stdout, err = run(
        capsys,
        "convert",
        "quantize",
        "--precision",
        "fp8",
        "--target",
        str(target_dir),
        "--drafter",
        str(drafter_dir),
        "--out",
        str(out),
        "--calib-size",
        "2",
        "--max-context",
        MAX_CONTEXT,
    )
    rejected = tmp_path / "q.rejected"
    line = one_error_line(err)
    assert code == 2 and line.startswith("loopspec: error: fp8 validation failed: drafter_"), err
    assert "> allowed 0.05" in line and f"{out} is unchanged" in line and f"are in {rejected}" in line
    assert "FAILED" in stdout and "BAD" in stdout  # the full report came first
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "q.rejected"]  # no temporary left behind
    report = json.loads((rejected / "quantize.json").read_text())
    assert any(c.startswith("drafter_block hidden relative error") for c in report["failed_checks"])
    assert (
        report["validation"]["passed"] is False
        and report["validation"]["engines"]["drafter_block"]["errors"]["hidden"] > 0.05
    )
    assert json.loads((rejected / "onnx" / "manifest.json").read_text())["validation"]["passed"] is False
