"""EAGLE-3 drafters on ONNX Runtime (engines/eagle3_export.py, engines/eagle3_graphs.py): the exported
graphs draft what the torch engine's EAGLE-3 path drafts (ids equal, log-probs and states within fp32
rounding, d2t applied in the graph), a row drafts bit for bit what it drafts alone beside rows of other
lengths, greedy chains, trees and DLoop over it commit plain decoding's tokens with drafts accepted,
`convert onnx` writes and validates its graphs (a graph 1 % off fails validation), the CLI decodes with
it on --backend onnxruntime, and quantized drafter graphs refuse it in one line."""

import json

import pytest
import torch

pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'loopspec[onnx]'")
pytest.importorskip("onnx", reason="needs onnx: pip install 'loopspec[onnx]'")

from conftest import accepted_drafts, batched_greedy_equals_plain, lively  # noqa: E402
from test_eagle3 import BLOCK, DRAFT_VOCAB, agreeing_eagle3, eagle3_checkpoint, prompts  # noqa: E402
from test_eagle3 import target_dir  # noqa: E402,F401  (the module's tiny qwen3 target of 8 layers)
from test_onnx import copy_of, scale_output  # noqa: E402

from loopspec.cli import main  # noqa: E402
from loopspec.convert.validate import validate_onnx  # noqa: E402
from loopspec.engines.backends import export_pair  # noqa: E402
from loopspec.engines.eagle3_specs import EAGLE3_FUSE, EAGLE3_STEP  # noqa: E402
from loopspec.engines.export import export_engines  # noqa: E402
from loopspec.engines.manifest import read_manifest  # noqa: E402
from loopspec.engines.ort_engine import OrtEngine  # noqa: E402
from loopspec.engines.specs import TARGET_VERIFY  # noqa: E402
from loopspec.engines.torch_engine import TorchEngine  # noqa: E402
from loopspec.errors import LoopspecError  # noqa: E402
from loopspec.model.drafter_kinds import require_zlab_block  # noqa: E402
from loopspec.model.eagle3 import Eagle3Drafter  # noqa: E402
from loopspec.runtime.decoder import generate  # noqa: E402
from loopspec.settings import DecodingSettings as Method  # noqa: E402
from loopspec.weights import load_target_dir  # noqa: E402

# rows of different lengths, one past the cache's first 32 slots: alone and batched, a row's call passes a past
# of another width
PROMPTS = [[5, 17, 33, 9, 71, 2, 40, 40, 12, 99], [7, 8, 9], [60, 3, 3, 81, 14, 5] * 7]
ANCHORS = [64, 11, 90]
CONTEXT = 128


@pytest.fixture(scope="module")
def reduced(target_dir, tmp_path_factory):
    """A SpecForge-layout drafter over a draft vocabulary of 48 (d2t), exported: (target, drafter, onnx dir)."""
    root = tmp_path_factory.mktemp("eagle3-onnx")
    directory, _ = eagle3_checkpoint(root / "eagle3")
    target = load_target_dir(target_dir)
    drafter = Eagle3Drafter.load(directory)
    drafter.cfg.fit(target.cfg)
    export_pair(target, drafter, root / "onnx", target_dir=target_dir, max_context=CONTEXT)
    return target, drafter, root / "onnx"


def prefilled(engine, rows=(0, 1, 2)):
    for b in rows:
        engine.prefill(b, PROMPTS[b], want_taps=True)
    return engine


def test_the_graphs_draft_what_the_torch_engine_drafts(reduced):
    """Rows of different lengths, drafted together in another order: ids equal (target ids through d2t),
    log-probs and the states fed back within fp32 rounding; then DLoop's later stage over those states."""
    target, drafter, onnx_dir = reduced
    manifest = read_manifest(onnx_dir)
    assert sorted(manifest.engines) == [EAGLE3_FUSE, EAGLE3_STEP, TARGET_VERIFY] and manifest.has_drafter
    te, oe = (
        prefilled(e)
        for e in (TorchEngine(target, drafter, CONTEXT, max_rows=3), OrtEngine(onnx_dir, CONTEXT, max_rows=3))
    )
    assert oe.has_drafter and oe.drafter_cfg.kind.chain and oe.drafter_cfg.draft_vocab_size == DRAFT_VOCAB
    assert torch.allclose(oe.context.states, te.context.states, atol=1e-5)  # the fused taps (eagle3_fuse)
    rows, order = [2, 0, 1], [len(PROMPTS[b]) for b in (2, 0, 1)]
    anchors = [ANCHORS[b] for b in rows]
    (dt, pt, ht), (do, po, ho) = (e.draft(rows, anchors, order, BLOCK) for e in (te, oe))
    assert do.shape == (3, BLOCK - 1, 8) and torch.equal(do, dt)
    assert set(do.flatten().tolist()) <= set(drafter.draft_ids.tolist())  # target ids of the draft rows
    assert torch.allclose(po, pt, atol=1e-5) and torch.allclose(ho, ht, atol=1e-5)
    for e in (te, oe):  # DLoop: the stage's own states as context, the next stage from its last draft
        e.append_pseudo_context(rows, ht[:, 1:])
    later = [o + BLOCK - 1 for o in order]
    (dt, pt, ht), (do, po, ho) = (e.draft(rows, dt[:, -1, 0].tolist(), later, BLOCK) for e in (te, oe))
    assert torch.equal(do, dt) and torch.allclose(po, pt, atol=1e-5) and torch.allclose(ho, ht, atol=1e-5)
    assert oe.context_lengths(rows) == later
    oe.context_rollback(rows, order)
    assert oe.context_lengths(rows) == order


