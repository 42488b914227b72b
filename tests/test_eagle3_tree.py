"""EAGLE-3's own dynamic draft tree (EAGLE-2's; --tree-kind dynamic): every node the engine grows is
drafted under its own path — its cumulative log-prob and its children equal an fp64 reference chain
forced along that path (a node conditioned on a sibling's path fails it); rows grow batched what they
grow alone; with a drafter trained here, greedy decoding commits plain decoding's tokens batched and
alone, and the tree accepts at least as many drafts per verification as the chain; at T = 1 the
committed tokens follow the target's exact law (a wrong tree acceptance fails the same test); and a
drafter that drafts its block in one forward is refused in one line."""

import pytest
import torch

from conftest import accepted_drafts, batched_greedy_equals_plain, lively
from test_distribution import (
    P_FAIL,
    P_PASS,
    PROMPT as LAW_PROMPT,
    RUNS,
    V as LAW_V,
    exact_distribution,
    gof_pvalue,
    seeds,
)
from test_eagle3 import (  # noqa: F401 (target_dir: a fixture)
    ANCHOR,
    BLOCK,
    PROMPT,
    PROMPTS,
    agreeing_eagle3,
    eagle3_checkpoint,
    fp64_pair,
    hf_hidden_states,
    reference_chain,
    target_dir,
)
from test_real_q import committed_counts
import loopspec.runtime.decoder as decoder_module
from loopspec.cli import main
from loopspec.decoding import SamplingParams, probabilities, sample
from loopspec.engines.torch_engine import TorchEngine
from loopspec.errors import LoopspecError
from loopspec.model.eagle3 import fresh_eagle3
from loopspec.runtime.decoder import generate
from loopspec.runtime.proposal import check_engine_runs
from loopspec.settings import DecodingSettings as Method
from loopspec.tree import DynamicTree
from loopspec.weights import load_target_dir

TOP_K, DEPTH = 3, BLOCK - 1
DYNAMIC = Method("dflash", block_size=BLOCK, tree_budget=10, tree_kind="dynamic", tree_top_k=TOP_K)
# accepted drafts the identity tests require of the drafter trained here (an untrained one: ~1)
FLOOR_GREEDY = 100


def grown(engine, prompt=PROMPT, anchor=ANCHOR, top_k=TOP_K, depth=DEPTH) -> DynamicTree:
    engine.prefill(0, prompt, want_taps=True)
    return engine.draft_dynamic([0], [anchor], [len(prompt)], top_k, depth)[0]


def largest_difference_from_reference(tree: DynamicTree, sd, target_dir, top_k=TOP_K) -> float:
    """Each node against the fp64 reference chain forced along the node's own path: its cumulative
    log-prob (the sum of each step's log-softmax at the path's tokens) and, where it was expanded, its
    children (the reference's next step's top-K) → the largest log-prob difference (inf when the
    children differ)."""
    hidden_states, embed, _ = hf_hidden_states(target_dir, PROMPT)
    draft_to_target = (torch.arange(sd["d2t"].numel()) + sd["d2t"]).tolist()
    row_of = {t: i for i, t in enumerate(draft_to_target)}
    worst = 0.0
    for node in range(1, len(tree)):
        path = [tree.tokens[n] for n in tree.ancestors(node) + [node]]
        _, logits, _, _ = reference_chain(
            sd, hidden_states, embed, PROMPT, ANCHOR, len(path) + 1, [2, 4, 5], forced=path
        )
        logprobs = torch.log_softmax(logits, -1)  # [len(path) + 1, Vd]: step i+1 predicts depth i+1
        want = sum(float(logprobs[i, row_of[t]]) for i, t in enumerate(path))
        worst = max(worst, abs(want - tree.scores[node]))
        children = [tree.tokens[c] for c in range(len(tree)) if tree.parents[c] == node]
        if children and children != [draft_to_target[i] for i in logprobs[len(path)].topk(top_k).indices.tolist()]:
            return float("inf")
    return worst


def test_each_node_is_drafted_under_its_own_path(target_dir, tmp_path):
    directory, sd = eagle3_checkpoint(tmp_path / "eagle3")
    target, drafter = fp64_pair(target_dir, directory)
    tree = grown(TorchEngine(target, drafter, max_context=64))
    # depth 1: top-K of the anchor; each later depth: the top-K nodes of the one before, K children each
    assert [tree.depths.count(d) for d in range(1, DEPTH + 1)] == [TOP_K] + [TOP_K * TOP_K] * (DEPTH - 1)
    assert largest_difference_from_reference(tree, sd, target_dir) <= 1e-9
    # the kept tree: the best nodes by cumulative log-prob, every parent among them
    kept = tree.best(7)
    assert kept.drafts == 7 and all(kept.parents[n] < n for n in range(1, 8))
    best = sorted(tree.scores[1:], reverse=True)[:7]
    assert sorted(best) == sorted(tree.scores[n] for n in _matched(tree, kept))


