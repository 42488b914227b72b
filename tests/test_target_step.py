"""The target's step graph (engines/target_step.py, precision gguf-fused): ONNX Runtime's fused ops
over the GGUF's blocks. A verification of k tokens computes what k one-token steps compute, a row
what it computes alone, speculative decoding commits what `ar` does; the planted bugs (a tap one layer
off, a row's length ignored, K/V written one slot early) fail these checks."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from conftest import accepted_drafts, agreeing_drafter  # noqa: E402
from test_invariance import BATCH_BUDGETS, BATCH_PROMPTS, lively_gguf_target, rows_against_alone  # noqa: E402

from loopspec.convert.onnx_export import convert_onnx  # noqa: E402
from loopspec.convert.validate import validate_onnx  # noqa: E402
from loopspec.engines import export, ort_engine  # noqa: E402
from loopspec.engines.ort_engine import OrtEngine  # noqa: E402
from loopspec.engines.specs import TARGET_STEP, TARGET_VERIFY  # noqa: E402
from loopspec.errors import LoopspecError  # noqa: E402
from loopspec.model.dflash import Drafter, DrafterConfig  # noqa: E402
from loopspec.runtime.decoder import Decoder, generate  # noqa: E402
from loopspec.settings import DecodingSettings  # noqa: E402

CONTEXT = 256
PRECISION = "gguf-fused"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(artifact dir, target, drafter dir) of the lively tiny GGUF target in gguf-fused, with a drafter
    trained to draft what that engine continues the batch prompts with (its drafts are accepted)."""
    root = tmp_path_factory.mktemp("step")
    target_dir, gguf_path, target = lively_gguf_target(root)
    options = dict(target_dir=target_dir, max_context=CONTEXT, precision=PRECISION, gguf_path=gguf_path)
    convert_onnx(target, None, root / "plain", validate=False, **options)
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=5, mask_token_id=127)
    drafter = agreeing_drafter(
        target, BATCH_PROMPTS, cfg, also_engines=[OrtEngine(root / "plain", CONTEXT, num_threads=1)]
    )
    drafter.save(root / "drafter", dtype=torch.float32)
    convert_onnx(target, drafter, root / "fused", validate=False, drafter_dir=root / "drafter", **options)
    return root / "fused", target, root / "drafter", options


@pytest.fixture(scope="module")
def engine(pair):
    return OrtEngine(pair[0], CONTEXT, num_threads=1)


