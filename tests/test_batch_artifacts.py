"""Batched calls over exported engines (ONNX Runtime): several rows per engine call, each at its own
position and KV length, commit what the same requests commit alone."""

import json

import pytest
import torch

pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'loopspec[onnx]'")
pytest.importorskip("onnx", reason="needs onnx: pip install 'loopspec[onnx]'")

from loopspec.decoding import SamplingParams  # noqa: E402
from loopspec.engines.export import export_engines  # noqa: E402
from loopspec.engines.manifest import read_manifest  # noqa: E402
from loopspec.errors import LoopspecError  # noqa: E402
from loopspec.model.dflash import DrafterConfig  # noqa: E402
from loopspec.runtime.decoder import Decoder, decode_all, generate  # noqa: E402
from loopspec.engines.ort_engine import OrtEngine  # noqa: E402
from loopspec.tree import DraftTree, tree_masks  # noqa: E402
from loopspec.engines.torch_engine import TorchEngine  # noqa: E402
from loopspec.settings import DecodingSettings as Method  # noqa: E402
from loopspec.weights import load_target_dir  # noqa: E402

from conftest import FAMILIES, accepted_drafts, agreeing_drafter, lively  # noqa: E402

CONTEXT = 160
METHODS = {
    "ar": Method(),
    "dflash": Method("dflash", block_size=5),
    "dloop": Method("dloop", block_size=5, max_stages=3, gate_threshold=-1e9),
    "dloop-tree": Method("dloop", block_size=5, max_stages=3, gate_threshold=-1e9, tree_budget=10, suffix=True),
    "suffix": Method("suffix", block_size=6),
}


def prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 120, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


BATCH_PROMPTS, BATCH_BUDGETS = prompts(7, seed=2), [40, 9, 33, 1, 40, 17, 26]
# the fewest drafts each method must have accepted over the seven requests' 166 tokens: measured 125 to
# 137 (qwen2's reduced draft vocabulary: 69 to 72); the suffix index alone copies 0 to 23 of a lively text
MIN_ACCEPTED = {"ar": 0, "dflash": 40, "dloop": 40, "dloop-tree": 40, "suffix": 0}


def alone(engine, prompt, method: Method, max_new_tokens, params=SamplingParams(), seed=0):
    return generate(
        engine,
        prompt,
        method,
        max_new_tokens=max_new_tokens,
        params=params,
        generator=torch.Generator().manual_seed(seed),
    )


@pytest.fixture(scope="module")
def pairs(tiny_targets, tmp_path_factory):
    """{family: (torch engine, ONNX Runtime engine)} over the same lively target and a drafter trained
    to draft its continuations of BATCH_PROMPTS (qwen2's drafter with a reduced draft vocabulary)."""
    out = {}
    for i, family in enumerate(FAMILIES):
        target = lively(load_target_dir(tiny_targets[family]))
        cfg = DrafterConfig.for_target(target.cfg, num_layers=2, block_size=5, mask_token_id=127)
        drafter = agreeing_drafter(target, BATCH_PROMPTS, cfg, seed=i)
        if family == "qwen2":
            drafter.draft_ids = torch.randperm(128, generator=torch.Generator().manual_seed(2))[:64]
        onnx_dir = tmp_path_factory.mktemp("onnx") / family
        export_engines(target, drafter, onnx_dir, target_dir=tiny_targets[family], max_context=CONTEXT, max_batch=4)
        out[family] = (TorchEngine(target, drafter, max_context=CONTEXT), OrtEngine(onnx_dir, CONTEXT))
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(METHODS))
def test_batched_greedy_equals_alone(family, name, pairs):
    """Seven requests of different lengths and budgets through three rows: rows retire and others are
    admitted mid-run; each commits what plain decoding commits alone (torch, and ONNX Runtime's
    single-row calls), and the method really drafted."""
    torch_engine, ort_engine = pairs[family]
    method = METHODS[name]
    ps, budgets = BATCH_PROMPTS, BATCH_BUDGETS
    refs = [alone(torch_engine, p, Method(), n).tokens for p, n in zip(ps, budgets)]
    assert len({tuple(r) for r in refs}) == 7 and min(len(set(r)) for r in refs if len(r) > 20) >= 3
    single = [alone(ort_engine, p, method, n) for p, n in zip(ps, budgets)]
    assert [r.tokens for r in single] == refs

    batch = ort_engine.with_rows(3)
    assert isinstance(batch, OrtEngine) and batch.max_rows == 3
    decoder = Decoder(batch, method)
    waiting, done, admitted_mid_run, widest = list(range(7)), {}, 0, 0
    while waiting or decoder.rows:
        while waiting and decoder.free_rows:
            i = waiting.pop(0)
            admitted_mid_run += any(len(r.tokens) > 1 for r in decoder.rows)
            row, _ = decoder.admit(i, ps[i], max_new_tokens=budgets[i])
            if row.finish:
                done[i] = row
        widest = max(widest, len(decoder.rows))
        for row, _ in decoder.step():
            if row.finish:
                done[row.key] = row
    assert [done[i].tokens for i in range(7)] == refs
    assert widest == 3 and admitted_mid_run >= 2
    assert min(accepted_drafts(single), accepted_drafts(done.values())) >= MIN_ACCEPTED[name]
    stages = [s for i in range(7) for s in done[i].stats.stages_per_round]
    assert max(stages, default=0) == {"ar": 0, "dflash": 1, "dloop": 3, "dloop-tree": 3, "suffix": 1}[name]


