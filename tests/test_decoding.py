"""Unit tests of the pure sampling / acceptance functions in loopspec.decoding.

The Monte Carlo checks use seeded generators and fixed thresholds, so they are deterministic.
"""

import math

import pytest
import torch
from scipy.stats import chisquare

from loopspec.decoding import SamplingParams, next_token, probabilities, sample, tree_accept
from loopspec.tree import DraftTree
from loopspec.errors import LoopspecError

P_MIN = 1e-3  # a correct sampler must pass the goodness-of-fit test at this level
Q0 = torch.tensor([0.4, 0.2, 0.3, 0.1])  # a draft law with q > p on tokens 0 and 2, q < p on 1 and 3
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


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (1e-6, [0.0, 1.0, 0.0, 0.0]),  # never empty: the most likely token is always kept
        (0.4, [0.0, 1.0, 0.0, 0.0]),  # 0.5 already reaches 0.4
        (0.7, [0.0, 0.5 / 0.8, 0.3 / 0.8, 0.0]),  # 0.5 < 0.7 <= 0.8
        (0.8 - 1e-3, [0.0, 0.5 / 0.8, 0.3 / 0.8, 0.0]),
        (0.9, [0.0, 0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95]),  # 0.8 < 0.9 <= 0.95
        (0.99, [0.05, 0.5, 0.3, 0.15]),  # needs every token
        (1.0, [0.05, 0.5, 0.3, 0.15]),
    ],
)
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


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=-0.1),
        dict(temperature=-1),
        dict(temperature=float("nan")),
        dict(temperature=float("-inf")),
        dict(temperature=float("inf")),
        dict(top_p=0.0),
        dict(top_p=-0.5),
        dict(top_p=1.0001),
        dict(top_p=2.0),
        dict(top_p=float("nan")),
        dict(top_k=-1),
        dict(top_k=-10),
    ],
)
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
# tree_accept: the acceptance walk over a draft tree (a chain is the tree with one child per node)

GREEDY = SamplingParams()


def test_greedy_chain_all_accepted():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 16, generator=g)
    choice = logits.argmax(-1)
    tree = DraftTree.chain(3, choice[:4].tolist())
    assert tree_accept(tree, logits, GREEDY, None) == ([0, 1, 2, 3, 4], int(choice[4]))


@pytest.mark.parametrize("i", [0, 1, 3])
def test_greedy_chain_first_mismatch(i):
    g = torch.Generator().manual_seed(i)
    logits = torch.randn(5, 16, generator=g)
    choice = logits.argmax(-1)
    drafts = choice[:4].clone()
    drafts[i] = (drafts[i] + 1) % 16
    if i + 1 < 4:
        drafts[i + 1] = (drafts[i + 1] + 3) % 16  # later mismatches do not matter
    assert tree_accept(DraftTree.chain(3, drafts.tolist()), logits, GREEDY, None) == (
        list(range(i + 1)),
        int(choice[i]),
    )


def test_greedy_no_drafts_is_the_argmax():
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]])
    assert tree_accept(DraftTree.root(1), logits, GREEDY, None) == ([0], 2)


def test_greedy_tree_follows_the_child_equal_to_the_argmax():
    """Root children 5 (node 1) and 7 (node 2), node 2's child 4 (node 3): the target's argmax 7
    takes the second branch, then 4, then the bonus."""
    tree = DraftTree.root(0)
    tree.add(0, 5)
    two = tree.add(0, 7)
    tree.add(1, 4)  # node 3: under the wrong branch
    four = tree.add(two, 4)  # node 4
    logits = torch.full((5, 8), -1.0)
    logits[0, 7] = logits[two, 4] = logits[four, 6] = 1.0
    logits[1, 4] = 1.0
    assert tree_accept(tree, logits, GREEDY, None) == ([0, two, four], 6)


