"""Draft trees: the tree builders, the suffix index, one-forward tree verification with
its ancestor-only mask, the commit of the accepted path, and lossless decoding with trees and
suffix branches (greedy identity here; the distribution tests at T > 0 are at the end)."""

import itertools
import random

import pytest
import torch

import loopspec.runtime.decoder as decoder_module
from conftest import FAMILIES, accepted_drafts, agreeing_drafter
from loopspec.decoding import SamplingParams, probabilities
from loopspec.errors import LoopspecError
from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.model.draft_head import StageDrafts
from loopspec.runtime.decoder import Decoder, decode_all, generate
from loopspec.engines.torch_engine import TorchEngine
from loopspec.method_names import method_variant, variant_name
from loopspec.settings import DecodingSettings, resolve_settings
from loopspec.tree import DraftTree, SuffixIndex, best_first, draft_tree, tree_masks
from loopspec.weights import load_target_dir

from test_distribution import (  # noqa: F401
    P_FAIL,
    P_PASS,
    RUNS,
    T1,
    V,
    engine,
    exact_distribution,
    gof_pvalue,
    seeds,
)


# --------------------------------------------------------------------------------------------------
# the suffix index


def brute_continuation(tokens, length, min_match=2, max_match=6):
    """The rule stated plainly: the longest suffix (max_match .. min_match tokens) that also ends
    earlier, its latest such end, and what followed it (the loop's period past the text's end)."""
    t = len(tokens) - 1
    for n in range(min(max_match, t + 1), min_match - 1, -1):
        suffix = tokens[t - n + 1 :]
        ends = [e for e in range(n - 1, t) if tokens[e - n + 1 : e + 1] == suffix]
        if ends:
            end = ends[-1]
            return [tokens[end + 1 + i % (t - end)] for i in range(length)]
    return []


def test_suffix_index_equals_the_plain_rule_at_every_length():
    rng = random.Random(0)
    for trial in range(30):
        tokens = [rng.randrange(3 + trial % 4) for _ in range(60)]
        index = SuffixIndex(tokens[:5])
        for t in range(5, 60):
            assert index.continuation(7) == brute_continuation(tokens[:t], 7), (trial, t)
            index.extend([tokens[t]])


def test_suffix_index_proposes_the_latest_longest_match_and_continues_a_loop():
    index = SuffixIndex([1, 2, 3, 9, 1, 2, 3, 4, 5, 8, 1, 2, 3])
    assert index.continuation(3) == [4, 5, 8]  # "1 2 3" last ended before 4 5 8 (not before 9)
    loop = SuffixIndex([7, 5, 6, 5, 6])  # "5 6" ended 2 tokens back: the loop 5 6 repeats
    assert loop.continuation(5) == [5, 6, 5, 6, 5]
    assert SuffixIndex([1, 2, 3, 4]).continuation(4) == []  # nothing repeats
    assert SuffixIndex([1, 2, 1, 2]).continuation(0) == []
    # the match the chain policy reads: its length and where the earlier occurrence ended
    assert index.longest_match() == (3, 6) and loop.longest_match() == (2, 2)
    assert SuffixIndex([1, 2, 3, 4]).longest_match() == (0, -1)
    assert SuffixIndex([4, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6]).longest_match() == (6, 6)  # at most max_match


# --------------------------------------------------------------------------------------------------
# the tree builders


def all_scores(logprobs: torch.Tensor, stage_sizes=None) -> list[float]:
    """Every node a best-first tree may hold (a rank per depth, a prefix of any length), by score."""
    D, C = logprobs.shape
    stage_of = [s for s, n in enumerate(stage_sizes or [D]) for _ in range(n)]
    scores = []
    for depth in range(1, D + 1):
        for ranks in itertools.product(range(C), repeat=depth):
            # a later stage continues only the argmax chain of the stages before it
            if any(stage_of[d + 1] != stage_of[d] and any(ranks[: d + 1]) for d in range(depth - 1)):
                continue
            scores.append(sum(float(logprobs[d, r]) for d, r in enumerate(ranks)))
    return sorted(scores, reverse=True)


