"""TensorRT plans and backend. Here (no TensorRT, no GPU): the clear refusals, the precision-vs-GPU
rule as a pure function, and the optimization profiles taken from the engine specs. On a GPU with
TensorRT (marked `gpu`): build the plans from an ONNX export and check parity and greedy identity."""

import importlib.util

import pytest
import torch

from loopspec.engines.specs import DRAFTER_BLOCK, TARGET_VERIFY, engine_specs
from loopspec.engines.trt_engine import check_precision_supported, profile_shapes
from loopspec.errors import LoopspecError
from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.model.target import TargetConfig
from loopspec.weights import load_target_dir

HAVE_TRT = importlib.util.find_spec("tensorrt") is not None
needs_trt_gpu = pytest.mark.skipif(not (HAVE_TRT and torch.cuda.is_available()), reason="needs TensorRT and a CUDA GPU")


@pytest.mark.parametrize(
    "precision, capability, ok",
    [
        ("nvfp4", (9, 0), False),  # Hopper (H100/H200): no FP4 kernels
        ("nvfp4", (8, 9), False),
        ("nvfp4", (10, 0), True),  # Blackwell B200
        ("nvfp4", (12, 0), True),  # Blackwell RTX
        ("fp8", (8, 6), False),  # Ampere A10/RTX 30xx
        ("fp8", (8, 9), True),  # Ada L4/L40
        ("fp8", (9, 0), True),
        ("bf16", (7, 5), False),
        ("bf16", (8, 0), True),
        ("fp32", (7, 5), True),
    ],
)
def test_precision_needs_the_right_gpu(precision, capability, ok):
    if ok:
        check_precision_supported(precision, capability, "GPU X")
    else:
        with pytest.raises(LoopspecError, match=r"GPU X has \d+\.\d"):
            check_precision_supported(precision, capability, "GPU X")


def test_nvfp4_refusal_names_blackwell():
    with pytest.raises(
        LoopspecError, match="nvfp4 engines need a Blackwell GPU .compute capability >= 10.0.; NVIDIA H200 has 9.0"
    ):
        check_precision_supported("nvfp4", (9, 0), "NVIDIA H200")
    with pytest.raises(LoopspecError, match="unknown engine precision"):
        check_precision_supported("int3", (10, 0))


def test_profiles_come_from_the_specs(tiny_pair):
    target = load_target_dir(tiny_pair[0])
    t: TargetConfig = target.cfg
    d = DrafterConfig.for_target(t, num_layers=1, block_size=6, mask_token_id=127)
    specs = engine_specs(t, d, max_context=128)
    for spec in specs.values():
        profile = profile_shapes(spec)
        assert [name for name, *_ in profile] == spec.input_names
        for name, lo, opt, hi in profile:
            assert len(lo) == len(opt) == len(hi)
            assert all(a <= b <= c for a, b, c in zip(lo, opt, hi)), name
    verify = {name: (lo, opt, hi) for name, lo, opt, hi in profile_shapes(specs[TARGET_VERIFY])}
    assert sum(name.startswith(("past_key_", "past_value_")) for name in verify) == 2 * t.num_layers  # one a layer
    lo, opt, hi = verify["past_key_0"]
    assert lo == (1, t.num_kv_heads, 1, t.head_dim)  # the first prefill's past: room for its tokens only
    assert opt == (1, t.num_kv_heads, 64, t.head_dim)  # tuned for one sequence
    assert hi == (16, t.num_kv_heads, 128 + 6, t.head_dim)  # up to 16 rows, a full context + a verification
    assert verify["input_ids"] == ((1, 1), (1, 6), (16, 128)) and verify["past_lengths"] == ((1,), (1,), (16,))
    block = {name: (lo, opt, hi) for name, lo, opt, hi in profile_shapes(specs[DRAFTER_BLOCK])}
    assert block["block_ids"] == ((1, 2), (1, 6), (16, 6))  # optimized for the drafter's block size
    assert block["context_key"][2] == (1, 16, d.num_kv_heads, 128 + 6, d.head_dim)  # room for a block
    # a plan for fewer rows (convert trt --max-batch): every input's batch axis narrowed, nothing else
    narrow = {name: (lo, opt, hi) for name, lo, opt, hi in profile_shapes(specs[DRAFTER_BLOCK].narrowed("batch", 4))}
    assert narrow["context_key"][2] == (1, 4, d.num_kv_heads, 128 + 6, d.head_dim)
    assert narrow["block_ids"] == ((1, 2), (1, 6), (4, 6)) and narrow["context_lengths"][2] == (4,)
    with pytest.raises(LoopspecError, match=r"batch max 17 is outside the exported range \[1, 16\]"):
        specs[TARGET_VERIFY].narrowed("batch", 17)


