"""Unit tests of the pure sampling / acceptance functions in loopspec.decoding (design.md §3).

The Monte Carlo checks use seeded generators and fixed thresholds, so they are deterministic.
"""

import math

import pytest
import torch
from scipy.stats import chisquare

from loopspec.decoding import (SamplingParams, greedy_accept, next_token, probabilities, sample,
                               speculative_accept)
from loopspec.errors import LoopspecError

P_MIN = 1e-3  # a correct sampler must pass the goodness-of-fit test at this level
T1 = SamplingParams(temperature=1.0)


def gof_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of integer `counts` [V] against `probs` [V] (all expected >= 5)."""
    n = int(counts.sum())
    expected = probs.double() / probs.double().sum() * n
    assert bool((expected >= 5).all()), "test design: every expected count must be >= 5"
    return float(chisquare(counts.double().numpy(), expected.numpy()).pvalue)


# --------------------------------------------------------------------------------------------------
# probabilities


def test_temperature_matches_softmax():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0)) * 3
    for t in (0.3, 1.0, 2.5):
        probs = probabilities(logits, SamplingParams(temperature=t))
        assert probs.dtype == torch.float32
        torch.testing.assert_close(probs, torch.softmax(logits / t, dim=-1), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(probs.sum(-1), torch.ones(3))


def test_half_precision_logits_give_fp32_probabilities():
    logits = torch.randn(2, 9, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    probs = probabilities(logits, T1)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits.float(), dim=-1))


@pytest.mark.parametrize("k", [1, 2, 5, 9])
def test_top_k_keeps_exactly_the_k_largest(k):
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(4, 10, generator=g) * 2  # distinct values (no ties)
    probs = probabilities(logits, SamplingParams(temperature=0.8, top_k=k))
    top = torch.topk(logits, k, dim=-1).indices
    for row in range(4):
        support = set(probs[row].nonzero().flatten().tolist())
        assert support == set(top[row].tolist())
        keep = top[row]
        expected = torch.zeros(10)
        expected[keep] = torch.softmax(logits[row, keep] / 0.8, dim=-1)
        torch.testing.assert_close(probs[row], expected)
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))


def test_top_k_off_or_at_least_vocab_is_plain_softmax():
    logits = torch.randn(2, 6, generator=torch.Generator().manual_seed(2))
    plain = torch.softmax(logits, -1)
    for k in (0, 6, 50):
        torch.testing.assert_close(probabilities(logits, SamplingParams(temperature=1.0, top_k=k)), plain)


# probs [0.05, 0.5, 0.3, 0.15]: by descending probability the cumulative mass is 0.5, 0.8, 0.95, 1.0
HAND = torch.tensor([0.05, 0.5, 0.3, 0.15])


@pytest.mark.parametrize("top_p, expected", [
    (1e-6, [0.0, 1.0, 0.0, 0.0]),  # never empty: the most likely token is always kept
    (0.4, [0.0, 1.0, 0.0, 0.0]),  # 0.5 already reaches 0.4
    (0.7, [0.0, 0.5 / 0.8, 0.3 / 0.8, 0.0]),  # 0.5 < 0.7 <= 0.8
    (0.8 - 1e-3, [0.0, 0.5 / 0.8, 0.3 / 0.8, 0.0]),
    (0.9, [0.0, 0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95]),  # 0.8 < 0.9 <= 0.95
    (0.99, [0.05, 0.5, 0.3, 0.15]),  # needs every token
    (1.0, [0.05, 0.5, 0.3, 0.15]),
])
def test_top_p_hand_computed(top_p, expected):
    probs = probabilities(HAND.log(), SamplingParams(temperature=1.0, top_p=top_p))
    torch.testing.assert_close(probs, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_top_p_smallest_prefix_reaching_mass_rowwise():
    """Random rows: the kept set is the shortest descending prefix with mass >= top_p, renormalized."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(50, 12, generator=g) * 1.5
    for top_p in (0.05, 0.3, 0.6, 0.9, 0.97):
        probs = probabilities(logits, SamplingParams(temperature=1.0, top_p=top_p))
        full = torch.softmax(logits, -1)
        torch.testing.assert_close(probs.sum(-1), torch.ones(50))
        for row in range(50):
            sorted_p, order = torch.sort(full[row], descending=True)
            cum = sorted_p.double().cumsum(0)
            m = int((cum < top_p - 1e-6).sum()) + 1  # prefix length; avoid rows too close to the boundary
            if abs(float(cum[m - 1]) - top_p) < 1e-5:
                continue
            assert m >= 1
            support = set(probs[row].nonzero().flatten().tolist())
            assert support == set(order[:m].tolist())
            kept = order[:m]
            torch.testing.assert_close(probs[row, kept], full[row, kept] / full[row, kept].sum())