def node_scores(tree: DraftTree, candidates, logprobs) -> list[float]:
    out = []
    for node in range(1, len(tree)):
        score, path = 0.0, tree.path(node)[1:]
        for d, n in enumerate(path):
            rank = candidates[d].tolist().index(tree.tokens[n])
            score += float(logprobs[d, rank])
        out.append(score)
    return out


@pytest.mark.parametrize("stage_sizes", [None, [2, 2]])
@pytest.mark.parametrize("budget", [1, 5, 12])
def test_best_first_takes_the_best_nodes(budget, stage_sizes):
    g = torch.Generator().manual_seed(budget)
    logprobs = torch.log_softmax(torch.randn(4, 6, generator=g), -1).topk(3, -1).values  # [4, 3] ranked
    candidates = torch.stack([torch.randperm(50, generator=g)[:3] for _ in range(4)])  # distinct per depth
    tree = best_first(99, candidates, logprobs, budget, stage_sizes)
    assert tree.drafts == budget and tree.tokens[0] == 99
    assert all(p < i for i, p in enumerate(tree.parents) if i)  # parents come first
    got = sorted(node_scores(tree, candidates, logprobs), reverse=True)
    assert got == pytest.approx(all_scores(logprobs, stage_sizes)[:budget], abs=1e-6)
    if stage_sizes:  # stage 2 (depths 3-4) hangs under the stage-1 argmax chain only
        chain_end = tree.child(tree.child(0, int(candidates[0, 0])), int(candidates[1, 0]))
        deep = [n for n in range(len(tree)) if tree.depths[n] == 3]
        assert all(tree.parents[n] == chain_end for n in deep)


def test_draft_tree_chain_suffix_merge_and_node_cap():
    candidates = torch.tensor([[5, 6], [7, 8], [9, 10]])
    logprobs = torch.tensor([[-0.1, -2.0], [-0.1, -2.0], [-0.1, -2.0]])
    chain = draft_tree(1, candidates, logprobs, [3], tree_budget=0, suffix=[], max_nodes=10)
    assert chain.tokens == [1, 5, 7, 9] and chain.is_chain and all(chain.from_drafter[1:])
    # the suffix branch shares the drafter's first node and forks after it
    tree = draft_tree(1, candidates, logprobs, [3], tree_budget=0, suffix=[5, 4, 4], max_nodes=10)
    assert tree.tokens == [1, 5, 7, 9, 4, 4] and tree.parents == [-1, 0, 1, 2, 1, 4]
    assert tree.from_suffix == [False, True, False, False, True, True]
    assert tree.from_drafter == [False, True, True, True, False, False]
    capped = draft_tree(1, candidates, logprobs, [3], tree_budget=0, suffix=[5, 4, 4], max_nodes=4)
    assert capped.tokens == [1, 5, 7, 9, 4]  # the context holds 4 more nodes
    masks = tree_masks([tree, chain], 7)
    assert masks.shape == (2, 7, 7)
    assert masks[0, 5].tolist() == [True, True, False, False, True, True, False]  # root, 5, 4 and itself
    assert masks[1, 6].tolist() == [False] * 6 + [True]  # padding sees itself only
    assert torch.equal(masks[1, :4, :4], torch.ones(4, 4, dtype=torch.bool).tril())


