"""Batched speculative decoding: every row of a batch commits what the same request commits alone."""

import pytest
import torch

from loopspec.decoding import SamplingParams
from loopspec.errors import LoopspecError
from loopspec.model.dflash import DrafterConfig
from loopspec.model.draft_head import StageDrafts
from loopspec.runtime.decoder import Decoder, decode_all, generate
from loopspec.runtime.proposal import AdaptiveFallback
from loopspec.engines.torch_engine import TorchEngine
from loopspec.settings import DecodingSettings as Method
from loopspec.weights import load_target_dir

from conftest import FAMILIES, accepted_drafts, agreeing_drafter, lively

METHODS = {
    "ar": Method(),
    "dflash": Method("dflash", block_size=5),
    "dloop": Method("dloop", block_size=5, max_stages=3, gate_threshold=-1e9),
    "tree": Method("dflash", block_size=5, tree_budget=8, suffix=True),
    "dloop-tree": Method("dloop", block_size=5, max_stages=3, gate_threshold=-1e9, tree_budget=10, suffix=True),
    "suffix": Method("suffix", block_size=6),
}


# the fewest drafts the batched rows must have accepted, of their 200 tokens: measured 142 to 168 for the
# drafter's methods; the suffix index alone copies 3 to 36 (a lively target seldom repeats itself)
MIN_ACCEPTED = {"ar": 0, "dflash": 80, "dloop": 80, "tree": 80, "dloop-tree": 80, "suffix": 1}


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 120, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def alone(engine, prompt, method: Method, max_new_tokens, params=SamplingParams(), seed=0, stop=frozenset()):
    return generate(
        engine,
        prompt,
        method,
        max_new_tokens=max_new_tokens,
        params=params,
        stop_token_ids=stop,
        generator=torch.Generator().manual_seed(seed),
    )


GREEDY_PROMPTS = prompts(5, seed=2)


@pytest.fixture(scope="module")
def engines(tiny_targets):
    """{family: a lively tiny target with a drafter trained to draft its continuations of GREEDY_PROMPTS}."""
    out = {}
    for family in FAMILIES:
        target = lively(load_target_dir(tiny_targets[family]))
        cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=5, mask_token_id=127)
        out[family] = TorchEngine(target, agreeing_drafter(target, GREEDY_PROMPTS, cfg), max_context=160)
    return out


def test_ragged_forward_equals_rows_alone(engines):
    engine = engines["qwen3"]
    target = engine.target
    cache = target.new_cache(64, rows=3)
    rows = prompts(3, seed=1)
    singles = []
    for r, p in enumerate(rows):  # prefill each row alone
        target(torch.tensor([p]), cache, first_row=r)
        ref = target.new_cache(64)
        target(torch.tensor([p]), ref)
        singles.append(ref)
    new = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    ids = torch.zeros(3, 5, dtype=torch.long)
    for b, t in enumerate(new):
        ids[b, : len(t)] = torch.tensor(t)
    out = target(ids, cache, counts=torch.tensor([3, 1, 5]))
    assert cache.lengths.tolist() == [len(p) + len(t) for p, t in zip(rows, new)]
    for b, t in enumerate(new):
        ref = target(torch.tensor([t]), singles[b])
        assert (out.logits[b, : len(t)] - ref.logits[0]).abs().max() < 1e-4
        assert (out.taps[b, : len(t)] - ref.taps[0]).abs().max() < 1e-4
        n = cache.lengths[b]
        assert torch.allclose(cache.k[:, b, :, :n], singles[b].k[:, 0, :, :n], atol=1e-5)
    with pytest.raises(LoopspecError, match="exceeds the context"):
        target(torch.zeros(1, 64, dtype=torch.long), cache, counts=torch.tensor([64]))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(METHODS))
def test_batched_greedy_equals_alone(family, name, engines):
    engine, method = engines[family], METHODS[name]
    ps = GREEDY_PROMPTS
    refs = [alone(engine, p, Method(), 40).tokens for p in ps]  # plain autoregressive decoding
    assert len({tuple(r) for r in refs}) == 5 and min(len(set(r)) for r in refs) >= 3
    decoder = Decoder(engine.with_rows(5), method)
    done = decode_all(decoder, [dict(key=i, prompt_ids=p, max_new_tokens=40) for i, p in enumerate(ps)])
    assert [done[i].tokens for i in range(5)] == refs
    assert accepted_drafts(done.values()) >= MIN_ACCEPTED[name]  # most of it accepted drafts
    if name.startswith("dloop"):
        assert max(max(done[i].stats.stages_per_round) for i in range(5)) == 3
    if method.tree_budget:  # the trees really branched: a round verified more nodes than its stages' chain
        assert any(
            nodes > stages * (method.block_size - 1)
            for i in range(5)
            for nodes, stages in zip(done[i].stats.nodes_per_round, done[i].stats.stages_per_round)
        )


