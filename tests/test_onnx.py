"""ONNX export → ONNX Runtime: per-engine parity with PyTorch, greedy identity across backends for
ar / dflash / dloop, the specs, the manifest, the first-use cache, the CLI and the bad paths."""

import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'loopspec[onnx]'")
onnx = pytest.importorskip("onnx", reason="needs onnx: pip install 'loopspec[onnx]'")

from loopspec.cli import main  # noqa: E402
from loopspec.convert.validate import format_report, validate_onnx  # noqa: E402
from loopspec.engines.export import export_engines  # noqa: E402
from loopspec.engines.manifest import read_manifest  # noqa: E402
from loopspec.engines.specs import (  # noqa: E402
    DRAFTER_BLOCK,
    DRAFTER_CONTEXT,
    DRAFTER_CONTEXT_HIDDEN,
    ENGINE_NAMES,
    TARGET_VERIFY,
    EngineSpec,
    TensorSpec,
    engine_specs,
)
from loopspec.errors import LoopspecError  # noqa: E402
from loopspec.files import file_sha256  # noqa: E402
from loopspec.model.dflash import Drafter, DrafterConfig  # noqa: E402
from loopspec.runtime.decoder import generate  # noqa: E402
from loopspec.engines.ort_engine import OrtEngine  # noqa: E402
from loopspec.engines.torch_engine import TorchEngine  # noqa: E402
from loopspec.settings import DecodingSettings  # noqa: E402
from loopspec.weights import load_target_dir  # noqa: E402

from conftest import FAMILIES, accepted_drafts, agreeing_drafter, target_greedy  # noqa: E402

IDENTITY_PROMPT = torch.randint(0, 120, (11,), generator=torch.Generator().manual_seed(4)).tolist()


def random_drafter(target, reduced_vocab: bool, block_size=5):
    torch.manual_seed(1)
    cfg = DrafterConfig.for_target(target.cfg, num_layers=2, block_size=block_size, mask_token_id=127)
    drafter = Drafter(cfg).eval()
    if reduced_vocab:  # a d2t draft vocabulary: the block graph must map draft rows back to target ids
        drafter.draft_ids = torch.randperm(target.cfg.vocab_size, generator=torch.Generator().manual_seed(2))[:48]
    return drafter


@pytest.fixture(scope="module")
def exported(tiny_targets, tmp_path_factory):
    """{family: (target, drafter, onnx dir)}: one export per family (qwen2 with a reduced draft vocab);
    the drafter is trained to draft the target's continuation of IDENTITY_PROMPT."""
    out = {}
    for family in FAMILIES:
        target = load_target_dir(tiny_targets[family])
        cfg = DrafterConfig.for_target(target.cfg, num_layers=2, block_size=5, mask_token_id=127)
        drafter = agreeing_drafter(target, [IDENTITY_PROMPT], cfg, new_tokens=50).eval()
        if family == "qwen2":  # a d2t draft vocabulary of 48 holding the text's tokens (its drafts can agree)
            text = torch.tensor(target_greedy(target, IDENTITY_PROMPT, 50)).unique()
            others = [
                t
                for t in torch.randperm(target.cfg.vocab_size, generator=torch.Generator().manual_seed(2)).tolist()
                if t not in text.tolist()
            ]
            drafter.draft_ids = torch.cat([text, torch.tensor(others)])[:48].sort().values
        onnx_dir = tmp_path_factory.mktemp("onnx") / family
        export_engines(target, drafter, onnx_dir, target_dir=tiny_targets[family])
        out[family] = (target, drafter, onnx_dir)
    return out