def test_settings_for_trees_and_suffix():
    drafter = DrafterConfig(
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        vocab_size=16,
        num_target_layers=4,
        target_layer_ids=[2],
        mask_token_id=3,
        block_size=8,
    )
    s = resolve_settings("dloop", drafter, tree_budget=16, suffix=True)
    assert (s.tree_budget, s.suffix, s.uses_drafter, s.uses_suffix) == (16, True, True, True)
    assert "tree 16" in s.describe() and "suffix" in s.describe()
    plain = resolve_settings("suffix", None)  # no drafter needed
    assert plain.method == "suffix" and plain.block_size == 8 and not plain.uses_drafter and plain.uses_suffix
    drafter.extra = {
        "dloop": {"tree_budget": 12, "suffix": True},  # what tune stored: for any backend,
        "tuned": {"torch": {"tree_budget": 0, "suffix": True}},
    }  # and per backend
    assert (resolve_settings("dflash", drafter).tree_budget, resolve_settings("dflash", drafter).suffix) == (12, True)
    assert resolve_settings("dflash", drafter, engine="onnxruntime").tree_budget == 12
    assert resolve_settings("dflash", drafter, engine="torch").tree_budget == 0
    assert resolve_settings("dflash", drafter, tree_budget=0, suffix=False).tree_budget == 0
    # bench/tune names: a bare name is the resolved setting; parts name tree and suffix completely
    assert method_variant("dflash") == ("dflash", {})
    assert method_variant("dflash+tree8") == (
        "dflash",
        {"tree_budget": 8, "suffix": False, "suffix_first": 0, "suffix_then_draft": False},
    )
    assert method_variant("dloop+tree16+suffix") == (
        "dloop",
        {"tree_budget": 16, "suffix": True, "suffix_first": 0, "suffix_then_draft": False},
    )
    assert method_variant("dflash+chain") == (
        "dflash",
        {"tree_budget": 0, "suffix": False, "suffix_first": 0, "suffix_then_draft": False},
    )
    assert variant_name(resolve_settings("dflash", drafter, **method_variant("dflash+tree8")[1])) == "dflash+tree8"
    assert method_variant("dloop+first3") == (
        "dloop",
        {"tree_budget": 0, "suffix": False, "suffix_first": 3, "suffix_then_draft": False},
    )
    then = resolve_settings("dloop", drafter, **method_variant("dloop+first3+thendraft")[1])
    assert (then.suffix_first, then.suffix_then_draft, variant_name(then)) == (3, True, "dloop+first3+thendraft")
    with pytest.raises(LoopspecError, match="name a match length"):
        method_variant("dloop+thendraft")
    first = resolve_settings("dloop", drafter, **method_variant("dloop+tree8+first4")[1])
    assert (first.suffix_first, first.uses_suffix, variant_name(first)) == (4, True, "dloop+tree8+first4")
    assert "suffix first at 4-token matches" in first.describe()
    drafter.extra["tuned"]["torch"]["suffix_first"] = 3  # a stored chain policy, and the flag over it
    assert resolve_settings("dflash", drafter, engine="torch").suffix_first == 3
    assert resolve_settings("dflash", drafter, engine="torch", suffix_first=0).suffix_first == 0
    assert resolve_settings("dflash", drafter, engine="torch", chains_only=True).suffix_first == 3  # a chain
    drafter.extra["tuned"]["torch"]["suffix_then_draft"] = True  # the stored variant goes with its match length
    assert resolve_settings("dflash", drafter, engine="torch").suffix_then_draft is True
    assert resolve_settings("dflash", drafter, engine="torch", suffix_first=2).suffix_then_draft is False
    assert "then the drafter" in resolve_settings("dflash", drafter, engine="torch").describe()
    for bad in (
        "dflash+tree0",
        "suffix+chain",
        "magic",
        "dflash+fast",
        "dflash+first1",
        "dflash+first7",
        "suffix+first3",
    ):
        with pytest.raises(LoopspecError):
            method_variant(bad)
    for bad, match in (
        (dict(method="suffix", block_size=8, tree_budget=4), "tree"),
        (dict(method="ar", suffix=True), "suffix"),
        (dict(method="dflash", block_size=8, tree_budget=-1), "tree budget"),
        (dict(method="suffix", block_size=8, suffix_first=3), "--suffix-first does not apply to method suffix"),
        (dict(method="ar", block_size=4), "--block-size does not apply to method ar"),
        (dict(method="dflash", block_size=8, max_stages=2), "--max-stages does not apply"),
        (dict(method="dflash", block_size=8, suffix_first=7), "2..6"),
        (dict(method="dflash", block_size=8, suffix_first=1), "2..6"),
        (dict(method="dflash", block_size=8, suffix_then_draft=True), "needs suffix-first"),
    ):
        with pytest.raises(LoopspecError, match=match):
            DecodingSettings(**bad)


# --------------------------------------------------------------------------------------------------
# one forward verifies the tree


def lively(target, scale: float = 8.0):
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return target


