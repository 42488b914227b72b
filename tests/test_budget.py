"""The verification budget (runtime/budget.py) and the step-cost table it reads (runtime/step_costs.py)."""

import json

import pytest
import torch

from loopspec.errors import LoopspecError
from loopspec.model.dflash import DrafterConfig
from loopspec.runtime.budget import VerifyBudget, best_step, best_width, pacing
from loopspec.runtime.decoder import Decoder, decode_all, generate
from loopspec.runtime.proposal import AdaptiveFallback
from loopspec.runtime.step_costs import StepCosts, measure_step_costs
from loopspec.engines.torch_engine import TorchEngine
from loopspec.settings import DecodingSettings as Method
from loopspec.tree import DraftTree
from loopspec.weights import load_target_dir

from conftest import accepted_drafts, agreeing_drafter, lively

MS = 1e-3


def table(verify_ms, draft_ms=(), rows=(1, 2), widths=(1, 2, 3, 4)):
    return StepCosts(
        engine="torch fp32",
        context=64,
        rows=rows,
        widths=widths,
        verify_s=tuple(tuple(t * MS for t in r) for r in verify_ms),
        draft_s=tuple(t * MS for t in draft_ms),
    )


HAND = table([(10, 11, 12, 20), (12, 13, 14, 24)], (3, 4))


def chain_gains(a, most):
    return [sum(a**i for i in range(1, d + 1)) for d in range(most + 1)]


def test_best_step_matches_the_hand_computed_optimum():
    # one row, acceptance 0.8, up to 3 drafts, one stage drafts 3: tokens per ms at width 1..4 are
    # 1/10 = .100, 1.8/(11+3) = .129, 2.44/(12+3) = .163, 2.952/(20+3) = .128 → width 3, depth 2
    assert best_step([chain_gains(0.8, 3)], [True], HAND, stage_drafts=3) == (3, [2])
    # acceptance 0.2: 1.2/14 = .086 and 1.24/15 = .083 < 1/10 → the plain step
    assert best_step([chain_gains(0.2, 3)], [True], HAND, stage_drafts=3) == (1, [0])
    # two rows (0.8 and 0.1): plain 2/12 = .167; width 3 with the first drafting alone 3.44/(14+3) = .202,
    # both 3.55/(14+4) = .197; width 2 alone 2.8/16 = .175; width 4 alone 3.952/27 = .146 → [2, 0]
    assert best_step([chain_gains(0.8, 3), chain_gains(0.1, 3)], [True, True], HAND, stage_drafts=3) == (3, [2, 0])
    # a copy of the text drafts nothing: the same row at acceptance 0.2 now pays, at width 2
    # (1.2/11 = .109 beats 1.24/12 = .103, 1.248/20 = .062 and 1/10)
    assert best_step([chain_gains(0.2, 3)], [False], HAND, stage_drafts=3) == (2, [1])
    # a row with room for one draft only stays at its depth however wide the step
    assert best_step([chain_gains(0.8, 3), chain_gains(0.9, 1)], [True, True], HAND, stage_drafts=3)[1][1] <= 1


def test_a_budget_that_forgets_the_drafter_is_caught():
    """Planted bug: the drafter's time left out of the step's cost. The hand-computed case above
    (acceptance 0.2 → plain) then drafts: the optimum test fails on it."""
    free_drafts = table([(10, 11, 12, 20), (12, 13, 14, 24)], (1e-6, 1e-6))
    assert best_step([chain_gains(0.2, 3)], [True], free_drafts, stage_drafts=3) != (1, [0])


def test_best_width_spends_the_drafter_time_already_spent():
    # two rows' node survivals; the drafter took 3 ms. Width 1: 2/(12+3) = .133; width 2: 3.5/16 = .219;
    # width 3: (2+1.5+1.2)/17 = .276; width 4: (2+1.5+1.2+.2)/27 = .181 → 3
    assert best_width([[0.9, 0.6, 0.1], [0.6, 0.6, 0.1]], HAND, 3 * MS) == 3
    # nothing drafted: 1/10 beats .05 per ms
    assert best_width([[0.05]], HAND, 0.0) == 1


def test_subtree_keeps_the_likeliest_nodes_as_a_tree():
    tree = DraftTree.chain(7, [1, 2, 3])
    tree.add_branch([1, 9], 4)  # node 4: 9 under node 1
    budget = VerifyBudget(HAND, Method("dflash", block_size=4), 3)
    from loopspec.runtime.budget import _keep_likeliest, _survival

    survival = _survival(tree, [1.0, 0.9, 0.3, 0.9, 0.6])  # node 3 (0.243) is less likely than node 4 (0.54)
    kept = _keep_likeliest(tree, survival, 4)
    assert kept.tokens == [7, 1, 2, 9] and kept.parents == [-1, 0, 1, 1]
    assert budget.p("anchor", 0.0) == 1.0


def step_costs_file(tmp_path, **changes):
    data = json.loads(HAND.to_json()) | changes
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(data))
    return path


