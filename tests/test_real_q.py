"""Speculative sampling with the drafter's real q (DecodingSettings.draft_sampling "drafter").

The acceptance rule against exact probabilities enumerated by hand; the committed tokens at T = 1
against the target's exact autoregressive law (chi-square, the tiny target of test_distribution.py)
for a DSpark drafter with a Markov head and a plain DFlash drafter — and a wrong q (the Markov bias
left out of q while the drafts come from the corrected logits) rejected by the same test; a row's
tokens independent of its batch; greedy output equal to `ar`'s; bad combinations refused.
"""

import re
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

from loopspec.decoding import SamplingParams, probabilities, sample, speculative_accept
from loopspec.errors import LoopspecError
from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.runtime.decoder import Decoder, decode_all, generate
from loopspec.engines.torch_engine import TorchEngine
from loopspec.settings import DecodingSettings, resolve_settings
from loopspec.weights import load_target_dir

from conftest import accepted_drafts, agreeing_drafter, lively
from test_distribution import (
    MASK,
    P_FAIL,
    P_PASS,
    PROMPT,
    RUNS,
    T1,
    V,
    distribution_target,
    exact_distribution,
    gof_pvalue,
    seeds,
)
from test_dspark import dspark_config, liven_heads


# --------------------------------------------------------------------------------------------------
# the acceptance rule alone


def test_acceptance_rule_matches_the_exact_law():
    """Two drafts over a vocabulary of 3, drawn here from q; speculative_accept's (accepted, bonus)
    against the law written out from the rule: P(accept x) = min(1, p(x)/q(x)), the bonus from
    normalize(max(0, p - q)) at the first rejection, from p after both. The first committed token
    is then p0's, the second p1's given it (the target rows are fixed here, whatever the prefix)."""
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.25, 0.25, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.2, 0.7, 0.1], [0.4, 0.4, 0.2]], dtype=torch.float64)
    logits = p.log().float()  # T = 1: probabilities(logits) gives p back
    g = torch.Generator().manual_seed(7)
    n = 20000
    counts: dict[tuple, int] = {}
    for _ in range(n):
        x = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        accepted, bonus = speculative_accept(x, q.float(), logits, T1, g)
        key = (*x, accepted, bonus)
        counts[key] = counts.get(key, 0) + 1

    def residual(i):
        r = (p[i] - q[i]).clamp_min(0)
        return r / r.sum()

    exact: dict[tuple, float] = {}
    for x0 in range(3):
        for x1 in range(3):
            a0 = min(1.0, float(p[0, x0] / q[0, x0]))
            a1 = min(1.0, float(p[1, x1] / q[1, x1]))
            draw = float(q[0, x0] * q[1, x1])
            for b in range(3):
                exact[(x0, x1, 0, b)] = draw * (1 - a0) * float(residual(0)[b])
                exact[(x0, x1, 1, b)] = draw * a0 * (1 - a1) * float(residual(1)[b])
                exact[(x0, x1, 2, b)] = draw * a0 * a1 * float(p[2, b])
    keys = [k for k, v in exact.items() if v > 0]
    assert set(counts) <= set(keys)  # nothing outside the rule's support
    assert chisquare([counts.get(k, 0) for k in keys], [exact[k] * n for k in keys]).pvalue > P_PASS
    # the committed tokens' law: the first is p0's, the second p1's
    first = torch.zeros(3)
    for (x0, x1, accepted, bonus), c in counts.items():
        first[x0 if accepted else bonus] += c
    assert chisquare(first.tolist(), (p[0] * n).tolist()).pvalue > P_PASS
    # and the acceptance rate of the first position is 1 - TV(p0, q0)
    rate = sum(c for k, c in counts.items() if k[2] >= 1) / n
    assert abs(rate - float(torch.minimum(p[0], q[0]).sum())) < 0.015


# --------------------------------------------------------------------------------------------------
# at T = 1 the committed tokens are the target's


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield distribution_target(tmp_path_factory.mktemp("real_q_target"))
    torch.set_num_threads(threads)


def markov_drafter(target) -> Drafter:
    """A DSpark drafter of DeepSpec's block convention with a live vanilla Markov head (its bias moves
    q well away from the uncorrected softmax) and a confidence head."""
    torch.manual_seed(2)
    cfg = replace(
        DrafterConfig.for_target(target.cfg, num_layers=1, block_size=3, mask_token_id=MASK),
        anchor_predicts=True,
        markov_rank=2,
        confidence_head=True,
        confidence_with_markov=True,
    )
    return liven_heads(Drafter(cfg), seed=3).eval()