def _matched(tree: DynamicTree, kept) -> list[int]:
    """The grown tree's node of each kept node (by path)."""
    out, of = [], {0: 0}
    for n in range(1, len(kept)):
        parent = of[kept.parents[n]]
        of[n] = next(c for c in range(len(tree)) if tree.parents[c] == parent and tree.tokens[c] == kept.tokens[n])
        out.append(of[n])
    return out


def test_a_node_conditioned_on_a_siblings_path_fails_the_reference(target_dir, tmp_path, monkeypatch):
    """The comparison above can fail: a node that attends to another path's ancestors (the first node
    of its depth under another parent) instead of its own moves off the reference."""
    directory, sd = eagle3_checkpoint(tmp_path / "eagle3")
    target, drafter = fp64_pair(target_dir, directory)
    real = DynamicTree.ancestors

    def siblings_ancestors(self, node):
        other = [
            n for n in range(len(self)) if self.depths[n] == self.depths[node] and self.parents[n] != self.parents[node]
        ]
        return real(self, other[0] if other else node)

    monkeypatch.setattr(DynamicTree, "ancestors", siblings_ancestors)
    tree = grown(TorchEngine(target, drafter, max_context=64))
    monkeypatch.setattr(DynamicTree, "ancestors", real)
    assert largest_difference_from_reference(tree, sd, target_dir) > 1e-3


def test_rows_grow_batched_what_they_grow_alone(target_dir, tmp_path):
    directory, _ = eagle3_checkpoint(tmp_path / "eagle3")
    target, drafter = fp64_pair(target_dir, directory)
    prompts, anchors = [PROMPT, [7, 8, 9], PROMPT[:6] + [3, 3]], [64, 11, 90]
    alone = []
    for p, a in zip(prompts, anchors):
        alone.append(grown(TorchEngine(target, drafter, max_context=64), p, a))
    engine = TorchEngine(target, drafter, max_context=64, max_rows=3)
    for b, p in enumerate(prompts):
        engine.prefill(b, p, want_taps=True)
    order = (2, 0, 1)
    batched = engine.draft_dynamic(
        list(order), [anchors[b] for b in order], [len(prompts[b]) for b in order], TOP_K, DEPTH
    )
    for tree, b in zip(batched, order):
        assert tree.tokens == alone[b].tokens and tree.parents == alone[b].parents
        assert max(abs(x - y) for x, y in zip(tree.scores, alone[b].scores)) <= 1e-12
    # the context keeps its length; a stage after the tree drafts what it drafts on a fresh row
    assert engine.context_lengths([0, 1, 2]) == [len(p) for p in prompts]
    fresh = TorchEngine(target, drafter, max_context=64)
    fresh.prefill(0, prompts[1], want_taps=True)
    again, once = engine.draft([1], [anchors[1]], [3], BLOCK), fresh.draft([0], [anchors[1]], [3], BLOCK)
    assert torch.equal(again[0], once[0]) and torch.allclose(again[1], once[1], atol=1e-12)


# --------------------------------------------------------------------------------------------------
# decoding with a drafter that agrees with the target


@pytest.fixture(scope="module")
def engine(target_dir):
    """The lively target with an EAGLE-3 drafter trained briefly on its greedy continuations of
    PROMPTS: good, not perfect, so that the tree's other branches have something to win."""
    target = lively(load_target_dir(target_dir))
    return TorchEngine(target, agreeing_eagle3(target, PROMPTS, steps=60), max_context=128)


@pytest.mark.parametrize(
    "settings",
    [
        DYNAMIC,
        Method("dflash", block_size=BLOCK, tree_budget=6, tree_kind="dynamic", tree_top_k=2, tree_depth=3),
        Method("dflash", block_size=BLOCK, tree_budget=10, tree_kind="dynamic", tree_top_k=TOP_K, suffix=True),
    ],
    ids=["top3", "top2-depth3", "top3+suffix"],
)
def test_greedy_dynamic_tree_commits_plain_decodings_tokens(settings, engine, plain):
    accepted = 0
    for p, ar in zip(PROMPTS, plain):
        spec = generate(engine, p, settings, max_new_tokens=40)
        assert spec.tokens == ar
        assert max(spec.stats.nodes_per_round) <= settings.tree_budget + (settings.max_drafts if settings.suffix else 0)
        accepted += accepted_drafts([spec])
    assert accepted >= FLOOR_GREEDY, accepted


def test_batched_rows_commit_what_each_commits_alone(engine):
    assert batched_greedy_equals_plain(engine, PROMPTS, DYNAMIC) >= FLOOR_GREEDY


@pytest.fixture(scope="module")
def plain(engine) -> list[list[int]]:
    """What plain decoding commits for each of PROMPTS (40 tokens, greedy)."""
    return [generate(engine, p, Method(), max_new_tokens=40).tokens for p in PROMPTS]


def tokens_per_verification(engine, settings) -> float:
    results = [generate(engine, p, settings, max_new_tokens=40) for p in PROMPTS]
    rounds = sum(len(r.stats.accepted_per_round) for r in results)
    return accepted_drafts(results) / rounds