def sample_tree() -> DraftTree:
    """root → 11 → (12 → 14, 13), root → 15 → 16: siblings at depths 1 and 2."""
    tree = DraftTree.root(10)
    a = tree.add(0, 11)
    b = tree.add(a, 12)
    tree.add(a, 13)
    tree.add(b, 14)
    c = tree.add(0, 15)
    tree.add(c, 16)
    return tree


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_tree_forward_equals_each_path_alone_and_a_sibling_leak_breaks_it(family, tiny_targets):
    target = lively(load_target_dir(tiny_targets[family]))
    prompt = torch.randint(0, 120, (1, 9), generator=torch.Generator().manual_seed(3))
    tree = sample_tree()
    mask = tree.ancestor_mask()[None]

    def run(mask):
        cache = target.new_cache(64)
        target(prompt, cache)
        return target(torch.tensor([tree.tokens]), cache, tree_mask=mask).logits[0], cache

    logits, cache = run(mask)
    for node in range(len(tree)):
        path = tree.path(node)
        alone = target.new_cache(64)
        target(prompt, alone)
        ref = target(torch.tensor([[tree.tokens[n] for n in path]]), alone).logits[0, -1]
        assert (logits[node] - ref).abs().max() < 1e-4, node
    # mutation: node 3 (13) also sees its sibling 12 (node 2) — its logits move
    leaky = mask.clone()
    leaky[0, 3, 2] = True
    assert (run(leaky)[0][3] - logits[3]).abs().max() > 1e-2
    # commit the path 0 → 11 → 12 → 14 (nodes 0, 1, 2, 4): its K/V now sit as that chain's would
    cache.commit([9], [[0, 1, 2, 4]])
    chain = target.new_cache(64)
    target(prompt, chain)
    target(torch.tensor([[10, 11, 12, 14]]), chain)
    assert int(cache.lengths[0]) == 13
    assert torch.allclose(cache.k[:, 0, :, :13], chain.k[:, 0, :, :13], atol=1e-5)
    assert torch.allclose(cache.v[:, 0, :, :13], chain.v[:, 0, :, :13], atol=1e-5)


# --------------------------------------------------------------------------------------------------
# greedy decoding with trees equals plain decoding


def random_drafter(target, block_size=5, seed=0):
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(target.cfg, num_layers=2, block_size=block_size, mask_token_id=127)
    return Drafter(cfg).eval()


SETTINGS = {
    "tree": DecodingSettings("dflash", block_size=5, tree_budget=12),
    "tree+suffix": DecodingSettings("dflash", block_size=5, tree_budget=8, suffix=True),
    "chain+suffix": DecodingSettings("dflash", block_size=5, suffix=True),
    "dloop-tree+suffix": DecodingSettings(
        "dloop", block_size=5, max_stages=3, gate_threshold=-1e9, tree_budget=14, suffix=True
    ),
    "suffix": DecodingSettings("suffix", block_size=8),
    "dloop+first3+suffix": DecodingSettings(
        "dloop", block_size=5, max_stages=2, gate_threshold=-1e9, suffix=True, suffix_first=3
    ),
    "tree+first2": DecodingSettings("dflash", block_size=5, tree_budget=8, suffix_first=2),
    "dloop+first2+thendraft": DecodingSettings(
        "dloop", block_size=5, max_stages=2, gate_threshold=-1e9, suffix_first=2, suffix_then_draft=True
    ),
}