def test_every_config_switch_drafts_on_the_graphs_what_the_torch_engine_drafts(target_dir, tmp_path):
    """EAGLE 3.1 (fc_norm, norm_output) with norm_before_fc and norm_before_residual on too: the fuse
    graph norms the taps and the step graph feeds the final-normed state back, as the torch engine does
    (tests/test_eagle3.py holds that to an fp64 reference); a stage and DLoop's next one agree."""
    from test_eagle3 import switch_tensors

    switches = ("fc_norm", "norm_before_fc", "norm_output")
    directory, _ = eagle3_checkpoint(
        tmp_path / "e31",
        tensors=switch_tensors(switches),
        fc_norm=True,
        norm_before_fc=True,
        norm_output=True,
        norm_before_residual=True,
    )
    target = load_target_dir(target_dir)
    drafter = Eagle3Drafter.load(directory)
    drafter.cfg.fit(target.cfg)
    assert len(drafter.cfg.variant.switched_on) == 4
    export_pair(target, drafter, tmp_path / "onnx", target_dir=target_dir, max_context=CONTEXT)
    te, oe = (
        prefilled(e, (0, 1))
        for e in (TorchEngine(target, drafter, CONTEXT, max_rows=2), OrtEngine(tmp_path / "onnx", CONTEXT, max_rows=2))
    )
    assert torch.allclose(oe.context.states, te.context.states, atol=1e-5)
    rows, lengths = [1, 0], [len(PROMPTS[1]), len(PROMPTS[0])]
    (dt, pt, ht), (do, po, ho) = (e.draft(rows, [ANCHORS[1], ANCHORS[0]], lengths, BLOCK) for e in (te, oe))
    assert torch.equal(do, dt) and torch.allclose(po, pt, atol=1e-5) and torch.allclose(ho, ht, atol=1e-5)
    for e in (te, oe):
        e.append_pseudo_context(rows, ht[:, 1:])
    later = [n + BLOCK - 1 for n in lengths]
    (dt, pt, ht), (do, po, ho) = (e.draft(rows, dt[:, -1, 0].tolist(), later, BLOCK) for e in (te, oe))
    assert torch.equal(do, dt) and torch.allclose(po, pt, atol=1e-5) and torch.allclose(ho, ht, atol=1e-5)


def test_a_row_drafts_bit_for_bit_what_it_drafts_alone(reduced):
    """Batch invariance: beside rows of other lengths (and other numbers of pending entries), a row's
    drafts, log-probs and states are exactly its own."""
    _, _, onnx_dir = reduced
    alone = []
    for b in range(3):
        engine = OrtEngine(onnx_dir, CONTEXT)
        engine.prefill(0, PROMPTS[b], want_taps=True)
        alone.append(engine.draft([0], [ANCHORS[b]], [len(PROMPTS[b])], BLOCK))
    batched = prefilled(OrtEngine(onnx_dir, CONTEXT, max_rows=3))
    got = batched.draft([2, 0, 1], [ANCHORS[b] for b in (2, 0, 1)], [len(PROMPTS[b]) for b in (2, 0, 1)], BLOCK)
    for i, b in enumerate((2, 0, 1)):
        for part in range(3):
            assert torch.equal(got[part][i], alone[b][part][0]), (b, part)


@pytest.fixture(scope="module")
def trained(target_dir, tmp_path_factory):
    """The lively target with an EAGLE-3 drafter trained to draft its greedy continuations, exported:
    (torch engine, ONNX Runtime engine)."""
    target = lively(load_target_dir(target_dir))
    drafter = agreeing_eagle3(target, TRAINED_PROMPTS, new_tokens=NEW_TOKENS, steps=60)
    onnx_dir = tmp_path_factory.mktemp("eagle3-trained") / "onnx"
    export_pair(target, drafter, onnx_dir, target_dir=target_dir, max_context=CONTEXT)
    return TorchEngine(target, drafter, CONTEXT), OrtEngine(onnx_dir, CONTEXT)


TRAINED_PROMPTS, NEW_TOKENS = prompts(2, seed=7), 30