def plain_drafter(target) -> Drafter:
    torch.manual_seed(1)
    return Drafter(DrafterConfig.for_target(target.cfg, num_layers=1, block_size=3, mask_token_id=MASK)).eval()


def committed_counts(engine, n: int, settings: DecodingSettings, run_seeds) -> tuple[torch.Tensor, list]:
    counts = torch.zeros(V**n, dtype=torch.float64)
    first_rounds = []
    for seed in run_seeds:
        res = generate(
            engine, PROMPT, settings, max_new_tokens=n, params=T1, generator=torch.Generator().manual_seed(seed)
        )
        assert len(res.tokens) == n
        index = 0
        for t in res.tokens:
            index = index * V + t
        counts[index] += 1
        first_rounds.append(res.stats.accepted_per_round[0])
    return counts, first_rounds


REAL_Q = DecodingSettings("dflash", block_size=3, draft_sampling="drafter")
N = 4  # the prefill's token, then a first round verifying a chain of two sampled drafts, then a bonus


@pytest.mark.parametrize("kind", ["dspark-markov", "dflash"])
def test_real_q_matches_the_target_distribution(kind, target):
    drafter = markov_drafter(target) if kind == "dspark-markov" else plain_drafter(target)
    engine = TorchEngine(target, drafter, max_context=16)
    counts, first = committed_counts(engine, N, REAL_Q, seeds(21 + (kind == "dflash")))
    hist = torch.bincount(torch.tensor(first), minlength=3)
    assert hist.shape[0] == 3 and int(hist.min()) > 0.1 * RUNS, hist  # no draft, one, both accepted: all frequent
    assert gof_pvalue(counts, exact_distribution(target, PROMPT, N, T1), min_cells=60) > P_PASS


def test_negative_control_q_without_the_markov_bias_is_rejected(target, monkeypatch):
    """Drafts drawn from the Markov-corrected q, accepted against the uncorrected softmax: the rule's
    ratio is wrong wherever the bias moved q, and the chi-square test must see it."""
    engine = TorchEngine(target, markov_drafter(target), max_context=16)
    real_draft = engine.draft

    def draft_with_uncorrected_q(rows, anchors, positions, block_size, sampling=None):
        stage = real_draft(rows, anchors, positions, block_size, sampling=sampling)
        hidden = stage[2]
        with torch.inference_mode():
            stage.q = torch.softmax(
                engine.context.draft_head(hidden[:, engine.drafter_cfg.first_draft :]).float(), -1
            ).cpu()
        return stage

    monkeypatch.setattr(engine, "draft", draft_with_uncorrected_q)
    counts, _ = committed_counts(engine, N, REAL_Q, seeds(23, RUNS))
    assert gof_pvalue(counts, exact_distribution(target, PROMPT, N, T1), min_cells=60) < P_FAIL


def bonus_from_p(drafts, q, target_logits, params, generator):
    """The mutant rule: at the first rejection the bonus is drawn from p, not from normalize(max(0, p - q))."""
    accepted, bonus = speculative_accept(drafts, q, target_logits, params, generator)
    if accepted < len(drafts):
        bonus = int(sample(probabilities(target_logits[accepted : accepted + 1], params)[0], generator))
    return accepted, bonus


def q_ignored(drafts, q, target_logits, params, generator):
    """The mutant rule: a draft accepted with probability p(x), as if q were 1 everywhere (the residual
    then empty: the bonus from p). Its law is p·(q + 1 - Σ q·p): wrong where q is far from uniform."""
    return speculative_accept(drafts, torch.ones_like(q), target_logits, params, generator)


@pytest.mark.parametrize("mutant", [bonus_from_p, q_ignored])
def test_a_wrong_real_q_rule_is_rejected(mutant, target, monkeypatch):
    """Mutation check of the chi-square test above: the decoder's real-q rule replaced by a wrong one
    (the residual's bonus drawn from p; q ignored) commits tokens the test rejects."""
    from loopspec.runtime import decoder

    monkeypatch.setattr(decoder, "speculative_accept", mutant)
    engine = TorchEngine(target, markov_drafter(target), max_context=16)  # its q is far from uniform
    counts, _ = committed_counts(engine, N, REAL_Q, seeds(21))
    assert gof_pvalue(counts, exact_distribution(target, PROMPT, N, T1), min_cells=60) < P_FAIL


# --------------------------------------------------------------------------------------------------
# batches, greedy, refusals


def prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 120, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


BATCH_PROMPTS, GREEDY_PROMPTS = prompts(4, seed=3), prompts(3, seed=5)