def test_top_k_then_top_p():
    probs = probabilities(HAND.log(), SamplingParams(temperature=1.0, top_k=3, top_p=0.9))
    # top_k=3 → [0, .5, .3, .15] / .95 = [0, .526, .316, .158]; cumulative .526, .842 < .9, then 1.0
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.5, 0.3, 0.15]) / 0.95, rtol=1e-5, atol=1e-6)
    probs = probabilities(HAND.log(), SamplingParams(temperature=1.0, top_k=3, top_p=0.8))
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.5, 0.3, 0.0]) / 0.8, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# SamplingParams


@pytest.mark.parametrize("kw", [
    dict(temperature=-0.1), dict(temperature=-1), dict(temperature=float("nan")), dict(temperature=float("-inf")),
    dict(temperature=float("inf")),
    dict(top_p=0.0), dict(top_p=-0.5), dict(top_p=1.0001), dict(top_p=2.0), dict(top_p=float("nan")),
    dict(top_k=-1), dict(top_k=-10),
])
def test_sampling_params_rejects_bad_values(kw):
    with pytest.raises(LoopspecError):
        SamplingParams(**kw)


def test_sampling_params_accepts_good_values():
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.0, top_k=5, top_p=0.5).greedy
    p = SamplingParams(temperature=0.7, top_k=0, top_p=1.0)
    assert not p.greedy
    SamplingParams(temperature=1e-4, top_k=1, top_p=1e-6)


def test_next_token_greedy_and_sampled():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert next_token(logits, SamplingParams(), None) == 1
    # top_k=1 leaves a single token whatever the temperature
    g = torch.Generator().manual_seed(0)
    assert {next_token(logits, SamplingParams(temperature=5.0, top_k=1), g) for _ in range(50)} == {1}


def test_sample_shapes():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(2, 3, 5, generator=g), -1)
    assert sample(probs, g).shape == (2, 3)
    assert sample(probs[0, 0], g).shape == ()


# --------------------------------------------------------------------------------------------------
# greedy_accept


def test_greedy_accept_all_accepted():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 16, generator=g)
    choice = logits.argmax(-1)
    assert greedy_accept(choice[:4], logits) == (4, int(choice[4]))


@pytest.mark.parametrize("i", [0, 1, 3])
def test_greedy_accept_first_mismatch(i):
    g = torch.Generator().manual_seed(i)
    logits = torch.randn(5, 16, generator=g)
    choice = logits.argmax(-1)
    drafts = choice[:4].clone()
    drafts[i] = (drafts[i] + 1) % 16
    if i + 1 < 4:
        drafts[i + 1] = (drafts[i + 1] + 3) % 16  # later mismatches do not matter
    assert greedy_accept(drafts, logits) == (i, int(choice[i]))


def test_greedy_accept_zero_drafts():
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]])
    assert greedy_accept(torch.empty(0, dtype=torch.long), logits) == (0, 2)


# --------------------------------------------------------------------------------------------------
# speculative_accept


def test_speculative_accept_zero_drafts_samples_from_p():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    counts = torch.zeros(4)
    for _ in range(4000):
        acc, bonus = speculative_accept(torch.empty(0, dtype=torch.long), None, p, g)
        assert acc == 0
        counts[bonus] += 1
    assert gof_pvalue(counts, p[0]) > P_MIN


P0 = torch.tensor([0.1, 0.45, 0.15, 0.3])
P1 = torch.tensor([0.25, 0.05, 0.4, 0.3])
Q0 = torch.tensor([0.4, 0.2, 0.3, 0.1])  # q > p on tokens 0 and 2, q < p on tokens 1 and 3
Q1 = torch.tensor([0.1, 0.5, 0.2, 0.2])


@pytest.mark.parametrize("draft", [0, 1, 2, 3])
def test_speculative_accept_one_hot_q_is_exact(draft):
    """Argmax drafts (q one-hot on `draft`): the first committed token is distributed as p[0],
    the draft is accepted with probability p[0](draft), and the bonus after it follows p[1]."""
    g = torch.Generator().manual_seed(100 + draft)
    target = torch.stack([P0, P1])
    drafts = torch.tensor([draft])
    trials = 20000
    first = torch.zeros(4)
    bonus_after_accept = torch.zeros(4)
    for _ in range(trials):
        acc, bonus = speculative_accept(drafts, None, target, g)
        if acc == 1:
            first[draft] += 1
            bonus_after_accept[bonus] += 1
        else:
            assert acc == 0 and bonus != draft  # the residual p - onehot(draft) excludes the draft
            first[bonus] += 1
    assert gof_pvalue(first, P0) > P_MIN
    n_acc = int(bonus_after_accept.sum())
    rate = n_acc / trials
    sd = math.sqrt(P0[draft] * (1 - P0[draft]) / trials)
    assert abs(rate - float(P0[draft])) < 5 * sd
    assert gof_pvalue(bonus_after_accept, P1) > P_MIN


