import pytest
import torch

from loopspec.decoding import SamplingParams
from loopspec.errors import LoopspecError
from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.model.draft_head import StageDrafts
from loopspec.runtime.decoder import generate
from loopspec.runtime.proposal import AdaptiveFallback, draft_round
from loopspec.engines.torch_engine import TorchEngine
from loopspec.settings import DecodingSettings
from loopspec.weights import load_target_dir

from conftest import FAMILIES, accepted_drafts, agreeing_drafter


def dflash(k):
    return DecodingSettings("dflash", block_size=k)


def dloop(k, stages, gate):
    return DecodingSettings("dloop", block_size=k, max_stages=stages, gate_threshold=gate)


# the fewest accepted drafts per dflash block size, of 60 tokens (measured 21-29, 33-47, 39-51, 40-54)
MIN_ACCEPTED = {2: 12, 5: 20, 8: 20, 12: 20}


def random_drafter(target, block_size=8, num_layers=2, seed=0, mask=127):
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(target.cfg, num_layers=num_layers, block_size=block_size, mask_token_id=mask)
    return Drafter(cfg).eval()


DFLASH_PROMPT = torch.randint(0, 120, (12,), generator=torch.Generator().manual_seed(3)).tolist()
DLOOP_PROMPT = torch.randint(0, 120, (9,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def agreeing_engines(tiny_targets):
    """{family: an engine whose drafter is trained to draft the target's continuations of the
    identity tests' prompts}: the identity checks below compare accepted drafts, not bonus tokens."""
    engines = {}
    for family in FAMILIES:
        target = load_target_dir(tiny_targets[family])
        cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=8, mask_token_id=127)
        drafter = agreeing_drafter(target, [DFLASH_PROMPT, DLOOP_PROMPT], cfg, new_tokens=70)
        engines[family] = TorchEngine(target, drafter, max_context=256)
    return engines


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_dflash_equals_ar(family, agreeing_engines):
    engine = agreeing_engines[family]
    ar = generate(engine, DFLASH_PROMPT, max_new_tokens=60)
    for k in (2, 5, 8, 12):
        spec = generate(engine, DFLASH_PROMPT, dflash(k), max_new_tokens=60)
        assert spec.tokens == ar.tokens
        assert spec.stats.verifications <= ar.stats.verifications
        assert accepted_drafts([spec]) >= MIN_ACCEPTED[k], (k, accepted_drafts([spec]))


def test_greedy_identity_with_accepted_drafts(tiny_targets):
    """Long accepted prefixes: an engine whose stage proposes the true AR continuation with one
    wrong token at block position 4, so acceptance, rejection and the bonus are all exercised."""
    target = load_target_dir(tiny_targets["llama"])
    drafter = random_drafter(target)
    engine = TorchEngine(target, drafter, max_context=256)
    ar = generate(engine, [5, 6, 7] * 4, max_new_tokens=40)

    class OracleEngine(TorchEngine):
        def draft(self, rows, anchors, positions, block_size):
            (position,) = positions
            start = position - 12 + 1  # index in ar.tokens of the first token after the anchor
            guess = ar.tokens[start : start + block_size - 1]
            guess = guess + [0] * (block_size - 1 - len(guess))
            if len(guess) > 3:
                guess[3] = (guess[3] + 1) % 128  # one wrong token so that both paths are exercised
            return StageDrafts(
                torch.tensor([guess])[..., None], torch.zeros(1, block_size - 1, 1), None
            )  # one candidate each

    oracle = OracleEngine(target, drafter, max_context=256)
    spec = generate(oracle, [5, 6, 7] * 4, dflash(8), max_new_tokens=40)
    assert spec.tokens == ar.tokens
    assert max(spec.stats.accepted_per_round) == 3
    assert spec.stats.acceptance_length > 3


def test_stop_tokens_max_new_tokens_and_context(tiny_targets):
    target = load_target_dir(tiny_targets["qwen3"])
    drafter = random_drafter(target)
    engine = TorchEngine(target, drafter, max_context=40)
    prompt = list(range(10, 30))
    ar = generate(engine, prompt, max_new_tokens=100)
    assert ar.stats.finish_reason == "context" and len(prompt) + len(ar.tokens) == 41  # last token not run
    spec = generate(engine, prompt, dflash(8), max_new_tokens=100)
    assert spec.tokens == ar.tokens and spec.stats.finish_reason == "context"
    stop = ar.tokens[7]
    first = ar.tokens.index(stop)
    for settings in (DecodingSettings(), dflash(8)):
        res = generate(engine, prompt, settings, max_new_tokens=100, stop_token_ids={stop})
        assert res.tokens == ar.tokens[: first + 1] and res.stats.finish_reason == "stop"
        res = generate(engine, prompt, settings, max_new_tokens=5)
        assert res.tokens == ar.tokens[:5] and res.stats.finish_reason == "length"


def test_streaming_callback_sees_every_token(tiny_targets):
    target = load_target_dir(tiny_targets["qwen2"])
    engine = TorchEngine(target, random_drafter(target), max_context=128)
    chunks = []
    res = generate(engine, [1, 2, 3], dflash(6), max_new_tokens=30, on_tokens=chunks.append)
    assert sum(chunks, []) == res.tokens


def test_bad_arguments(tiny_targets):
    target = load_target_dir(tiny_targets["llama"])
    engine = TorchEngine(target, None, max_context=16)
    with pytest.raises(LoopspecError, match="empty prompt"):
        generate(engine, [], max_new_tokens=4)
    with pytest.raises(LoopspecError, match="does not fit"):
        generate(engine, list(range(16)), max_new_tokens=4)
    with pytest.raises(LoopspecError, match="block size"):
        generate(engine, [1], dflash(0), max_new_tokens=4)
    with pytest.raises(LoopspecError, match="drafter"):
        generate(engine, [1], dflash(4), max_new_tokens=4)
    with pytest.raises(LoopspecError, match="temperature"):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_dloop_equals_ar(family, agreeing_engines):
    engine, prompt = agreeing_engines[family], DLOOP_PROMPT
    ar = generate(engine, prompt, max_new_tokens=70)
    for stages, gate in ((2, -1e9), (4, -1e9), (3, -5.0)):
        res = generate(engine, prompt, dloop(5, stages, gate), max_new_tokens=70)
        assert res.tokens == ar.tokens
        assert accepted_drafts([res]) >= 25, (stages, gate, accepted_drafts([res]))  # measured 39 to 63 of 70
        assert engine.context_lengths([0])[0] <= 256
        if gate == -1e9:
            assert max(res.stats.stages_per_round) == stages  # an always-open gate runs every stage


class RecordingEngine(TorchEngine):
    """Scripted gate scores: stage i of a round reports log-prob sum scores[i]; records stage calls."""

    def __init__(self, *a, scores, **kw):
        super().__init__(*a, **kw)
        self.scores, self.calls = scores, []

    def draft(self, rows, anchors, positions, block_size):
        drafts, logprobs, hidden = super().draft(rows, anchors, positions, block_size)
        i = len(self.calls) % len(self.scores)
        self.calls.append((anchors[0], positions[0], self.context_lengths(rows)[0]))
        logprobs = torch.full_like(logprobs, self.scores[i] / logprobs.shape[1])
        return StageDrafts(drafts, logprobs, hidden)


def test_gate_adds_next_stage_only_and_never_cuts_a_block(tiny_targets):
    target = load_target_dir(tiny_targets["qwen2"])
    drafter = random_drafter(target, block_size=5)
    # stage 1 scores -0.1 (>= gate): stage 2 runs; stage 2 scores -9 (< gate): no stage 3, but all of
    # stage 2's drafts are still proposed for verification.
    engine = RecordingEngine(target, drafter, max_context=100, scores=[-0.1, -9.0, -0.1])
    engine.prefill(0, list(range(3, 13)), want_taps=True)
    before = engine.context_lengths([0])[0]
    (drafted,) = draft_round(engine, dloop(5, 4, -0.5), anchors=[7], positions=[10], budgets=[100])
    drafts = drafted.candidates[:, 0]  # the chain
    assert drafted.stages == 2 and drafts.numel() == 8 and drafted.stage_sizes == [4, 4]  # two whole blocks
    (a1, p1, c1), (a2, p2, c2) = engine.calls
    assert (p1, c1) == (10, before) and p2 == 14 and c2 == before + 4  # 4 pseudo-features, then gone
    assert a2 == int(drafts[3])  # stage 2's anchor is stage 1's last draft
    assert engine.context_lengths([0])[0] == before
    # a low-scoring FIRST stage is still verified whole: its own score never drops it
    engine.scores, engine.calls = [-9.0], []
    (drafted,) = draft_round(engine, dloop(5, 4, -0.5), [7], [10], [100])
    assert drafted.stages == 1 and drafted.candidates.shape[0] == 4


def test_adaptive_fallback_changes_speed_not_output(tiny_targets):
    target = load_target_dir(tiny_targets["llama"])
    engine = TorchEngine(target, random_drafter(target, block_size=6), max_context=256)
    prompt = [9, 8, 7, 6, 5]
    ar = generate(engine, prompt, max_new_tokens=80)
    # a random drafter never pays: the fallback must switch to plain rounds, output unchanged
    fb = AdaptiveFallback(min_rounds=2, backoff=4)
    res = generate(engine, prompt, dflash(6), max_new_tokens=80, pacing=fb)
    assert res.tokens == ar.tokens
    assert res.stats.fallback_switches >= 1 and res.stats.fallback_rounds >= 4
    for stages in (1, 3):
        res = generate(
            engine, prompt, dloop(6, stages, -1e9), max_new_tokens=80, pacing=AdaptiveFallback(min_rounds=1, backoff=2)
        )
        assert res.tokens == ar.tokens


def test_adaptive_fallback_keeps_drafting_when_it_pays():
    fb = AdaptiveFallback(min_rounds=2)
    fb.record(drafted=False, committed=1, seconds=0.020)  # calibration: plain round 20 ms
    assert fb.want_draft()
    for _ in range(10):  # τ = 4 in 50 ms beats 1 token in 20 ms
        fb.record(drafted=True, committed=4, seconds=0.050)
    assert fb.want_draft() and fb.switches == 0
    for _ in range(3):  # τ = 1.5 in 50 ms loses
        fb.record(drafted=True, committed=1, seconds=0.050)
    assert not fb.want_draft() and fb.switches == 1