P0 = torch.tensor([0.1, 0.45, 0.15, 0.3])
P1 = torch.tensor([0.25, 0.05, 0.4, 0.3])
P2 = torch.tensor([0.3, 0.3, 0.2, 0.2])
T1 = SamplingParams(temperature=1.0)


def test_sampling_no_drafts_samples_from_p():
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(4000):
        path, bonus = tree_accept(DraftTree.root(0), P0.log()[None], T1, g)
        assert path == [0]
        counts[bonus] += 1
    assert gof_pvalue(counts, P0) > P_MIN


@pytest.mark.parametrize("draft", [0, 1, 2, 3])
def test_sampling_chain_is_exact(draft):
    """Argmax drafts (a one-hot q on `draft`): the first committed token is distributed as p[0],
    the draft is accepted with probability p[0](draft), and the bonus after it follows p[1]."""
    g = torch.Generator().manual_seed(100 + draft)
    logits = torch.stack([P0, P1]).log()
    trials = 20000
    first, bonus_after_accept = torch.zeros(4), torch.zeros(4)
    for _ in range(trials):
        path, bonus = tree_accept(DraftTree.chain(0, [draft]), logits, T1, g)
        if len(path) == 2:
            first[draft] += 1
            bonus_after_accept[bonus] += 1
        else:
            assert path == [0] and bonus != draft  # a drawn token equal to the draft is accepted
            first[bonus] += 1
    assert gof_pvalue(first, P0) > P_MIN
    rate = float(bonus_after_accept.sum()) / trials
    assert abs(rate - float(P0[draft])) < 5 * math.sqrt(P0[draft] * (1 - P0[draft]) / trials)
    assert gof_pvalue(bonus_after_accept, P1) > P_MIN


def test_sampling_tree_is_exact():
    """Root children 1 and 3, node 1's child 2: the first committed token ~ p at the root, the
    second ~ p at the node the walk took, and a branch is taken with its token's probability."""
    g = torch.Generator().manual_seed(11)
    tree = DraftTree.root(0)
    one, three = tree.add(0, 1), tree.add(0, 3)
    tree.add(one, 2)
    logits = torch.stack([P0, P1, P2, P0]).log()  # rows: root, `one`, `three`, one's child
    first, after_one, after_three = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    trials = 20000
    for _ in range(trials):
        path, bonus = tree_accept(tree, logits, T1, g)
        committed = [tree.tokens[n] for n in path[1:]] + [bonus]
        first[committed[0]] += 1
        if path[1:2] == [one]:
            after_one[committed[1]] += 1
        if path[1:2] == [three]:
            after_three[committed[1]] += 1
    assert gof_pvalue(first, P0) > P_MIN
    assert gof_pvalue(after_one, P1) > P_MIN and gof_pvalue(after_three, P2) > P_MIN
    taken = float(after_one.sum() + after_three.sum()) / trials
    assert abs(taken - float(P0[1] + P0[3])) < 5 * math.sqrt(0.75 * 0.25 / trials)


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


def test_sampling_never_commits_a_zero_probability_draft():
    """A draft outside the warped support (p = 0, e.g. cut by top-k) is never committed."""
    g = torch.Generator().manual_seed(9)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    for _ in range(3000):
        path, bonus = tree_accept(DraftTree.chain(0, [3]), logits, SamplingParams(temperature=1.0, top_k=2), g)
        assert path == [0] and bonus in (0, 1)


def test_tiny_temperature_tends_to_greedy_without_nan():
    logits = torch.tensor([[1.0, 3.0, -2.0, 2.5], [0.0, 0.0, -1.0, -5.0]])
    probs = probabilities(logits, SamplingParams(temperature=1e-300))
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]))


def test_tiny_top_p_keeps_the_most_likely_token():
    probs = probabilities(torch.tensor([1.0, 3.0, 2.0]), SamplingParams(temperature=1.0, top_p=5e-324))
    torch.testing.assert_close(probs, torch.tensor([0.0, 1.0, 0.0]))