def copy_of(onnx_dir, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(onnx_dir, dst)
    return dst


# ---- export and parity ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_every_engine_matches_pytorch(family, exported):
    target, drafter, onnx_dir = exported[family]
    manifest = read_manifest(onnx_dir)
    assert manifest.engines == list(ENGINE_NAMES) and manifest.stage == "onnx" and manifest.precision == "fp32"
    for name in ENGINE_NAMES:
        graph = onnx.load(str(manifest.path(name)))
        assert {n.domain for n in graph.graph.node} <= {""}  # standard ONNX ops only
        assert graph.opset_import[0].version >= 17
        spec = manifest.spec(name)
        assert [i.name for i in graph.graph.input] == spec.input_names
        assert [o.name for o in graph.graph.output] == spec.output_names
    report = validate_onnx(onnx_dir, target, drafter, "fp32")
    assert report["passed"] and report["greedy_identical"]
    for engine, r in report["engines"].items():
        for output, error in r["errors"].items():
            assert error < 1e-5, (engine, output, error)
    assert report["acceptance"]["relative_drop"] == 0.0
    assert read_manifest(onnx_dir).data["validation"]["passed"]  # the report is stored with the artifact


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identical_across_backends(family, exported):
    target, drafter, onnx_dir = exported[family]
    engines = {"torch": TorchEngine(target, drafter, max_context=160), "onnxruntime": OrtEngine(onnx_dir, 160)}
    prompt = IDENTITY_PROMPT
    outputs = {}
    for backend, engine in engines.items():
        assert engine.has_drafter and engine.drafter_cfg.block_size == 5 and engine.drafter_cfg.mask_token_id == 127
        ar = generate(engine, prompt, max_new_tokens=50)
        dflash = generate(engine, prompt, DecodingSettings("dflash", 5), max_new_tokens=50)
        dloop = generate(engine, prompt, DecodingSettings("dloop", 5, 3, -1e9), max_new_tokens=50)
        assert dflash.tokens == ar.tokens and dloop.tokens == ar.tokens
        assert min(accepted_drafts([dflash]), accepted_drafts([dloop])) >= 25  # of 50 (measured 36 to 45)
        assert max(dloop.stats.stages_per_round) == 3  # the pseudo-context engine really ran
        outputs[backend] = (ar.tokens, dflash.stats.accepted_per_round, dloop.stats.accepted_per_round)
    assert outputs["onnxruntime"] == outputs["torch"]  # same tokens and the same drafts accepted


def test_engine_calls_match_torch_engine(exported):
    target, drafter, onnx_dir = exported["qwen2"]
    te, oe = TorchEngine(target, drafter, max_context=64), OrtEngine(onnx_dir, 64)
    prompt = list(range(3, 17))
    lt, lo = (e.prefill(0, prompt, want_taps=True) for e in (te, oe))
    assert lo.shape == lt.shape == (128,) and torch.allclose(lo, lt, atol=1e-5)
    # the prompt's context features, as K/V of every drafter layer
    assert torch.allclose(oe.context.kv.k[:, 0, :, :14], te.context.kv.k[:, 0, :, :14], atol=1e-5)
    assert torch.allclose(oe.context.kv.v[:, 0, :, :14], te.context.kv.v[:, 0, :, :14], atol=1e-5)
    (dt, pt, ht), (do, po, ho) = (e.draft([0], [7], [14], 5) for e in (te, oe))
    assert torch.equal(do, dt) and set(do.flatten().tolist()) <= set(drafter.draft_ids.tolist())  # target ids
    assert torch.allclose(po, pt, atol=1e-5) and torch.allclose(ho, ht, atol=1e-5)
    for e in (te, oe):  # DLoop pseudo-context, then rollback
        e.append_pseudo_context([0], ht[:, 1:] if e is te else ho[:, 1:])
        assert e.context_lengths([0]) == [18]
        e.context_rollback([0], [14])
    (lt, _), (lo, _) = (e.verify([[5, 6, 7]], want_taps=False) for e in (te, oe))
    assert lo.shape == (1, 3, 128) and torch.allclose(lo, lt, atol=1e-5)
    for e in (te, oe):
        e.target_rollback([15])
        assert e.cache.lengths[0] == 15
    with pytest.raises(ValueError):
        oe.target_rollback([16])
    with pytest.raises(LoopspecError, match="exceeds the context"):
        oe.verify([list(range(60))], want_taps=False)


def test_target_only_export_runs_ar(tiny_targets, tmp_path):
    target = load_target_dir(tiny_targets["llama"])
    manifest = export_engines(target, None, tmp_path / "ar", target_dir=tiny_targets["llama"])
    assert manifest.engines == [TARGET_VERIFY] and "taps" not in manifest.spec(TARGET_VERIFY).output_names
    engine = OrtEngine(tmp_path / "ar", 100)
    assert not engine.has_drafter and engine.drafter_cfg is None
    prompt = [4, 9, 16, 25]
    ref = generate(TorchEngine(target, None, max_context=100), prompt, max_new_tokens=30)
    assert generate(engine, prompt, max_new_tokens=30).tokens == ref.tokens
    with pytest.raises(LoopspecError, match="drafter"):
        generate(engine, prompt, DecodingSettings("dflash", 4), max_new_tokens=5)
    assert validate_onnx(tmp_path / "ar", target, None)["passed"]


def scale_output(onnx_dir, engine: str, output: str, factor: float) -> None:
    """Rewrite `engine`'s graph in `onnx_dir` to return `output` times `factor`: everything the graph
    computes inside (its other outputs included) stays exact, only what leaves it is off."""
    manifest = read_manifest(onnx_dir)
    path = manifest.path(engine)
    model = onnx.load(str(path))
    exact = f"{output}_exact"
    for node in model.graph.node:
        for names in (node.input, node.output):
            renamed = [exact if name == output else name for name in names]
            del names[:]
            names.extend(renamed)
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(factor, np.float32), f"{output}_factor"))
    model.graph.node.append(onnx.helper.make_node("Mul", [exact, f"{output}_factor"], [output]))
    onnx.save(model, str(path))  # the weights inline now; the external data file stays as it was
    manifest.data["files"][path.name] = file_sha256(path)
    manifest.save()