def test_bad_step_cost_tables_are_refused_in_one_line(tmp_path):
    assert StepCosts.load(step_costs_file(tmp_path), engine="torch fp32") == HAND
    cases = {
        "missing verify_s": {"verify_s": None},
        "rows must be increasing": {"rows": [2, 1]},
        "widths must start at 1": {"widths": [2, 3, 4, 5]},
        "must be 2 rows of 4 times": {"verify_s": [[0.01, 0.011, 0.012, 0.02]]},
        "seconds in \\(0, 60\\)": {"verify_s": [[0.01, -1, 0.012, 0.02], [0.01, 0.01, 0.01, 0.01]]},
        "unknown fields": {"speed": 3},
        "one per row count": {"draft_s": [0.003]},
    }
    for message, change in cases.items():
        data = json.loads(HAND.to_json()) | change
        if change.get("verify_s", 1) is None:
            del data["verify_s"]
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(data))
        with pytest.raises(LoopspecError, match=message) as e:
            StepCosts.load(path)
        assert "\n" not in str(e.value)
    with pytest.raises(LoopspecError, match="measured on the torch fp32 engine, not onnxruntime fp32"):
        StepCosts.load(step_costs_file(tmp_path), engine="onnxruntime fp32")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(LoopspecError, match="not JSON"):
        StepCosts.load(tmp_path / "junk.json")


def test_pacing_is_the_budget_with_a_table_else_the_fallback(engine):
    dflash, suffix = Method("dflash", block_size=5, adaptive=True), Method("suffix", block_size=5, adaptive=True)
    assert isinstance(pacing(dflash, engine, HAND), VerifyBudget) and pacing(dflash, engine, HAND).stage_drafts == 4
    assert pacing(suffix, engine, HAND).stage_drafts == 0  # no drafter to pay for
    assert isinstance(pacing(dflash, engine, None), AdaptiveFallback)
    assert pacing(Method("dflash", block_size=5), engine, HAND) is None  # adaptive off: every round drafts


PROMPTS = [torch.randint(3, 120, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 14, 21)]


@pytest.fixture(scope="module")
def engine(tiny_targets):
    target = lively(load_target_dir(tiny_targets["qwen3"]))
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=5, mask_token_id=127)
    # the drafter knows the first two prompts' continuations only: rows of one batch draft well and badly
    return TorchEngine(target, agreeing_drafter(target, PROMPTS[:2], cfg), max_context=160)


@pytest.mark.parametrize(
    "method",
    [
        Method("dflash", block_size=5, adaptive=True),
        Method("dloop", block_size=5, max_stages=3, gate_threshold=-1e9, adaptive=True, tree_budget=6, suffix=True),
    ],
    ids=["dflash", "dloop-tree"],
)
def test_the_budget_changes_what_is_verified_never_the_output(engine, method):
    """Greedy: batched with the budget on, every row commits plain decoding's tokens, rows verify different
    counts in one step (the well-drafted rows more), and each row alone commits the same."""
    # the table is the truth here (a measured one would make the choices, and so this test, depend on
    # the machine's timing): verifying more costs little, a drafter stage 0.15 of a one-row step per
    # row, so drafting pays for the rows whose drafts are accepted and not for the others
    costs = table(
        [[10 * (1 + 0.1 * (n - 1)) * (1 + 0.08 * (w - 1)) for w in (1, 2, 4, 8)] for n in (1, 2, 4)],
        [1.5 * n for n in (1, 2, 4)],
        rows=(1, 2, 4),
        widths=(1, 2, 4, 8),
    )
    refs = [generate(engine, p, Method(), max_new_tokens=40).tokens for p in PROMPTS]
    widths_seen = []

    class Watching(VerifyBudget):
        def record(self, *a, seconds):  # every step took what the table says
            super().record(*a, seconds=self._predicted[0])

        def after_drafting(self, *a, **k):
            trees = super().after_drafting(*a, **k)
            widths_seen.append(sorted(len(t) for t in trees))
            return trees

    budget = Watching(costs, method, engine.drafter_cfg.drafts_per_block(5))
    decoder = Decoder(engine.with_rows(4), method, budget)
    done = decode_all(decoder, [dict(key=i, prompt_ids=p, max_new_tokens=40) for i, p in enumerate(PROMPTS)])
    assert [done[i].tokens for i in range(4)] == refs
    assert accepted_drafts(done.values()) >= 40  # measured: 56 (dflash), 60 (dloop-tree)
    assert any(w[0] < w[-1] for w in widths_seen)  # rows verified different counts in one call
    assert sum(r.stats.fallback_rounds for r in done.values()) > 0  # and some rows verified no draft
    for i, p in enumerate(PROMPTS):  # each alone, with a budget of its own, commits the same
        alone = generate(engine, p, method, max_new_tokens=40, pacing=Watching(costs, method, budget.stage_drafts))
        assert alone.tokens == refs[i]


def test_a_step_cost_table_is_measured_on_the_engine(engine, tmp_path):
    costs = measure_step_costs(
        engine.with_rows(2),
        "torch fp32",
        rows=(1, 2, 4),
        widths=(1, 3),
        context=16,
        block_size=5,
        repeats=1,
        progress=False,
    )
    assert costs.rows == (1, 2) and costs.widths == (1, 3)  # rows past the engine's are left out
    assert len(costs.verify_s) == 2 and all(t > 0 for r in costs.verify_s for t in r) and len(costs.draft_s) == 2
    (tmp_path / "t.json").write_text(costs.to_json())
    assert StepCosts.load(tmp_path / "t.json", engine="torch fp32") == costs