@pytest.fixture(scope="module")
def lively_engines(tiny_targets):
    """A lively tiny target with a DSpark drafter (an RNN Markov head) and a plain DFlash drafter, both
    trained to draft what the target continues the tests' prompts with (their drafts are accepted).
    Both have two layers: the engines share the target, whose taps the last engine made sets."""
    target = lively(load_target_dir(tiny_targets["qwen3"]))
    taught = BATCH_PROMPTS + GREEDY_PROMPTS
    plain_cfg = DrafterConfig.for_target(target.cfg, num_layers=2, block_size=5, mask_token_id=127)
    dspark = agreeing_drafter(target, taught, dspark_config(target.cfg, head_type="rnn"))
    plain = agreeing_drafter(target, taught, plain_cfg)
    return {
        "dspark": TorchEngine(target, dspark, max_context=160),
        "dflash": TorchEngine(target, plain, max_context=160),
    }


BATCH_SETTINGS = {
    "dspark": DecodingSettings("dflash", block_size=5, draft_sampling="drafter"),
    "dflash": DecodingSettings("dloop", block_size=5, max_stages=2, gate_threshold=-1e9, draft_sampling="drafter"),
}


@pytest.mark.parametrize("kind", list(BATCH_SETTINGS))
def test_a_row_commits_what_it_commits_alone(kind, lively_engines):
    """Rows of different lengths and sampling parameters (a greedy one among them) in one batch:
    each commits, seeded, exactly what the same request commits alone."""
    engine, settings = lively_engines[kind], BATCH_SETTINGS[kind]
    ps = BATCH_PROMPTS
    params = [
        T1,
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(),
        SamplingParams(temperature=1.3, top_k=20),
    ]
    alone = [
        generate(engine, p, settings, max_new_tokens=30, params=q, seed=s)
        for p, q, s in zip(ps, params, (11, 12, 13, 14))
    ]
    decoder = Decoder(engine.with_rows(4), settings)
    done = decode_all(
        decoder,
        [
            dict(key=i, prompt_ids=p, max_new_tokens=30, params=q, seed=s)
            for i, (p, q, s) in enumerate(zip(ps, params, (11, 12, 13, 14)))
        ],
    )
    assert [done[i].tokens for i in range(4)] == [r.tokens for r in alone]
    assert sum(sum(r.stats.accepted_per_round) for r in alone) > 0  # drafts were accepted
    # the greedy row is plain decoding's
    assert alone[2].tokens == generate(engine, ps[2], DecodingSettings(), max_new_tokens=30).tokens
    # and the setting changed what the sampled rows drew (the walk reproduces ar's tokens)
    walk = replace(settings, draft_sampling="walk")
    assert any(
        generate(engine, p, walk, max_new_tokens=30, params=q, seed=s).tokens != r.tokens
        for p, q, s, r in zip(ps, params, (11, 12, 13, 14), alone)
        if not q.greedy
    )


# so cold that the target's and the drafter's laws are one-hot at their argmax (a logit 1e-3 below the
# top one has probability e^-100): the real-q rule then commits plain decoding's tokens
NEAR_GREEDY = SamplingParams(temperature=1e-5)


@pytest.mark.parametrize("kind", list(BATCH_SETTINGS))
def test_near_greedy_real_q_commits_what_ar_commits(kind, lively_engines, monkeypatch):
    """Sampled (not greedy) rows are accepted by the real-q rule, speculative sampling against the
    drafter's q: at a temperature near 0 both laws are one-hot, a draft is accepted exactly where it
    is the target's argmax and the residual's bonus is the target's argmax — plain decoding's text,
    with most of it accepted drafts."""
    from loopspec.runtime import decoder

    engine, settings = lively_engines[kind], BATCH_SETTINGS[kind]
    rounds_by_real_q = []
    real_rule = decoder.speculative_accept
    monkeypatch.setattr(
        decoder, "speculative_accept", lambda *args: rounds_by_real_q.append(1) or real_rule(*args)
    )  # a spy: counts, changes nothing
    results = []
    for p in GREEDY_PROMPTS:
        ref = generate(engine, p, DecodingSettings(), max_new_tokens=40).tokens
        results.append(generate(engine, p, settings, max_new_tokens=40, params=NEAR_GREEDY, seed=1))
        assert results[-1].tokens == ref
    drafting_rounds = sum(nodes > 0 for r in results for nodes in r.stats.nodes_per_round)
    assert len(rounds_by_real_q) == drafting_rounds > 0  # every round that verified drafts, by the real-q rule
    assert accepted_drafts(results) >= 50, accepted_drafts(results)