def repeating_prompt(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    line = torch.randint(3, 120, (7,), generator=g).tolist()
    return line + [5] + line + [6] + line[:3]  # text that repeats, so the suffix index matches


REPEATING_PROMPTS = [repeating_prompt(s) for s in range(3)]


@pytest.fixture(scope="module")
def agreeing_engines(tiny_targets):
    """{family: a lively tiny target with a drafter trained to draft its continuations of REPEATING_PROMPTS}."""
    engines = {}
    for family in FAMILIES:
        target = lively(load_target_dir(tiny_targets[family]))
        cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=5, mask_token_id=127)
        engines[family] = TorchEngine(target, agreeing_drafter(target, REPEATING_PROMPTS, cfg), max_context=200)
    return engines


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_tree_decoding_equals_ar(family, name, agreeing_engines):
    engine, settings, ps = agreeing_engines[family], SETTINGS[name], REPEATING_PROMPTS
    refs = [generate(engine, p, max_new_tokens=40).tokens for p in ps]
    outs = [generate(engine, p, settings, max_new_tokens=40) for p in ps]
    assert [o.tokens for o in outs] == refs
    # of the 120 tokens: measured 79 to 104 for the drafter's settings, 2 to 24 for the suffix index alone
    assert accepted_drafts(outs) >= (40 if settings.uses_drafter else 1), accepted_drafts(outs)
    if settings.tree_budget:  # it branched: a round verified more nodes than its stages' chain
        assert any(
            nodes > stages * (settings.block_size - 1)
            for o in outs
            for nodes, stages in zip(o.stats.nodes_per_round, o.stats.stages_per_round)
        )
    done = decode_all(
        Decoder(engine.with_rows(3), settings), [dict(key=i, prompt_ids=p, max_new_tokens=40) for i, p in enumerate(ps)]
    )
    assert [done[i].tokens for i in range(3)] == refs  # batched rows too
    if settings.uses_suffix and settings.uses_drafter:
        # the agreeing drafter proposes what the suffix index copies; beside a random drafter the
        # suffix index's own nodes are accepted. (The same taps: an engine sets its target's taps.)
        torch.manual_seed(0)
        cfg = DrafterConfig.for_target(
            engine.target_cfg,
            num_layers=2,
            block_size=5,
            mask_token_id=127,
            target_layer_ids=engine.drafter_cfg.target_layer_ids,
        )
        guessing = TorchEngine(engine.target, Drafter(cfg).eval(), max_context=200)
        outs = [generate(guessing, p, settings, max_new_tokens=40) for p in ps]
        assert [o.tokens for o in outs] == refs and sum(o.stats.suffix_tokens for o in outs) > 0


class CountingEngine(TorchEngine):
    """Records the anchor position (and token) of every row the drafter drafts for."""

    def draft(self, rows, anchors, positions, block_size):
        self.drafted_at += list(positions)
        self.anchors = getattr(self, "anchors", []) + list(anchors)
        return super().draft(rows, anchors, positions, block_size)


def brute_match_length(tokens, min_match=2, max_match=6) -> int:
    t = len(tokens) - 1
    return next(
        (
            n
            for n in range(min(max_match, t + 1), min_match - 1, -1)
            if any(tokens[e - n + 1 : e + 1] == tokens[t - n + 1 :] for e in range(n - 1, t))
        ),
        0,
    )


@pytest.mark.parametrize("suffix_first", [2, 4])
def test_the_chain_policy_copies_after_a_long_match_and_drafts_otherwise(tiny_targets, suffix_first):
    """Round by round (replayed from the committed tokens with the rule stated plainly): the drafter
    runs exactly in the rounds whose text's longest earlier match is shorter than suffix_first; the
    others verify the copy alone (as many nodes as the chain would have), and the output is ar's."""
    target = lively(load_target_dir(tiny_targets["llama"]))
    engine = CountingEngine(target, random_drafter(target), max_context=200)
    settings = DecodingSettings("dflash", block_size=5, suffix_first=suffix_first)
    copied = drafted = 0
    for seed in range(3):
        prompt = repeating_prompt(seed) + [7, 8]  # ends inside its repeated line: a match of 5
        prompt[-2:] = prompt[3:5]
        engine.drafted_at = []
        ref = generate(engine, prompt, max_new_tokens=40).tokens
        result = generate(engine, prompt, settings, max_new_tokens=40)
        assert result.tokens == ref
        text, expected_drafts = prompt + ref[:1], []
        for accepted, nodes in zip(result.stats.accepted_per_round, result.stats.nodes_per_round):
            depth = min(4, 40 - (len(text) - len(prompt)) - 1)  # what the round may draft
            if depth and brute_match_length(text) < suffix_first:
                expected_drafts.append(len(text) - 1)
                drafted += 1
            elif depth:
                assert nodes == depth  # the copy fills the chain's depth
                copied += 1
            text = prompt + ref[: len(text) - len(prompt) + accepted + 1]
        assert engine.drafted_at == expected_drafts
    assert copied >= 3 and drafted >= 3  # both kinds of round happened