def test_plan_arithmetic_clears_tf32_for_fp32_and_marks_reduced_precision_not_order_exact():
    from loopspec.engines.trt_engine import builder_flags, plan_arithmetic
    from loopspec.engines.artifact_engine import verifies_chains_only

    class FakeBuilderFlag:  # TensorRT's enum, by name: builder_flags only picks which members to touch
        TF32 = "TF32"
        FP16 = "FP16"

    class FakeTrt:
        BuilderFlag = FakeBuilderFlag

    assert plan_arithmetic("fp32") == {"activations": "fp32", "tf32": False, "order_exact": True}
    assert builder_flags(FakeTrt, "fp32") == ([], ["TF32"])
    for precision in ("fp16", "bf16", "fp8", "nvfp4"):
        arithmetic = plan_arithmetic(precision)
        assert arithmetic["order_exact"] is False and arithmetic["activations"] == precision
        assert builder_flags(FakeTrt, precision) == ([], [])  # strongly typed: the graph's types decide
        assert verifies_chains_only({"arithmetic": arithmetic})
    assert not verifies_chains_only({"arithmetic": plan_arithmetic("fp32")})
    # the int8 rule the same function carries (engines/artifact_engine.py)
    assert verifies_chains_only({"arithmetic": {"activations": "int8"}})
    from loopspec.engines.export import ORDER_FREE_SOFTMAX

    assert not verifies_chains_only({"arithmetic": {"activations": "int8"}, "softmax": ORDER_FREE_SOFTMAX})
    assert not verifies_chains_only({})  # an fp32 ONNX export declares nothing: trees verify
    with pytest.raises(LoopspecError, match="unknown engine precision 'int3'"):
        plan_arithmetic("int3")


def test_a_plan_that_is_not_order_exact_verifies_chains_only(tiny_targets, tmp_path):
    """The runtime reads a plan manifest's arithmetic through the one mechanism the artifact engines
    share (TrtEngine is an ArtifactEngine, as OrtEngine is): here an ONNX export whose manifest says what
    a bf16 plan's says; a draft tree is refused with the reason, a chain still decodes what ar decodes."""
    pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'loopspec[onnx]'")
    from loopspec.engines.export import export_engines
    from loopspec.engines.manifest import read_manifest
    from loopspec.engines.trt_engine import plan_arithmetic
    from loopspec.runtime.decoder import generate
    from loopspec.engines.ort_engine import OrtEngine
    from loopspec.settings import DecodingSettings

    target = load_target_dir(tiny_targets["llama"])
    torch.manual_seed(0)
    drafter_cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=4, mask_token_id=127)
    export_engines(
        target, Drafter(drafter_cfg).eval(), tmp_path / "onnx", target_dir=tiny_targets["llama"], max_context=64
    )
    assert not OrtEngine(tmp_path / "onnx", max_context=64).chains_only
    manifest = read_manifest(tmp_path / "onnx")
    manifest.data["settings"]["arithmetic"] = plan_arithmetic("bf16")
    manifest.save()
    engine = OrtEngine(tmp_path / "onnx", max_context=64)
    assert engine.chains_only
    prompt = [5, 9, 14, 3]
    with pytest.raises(LoopspecError, match="chains exactly, not trees"):
        generate(engine, prompt, DecodingSettings("dflash", 4, tree_budget=6), max_new_tokens=6)
    ar = generate(engine, prompt, DecodingSettings(), max_new_tokens=6).tokens
    assert generate(engine, prompt, DecodingSettings("dflash", 4), max_new_tokens=6).tokens == ar


@pytest.mark.skipif(HAVE_TRT, reason="TensorRT is installed here")
def test_without_tensorrt_a_clear_error(tmp_path):
    from loopspec.convert.trt import build_plans
    from loopspec.engines.trt_engine import TrtEngine

    for make in (lambda: build_plans(tmp_path, tmp_path / "plans"), lambda: TrtEngine(tmp_path)):
        with pytest.raises(LoopspecError, match="TensorRT is not installed: pip install tensorrt"):
            make()
    assert not (tmp_path / "plans").exists()