def test_the_artifact_holds_the_fused_graph_and_verifies_chains_only(pair, engine):
    import onnx

    manifest = engine.manifest
    assert TARGET_STEP in manifest.engines and TARGET_VERIFY not in manifest.engines
    graph = onnx.load(str(manifest.path(TARGET_STEP)), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    layers = engine.target_cfg.num_layers
    assert ops.count("GroupQueryAttention") == layers and ops.count("SkipSimplifiedLayerNormalization") == 2 * layers
    # every matrix of the GGUF is a block product, the file's own (Q4_1 codes; their minimums as a term)
    assert ops.count("MatMulNBits") == 4 * layers + 1
    # each attention runs one query more than its row's tokens (a copy of the last): never one query
    assert ops.count("Concat") >= layers and engine.chains_only
    with pytest.raises(LoopspecError, match="verifies chains exactly, not trees.*--precision gguf-int8act"):
        generate(engine, BATCH_PROMPTS[0], DecodingSettings("dflash", 5, tree_budget=8), max_new_tokens=4)


def steps_against_verification(engine, prompt, tokens) -> float:
    """`tokens` run one per call (a padding token each) and then all in one verification, from the same
    prefix → the largest difference of their logits and taps (0.0: bit for bit)."""
    engine.prefill(0, prompt, want_taps=True)
    start = int(engine.cache.lengths[0])
    one = [engine.verify([[t]], want_taps=True) for t in tokens]
    engine.target_rollback([start])
    logits, taps = engine.verify([tokens], want_taps=True)
    return max(
        max(float((logits[0, i] - one[i][0][0, 0]).abs().max()) for i in range(len(tokens))),
        max(float((taps[0, i] - one[i][1][0, 0]).abs().max()) for i in range(len(tokens))),
    )


def test_a_verification_computes_what_one_token_steps_compute(engine):
    for prompt in BATCH_PROMPTS[:3]:
        assert steps_against_verification(engine, prompt, [5, 17, 33, 2, 90, 61, 7, 11]) == 0.0


def lone_token_agrees_with_padded(engine, contexts: int = 4) -> bool:
    """An oracle for the engine's own measurement, on other contexts and tokens: a lone token's logits,
    taps and stored K/V, computed alone and beside a padding token, are the same bits."""
    single = engine.with_rows(1)
    for i, prompt in enumerate(BATCH_PROMPTS[:contexts]):
        single.prefill(0, prompt, want_taps=False)
        seen = []
        for width in (1, 2):
            out = single.run_target([0], [[3 + i]], width, all_logits=True)
            slot = len(prompt)
            seen.append(
                [out["logits"][:, :1], out["taps"][:, :1], single.cache.k[:, 0, :, slot], single.cache.v[:, 0, :, slot]]
            )
            seen[-1] = [t.clone() for t in seen[-1]]
        if not all(torch.equal(a, b) for a, b in zip(*seen)):
            return False
    return True


def test_a_lone_token_gets_a_padding_token_only_where_this_cpu_needs_one(engine):
    assert engine.lone_step_width == (1 if lone_token_agrees_with_padded(engine) else 2)


def test_a_one_row_kernel_that_differs_makes_the_engine_pad(engine, monkeypatch):
    """Mutation check of the test above, on any CPU: a step graph whose one-token, one-row call returns
    other last bits (as AVX2's one-row MatMulNBits does) makes the engine pad every lone step."""
    single = engine.with_rows(1)
    run = single.step.run

    def one_row_kernel(cache, first, ids, logit_index):
        out = run(cache, first, ids, logit_index)
        if ids.shape == (1, 1):
            out["logits"] = torch.nextafter(out["logits"], torch.full_like(out["logits"], float("inf")))
        return out

    monkeypatch.setattr(single.step, "run", one_row_kernel)
    assert single._measure_lone_step_width() == 2


def test_an_attention_of_one_query_is_what_the_padding_query_prevents(pair, tmp_path, monkeypatch):
    """Planted: the graph without its copied query. A lone token's attention then runs one query, whose
    kernel differs from a verification's: the engine's load-time measurement sees it and pads."""
    from loopspec.engines import target_step

    _, target, _, options = pair
    monkeypatch.setattr(target_step, "ATTENTION_PADDING", 0)
    convert_onnx(target, None, tmp_path / "unpadded", validate=False, **options)
    assert OrtEngine(tmp_path / "unpadded", CONTEXT, num_threads=1).lone_step_width == 2


def calls_of_ragged_rows() -> list:
    return [
        [([5, 6, 7], None), ([8], None), ([9, 10, 11, 12, 13], None)],
        [([14], None), ([15, 16], None), ([17], None)],
        [([18, 19, 20, 21, 22, 23, 24, 25], None), ([26, 27, 28], None), ([29, 30], None)],
    ]


def test_a_row_computes_alone_what_it_computes_beside_rows_of_other_lengths(engine):
    assert rows_against_alone(engine, BATCH_PROMPTS[:3], calls_of_ragged_rows()) == 0.0


def test_a_row_length_ignored_breaks_it(engine, monkeypatch):
    """Planted: every row's GroupQueryAttention lengths taken from the longest row."""
    real = ort_engine.gqa_lengths
    monkeypatch.setattr(
        ort_engine, "gqa_lengths", lambda starts, width: real(np.full_like(starts, starts.max()), width)
    )
    assert rows_against_alone(engine, BATCH_PROMPTS[:3], calls_of_ragged_rows()) > 0.0


@pytest.mark.parametrize(
    "method",
    [DecodingSettings("dflash", 5), DecodingSettings("dloop", 5, 3, -1e9), DecodingSettings("suffix", 6)],
    ids=["dflash", "dloop", "suffix"],
)
def test_speculation_commits_what_ar_commits_alone_and_batched(engine, method):
    ar = [generate(engine, p, max_new_tokens=n).tokens for p, n in zip(BATCH_PROMPTS, BATCH_BUDGETS)]
    alone = [generate(engine, p, method, max_new_tokens=n) for p, n in zip(BATCH_PROMPTS, BATCH_BUDGETS)]
    assert [r.tokens for r in alone] == ar
    decoder, done = Decoder(engine.with_rows(3), method), {}
    waiting = list(range(len(BATCH_PROMPTS)))
    while waiting or decoder.rows:
        while waiting and decoder.free_rows:
            i = waiting.pop(0)
            row, _ = decoder.admit(i, BATCH_PROMPTS[i], max_new_tokens=BATCH_BUDGETS[i])
            if row.finish:
                done[i] = row
        for row, _ in decoder.step():
            if row.finish:
                done[row.key] = row
    assert [done[i].tokens for i in range(len(BATCH_PROMPTS))] == ar
    if method.method != "suffix":  # the suffix index finds little to copy in a lively target's text
        # measured 120 to 130 of the 166 tokens, alone and batched
        assert accepted_drafts(alone) >= 60 and accepted_drafts(done.values()) >= 60


def test_validation_against_the_reference_passes(pair):
    onnx_dir, target, drafter_dir, _ = pair
    report = validate_onnx(onnx_dir, target, Drafter.load(drafter_dir), PRECISION, num_threads=1)
    assert report["passed"] and report["verify_equals_plain"]
    errors = report["engines"][TARGET_STEP]["errors"]
    assert set(errors) == {"logits", "new_key", "new_value", "taps"} and max(errors.values()) < 0.25


def test_kv_written_one_slot_early_fails_validation(pair, monkeypatch):
    """Planted: a row's new K/V one slot before its length (over its last committed token's)."""
    onnx_dir, target, drafter_dir, _ = pair
    real = ort_engine.gqa_lengths
    monkeypatch.setattr(ort_engine, "gqa_lengths", lambda starts, width: real(np.maximum(starts - 1, 0), width))
    report = validate_onnx(onnx_dir, target, Drafter.load(drafter_dir), PRECISION, num_threads=1)
    assert not report["passed"]


def test_a_tap_one_layer_off_fails_validation(pair, tmp_path, monkeypatch):
    """Planted: the graph taps the layer before each one the drafter reads."""
    _, target, drafter_dir, options = pair
    real = export.write_step_graph
    monkeypatch.setattr(export, "write_step_graph", lambda t, taps, *a: real(t, [i - 1 for i in taps], *a))
    drafter = Drafter.load(drafter_dir)
    _, report = convert_onnx(target, drafter, tmp_path / "off", drafter_dir=drafter_dir, num_threads=1, **options)
    assert not report["passed"] and report["engines"][TARGET_STEP]["errors"]["taps"] > 0.25


def test_tune_sweeps_what_a_chains_only_engine_verifies(pair, tmp_path, capsys):
    """`loopspec tune` on the fused engine: its default grid holds chains only (a tree or the suffix
    branch would be refused mid-sweep); asking for trees there is refused before the sweep, in one line."""
    import json

    from loopspec.cli import main

    prompts = tmp_path / "calib.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("hello there", "one two three")))
    common = ["tune", "--prompts", str(prompts), "--backend", "onnxruntime", "--onnx-dir", str(pair[0])]
    common += ["--no-store", "--thresholds=-1", "--stages", "1", "--max-new-tokens", "6", "--threads", "1"]
    out = tmp_path / "tune.json"
    assert main(common + ["--suffix-firsts", "0,2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["tree_budget"] == 0 and not r["suffix"] and r["lossless"] for r in rows)
    capsys.readouterr()
    assert main(common + ["--tree-budgets", "0,8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "verifies chains only" in err and len(err.splitlines()) == 1