@pytest.mark.parametrize(
    "engine,output",
    [
        (TARGET_VERIFY, "logits"),
        (TARGET_VERIFY, "new_key"),
        (DRAFTER_CONTEXT, "context_value"),
        (DRAFTER_BLOCK, "hidden"),
        (DRAFTER_CONTEXT_HIDDEN, "context_key"),
    ],
)
def test_validation_refuses_a_wrong_graph(engine, output, exported, tmp_path):
    """One output of one graph 1 % off: validation, through the engine the runtime runs, fails that
    engine and only that one (each figure is its own graph's error). The K/V outputs leave no trace in
    the call's own logits or drafts; they are read where the engine stored them."""
    target, drafter, onnx_dir = exported["llama"]
    bad = copy_of(onnx_dir, tmp_path)
    scale_output(bad, engine, output, 1.01)
    report = validate_onnx(bad, target, drafter, "fp32")
    assert not report["passed"] and read_manifest(bad).data["validation"]["passed"] is False
    assert [name for name, r in report["engines"].items() if not r["passed"]] == [engine]
    assert report["engines"][engine]["errors"][output] > 5e-3, report["engines"][engine]
    text = format_report(report)
    assert text.startswith("validation (fp32, tolerance 0.0001 relative): FAILED")
    assert f"  {engine:<24}BAD " in text


# ---- specs ---------------------------------------------------------------------------------------