def test_admit_and_retire_between_steps(engines):
    """More requests than rows, different lengths and budgets: rows retire and new ones are admitted
    (moving the last row into a hole) while the others are mid-decode."""
    engine, method = engines["llama"], METHODS["dloop"]
    ps = prompts(9, seed=3)
    budgets = [5, 40, 12, 1, 33, 20, 7, 40, 26]
    refs = [alone(engine, p, Method(), n).tokens for p, n in zip(ps, budgets)]
    decoder = Decoder(engine.with_rows(3), method)
    admitted_mid_run = 0
    waiting = list(range(9))
    done = {}
    while waiting or decoder.rows:
        while waiting and decoder.free_rows:
            i = waiting.pop(0)
            admitted_mid_run += any(len(r.tokens) > 1 for r in decoder.rows)
            row, first = decoder.admit(i, ps[i], max_new_tokens=budgets[i])
            assert first == refs[i][:1]
            if row.finish:
                done[i] = row
        assert len(decoder.rows) <= 3
        for row, new in decoder.step():
            assert row.tokens[-len(new) :] == new if new else True
            if row.finish:
                done[row.key] = row
    assert admitted_mid_run >= 3
    assert [done[i].tokens for i in range(9)] == refs
    assert [done[i].stats.finish_reason for i in range(9)] == ["length"] * 9


def test_ragged_acceptance_with_oracle_drafts(engines):
    """Drafts that are the true continuation with one wrong token at a row-specific place: rows
    accept different numbers of drafts in the same verification, and still commit the AR tokens."""
    engine = engines["qwen2"]
    ps = prompts(4, seed=4)
    refs = [alone(engine, p, Method(), 50).tokens for p in ps]
    wrong_at = [1, 3, 6, 100]  # index in the chain of the first wrong draft (100: never wrong)

    class OracleEngine(TorchEngine):
        def draft(self, rows, anchors, positions, block_size):
            drafts, logprobs, hidden = super().draft(rows, anchors, positions, block_size)
            drafts = drafts.clone()
            for i, b in enumerate(rows):
                row = decoder.rows[b]
                start = positions[i] - row.prompt_len + 1  # index in refs of the token after the anchor
                guess = (refs[row.key] + [0] * 64)[start : start + block_size - 1]
                chain_index = start - len(row.tokens)  # which draft of this round's chain
                for j in range(len(guess)):
                    if chain_index + j == wrong_at[row.key]:
                        guess[j] = (guess[j] + 1) % 128
                drafts[i, :, 0] = torch.tensor(guess)  # the chain; the other ranks stay the drafter's
            return StageDrafts(drafts, logprobs, hidden)

    decoder = Decoder(OracleEngine(engine.target, engine.drafter, 160, max_rows=4), METHODS["dloop"])
    done = decode_all(decoder, [dict(key=i, prompt_ids=p, max_new_tokens=50) for i, p in enumerate(ps)])
    assert [done[i].tokens for i in range(4)] == refs
    accepted = [done[i].stats.accepted_per_round for i in range(4)]
    assert max(accepted[0]) == 1 and max(accepted[1]) == 3 and max(accepted[2]) == 6
    assert max(accepted[3]) == 12  # three whole stages of 4 drafts accepted
    assert done[3].stats.acceptance_length > done[0].stats.acceptance_length


@pytest.mark.parametrize("name", ["ar", "dflash", "dloop", "dloop-tree", "suffix"])
def test_sampled_rows_reproduce_their_seed(name, engines):
    """T > 0: a row's tokens depend on its own seed only: the same as the request alone with that seed."""
    engine, method = engines["llama"], METHODS[name]
    ps = prompts(4, seed=5)
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(),
        SamplingParams(temperature=1.3, top_k=20),
    ]
    seeds = [11, 12, 13, 14]
    refs = [alone(engine, p, method, 30, params=q, seed=s).tokens for p, q, s in zip(ps, params, seeds)]
    decoder = Decoder(engine.with_rows(4), method)
    reqs = [
        dict(key=i, prompt_ids=p, max_new_tokens=30, params=q, seed=s)
        for i, (p, q, s) in enumerate(zip(ps, params, seeds))
    ]
    done = decode_all(decoder, reqs)
    assert [done[i].tokens for i in range(4)] == refs
    assert refs[0] != alone(engine, ps[0], method, 30, params=params[0], seed=99).tokens