def test_batched_calls_match_the_torch_batch_engine(pairs):
    """The same calls on the ONNX Runtime and the torch batch engines, rows of different lengths:
    verify logits and taps, drafts on a shuffled subset of rows, pseudo-context, rollback, swap_rows."""
    torch_engine, ort_engine = pairs["qwen2"]
    tb, ob = torch_engine.with_rows(4), ort_engine.with_rows(4)
    ps = prompts(3, seed=3)
    for r, p in enumerate(ps):
        lt, lo = tb.prefill(r, p, want_taps=True), ob.prefill(r, p, want_taps=True)
        assert lo.shape == (128,) and (lo - lt).abs().max() < 1e-4
    assert ob.cache.lengths[:3].tolist() == ob.context.lengths[:3].tolist() == [len(p) for p in ps]
    tokens = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    (lt, tt), (lo, to) = tb.verify(tokens, want_taps=True), ob.verify(tokens, want_taps=True)
    assert lo.shape == (3, 5, 128) and to.shape == tt.shape
    for b, t in enumerate(tokens):
        assert (lo[b, : len(t)] - lt[b, : len(t)]).abs().max() < 1e-4
        assert (to[b, : len(t)] - tt[b, : len(t)]).abs().max() < 1e-4
    kept = [len(p) + n for p, n in zip(ps, [2, 1, 4])]
    for e, taps in ((tb, tt), (ob, to)):
        e.target_rollback(kept)
        e.append_context(taps, [2, 1, 4])
    assert ob.cache.lengths[:3].tolist() == ob.context.lengths[:3].tolist() == kept
    # the past of rows 0..R-1 is passed as the cache buffer itself, never copied
    assert "past_key" not in ob._staging and ob.cache.slots % 32 == 0 and ob.cache.slots >= max(kept)
    n = kept[1]
    assert torch.allclose(ob.cache.k[:, 1, :, :n], tb.cache.k[:, 1, :, :n], atol=1e-4)
    assert torch.allclose(ob.context.kv.v[:, 2, :, : kept[2]], tb.context.kv.v[:, 2, :, : kept[2]], atol=1e-4)

    rows, anchors = [2, 0], [7, 9]
    positions = [kept[r] for r in rows]
    (dt, pt, ht), (do, po, ho) = (e.draft(rows, anchors, positions, 5) for e in (tb, ob))
    assert torch.equal(do, dt) and set(do.flatten().tolist()) <= set(torch_engine.context.draft_ids.tolist())
    assert (po - pt).abs().max() < 1e-4 and (ho - ht).abs().max() < 1e-4
    for e, hidden in ((tb, ht), (ob, ho)):  # DLoop's second stage on its pseudo-context
        e.append_pseudo_context(rows, hidden[:, 1:])
    assert ob.context_lengths(rows) == [p + 4 for p in positions]
    (dt, pt, _), (do, po, _) = (
        e.draft(rows, [int(d[-1, 0]) for d in dt], [p + 4 for p in positions], 5) for e in (tb, ob)
    )
    assert torch.equal(do, dt) and (po - pt).abs().max() < 1e-4
    for e in (tb, ob):
        e.context_rollback(rows, positions)
        e.swap_rows(2, 1)  # retire row 1: the last row moves into its place
    assert ob.context_lengths([0, 1]) == [kept[0], kept[2]]
    (lt, _), (lo, _) = tb.verify([[3], [4, 5]], want_taps=False), ob.verify([[3], [4, 5]], want_taps=False)
    assert (lo[0, :1] - lt[0, :1]).abs().max() < 1e-4 and (lo[1] - lt[1]).abs().max() < 1e-4
    # draft trees: two rows of different trees in one verification, then each commits a path that
    # is not a prefix (its K/V move into place)
    trees = [DraftTree.root(3), DraftTree.root(4)]
    trees[0].add(0, 11)
    b = trees[0].add(0, 12)
    trees[0].add(b, 13)
    trees[1].add(0, 21)
    masks = tree_masks(trees, 4)
    starts = ob.cache.lengths[:2].tolist()
    (lt, tt), (lo, to) = (e.verify([t.tokens for t in trees], want_taps=True, tree_masks=masks) for e in (tb, ob))
    assert (lo[0] - lt[0]).abs().max() < 1e-4 and (lo[1, :2] - lt[1, :2]).abs().max() < 1e-4
    assert (to[0] - tt[0]).abs().max() < 1e-4
    paths = [[0, b, 3], [0, 1]]
    for e in (tb, ob):
        e.target_commit(starts, paths)
    assert ob.cache.lengths[:2].tolist() == [starts[0] + 3, starts[1] + 2]
    n = starts[0] + 3
    assert torch.allclose(ob.cache.k[:, 0, :, :n], tb.cache.k[:, 0, :, :n], atol=1e-4)
    with pytest.raises(ValueError, match="roll a row forward"):
        ob.target_rollback([100, 100])
    with pytest.raises(LoopspecError, match="exceeds the context"):
        ob.verify([list(range(CONTEXT))], want_taps=False)