@pytest.mark.skipif(HAVE_TRT, reason="TensorRT is installed here")
def test_cli_convert_trt_without_tensorrt(tmp_path, capsys):
    from loopspec.cli import main

    assert main(["convert", "trt", "--onnx", str(tmp_path), "--out", str(tmp_path / "plans")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loopspec: error: TensorRT is not installed: pip install tensorrt") and err.count("\n") == 1
    assert main(["generate", "--backend", "tensorrt", "--trt-dir", str(tmp_path), "--prompt", "hi"]) == 2
    assert "TensorRT is not installed" in capsys.readouterr().err


def test_tensorrt_backend_needs_its_plans(tmp_path):
    from loopspec.runtime.pipeline import load_pipeline

    with pytest.raises(LoopspecError, match="--backend tensorrt runs the plans of --trt-dir"):
        load_pipeline(backend="tensorrt")
    with pytest.raises(LoopspecError, match="--trt-dir needs --backend tensorrt"):
        load_pipeline(backend="torch", trt_dir=tmp_path)
    if not HAVE_TRT:
        with pytest.raises(LoopspecError, match="TensorRT is not installed"):
            load_pipeline(backend="tensorrt", trt_dir=tmp_path)


# --------------------------------------------------------------------------------------------------
# on a GPU with TensorRT


@pytest.fixture(scope="module")
def plans(tiny_pair, tmp_path_factory):
    from loopspec.cli import main

    target_dir, drafter_dir = tiny_pair
    root = tmp_path_factory.mktemp("trt")
    assert (
        main(
            ["convert", "onnx", "--target", str(target_dir), "--drafter", str(drafter_dir), "--out", str(root / "onnx")]
        )
        == 0
    )
    assert main(["convert", "trt", "--onnx", str(root / "onnx"), "--out", str(root / "plans")]) == 0
    return root / "plans"


@pytest.mark.gpu
@needs_trt_gpu
def test_plans_match_torch(plans, tiny_pair):
    from loopspec.model.dflash import Drafter
    from loopspec.engines.torch_engine import TorchEngine
    from loopspec.engines.trt_engine import TrtEngine

    target_dir, drafter_dir = tiny_pair
    trt_engine = TrtEngine(plans, max_context=128)
    torch_engine = TorchEngine(load_target_dir(target_dir).cuda(), Drafter.load(drafter_dir).cuda(), max_context=128)
    prompt = list(range(3, 20))
    for engine in (torch_engine, trt_engine):
        engine.prefill(0, prompt, want_taps=True)
    (tl, tt), (rl, rt) = (e.verify([[5, 6, 7]], want_taps=True) for e in (torch_engine, trt_engine))
    torch.testing.assert_close(rl, tl, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(rt, tt, rtol=1e-3, atol=1e-3)
    for engine, taps in ((torch_engine, tt), (trt_engine, rt)):
        engine.append_context(taps, [3])
    (td, tp, th), (rd, rp, rh) = (e.draft([0], [7], [20], 6) for e in (torch_engine, trt_engine))
    assert torch.equal(rd, td)
    torch.testing.assert_close(rp, tp, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(rh, th, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@needs_trt_gpu
def test_trt_greedy_identity(plans):
    from loopspec.runtime.decoder import generate
    from loopspec.engines.trt_engine import TrtEngine
    from loopspec.settings import DecodingSettings

    engine = TrtEngine(plans, max_context=128)
    prompt = [5, 6, 7, 8, 9, 10]
    ar = generate(engine, prompt, max_new_tokens=40)
    assert generate(engine, prompt, DecodingSettings("dflash", 6), max_new_tokens=40).tokens == ar.tokens
    dloop = generate(engine, prompt, DecodingSettings("dloop", 6, 3, -1e9), max_new_tokens=40)
    assert dloop.tokens == ar.tokens


@pytest.mark.gpu
@needs_trt_gpu
def test_trt_batched_rows_equal_alone(plans):
    """Several rows per plan call, admitted and retired mid-run."""
    from loopspec.runtime.decoder import Decoder, decode_all, generate
    from loopspec.engines.trt_engine import TrtEngine
    from loopspec.settings import DecodingSettings as Method

    engine = TrtEngine(plans, max_context=128)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], list(range(20, 45)), [3, 4, 5, 6], [60, 61, 62]]
    budgets = [40, 7, 30, 1, 25]
    refs = [generate(engine, p, max_new_tokens=n).tokens for p, n in zip(prompts, budgets)]
    batch = engine.with_rows(3)
    assert batch.max_rows == 3
    for method in (Method(), Method("dflash", 6), Method("dloop", 6, 3, -1e9)):
        done = decode_all(
            Decoder(batch, method),
            [dict(key=i, prompt_ids=p, max_new_tokens=n) for i, (p, n) in enumerate(zip(prompts, budgets))],
        )
        assert [done[i].tokens for i in range(5)] == refs, method
