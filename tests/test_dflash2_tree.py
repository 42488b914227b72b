"""DFlash2 draft trees over the candidate selector's whole lattice: the lattice a stage returns is the
selector's score from every predecessor (checked against the formula in fp64, and against the walk
on the walk's own row); the tree is the best `budget` paths of the lattice, each child scored after
its own parent (checked against brute-force enumeration; a child scored after the walk's token fails
it), and a later DLoop stage hangs under the walk only; with a drafter trained here, greedy tree
decoding commits plain decoding's tokens alone and batched and accepts at least what the chain does;
at T = 1 the committed tokens follow the target's exact law (a tree walk without the residual between
siblings fails the same test)."""

import itertools

import pytest
import torch

from conftest import accepted_drafts, batched_greedy_equals_plain, lively
from test_dflash2 import (  # noqa: F401 (law_target, target_dir: fixtures)
    ANCHOR,
    BLOCK,
    PROMPT,
    PROMPTS,
    agreeing_dflash2,
    dflash2_checkpoint,
    law_engine,
    law_target,
    target_dir,
)
from test_distribution import P_FAIL, P_PASS, PROMPT as LAW_PROMPT, RUNS, exact_distribution, gof_pvalue, seeds
from test_real_q import committed_counts
from test_eagle3_tree import walk_without_residual
import loopspec.runtime.decoder as decoder_module
from loopspec.decoding import SamplingParams
from loopspec.engines.torch_engine import TorchEngine
from loopspec.model.dflash2 import DFlash2Drafter
from loopspec.runtime.decoder import generate
from loopspec.settings import DecodingSettings as Method
from loopspec.tree import Lattice, lattice_best_first
from loopspec.weights import load_target_dir

FLOOR_GREEDY = 100  # accepted drafts of 160 greedy tokens the identity tests require (an untrained drafter: ~1)
NEG = float("-inf")


def random_lattice(D=3, K=3, seed=0) -> Lattice:
    g = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(torch.randn(D, K, K, generator=g, dtype=torch.float64) * 2, dim=-1)
    logprobs[0, 1:] = NEG  # slot 0 follows the anchor alone
    candidates = torch.stack([torch.randperm(20, generator=g)[:K] for _ in range(D)])  # distinct tokens per slot
    return Lattice(candidates, logprobs)


def all_paths(lattice: Lattice) -> dict[tuple[int, ...], float]:
    """Every path of the lattice from the anchor (as candidate indices) → its cumulative log-prob, each
    step scored by the transition from the path's own previous candidate."""
    D, K = lattice.candidates.shape
    out = {}
    for depth in range(1, D + 1):
        for path in itertools.product(range(K), repeat=depth):
            score, previous = 0.0, 0
            for slot, index in enumerate(path):
                score += float(lattice.logprobs[slot, previous, index])
                previous = index
            if score > NEG:
                out[path] = score
    return out


def tree_paths(tree, lattice: Lattice) -> set[tuple[int, ...]]:
    """The tree's nodes as candidate-index paths."""
    ids = lattice.candidates.tolist()
    out = set()
    for node in range(1, len(tree)):
        path = tree.path(node)[1:]
        out.add(tuple(ids[slot].index(tree.tokens[n]) for slot, n in enumerate(path)))
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [1, 5, 12, 39])
def test_the_tree_is_the_lattices_best_paths(seed, budget):
    lattice = random_lattice(seed=seed)
    scores = all_paths(lattice)
    tree = lattice_best_first(7, lattice, budget)
    got = tree_paths(tree, lattice)
    assert len(got) == min(budget, len(scores)) and all(tree.parents[n] < n for n in range(1, len(tree)))
    worst_kept = min(scores[p] for p in got)
    assert all(scores[p] <= worst_kept + 1e-12 for p in set(scores) - got)  # nothing left out scores above


def test_a_later_stage_hangs_under_the_walk_only():
    """Lattice.join: a DLoop stage drafted after the walk continues from the walk's candidate only."""
    first, second = random_lattice(D=2, seed=5), random_lattice(D=2, seed=6)
    walk_index = 2
    walk = [int(first.candidates[0, 0]), int(first.candidates[1, walk_index])] + second.candidates[:, 0].tolist()
    joined = Lattice.join([first, second], walk, 4)
    assert joined.candidates.shape == (4, 3)
    assert bool((joined.logprobs[2, [0, 1]] == NEG).all()) and torch.equal(
        joined.logprobs[2, walk_index], second.logprobs[0, 0]
    )
    tree = lattice_best_first(7, joined, 40)
    for node in range(1, len(tree)):
        if tree.depths[node] == 3:
            assert tree.tokens[tree.parents[node]] == walk[1]
    assert max(tree.depths) == 4