@pytest.mark.parametrize("name", ["ar", "dloop", "dloop-tree"])
def test_sampled_rows_reproduce_their_seed(name, pairs):
    """T > 0: a row's tokens depend on its own seed only, as the request alone with that seed."""
    _, ort_engine = pairs["llama"]
    method = METHODS[name]
    ps = prompts(4, seed=5)
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(),
        SamplingParams(temperature=1.3, top_k=20),
    ]
    seeds = [11, 12, 13, 14]
    refs = [alone(ort_engine, p, method, 30, params=q, seed=s).tokens for p, q, s in zip(ps, params, seeds)]
    reqs = [
        dict(key=i, prompt_ids=p, max_new_tokens=30, params=q, seed=s)
        for i, (p, q, s) in enumerate(zip(ps, params, seeds))
    ]
    done = decode_all(Decoder(ort_engine.with_rows(4), method), reqs)
    assert [done[i].tokens for i in range(4)] == refs
    assert refs[0] != alone(ort_engine, ps[0], method, 30, params=params[0], seed=99).tokens


def test_bad_max_rows_and_old_exports(pairs, tmp_path):
    import shutil

    _, ort_engine = pairs["qwen3"]
    assert ort_engine.max_batch == 4
    with pytest.raises(LoopspecError, match=r"max batch size 5 is outside the exported engines' batch range \[1, 4\]"):
        ort_engine.with_rows(5)
    with pytest.raises(LoopspecError, match="max batch size must be >= 1"):
        ort_engine.with_rows(0)
    old = tmp_path / "old"  # an export from before draft trees: refused with what to do
    shutil.copytree(ort_engine.artifact_dir, old)
    manifest = read_manifest(old)
    spec = manifest.data["engines"]["target_verify"]["spec"]
    spec["inputs"] = [t for t in spec["inputs"] if t["name"] != "tree_mask"]
    manifest.save()
    assert "tree_mask" not in json.dumps(read_manifest(old).spec("target_verify").to_dict()["inputs"])
    with pytest.raises(
        LoopspecError, match="older loopspec .its target graph takes no draft-tree mask.: export it again"
    ):
        OrtEngine(old)
    stacked = tmp_path / "stacked"  # an export whose past came stacked, without room: refused the same way
    shutil.copytree(ort_engine.artifact_dir, stacked)
    manifest = read_manifest(stacked)
    spec = manifest.data["engines"]["target_verify"]["spec"]
    spec["inputs"] = [t for t in spec["inputs"] if not t["name"].startswith(("past_key_", "past_value_"))] + [
        {"name": "past_key", "dtype": "float32", "dims": [1, "batch", 1, "past", 8]}
    ]
    manifest.save()
    with pytest.raises(LoopspecError, match="older loopspec .its target graph takes a stacked past.: export it again"):
        OrtEngine(stacked)