def brute_copy(tokens, length, min_match=2, max_match=6) -> list[int]:
    """What followed the latest earlier occurrence of the text's longest repeated suffix, `length`
    tokens (a run into the suffix itself repeats its period)."""
    t, n = len(tokens) - 1, brute_match_length(tokens, min_match, max_match)
    end = max(e for e in range(n - 1, t) if tokens[e - n + 1 : e + 1] == tokens[t - n + 1 :])
    return [tokens[end + 1 + i % (t - end)] for i in range(length)]


def test_the_chain_policy_then_draft_extends_the_copy_from_its_end(tiny_targets):
    """The second variant, replayed round by round: after a long enough match the drafter drafts
    one block anchored at the copy's last token, at the position after the copy, and the round
    verifies copy + drafts as one chain; other rounds draft as plain dflash; the output is ar's."""
    target = lively(load_target_dir(tiny_targets["llama"]))
    engine = CountingEngine(target, random_drafter(target), max_context=200)
    settings = DecodingSettings("dflash", block_size=5, suffix_first=2, suffix_then_draft=True)
    extended = plain = 0
    for seed in range(3):
        prompt = repeating_prompt(seed) + [7, 8]
        prompt[-2:] = prompt[3:5]
        ref = generate(engine, prompt, max_new_tokens=40).tokens
        engine.drafted_at, engine.anchors = [], []
        result = generate(engine, prompt, settings, max_new_tokens=40)
        assert result.tokens == ref
        text, expected = prompt + ref[:1], []
        for accepted, nodes in zip(result.stats.accepted_per_round, result.stats.nodes_per_round):
            produced = len(text) - len(prompt)
            depth = min(4, 40 - produced - 1)
            if depth and brute_match_length(text) < 2:
                expected.append((len(text) - 1, text[-1]))
                plain += 1
            elif depth:
                copy = brute_copy(text, depth)
                drafts = min(4, 40 - produced - 1 - depth)
                if drafts:
                    expected.append((len(text) - 1 + depth, copy[-1]))
                assert nodes == depth + drafts  # the copy, then the drafter's chain from its end
                extended += drafts > 0
            text = prompt + ref[: produced + accepted + 1]
        assert list(zip(engine.drafted_at, engine.anchors)) == expected
    assert extended >= 3 and plain >= 3


class OracleEngine(TorchEngine):
    """Drafts whose TRUE continuation is the drafter's second choice at every depth: the chain
    misses it, a tree finds it."""

    truth: dict[int, list[int]]  # position → the plain-decoding token there

    def draft(self, rows, anchors, positions, block_size):
        drafts, logprobs, hidden = super().draft(rows, anchors, positions, block_size)
        drafts, logprobs = drafts.clone(), torch.full_like(logprobs, -6.0)
        for i, p in enumerate(positions):
            for j in range(block_size - 1):
                true = self.truth.get(p + 1 + j, 0)
                drafts[i, j, 1] = true
                drafts[i, j, 0] = (true + 1) % 128
                logprobs[i, j, :2] = torch.tensor([-0.5, -0.9])
        return StageDrafts(drafts, logprobs, hidden)


def test_tree_accepts_what_the_chain_misses_and_a_sibling_leak_breaks_equality(tiny_targets, monkeypatch):
    target = lively(load_target_dir(tiny_targets["llama"]))
    drafter = random_drafter(target)
    prompt = list(range(20, 32))
    ar = generate(TorchEngine(target, drafter, max_context=200), prompt, max_new_tokens=40).tokens
    oracle = OracleEngine(target, drafter, max_context=200)
    oracle.truth = {len(prompt) + i: t for i, t in enumerate(ar)}
    chain = generate(oracle, prompt, DecodingSettings("dflash", block_size=5), max_new_tokens=40)
    tree = generate(oracle, prompt, DecodingSettings("dflash", block_size=5, tree_budget=16), max_new_tokens=40)
    assert chain.tokens == tree.tokens == ar
    assert chain.stats.acceptance_length == 1.0 and tree.stats.acceptance_length >= 3.0  # 16 nodes reach depth 2 or 3

    # mutation: every node also sees its earlier siblings — the output is no longer plain decoding's
    def leaky_masks(trees, width):
        masks = tree_masks(trees, width)
        for b, t in enumerate(trees):
            for i in range(1, len(t)):
                for j in range(1, i):
                    if t.parents[j] == t.parents[i]:
                        masks[b, i, j] = True
        return masks

    monkeypatch.setattr(decoder_module, "tree_masks", leaky_masks)
    assert (
        generate(oracle, prompt, DecodingSettings("dflash", block_size=5, tree_budget=16), max_new_tokens=40).tokens
        != ar
    )