def test_the_stage_lattice_is_the_selectors_score_from_every_predecessor(target_dir, tmp_path):
    """fp64: logprobs[i, a, b] = log-softmax over b of unary[b] + ⟨A[candidate a of slot i-1] ⊙ u_i,
    B[candidate b]⟩ (slot 0: the anchor's row); on the walk's own predecessor it is the stage's ranked
    log-probs, whose best candidate is the walk's."""
    directory, _, _ = dflash2_checkpoint(tmp_path / "d2")
    target = load_target_dir(target_dir, dtype=torch.float64)
    drafter = DFlash2Drafter.load(directory, dtype=torch.float64)
    engine = TorchEngine(target, drafter, max_context=64)
    engine.prefill(0, PROMPT, want_taps=True)
    stage = engine.draft([0], [ANCHOR], [len(PROMPT)], BLOCK)
    lattice = stage.lattice.row(0)
    selector = drafter.candidate_selector
    with torch.inference_mode():
        states = stage[2][0, 1:]  # [D, H]
        unary = drafter.unary_logits(engine.context.draft_head(states))  # [D, V]
        u = selector.hidden_projection(states)  # [D, rank]
        A, B = selector.predecessor_codebook.detach(), selector.successor_codebook.detach()
    candidates = lattice.candidates.tolist()
    D = len(candidates)
    walk = stage[0][0, :, 0].tolist()
    for i in range(D):
        previous = [ANCHOR] if i == 0 else candidates[i - 1]
        for a, p in enumerate(previous):
            scores = torch.tensor(
                [float(unary[i, c] + (A[p] * u[i] * B[c]).sum()) for c in candidates[i]], dtype=torch.float64
            )
            assert torch.allclose(lattice.logprobs[i, a], torch.log_softmax(scores, -1), rtol=0, atol=1e-9)
        row = 0 if i == 0 else candidates[i - 1].index(walk[i - 1])
        ranked = lattice.logprobs[i, row].sort(descending=True, stable=True)
        assert torch.allclose(ranked.values[: stage[1].shape[-1]].float(), stage[1][0, i], atol=1e-6)
        assert candidates[i][int(ranked.indices[0])] == walk[i]  # the walk takes its row's best


# --------------------------------------------------------------------------------------------------
# decoding with a drafter that agrees with the target


@pytest.fixture(scope="module")
def engine(target_dir):
    """The lively target with a DFlash2 drafter trained briefly on its greedy continuations of PROMPTS:
    good, not perfect, so that the tree's other branches have something to win."""
    target = lively(load_target_dir(target_dir))
    plain = TorchEngine(target, None, max_context=128)
    texts = [(p, generate(plain, p, Method(), max_new_tokens=40).tokens) for p in PROMPTS]
    return TorchEngine(target, agreeing_dflash2(target, texts, steps=60), max_context=128)


TREE = Method("dflash", block_size=BLOCK, tree_budget=10)


@pytest.mark.parametrize(
    "settings",
    [TREE, Method("dloop", block_size=BLOCK, max_stages=3, gate_threshold=-2.0, tree_budget=12)],
    ids=["dflash", "dloop"],
)
def test_greedy_lattice_tree_commits_plain_decodings_tokens(settings, engine, plain):
    accepted = 0
    for p, ar in zip(PROMPTS, plain):
        spec = generate(engine, p, settings, max_new_tokens=40)
        assert spec.tokens == ar
        accepted += accepted_drafts([spec])
    assert accepted >= FLOOR_GREEDY, accepted


def test_batched_rows_commit_what_each_commits_alone(engine):
    assert batched_greedy_equals_plain(engine, PROMPTS, TREE) >= FLOOR_GREEDY


@pytest.fixture(scope="module")
def plain(engine) -> list[list[int]]:
    """What plain decoding commits for each of PROMPTS (40 tokens, greedy)."""
    return [generate(engine, p, Method(), max_new_tokens=40).tokens for p in PROMPTS]


def tokens_per_verification(engine, settings) -> float:
    results = [generate(engine, p, settings, max_new_tokens=40) for p in PROMPTS]
    return accepted_drafts(results) / sum(len(r.stats.accepted_per_round) for r in results)


def test_the_tree_accepts_at_least_what_the_chain_does(engine):
    chain = tokens_per_verification(engine, Method("dflash", block_size=BLOCK))
    tree = tokens_per_verification(engine, TREE)
    assert tree >= chain, (tree, chain)


def test_lattice_tree_commits_the_targets_exact_law(law_target):
    """T = 1, the walk over a lattice tree of depth 2 with a live selector (test_dflash2's law engine)."""
    engine = law_engine(law_target)
    settings = Method("dflash", block_size=3, tree_budget=5)
    counts, first = committed_counts(engine, 4, settings, seeds(51))
    hist = torch.bincount(torch.tensor(first), minlength=3)
    assert int(hist[1:].sum()) > 0.2 * RUNS, hist
    assert (
        gof_pvalue(counts, exact_distribution(law_target, LAW_PROMPT, 4, SamplingParams(temperature=1.0)), min_cells=60)
        > P_PASS
    )


def test_a_wrong_tree_acceptance_is_rejected(law_target, monkeypatch):
    """Power: the same lattice trees walked without the residual between siblings leave the law."""
    monkeypatch.setattr(decoder_module, "tree_accept", walk_without_residual)
    counts, _ = committed_counts(
        law_engine(law_target), 4, Method("dflash", block_size=3, tree_budget=5), seeds(52, RUNS // 2)
    )
    assert (
        gof_pvalue(counts, exact_distribution(law_target, LAW_PROMPT, 4, SamplingParams(temperature=1.0)), min_cells=40)
        < P_FAIL
    )