def test_server_on_onnxruntime_batches_its_rows(tiny_pair, tmp_path, monkeypatch):
    """`serve --backend onnxruntime --max-batch-size N` decodes N rows per engine call; concurrent
    requests answer what each request alone answers; a batch size the export lacks is refused."""
    pytest.importorskip("fastapi", reason="needs fastapi: pip install 'loopspec[serve]'")
    pytest.importorskip("httpx", reason="needs httpx: pip install 'loopspec[serve]'")
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from loopspec.runtime.pipeline import load_pipeline
    from loopspec.runtime.server import ServeConfig, create_app

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target_dir, drafter_dir = tiny_pair
    pipe = load_pipeline(str(target_dir), str(drafter_dir), max_context=128, backend="onnxruntime")
    dloop = pipe.settings("dloop", adaptive=False)
    app = create_app(pipe, ServeConfig(settings=dloop, model_name="tiny", max_batch_size=3))
    assert isinstance(app.state.server.scheduler.decoder.engine, OrtEngine)
    texts = ["hello", "a longer prompt, with more characters", "xyz", "0123456789"]
    refs = [pipe.decode(pipe.run(pipe.tokenizer.encode(t), dloop, max_new_tokens=20).tokens) for t in texts]
    with TestClient(app) as client:
        assert client.get("/health").json()["max_batch_size"] == 3

        def complete(text):
            body = {"model": "tiny", "prompt": text, "max_tokens": 20, "temperature": 0}
            return client.post("/v1/completions", json=body).json()["choices"][0]["text"]

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(complete, texts)) == refs
    with pytest.raises(LoopspecError, match="outside the exported engines' batch range"):
        create_app(pipe, ServeConfig(settings=dloop, max_batch_size=17))


def test_fp8_qdq_engines_batch_their_rows(tiny_pair, tmp_path):
    """The FP8 Q/DQ graphs (dynamo export of the same wrappers) take the batch dim and the row lengths
    too: batched dloop rows equal the same requests alone on those engines, and every row, alone or
    batched, equals that engine's plain decoding (`ar`) of its prompt alone, token for token."""
    pytest.importorskip("modelopt", reason="needs nvidia-modelopt: pip install 'loopspec[quant]'")
    from loopspec.cli import main

    target_dir, drafter_dir = tiny_pair
    out = tmp_path / "fp8"
    assert (
        main(
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
                "2",
                "--max-context",
                "128",
                "--no-validate",
            ]
        )
        == 0
    )
    engine = OrtEngine(out / "onnx", 128)
    assert engine.manifest.precision == "fp8" and engine.max_batch == 16
    ps = prompts(4, seed=6)
    method = Method("dloop", block_size=6, max_stages=3, gate_threshold=-1e9)
    plain = [alone(engine, p, METHODS["ar"], 24).tokens for p in ps]
    refs = [alone(engine, p, method, 24).tokens for p in ps]
    done = decode_all(
        Decoder(engine.with_rows(4), method), [dict(key=i, prompt_ids=p, max_new_tokens=24) for i, p in enumerate(ps)]
    )
    assert [done[i].tokens for i in range(4)] == refs
    for i in range(4):  # the FP8 drafter changes what is drafted, never what is committed
        assert refs[i] == plain[i] and done[i].tokens == plain[i], i
    assert max(s for i in range(4) for s in done[i].stats.stages_per_round) == 3