# --------------------------------------------------------------------------------------------------
# at T > 0 the committed tokens are distributed as the target's samples (engine: test_distribution's
# vocabulary-8 target and random drafter)


def repeating(target) -> list[int]:
    """The prompt [a, b, c, a, b] whose target law gives the suffix index's proposal c (the suffix
    "a b" occurred before, followed by c) the most probability: suffix nodes are accepted often."""
    prompts = torch.tensor([[a, b, c, a, b] for a, b, c in itertools.product(range(V), repeat=3)])
    logits = target(prompts, target.new_cache(5, rows=prompts.shape[0]), want_taps=False).logits[:, -1]
    p_c = torch.softmax(logits, -1)[torch.arange(prompts.shape[0]), prompts[:, 2]]
    return prompts[int(p_c.argmax())].tolist()


def tree_counts(engine, prompt, n, params, settings, seed_list):
    counts = torch.zeros(V**n, dtype=torch.float64)
    accepted = nodes = 0
    for seed in seed_list:
        res = generate(
            engine, prompt, settings, max_new_tokens=n, params=params, generator=torch.Generator().manual_seed(seed)
        )
        assert len(res.tokens) == n
        index = 0
        for t in res.tokens:
            index = index * V + t
        counts[index] += 1
        accepted += sum(res.stats.accepted_per_round)
        nodes = max(nodes, max(res.stats.nodes_per_round))
    return counts, accepted, nodes


CASES = {
    "tree dflash": (DecodingSettings("dflash", block_size=4, tree_budget=6), T1, 3),
    "tree dflash top-k top-p": (
        DecodingSettings("dflash", block_size=4, tree_budget=6),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
        3,
    ),
    "tree dloop + suffix": (
        DecodingSettings("dloop", block_size=3, max_stages=2, gate_threshold=-1e9, tree_budget=6, suffix=True),
        T1,
        4,
    ),
    "suffix": (DecodingSettings("suffix", block_size=4), T1, 3),
    "chain policy": (DecodingSettings("dflash", block_size=4, suffix_first=2), T1, 4),
    "chain policy, then the drafter": (
        DecodingSettings("dflash", block_size=4, suffix_first=2, suffix_then_draft=True),
        T1,
        4,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tree_sampling_matches_target_distribution(engine, name):  # noqa: F811
    settings, params, n = CASES[name]
    prompt = repeating(engine.target) if settings.uses_suffix else [1, 5, 3]
    exact = exact_distribution(engine.target, prompt, n, params)
    counts, accepted, nodes = tree_counts(engine, prompt, n, params, settings, seeds(20 + len(name)))
    assert accepted > 0.2 * RUNS  # drafts were accepted often enough for the test to see them
    if settings.tree_budget:
        assert nodes > settings.max_drafts  # the trees branched
    assert gof_pvalue(counts, exact, min_cells=15) > P_PASS


def test_tree_negative_control_following_the_drafter_is_rejected(engine, monkeypatch):  # noqa: F811
    """Power: a walk that takes the drafter's first child whenever p allows it, without drawing
    from p, is rejected by the same test."""

    def wrong_accept(tree, logits, params, generator):
        p, node, path = probabilities(logits, params), 0, [0]
        while True:
            child = next((c for c in range(len(tree)) if tree.parents[c] == node), None)
            if child is None or float(p[node, tree.tokens[child]]) == 0.0:
                return path, int(torch.multinomial(p[node], 1, generator=generator))
            path.append(child)
            node = child

    monkeypatch.setattr(decoder_module, "tree_accept", wrong_accept)
    settings = DecodingSettings("dflash", block_size=4, tree_budget=6)
    exact = exact_distribution(engine.target, [1, 5, 3], 3, T1)
    counts, _, _ = tree_counts(engine, [1, 5, 3], 3, T1, settings, seeds(31, RUNS // 2))
    assert gof_pvalue(counts, exact) < P_FAIL