def test_bad_combinations_are_refused(lively_engines):
    for kw, needle in (
        (dict(tree_budget=4), "chain only"),
        (dict(suffix=True), "chain only"),
        (dict(suffix_first=3), "chain only"),
    ):
        with pytest.raises(LoopspecError, match=needle):
            DecodingSettings("dflash", block_size=4, draft_sampling="drafter", **kw)
    with pytest.raises(LoopspecError, match="has no drafter"):
        DecodingSettings("suffix", block_size=4, draft_sampling="drafter")
    with pytest.raises(LoopspecError, match="unknown draft sampling"):
        DecodingSettings("dflash", block_size=4, draft_sampling="argmax")
    # a tree stored with the drafter is not taken; one given is refused
    cfg = replace(lively_engines["dflash"].drafter_cfg, extra={"dloop": {"tree_budget": 8, "suffix": True}})
    assert resolve_settings("dflash", cfg).tree_budget == 8
    chain = resolve_settings("dflash", cfg, draft_sampling="drafter")
    assert (chain.tree_budget, chain.suffix, chain.draft_sampling) == (0, False, "drafter")
    with pytest.raises(LoopspecError, match="chain only"):
        resolve_settings("dflash", cfg, draft_sampling="drafter", tree_budget=4)

    class TopCandidatesOnly(TorchEngine):  # as the exported drafter graphs: no q to return
        backend, samples_drafts = "onnxruntime", False

    engine = lively_engines["dflash"]
    other = TopCandidatesOnly(engine.target, engine.drafter, max_context=32)
    with pytest.raises(LoopspecError, match="onnxruntime engine's drafter does not return"):
        Decoder(other, BATCH_SETTINGS["dspark"])


@pytest.fixture(scope="module")
def agreeing_pair(tiny_pair, tmp_path_factory):
    """tiny_pair's target with a drafter trained to draft its continuation of the CLI test's prompt."""
    from loopspec.prompts import prompt_ids
    from loopspec.weights import load_tokenizer

    target_dir, _ = tiny_pair
    target = load_target_dir(target_dir)
    ids = prompt_ids(load_tokenizer(target_dir), CLI_PROMPT)
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=6, mask_token_id=127)
    out = tmp_path_factory.mktemp("agreeing") / "drafter"
    agreeing_drafter(target, [ids], cfg, new_tokens=16).save(out, dtype=torch.float32)
    return target_dir, out


CLI_PROMPT = "hello world"


def test_cli_flag(capsys, agreeing_pair, monkeypatch):
    """`--draft-sampling drafter` from the command line: at a temperature near 0 the real-q rule
    commits plain decoding's text, most of it accepted drafts (τ over its verifications)."""
    from loopspec.cli import main
    from loopspec.runtime import decoder

    target, drafter = agreeing_pair
    rounds_by_real_q, real_rule = [], decoder.speculative_accept
    monkeypatch.setattr(
        decoder, "speculative_accept", lambda *args: rounds_by_real_q.append(1) or real_rule(*args)
    )  # a spy: counts, changes nothing
    base = [
        "generate",
        "--prompt",
        CLI_PROMPT,
        "--target",
        str(target),
        "--drafter",
        str(drafter),
        "--backend",
        "torch",
        "--max-new-tokens",
        "12",
        "--tree-budget",
        "0",
        "--no-suffix",
    ]
    texts, taus = [], []
    for extra in (
        ["--method", "ar"],
        ["--method", "dflash", "--draft-sampling", "drafter", "--temperature", str(NEAR_GREEDY.temperature)],
    ):
        assert main(base + extra) == 0
        captured = capsys.readouterr()
        texts.append(captured.out)
        taus.append(re.search(r"\| tau (\S+) over", captured.err).group(1))
    assert texts[0].split("\n")[0] == texts[1].split("\n")[0]  # plain decoding's text
    assert float(taus[0]) == 1.0 and float(taus[1]) >= 3.0, taus  # drafts accepted (a block drafts 5)
    assert rounds_by_real_q  # by the real-q rule
    for extra, needle in (
        (["--tree-budget", "4", "--temperature", "0.8"], "chain only"),
        ([], "temperature > 0"),
    ):  # greedy: it cannot apply
        assert main(base[:-3] + ["--method", "dflash", "--draft-sampling", "drafter", *extra]) == 2
        line = capsys.readouterr().err.strip()
        assert line.startswith("loopspec: error: ") and needle in line and "\n" not in line