def test_speculative_accept_real_q_is_exact():
    """Drafts sampled from a real q: first committed token ~ p[0]; acceptance rate = sum min(p, q);
    the residual sample after a rejection only lands where p > q."""
    g = torch.Generator().manual_seed(7)
    target = torch.stack([P0, P1])
    q = Q0[None]
    trials = 20000
    first = torch.zeros(4)
    accepted = 0
    for _ in range(trials):
        d = sample(Q0, g)
        acc, bonus = speculative_accept(d.reshape(1), q, target, g)
        if acc == 1:
            first[int(d)] += 1
            accepted += 1
        else:
            assert P0[bonus] > Q0[bonus]
            first[bonus] += 1
    assert gof_pvalue(first, P0) > P_MIN
    alpha = float(torch.minimum(P0, Q0).sum())  # 0.1 + 0.2 + 0.15 + 0.1 = 0.55
    assert abs(accepted / trials - alpha) < 5 * math.sqrt(alpha * (1 - alpha) / trials)


def test_speculative_accept_two_draft_chain_is_exact():
    """A chain of two drafts sampled from q0, q1 (rows independent of the prefix, as for a target
    whose next-token law does not depend on history): first committed token ~ p0 and, given that
    the first draft was accepted, the second committed token ~ p1; after two accepts the bonus ~ p2."""
    g = torch.Generator().manual_seed(11)
    P2 = torch.tensor([0.3, 0.3, 0.2, 0.2])
    target = torch.stack([P0, P1, P2])
    q = torch.stack([Q0, Q1])
    first, second, third = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    for _ in range(20000):
        d = sample(q, g)
        acc, bonus = speculative_accept(d, q, target, g)
        committed = d[:acc].tolist() + [bonus]
        first[committed[0]] += 1
        if acc >= 1:
            second[committed[1]] += 1
        if acc == 2:
            third[committed[2]] += 1
    assert gof_pvalue(first, P0) > P_MIN
    assert gof_pvalue(second, P1) > P_MIN
    assert gof_pvalue(third, P2) > P_MIN


def test_goodness_of_fit_has_power():
    """The same Monte Carlo size rejects a plausible bug: resampling from p (not from the residual
    max(0, p - q)) after a rejection."""
    g = torch.Generator().manual_seed(7)
    first = torch.zeros(4)
    for _ in range(20000):
        d = int(sample(Q0, g))
        if float(torch.rand((), generator=g)) * Q0[d] <= P0[d]:
            first[d] += 1
        else:
            first[int(sample(P0, g))] += 1  # wrong: should be normalize(max(0, p - q))
    assert gof_pvalue(first, P0) < 1e-12


def test_speculative_accept_p_equals_q_always_accepts():
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(4, 6, generator=g), -1)
    for _ in range(2000):
        d = sample(p[:3], g)
        acc, bonus = speculative_accept(d, p[:3], p, g)
        assert acc == 3 and 0 <= bonus < 6
    # a deterministic target on the argmax draft (p one-hot = q one-hot) accepts too
    onehot = torch.zeros(2, 6)
    onehot[0, 4] = 1.0
    onehot[1, 2] = 1.0
    for _ in range(200):
        assert speculative_accept(torch.tensor([4]), None, onehot, g) == (1, 2)
        assert speculative_accept(torch.tensor([4]), onehot[:1], onehot, g) == (1, 2)


def test_speculative_accept_rejects_zero_probability_draft():
    """A draft outside the warped support (p = 0, e.g. cut by top-k) is never committed."""
    g = torch.Generator().manual_seed(9)
    p = probabilities(torch.tensor([[2.0, 1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]]),
                      SamplingParams(temperature=1.0, top_k=2))
    for _ in range(3000):
        acc, bonus = speculative_accept(torch.tensor([3]), None, p, g)
        assert acc == 0 and bonus in (0, 1)


def test_speculative_accept_zero_uniform_never_accepts_zero_probability(monkeypatch):
    """A uniform draw of exactly 0 (probability 2^-24 for fp32 torch.rand) must not accept p = 0."""
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: torch.zeros_like(real_rand(*a, **kw)))
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    acc, bonus = speculative_accept(torch.tensor([3]), None, p, torch.Generator().manual_seed(0))
    assert acc == 0 and bonus in (0, 1)


def test_tiny_temperature_tends_to_greedy_without_nan():
    logits = torch.tensor([[1.0, 3.0, -2.0, 2.5], [0.0, 0.0, -1.0, -5.0]])
    probs = probabilities(logits, SamplingParams(temperature=1e-300))
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]))


def test_tiny_top_p_keeps_the_most_likely_token():
    probs = probabilities(torch.tensor([1.0, 3.0, 2.0]), SamplingParams(temperature=1.0, top_p=5e-324))
    torch.testing.assert_close(probs, torch.tensor([0.0, 1.0, 0.0]))
