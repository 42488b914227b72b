"""DSpark drafters in the ONNX drafter-block graph: the Markov correction and the confidence head run
in-graph. Per head type, confidence variant and block convention, the exported graph in a real ONNX
Runtime session against the torch draft-head step (`draft_stage`, itself checked against an fp64
reference in test_dspark.py), each row computed alone; mutated exports that the check must catch;
greedy decoding through the ONNX Runtime engine equal to `ar`, batched rows equal to themselves
alone; validation, the CLI, backend `auto`; TensorRT plans on a GPU (skipped without one)."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'loopspec[onnx]'")
pytest.importorskip("onnx", reason="needs onnx: pip install 'loopspec[onnx]'")

from conftest import lively, save_tiny_tokenizer  # noqa: E402
from test_dspark import BLOCK, MASK, SETTINGS, deepspec_checkpoint, dspark_drafter, repeating_prompt  # noqa: E402
from loopspec.convert.validate import validate_onnx  # noqa: E402
from loopspec.engines.export import DrafterBlock, example_inputs, export_engines, export_graph  # noqa: E402
from loopspec.engines.manifest import read_manifest  # noqa: E402
from loopspec.engines.ort_engine import EngineSession  # noqa: E402
from loopspec.engines.specs import DRAFTER_BLOCK, drafter_block_spec, engine_specs, with_room  # noqa: E402
from loopspec.model.draft_head import draft_head_weight, draft_stage  # noqa: E402
from loopspec.model.drafter_kinds import MARKOV_HEAD_TYPES  # noqa: E402
from loopspec.model.dspark import MarkovHead  # noqa: E402
from loopspec.runtime.decoder import Decoder, decode_all, generate  # noqa: E402
from loopspec.engines.ort_engine import OrtEngine  # noqa: E402
from loopspec.engines.torch_engine import TorchEngine  # noqa: E402
from loopspec.weights import load_target_dir  # noqa: E402

CONTEXTS = [9, 4, 6]  # rows' valid context lengths: the graph masks each row's slots past its own


@pytest.fixture(scope="module")
def target(tiny_targets):
    return lively(load_target_dir(tiny_targets["qwen3"]))


def reduced_vocab(drafter, size=48):
    """A d2t draft vocabulary: the graph drafts over those rows of the lm_head and of W2."""
    drafter.draft_ids = torch.randperm(drafter.cfg.vocab_size, generator=torch.Generator().manual_seed(2))[:size]
    return drafter


def block_session(drafter, target, path) -> EngineSession:
    """The drafter-block graph alone, exported for blocks of up to BLOCK, in an ONNX Runtime session."""
    spec = drafter_block_spec(drafter.cfg, max_context=64)
    module = DrafterBlock(drafter, target.embed_tokens.weight, target.lm_head.weight, max_block=spec.ranges["block"][2])
    export_graph(module, spec, example_inputs(spec, target.cfg.vocab_size), path)
    return EngineSession(path, spec)


def check_block_parity(session, drafter, target, k=BLOCK, seed=0):
    """Three rows of different context lengths in ONE call of the graph, each against the torch
    drafter + `draft_stage` run on that row alone: drafts (every rank) equal, log-probs, confidence
    and hidden states within fp32 rounding."""
    cfg = drafter.cfg
    g = torch.Generator().manual_seed(seed)
    width = max(CONTEXTS)
    with torch.inference_mode():
        features = torch.randn(len(CONTEXTS), width, cfg.hidden_size, generator=g)  # [R, C, H]
        ctx_k, ctx_v = drafter.context_kv(features, torch.arange(width))  # [N, R, kvh, C, hd]
    anchors = torch.randint(3, 120, (len(CONTEXTS),), generator=g)
    ids = torch.full((len(CONTEXTS), k), MASK, dtype=torch.long)
    ids[:, 0] = anchors
    positions = torch.tensor(CONTEXTS)[:, None] + torch.arange(k)  # [R, k]: each block right after its context
    out = session.run(
        block_ids=ids.numpy(),
        positions=positions.numpy(),
        context_key=with_room(ctx_k.numpy(), k),
        context_value=with_room(ctx_v.numpy(), k),
        context_lengths=torch.tensor(CONTEXTS).numpy(),
    )
    head = draft_head_weight(target.lm_head.weight, drafter.draft_ids)
    D = cfg.drafts_per_block(k)
    assert out["draft_ids"].shape[:2] == (len(CONTEXTS), D)
    assert ("confidence" in out) == cfg.confidence_head
    for b, length in enumerate(CONTEXTS):
        with torch.inference_mode():
            hidden = drafter(
                target.embed_tokens(ids[b : b + 1]),
                positions[b],
                ctx_k[:, b : b + 1, :, :length],
                ctx_v[:, b : b + 1, :, :length],
            )  # [1, k, H]
            drafts, logprobs, confidence = draft_stage(
                drafter, hidden, ids[b : b + 1, 0], lambda h: F.linear(h, head), drafter.draft_ids
            )  # [1, D, C] each, [1, D]
        assert torch.equal(torch.from_numpy(out["draft_ids"][b]), drafts[0]), (
            b,
            out["draft_ids"][b, :, 0],
            drafts[0, :, 0],
        )
        torch.testing.assert_close(torch.from_numpy(out["draft_logprobs"][b]), logprobs[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.from_numpy(out["hidden"][b]), hidden[0], atol=1e-5, rtol=1e-5)
        if cfg.confidence_head:
            torch.testing.assert_close(torch.from_numpy(out["confidence"][b]), confidence[0], atol=1e-6, rtol=1e-5)
    return out


# every head type, with no confidence head / one on h alone / one that reads W1[prev] too, both conventions
CONFIDENCE = {
    "none": dict(confidence=False),
    "alone": dict(confidence=True, with_markov=False),
    "with_markov": dict(confidence=True, with_markov=True),
}
CASES = [(kind, conf, anchor) for kind in MARKOV_HEAD_TYPES for conf in CONFIDENCE for anchor in (True, False)]


@pytest.mark.parametrize("kind,confidence,anchor_predicts", CASES)
def test_block_graph_runs_the_markov_and_confidence_heads(kind, confidence, anchor_predicts, target, tmp_path):
    drafter = dspark_drafter(target, head_type=kind, anchor_predicts=anchor_predicts, **CONFIDENCE[confidence])
    session = block_session(drafter, target, tmp_path / "block.onnx")
    assert session.spec.output_names == ["draft_ids", "draft_logprobs", "hidden"] + (
        ["confidence"] if drafter.cfg.confidence_head else []
    )
    out = check_block_parity(session, drafter, target)
    check_block_parity(session, drafter, target, k=3, seed=1)  # a shorter block than the graph unrolls
    # the heads are live: without the Markov bias the chain would differ somewhere
    hidden = torch.from_numpy(out["hidden"])[:, drafter.cfg.first_draft :]
    assert not torch.equal(torch.from_numpy(out["draft_ids"][:, :, 0]), (hidden @ target.lm_head.weight.T).argmax(-1))


@pytest.mark.parametrize("variant", ["confidence only", "deepspec dflash", "reduced vocabulary"])
def test_block_graph_other_dspark_shapes(variant, target, tmp_path):
    """A confidence head without a Markov head; DeepSpec's DFlash (its convention, no heads); a
    d2t draft vocabulary (the bias over W2's draft rows, the predecessor a target id)."""
    if variant == "confidence only":
        drafter = dspark_drafter(target, rank=0, with_markov=False)
    elif variant == "deepspec dflash":
        drafter = dspark_drafter(target, rank=0, confidence=False)
    else:
        drafter = reduced_vocab(dspark_drafter(target, head_type="rnn", anchor_predicts=False))
    out = check_block_parity(block_session(drafter, target, tmp_path / "block.onnx"), drafter, target)
    if drafter.draft_ids is not None:
        assert set(out["draft_ids"].flatten().tolist()) <= set(drafter.draft_ids.tolist())


def latent_without_bias(original):
    def latent(self, prev, h, state):
        u, state = original(self, prev, h, state)
        return u * 0, state

    return latent


def latent_one_position_late(original):
    """The predecessor of the position before: prev taken from the wrong position."""
    seen = []

    def latent(self, prev, h, state):
        seen.append(prev)
        return original(self, seen[-2] if len(seen) > 1 else prev, h, state)

    return latent


@pytest.mark.parametrize("mutation", [latent_without_bias, latent_one_position_late])
def test_the_parity_check_catches_a_wrong_markov_graph(mutation, target, tmp_path, monkeypatch):
    drafter = dspark_drafter(target, head_type="vanilla", confidence=False)
    with monkeypatch.context() as patch:  # only the export sees the mutated head
        patch.setattr(MarkovHead, "latent", mutation(MarkovHead.latent))
        session = block_session(drafter, target, tmp_path / "mutated.onnx")
    with pytest.raises(AssertionError):
        check_block_parity(session, drafter, target)
    check_block_parity(block_session(drafter, target, tmp_path / "right.onnx"), drafter, target)


def test_spec_declares_confidence_once(target):
    with_conf = dspark_drafter(target, head_type="gated").cfg
    specs = engine_specs(target.cfg, with_conf, max_context=128)
    block = specs[DRAFTER_BLOCK]
    assert block.output_names == ["draft_ids", "draft_logprobs", "hidden", "confidence"]
    assert block.outputs[-1].dims == ("batch", "drafts") and block.dynamic_axes()["confidence"] == {
        0: "batch",
        1: "drafts",
    }
    assert list(block.profile_shapes()) == block.input_names  # a TensorRT profile covers inputs only
    plain = engine_specs(target.cfg, dspark_drafter(target, confidence=False).cfg, max_context=128)[DRAFTER_BLOCK]
    assert plain.output_names == ["draft_ids", "draft_logprobs", "hidden"]


# --------------------------------------------------------------------------------------------------
# the whole engine set: decoding, validation


DRAFTERS = {
    "rnn deepspec + confidence": dict(head_type="rnn"),
    "gated z-lab + confidence alone": dict(head_type="gated", anchor_predicts=False, with_markov=False),
    "vanilla deepspec, d2t": dict(head_type="vanilla", confidence=False),
}


@pytest.fixture(scope="module")
def exported(target, tiny_targets, tmp_path_factory):
    """{name: (torch engine, onnx dir)}. The torch engine is built first: it packs the drafter's
    Linears for oneDNN in place, and the export must still trace plain heads."""
    out = {}
    for name, kw in DRAFTERS.items():
        drafter = dspark_drafter(target, **kw)
        if "d2t" in name:
            reduced_vocab(drafter)
        engine = TorchEngine(target, drafter, max_context=200)
        onnx_dir = tmp_path_factory.mktemp("dspark-onnx") / "engines"
        export_engines(target, drafter, onnx_dir, target_dir=tiny_targets["qwen3"])
        out[name] = (engine, onnx_dir)
    return out


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_ort_engine_stage_equals_torch_engine(name, exported):
    torch_engine, onnx_dir = exported[name]
    engines = (torch_engine.with_rows(2), OrtEngine(onnx_dir, 200, max_rows=2))
    prompts = [repeating_prompt(0), [8, 8, 30]]
    for engine in engines:
        for b, p in enumerate(prompts):
            engine.prefill(b, p, want_taps=True)
    stages = [e.draft([0, 1], [11, 12], [len(p) for p in prompts], BLOCK) for e in engines]
    (td, tp, th), (od, op, oh) = stages
    assert torch.equal(od, td) and od.shape[1] == torch_engine.drafter_cfg.drafts_per_block(BLOCK)
    torch.testing.assert_close(op, tp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(oh, th, atol=1e-5, rtol=1e-5)
    if torch_engine.drafter_cfg.confidence_head:
        torch.testing.assert_close(stages[1].confidence, stages[0].confidence, atol=1e-6, rtol=1e-5)
    else:
        assert stages[1].confidence is None


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_ort_greedy_dspark_decoding_equals_ar(name, setting, exported):
    torch_engine, onnx_dir = exported[name]
    engine = OrtEngine(onnx_dir, 200)
    settings = SETTINGS[setting]
    prompts = [repeating_prompt(s) for s in range(3)]
    prompts[1] = prompts[1][:9]  # rows of different lengths
    refs = [generate(torch_engine, p, max_new_tokens=30).tokens for p in prompts]
    assert [generate(engine, p, max_new_tokens=30).tokens for p in prompts] == refs  # ar on both backends
    alone = [generate(engine, p, settings, max_new_tokens=30) for p in prompts]
    assert [o.tokens for o in alone] == refs
    assert max(n for o in alone for n in o.stats.nodes_per_round) > 1  # drafts were verified
    done = decode_all(
        Decoder(engine.with_rows(3), settings),
        [dict(key=i, prompt_ids=p, max_new_tokens=30) for i, p in enumerate(prompts)],
    )
    assert [done[i].tokens for i in range(3)] == refs  # batched rows: each equals itself alone


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_validation_checks_the_dspark_block(name, exported):
    torch_engine, onnx_dir = exported[name]
    report = validate_onnx(onnx_dir, torch_engine.target, torch_engine.drafter)
    block = report["engines"][DRAFTER_BLOCK]
    assert report["passed"] and block["passed"] and block["errors"]["draft_ids"] == 0.0
    assert ("confidence" in block["errors"]) == torch_engine.drafter_cfg.confidence_head
    assert all(error < 1e-5 for error in block["errors"].values()), block
    assert report["acceptance"]["relative_drop"] == 0.0
    assert read_manifest(onnx_dir).data["validation"]["engines"][DRAFTER_BLOCK] == block  # recorded


# --------------------------------------------------------------------------------------------------
# a DeepSpec checkpoint through the CLI and backend auto


@pytest.fixture(scope="module")
def deepspec_pair(tiny_targets, tmp_path_factory):
    root = tmp_path_factory.mktemp("deepspec-pair")
    target_dir = root / "target"
    target_dir.mkdir()
    for f in tiny_targets["qwen3"].iterdir():
        (target_dir / f.name).write_bytes(f.read_bytes())
    save_tiny_tokenizer(target_dir)
    drafter_dir, _ = deepspec_checkpoint(root / "dspark", target_dir, kind="gated")
    return target_dir, drafter_dir


def test_backend_auto_never_fails_on_a_dspark_drafter(deepspec_pair, tmp_path, monkeypatch):
    from loopspec.runtime.pipeline import load_pipeline

    target_dir, drafter_dir = deepspec_pair
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    auto = load_pipeline(str(target_dir), str(drafter_dir), max_context=128)  # backend "auto"
    exportable = all(importlib.util.find_spec(m) is not None for m in ("onnxruntime", "onnx", "onnxscript"))
    assert auto.backend == ("onnxruntime" if exportable else "torch")
    assert auto.engine.drafter_cfg.markov_head_type == "gated" and auto.engine.drafter_cfg.anchor_predicts
    plain = load_pipeline(str(target_dir), str(drafter_dir), max_context=128, backend="torch")
    ids = auto.encode("hello there")
    ar = plain.run(ids, plain.settings("ar"), max_new_tokens=20).tokens
    for method in ("ar", "dflash", "dloop"):
        assert auto.run(ids, auto.settings(method), max_new_tokens=20).tokens == ar, method


def test_cli_converts_a_deepspec_dspark_drafter(deepspec_pair, tmp_path, capsys):
    from loopspec.cli import main

    target_dir, drafter_dir = deepspec_pair
    out = tmp_path / "onnx"
    assert main(["convert", "onnx", "--target", str(target_dir), "--drafter", str(drafter_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "PASSED" in printed and "confidence" in printed
    from conftest import generated_texts_on_both_backends

    texts = [
        t for ts in generated_texts_on_both_backends(target_dir, drafter_dir, out, capsys, 16).values() for t in ts
    ]
    assert len(set(texts)) == 1 and texts[0].strip()


# --------------------------------------------------------------------------------------------------
# TensorRT: plans built from the same ONNX graphs (needs TensorRT and a CUDA GPU; skipped here)

needs_trt_gpu = pytest.mark.skipif(
    not (importlib.util.find_spec("tensorrt") is not None and torch.cuda.is_available()),
    reason="needs TensorRT and a CUDA GPU",
)


@pytest.mark.gpu
@needs_trt_gpu
def test_trt_plans_run_the_dspark_heads(deepspec_pair, tmp_path):
    from loopspec.cli import main
    from loopspec.pair import load_pair
    from loopspec.engines.trt_engine import TrtEngine

    target_dir, drafter_dir = deepspec_pair
    assert (
        main(
            [
                "convert",
                "onnx",
                "--target",
                str(target_dir),
                "--drafter",
                str(drafter_dir),
                "--out",
                str(tmp_path / "onnx"),
            ]
        )
        == 0
    )
    assert main(["convert", "trt", "--onnx", str(tmp_path / "onnx"), "--out", str(tmp_path / "plans")]) == 0
    pair = load_pair(target_dir, drafter_dir)
    engines = (
        TorchEngine(pair.target.cuda(), pair.drafter.cuda(), max_context=128),
        TrtEngine(tmp_path / "plans", 128),
    )
    prompt = repeating_prompt(0)
    for engine in engines:
        engine.prefill(0, prompt, want_taps=True)
    (td, tp, _), (rd, rp, _) = stages = [e.draft([0], [7], [len(prompt)], BLOCK) for e in engines]
    assert torch.equal(rd, td)
    torch.testing.assert_close(rp, tp, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(stages[1].confidence, stages[0].confidence.cpu(), rtol=1e-3, atol=1e-3)
    ar = generate(engines[1], prompt, max_new_tokens=30).tokens
    for setting in ("dflash chain", "dloop chain"):
        assert generate(engines[1], prompt, SETTINGS[setting], max_new_tokens=30).tokens == ar