def test_specs_are_the_one_source_of_truth(tiny_targets):
    target = load_target_dir(tiny_targets["qwen3"])
    drafter = random_drafter(target, reduced_vocab=False, block_size=8)
    specs = engine_specs(target.cfg, drafter.cfg, max_context=256)
    assert list(specs) == list(ENGINE_NAMES)
    verify = specs[TARGET_VERIFY]
    L, kvh, hd = target.cfg.num_layers, target.cfg.num_kv_heads, target.cfg.head_dim
    shapes = verify.profile_shapes()
    # batch: 1 row (optimized for), up to 16; past: one input per layer, with room for the call's tokens
    assert [n for n in verify.input_names if n.startswith(("past_key_", "past_value_"))] == [
        f"past_{kind}_{i}" for i in range(L) for kind in ("key", "value")
    ]
    assert shapes["past_key_0"] == ((1, kvh, 1, hd), (1, kvh, 128, hd), (16, kvh, 256 + 8, hd))
    assert shapes["input_ids"] == ((1, 1), (1, 8), (16, 256))
    assert shapes["past_lengths"] == ((1,), (1,), (16,))
    assert verify.dynamic_axes()["taps"] == {0: "batch", 1: "tokens"}
    block = specs["drafter_block"]
    assert block.profile_shapes()["block_ids"] == ((1, 2), (1, 8), (16, 8))
    assert block.input_names[-1] == "context_lengths"
    assert block.output_names == ["draft_ids", "draft_logprobs", "hidden"]
    assert EngineSpec.from_dict(json.loads(json.dumps(block.to_dict()))) == block
    block.check_input("block_ids", (1, 5))
    block.check_input("block_ids", (16, 5))
    with pytest.raises(LoopspecError, match="outside"):
        block.check_input("block_ids", (1, 9))
    with pytest.raises(LoopspecError, match="batch=17 is outside"):
        block.check_input("block_ids", (17, 5))
    with pytest.raises(LoopspecError, match=f"axis 1 must be {kvh}"):
        verify.check_input("past_key_0", (3, kvh + 1, 5, hd))
    small = engine_specs(target.cfg, drafter.cfg, max_context=256, max_batch=4)
    assert {spec.ranges["batch"] for spec in small.values()} == {(1, 1, 4)}
    with pytest.raises(LoopspecError, match="max batch"):
        engine_specs(target.cfg, drafter.cfg, max_context=256, max_batch=0)
    with pytest.raises(LoopspecError, match="no range"):
        EngineSpec("x", (TensorSpec("a", "float32", (1, "n")),), (), {})
    with pytest.raises(LoopspecError, match="min <= opt <= max"):
        EngineSpec("x", (TensorSpec("a", "float32", (1, "n")),), (), {"n": (4, 2, 8)})
    with pytest.raises(LoopspecError, match="dtype"):
        TensorSpec("a", "float8", (1,))


# ---- the runtime's cache and the CLI --------------------------------------------------------------


def test_pipeline_exports_once_and_reuses_the_cache(tiny_pair, tmp_path, monkeypatch, capsys):
    from loopspec.runtime.pipeline import load_pipeline

    target_dir, drafter_dir = tiny_pair
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    pipe = load_pipeline(str(target_dir), str(drafter_dir), max_context=128, backend="onnxruntime")
    assert "exporting fp32 ONNX engines" in capsys.readouterr().err
    cached = pipe.engine.onnx_dir
    assert cached.parent == tmp_path / "loopspec" / "onnx" and pipe.backend == "onnxruntime"
    torch_pipe = load_pipeline(str(target_dir), str(drafter_dir), max_context=128, backend="torch")
    ids = pipe.encode("hello there")
    for method in ("ar", "dflash", "dloop"):
        settings = pipe.settings(method)
        assert (
            pipe.run(ids, settings, max_new_tokens=24).tokens == torch_pipe.run(ids, settings, max_new_tokens=24).tokens
        )
    again = load_pipeline(str(target_dir), str(drafter_dir), max_context=128, backend="onnxruntime")
    assert again.engine.onnx_dir == cached and "exporting" not in capsys.readouterr().err
    (cached / "drafter_block.onnx.data").write_bytes(b"garbage")  # a damaged cache is exported again
    load_pipeline(str(target_dir), str(drafter_dir), max_context=128, backend="onnxruntime")
    err = capsys.readouterr().err
    assert "hash mismatch" in err and "exporting" in err
    assert read_manifest(cached).has_drafter


def test_cli_convert_then_generate_and_bench_on_both_backends(tiny_pair, tmp_path, capsys):
    target_dir, drafter_dir = tiny_pair
    out = tmp_path / "onnx"
    assert main(["convert", "onnx", "--target", str(target_dir), "--drafter", str(drafter_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "PASSED" in printed and "identical to PyTorch" in printed
    assert read_manifest(out).data["sources"]["drafter"]["files"]["model.safetensors"]
    from conftest import generated_texts_on_both_backends

    texts = generated_texts_on_both_backends(target_dir, drafter_dir, out, capsys, 24)
    assert texts["ar"][0] == texts["ar"][1] == texts["dloop"][0] == texts["dloop"][1]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["hello"]}) + "\n" + json.dumps({"turns": ["world"]}) + "\n")
    report = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "--prompts",
                str(prompts),
                "--methods",
                "ar,dflash,dloop",
                "--max-new-tokens",
                "16",
                "--backend",
                "onnxruntime",
                "--onnx-dir",
                str(out),
                "--json",
                str(report),
            ]
        )
        == 0
    )
    results = json.loads(report.read_text())["results"]
    assert {r["backend"] for r in results} == {"onnxruntime fp32"} and all(r["identical_to_ar"] for r in results)