def test_stop_tokens_and_context_end(engines):
    engine = engines["qwen3"]
    ps = prompts(3, seed=6)
    ref = alone(engine, ps[0], Method(), 200)
    assert ref.stats.finish_reason == "context"
    stop = ref.tokens[9]
    decoder = Decoder(engine.with_rows(3), METHODS["dloop"])
    reqs = [
        dict(key=0, prompt_ids=ps[0], max_new_tokens=200),
        dict(key=1, prompt_ids=ps[0], max_new_tokens=200, stop_token_ids=frozenset({stop})),
        dict(key=2, prompt_ids=ps[1], max_new_tokens=3),
    ]
    done = decode_all(decoder, reqs)
    assert done[0].tokens == ref.tokens and done[0].finish == "context"
    assert done[1].tokens == ref.tokens[: ref.tokens.index(stop) + 1] and done[1].finish == "stop"
    assert done[2].tokens == alone(engine, ps[1], Method(), 3).tokens and done[2].finish == "length"


def test_cancel_and_bad_input(engines):
    engine = engines["llama"]
    decoder = Decoder(engine.with_rows(2), METHODS["dflash"])
    ps = prompts(2, seed=8)
    decoder.admit("a", ps[0], max_new_tokens=30)
    decoder.admit("b", ps[1], max_new_tokens=30)
    decoder.step()
    assert decoder.cancel("a").finish == "cancelled" and [r.key for r in decoder.rows] == ["b"]
    assert decoder.cancel("zzz") is None
    while decoder.rows:
        decoder.step()
    with pytest.raises(LoopspecError, match="does not fit"):
        decoder.admit("c", list(range(160)), max_new_tokens=4)
    with pytest.raises(LoopspecError, match="max_new_tokens"):
        decoder.admit("c", [1, 2], max_new_tokens=0)
    with pytest.raises(LoopspecError, match="empty prompt"):
        decoder.admit("c", [], max_new_tokens=3)
    with pytest.raises(LoopspecError, match="drafter"):
        Decoder(TorchEngine(engine.target, None, 64, max_rows=2), METHODS["dflash"])
    with pytest.raises(LoopspecError, match="max batch size"):
        engine.with_rows(0)
    decoder.admit("d", ps[0], max_new_tokens=2)
    decoder.admit("e", ps[1], max_new_tokens=2)
    with pytest.raises(LoopspecError, match="no free row"):
        decoder.admit("f", ps[1], max_new_tokens=2)


def test_batch_level_adaptive_fallback_changes_speed_not_output(engines):
    engine = engines["qwen3"]
    ps = prompts(4, seed=9)
    refs = [alone(engine, p, Method(), 40).tokens for p in ps]
    settings = Method("dloop", block_size=5, max_stages=2, gate_threshold=-1e9, adaptive=True)
    # decide fast: a random drafter never pays
    decoder = Decoder(engine.with_rows(4), settings, AdaptiveFallback(min_rounds=1, backoff=2))
    done = decode_all(decoder, [dict(key=i, prompt_ids=p, max_new_tokens=40) for i, p in enumerate(ps)])
    assert [done[i].tokens for i in range(4)] == refs
    assert decoder.pacing.switches >= 1
    stages = done[0].stats.stages_per_round
    assert 0 in stages[1:] and max(stages) == 2  # plain rounds (0 stages) between drafted ones
    with pytest.raises(LoopspecError, match="--adaptive does not apply to method ar"):
        Method(adaptive=True)  # ar: nothing to adapt, so the setting is refused


def test_onnxruntime_engine_batches_its_rows(engines, tiny_targets, tmp_path):
    """The ONNX Runtime engine has its own batched calls (tests/test_batch_artifacts.py has the rest)."""
    pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'loopspec[onnx]'")
    from loopspec.engines.export import export_engines
    from loopspec.engines.ort_engine import OrtEngine

    engine = engines["qwen3"]
    export_engines(engine.target, engine.drafter, tmp_path / "onnx", target_dir=tiny_targets["qwen3"], max_context=160)
    batch = OrtEngine(tmp_path / "onnx", max_context=160).with_rows(4)
    assert isinstance(batch, OrtEngine) and batch.max_rows == 4
    ps = prompts(3, seed=10)
    refs = [alone(engine, p, Method(), 20).tokens for p in ps]
    for method in METHODS.values():
        done = decode_all(
            Decoder(batch, method), [dict(key=i, prompt_ids=p, max_new_tokens=20) for i, p in enumerate(ps)]
        )
        assert [done[i].tokens for i in range(3)] == refs