@pytest.mark.parametrize(
    "settings",
    [
        Method("dflash", block_size=BLOCK),
        Method("dflash", block_size=BLOCK, tree_budget=8),
        Method("dloop", block_size=BLOCK, max_stages=3, gate_threshold=-2.0),
    ],
    ids=["chain", "tree", "dloop"],
)
def test_greedy_decoding_on_onnxruntime_commits_plain_decodings_tokens(settings, trained):
    te, oe = trained
    accepted = 0
    for p in TRAINED_PROMPTS:
        ar = generate(oe, p, Method(), max_new_tokens=NEW_TOKENS)
        spec = generate(oe, p, settings, max_new_tokens=NEW_TOKENS)
        assert spec.tokens == ar.tokens == generate(te, p, Method(), max_new_tokens=NEW_TOKENS).tokens
        accepted += accepted_drafts([spec])
    assert accepted >= 30, accepted  # of 60 tokens (measured 46 to 50; an untrained drafter: about 1)
    if settings.method == "dloop":
        assert max(spec.stats.stages_per_round) == 3  # the later stages really ran


def test_batched_rows_commit_what_each_commits_alone(trained):
    _, oe = trained
    assert batched_greedy_equals_plain(oe, TRAINED_PROMPTS, Method("dflash", block_size=BLOCK), NEW_TOKENS) >= 30


@pytest.mark.parametrize("engine,output", [(EAGLE3_FUSE, "states"), (EAGLE3_STEP, "state")])
def test_validation_refuses_a_wrong_graph(engine, output, reduced, tmp_path):
    """One output of one EAGLE-3 graph 1 % off: validation fails that graph and only that one."""
    target, drafter, onnx_dir = reduced
    bad = copy_of(onnx_dir, tmp_path)
    scale_output(bad, engine, output, 1.01)
    report = validate_onnx(bad, target, drafter, new_tokens=6)
    assert not report["passed"] and [n for n, r in report["engines"].items() if not r["passed"]] == [engine]


def test_cli_converts_and_generates_on_onnxruntime_what_ar_does(target_dir, tmp_path, monkeypatch, capsys):
    directory, _ = eagle3_checkpoint(tmp_path / "eagle3")
    out = tmp_path / "onnx"
    assert (
        main(
            [
                "convert",
                "onnx",
                "--target",
                str(target_dir),
                "--drafter",
                str(directory),
                "--out",
                str(out),
                "--max-context",
                str(CONTEXT),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "PASSED" in printed and EAGLE3_STEP in printed
    manifest = read_manifest(out)
    report = manifest.data["validation"]
    assert report["passed"] and set(report["engines"]) == set(manifest.engines) == {
        TARGET_VERIFY,
        EAGLE3_FUSE,
        EAGLE3_STEP,
    }
    assert report["greedy_identical"] and report["acceptance"]["relative_drop"] <= 0.02
    assert json.loads((out / "drafter" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    base = ["generate", "--prompt", "hello world", "--max-new-tokens", "12"]
    pair = ["--target", str(target_dir), "--drafter", str(directory)]
    drafting = ["--block-size", str(BLOCK), "--method"]
    runs = {
        "torch ar": pair + ["--backend", "torch", "--method", "ar"],
        "artifact dflash": ["--backend", "onnxruntime", "--onnx-dir", str(out)] + drafting + ["dflash"],
        "artifact dloop": ["--backend", "onnxruntime", "--onnx-dir", str(out)] + drafting + ["dloop"],
        "exported once, dloop": pair + ["--backend", "onnxruntime"] + drafting + ["dloop"],
    }
    texts = {}
    for name, argv in runs.items():
        assert main(base + argv) == 0, name
        texts[name] = capsys.readouterr().out
    assert len(set(texts.values())) == 1 and texts["torch ar"].strip(), texts


def test_quantized_drafter_graphs_refuse_it_in_one_line(reduced, tmp_path):
    from loopspec.engines.gguf_export import block_drafter

    target, drafter, _ = reduced
    kind = drafter.cfg.kind
    assert not kind.exports_quantized
    for refused in (
        lambda: require_zlab_block(drafter.cfg, "quantization"),
        lambda: block_drafter(drafter, None, "gguf-int8act"),
        lambda: export_pair(target, drafter, tmp_path / "q", target_dir=tmp_path, draft_drafter=drafter),
    ):
        with pytest.raises(
            LoopspecError, match="does not take EAGLE-3 drafters: their graphs are exported in fp32"
        ) as e:
            refused()
        assert "\n" not in str(e.value)
    assert block_drafter(drafter, None, "gguf-fp32act") is None  # fp32 activations: the drafter stays fp32
    with pytest.raises(LoopspecError, match="export_pair"):  # the block exporter alone does not build its graphs
        export_engines(target, drafter, tmp_path / "plain", target_dir=tmp_path)