# ---- bad input -----------------------------------------------------------------------------------


def test_corrupt_or_edited_files_are_refused(exported, tmp_path):
    _, _, onnx_dir = exported["llama"]
    bad = copy_of(onnx_dir, tmp_path)
    data = bytearray((bad / "drafter_block.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "drafter_block.onnx").write_bytes(bytes(data))
    with pytest.raises(LoopspecError, match="hash mismatch for drafter_block.onnx"):
        OrtEngine(bad)
    # a corrupt graph whose manifest was rewritten to match: ONNX Runtime itself refuses it
    (bad / "drafter_block.onnx").write_bytes(b"\x08\x07garbage that is not a protobuf")
    manifest = read_manifest(bad, verify=False)
    from loopspec.weights import file_sha256

    manifest.data["files"]["drafter_block.onnx"] = file_sha256(bad / "drafter_block.onnx")
    manifest.save()
    with pytest.raises(LoopspecError, match="cannot load ONNX engine .*drafter_block.onnx"):
        OrtEngine(bad)


def test_missing_engine_manifest_and_precision_are_refused(exported, tmp_path):
    target, drafter, onnx_dir = exported["qwen3"]
    missing_file = copy_of(onnx_dir, tmp_path / "a")
    (missing_file / "drafter_context.onnx.data").unlink()
    with pytest.raises(LoopspecError, match="missing artifact file drafter_context.onnx.data"):
        OrtEngine(missing_file)
    missing_engine = copy_of(onnx_dir, tmp_path / "b")
    manifest = read_manifest(missing_engine)
    del manifest.data["engines"]["drafter_block"]
    manifest.save()
    with pytest.raises(LoopspecError, match="missing drafter engine.*drafter_block"):
        OrtEngine(missing_engine)
    no_manifest = copy_of(onnx_dir, tmp_path / "c")
    (no_manifest / "manifest.json").unlink()
    with pytest.raises(LoopspecError, match="missing manifest.json"):
        OrtEngine(no_manifest)
    nvfp4 = copy_of(onnx_dir, tmp_path / "d")
    manifest = read_manifest(nvfp4)
    manifest.data["precision"] = "nvfp4"
    manifest.save()
    not_here = r"(?i)nvfp4.*(cannot run on ONNX Runtime|not run here)"
    with pytest.raises(LoopspecError, match=not_here):
        OrtEngine(nvfp4)
    with pytest.raises(LoopspecError, match=not_here):
        validate_onnx(nvfp4, target, drafter, "nvfp4")
    with pytest.raises(LoopspecError, match="unknown precision"):
        validate_onnx(onnx_dir, target, drafter, "int3")
    with pytest.raises(LoopspecError, match="holds fp32 engines, not fp8"):
        validate_onnx(onnx_dir, target, drafter, "fp8")
    with pytest.raises(LoopspecError, match="no reference drafter"):
        validate_onnx(onnx_dir, target, None)


def test_cli_bad_input_exits_2_with_one_line(exported, tmp_path, capsys):
    _, _, onnx_dir = exported["llama"]
    bad = copy_of(onnx_dir, tmp_path)
    (bad / "target_verify.onnx.data").write_bytes(b"\0" * 16)
    no_engine = copy_of(onnx_dir, tmp_path / "e")
    manifest = read_manifest(no_engine)
    del manifest.data["engines"]["drafter_context"]
    manifest.save()
    nvfp4 = copy_of(onnx_dir, tmp_path / "p")
    manifest = read_manifest(nvfp4)
    manifest.data["precision"] = "nvfp4"
    manifest.save()
    ort = ["generate", "--prompt", "x", "--backend", "onnxruntime", "--onnx-dir"]
    cases = [
        (ort + [str(bad)], "hash mismatch"),
        (ort + [str(no_engine)], "missing drafter engine(s) drafter_context"),
        (ort + [str(nvfp4)], "NVFP4"),
        (
            ["generate", "--prompt", "x", "--backend", "onnxruntime", "--onnx-dir", str(tmp_path / "nope")],
            "does not exist",
        ),
        (["generate", "--prompt", "x", "--backend", "tensorflow"], "unknown backend"),
        (
            ["generate", "--prompt", "x", "--backend", "torch", "--onnx-dir", str(onnx_dir)],
            "needs --backend onnxruntime",
        ),
        (["convert", "onnx", "--target", str(tmp_path / "missing"), "--out", str(tmp_path / "o")], "does not exist"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message.lower() in err.lower() and len(err.splitlines()) == 1, err
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    target_dir = onnx_dir.parent  # any existing target works: the refusal comes first
    with pytest.raises(LoopspecError, match="refusing to overwrite"):
        export_engines(exported["llama"][0], None, occupied, target_dir=target_dir)
    assert (occupied / "notes.txt").read_text() == "mine"


# ---- the default pair --------------------------------------------------------------------------------


@pytest.mark.e2e
def test_default_pair_onnxruntime_equals_torch(tmp_path_factory):
    from loopspec.convert.onnx_export import convert_onnx
    from loopspec.runtime.pipeline import load_pipeline

    torch_pipe = load_pipeline("default", "default", max_context=512, backend="torch")
    onnx_dir = tmp_path_factory.mktemp("default") / "onnx"
    _, report = convert_onnx(
        torch_pipe.target,
        torch_pipe.drafter,
        onnx_dir,
        target_dir=torch_pipe.target_dir,
        drafter_dir=torch_pipe.drafter_dir,
    )
    assert report["passed"] and report["greedy_identical"]
    ort_pipe = load_pipeline(backend="onnxruntime", onnx_dir=onnx_dir, max_context=512)
    assert ort_pipe.settings("dloop") == torch_pipe.settings("dloop")  # the tuned setting travels with the export
    ids = torch_pipe.encode("Write a Python function that checks whether a number is prime.")
    assert ort_pipe.encode("Write a Python function that checks whether a number is prime.") == ids
    ar = torch_pipe.run(ids, torch_pipe.settings("ar"), max_new_tokens=24).tokens
    for method in ("ar", "dflash", "dloop"):
        assert ort_pipe.run(ids, ort_pipe.settings(method, adaptive=False), max_new_tokens=24).tokens == ar, method


def test_the_target_graph_writes_the_new_kv_into_the_cache_itself(exported):
    """The past outputs are bound to the cache's own memory (engines/ort_engine.py): a call that stores
    nothing still finds its new K/V in the cache's room, written by the graph, and every valid slot
    untouched; rows passed as a copy (not in the cache's order) leave the cache as it was."""
    target, drafter, onnx_dir = exported["llama"]
    engine = OrtEngine(onnx_dir, 64).with_rows(2)
    for row, prompt in enumerate([list(range(3, 17)), list(range(20, 30))]):
        engine.prefill(row, prompt, want_taps=False)
    before = engine.cache.k.clone(), engine.cache.v.clone()
    out = engine.run_target([0, 1], [[5, 6, 7], [8, 9, 10]], 3, all_logits=True)
    for b, length in enumerate([14, 10]):
        assert torch.equal(engine.cache.k[:, b, :, length : length + 3], out["new_key"][:, b])
        assert torch.equal(engine.cache.v[:, b, :, length : length + 3], out["new_value"][:, b])
        assert torch.equal(engine.cache.k[:, b, :, :length], before[0][:, b, :, :length])
        assert torch.equal(engine.cache.v[:, b, :, :length], before[1][:, b, :, :length])
    engine.cache.k.copy_(before[0]), engine.cache.v.copy_(before[1])
    engine.run_target([1, 0], [[8, 9, 10], [5, 6, 7]], 3, all_logits=True)  # out of order: a copy
    assert torch.equal(engine.cache.k, before[0]) and torch.equal(engine.cache.v, before[1])