def test_the_tree_accepts_at_least_what_the_chain_does(engine):
    chain = tokens_per_verification(engine, Method("dflash", block_size=BLOCK))
    tree = tokens_per_verification(engine, DYNAMIC)
    assert tree >= chain, (tree, chain)


# --------------------------------------------------------------------------------------------------
# T = 1: the target's exact law


@pytest.fixture(scope="module")
def law_engine(tmp_path_factory):
    """A vocabulary-8 Llama target of 4 layers (as test_distribution's, deeper: EAGLE-3 fuses three
    taps) with a random EAGLE-3 drafter whose distributions are far from the target's."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=LAW_V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.normal_(0.0, 0.35)
    directory = tmp_path_factory.mktemp("eagle3_law")
    model.save_pretrained(str(directory))
    target = load_target_dir(directory)
    torch.manual_seed(2)
    drafter = fresh_eagle3(target.cfg, block_size=3, target_layer_ids=[0, 1, 2])
    with torch.no_grad():
        drafter.lm_head.weight.normal_(0.0, 1.0)  # confident, varied drafts
    yield TorchEngine(target, drafter.eval(), max_context=16)
    torch.set_num_threads(threads)


LAW_SETTINGS = Method("dflash", block_size=3, tree_budget=5, tree_kind="dynamic", tree_top_k=3)
N = 4  # the prefill's token, a first round verifying a tree of depth 2, then a bonus
T1 = SamplingParams(temperature=1.0)


def test_dynamic_tree_commits_the_targets_exact_law(law_engine):
    counts, first = committed_counts(law_engine, N, LAW_SETTINGS, seeds(41))
    hist = torch.bincount(torch.tensor(first), minlength=3)
    assert int(hist[1:].sum()) > 0.2 * RUNS, hist  # drafts are accepted often enough to matter
    assert gof_pvalue(counts, exact_distribution(law_engine.target, LAW_PROMPT, N, T1), min_cells=60) > P_PASS


def walk_without_residual(tree, logits, params, generator):
    """A wrong tree acceptance: try a node's children one by one, accepting each with the target's
    probability of its token, and at the end draw the bonus from p itself (no residual between
    siblings, nor after them)."""
    p, node, path = probabilities(logits, params), 0, [0]
    while True:
        for child in [c for c in range(len(tree)) if tree.parents[c] == node]:
            if float(torch.rand((), generator=generator)) < float(p[node, tree.tokens[child]]):
                break
        else:
            return path, int(sample(p[node], generator))
        path.append(child)
        node = child


def test_a_wrong_tree_acceptance_is_rejected(law_engine, monkeypatch):
    """Power: the same trees walked without the residual between siblings leave the law."""
    monkeypatch.setattr(decoder_module, "tree_accept", walk_without_residual)
    counts, _ = committed_counts(law_engine, N, LAW_SETTINGS, seeds(42, RUNS // 2))
    assert gof_pvalue(counts, exact_distribution(law_engine.target, LAW_PROMPT, N, T1), min_cells=40) < P_FAIL


# --------------------------------------------------------------------------------------------------
# what is refused


def test_a_block_drafter_is_refused_in_one_line(tiny_pair, capsys):
    target_dir_, drafter_dir = tiny_pair
    from loopspec.pair import load_pair

    pair = load_pair(target_dir_, drafter_dir)
    engine = TorchEngine(pair.target, pair.drafter, max_context=64)
    with pytest.raises(LoopspecError, match="--tree-kind dynamic") as e:
        check_engine_runs(engine, Method("dflash", block_size=4, tree_budget=6, tree_kind="dynamic"))
    assert "\n" not in str(e.value) and "best-first" in str(e.value)
    code = main(
        [
            "generate",
            "--prompt",
            "x",
            "--target",
            str(target_dir_),
            "--drafter",
            str(drafter_dir),
            "--backend",
            "torch",
            "--method",
            "dflash",
            "--tree-budget",
            "6",
            "--tree-kind",
            "dynamic",
            "--max-new-tokens",
            "2",
        ]
    )
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "--tree-kind dynamic" in lines[0], lines


@pytest.mark.parametrize(
    "knobs, words",
    [
        (dict(method="dflash", tree_kind="dynamic"), "give --tree-budget N"),
        (dict(method="dflash", tree_budget=4, tree_top_k=2), "add --tree-kind dynamic"),
        (dict(method="dflash", tree_budget=4, tree_kind="dynamic", tree_depth=BLOCK), "raise --block-size"),
        (dict(method="dloop", tree_budget=4, tree_kind="dynamic"), "--tree-kind does not apply to method dloop"),
        (dict(method="dflash", tree_budget=4, tree_kind="wide"), "unknown tree kind"),
    ],
)
def test_bad_dynamic_settings_are_refused_in_one_line(knobs, words):
    with pytest.raises(LoopspecError) as e:
        Method(block_size=BLOCK, **knobs)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_help_names_the_tree_kinds(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--tree-kind" in text and "dynamic" in text and "--tree-top-k" in text and "--tree-depth" in text
