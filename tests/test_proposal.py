"""A row's plan for one round (runtime/proposal.py `plan_row`): how deep it drafts and what fills it."""

from types import SimpleNamespace

import pytest
import torch

from loopspec.decoding import SamplingParams
from loopspec.runtime.decoder import Row
from loopspec.runtime.proposal import Drafted, plan_row, row_tree
from loopspec.settings import DecodingSettings
from loopspec.tree import SuffixIndex

ZLAB = SimpleNamespace(drafts_per_block=lambda k: k - 1)  # z-lab's convention: the anchor's position drafts nothing


def engine(max_context=100):
    return SimpleNamespace(max_context=max_context, drafter_cfg=ZLAB)


def row(prompt, tokens, max_new_tokens=50, suffix=True):
    return Row(
        key=0,
        prompt_len=len(prompt),
        max_new_tokens=max_new_tokens,
        params=SamplingParams(),
        generator=torch.Generator(),
        stop_token_ids=frozenset(),
        tokens=list(tokens),
        suffix_index=SuffixIndex(list(prompt) + list(tokens)) if suffix else None,
    )


def test_depth_is_the_least_of_the_method_the_tokens_left_and_the_room():
    settings = DecodingSettings("dflash", 8)
    r = row([1, 2, 3], [4], suffix=False)
    assert plan_row(r, settings, engine(), 7, cap=7).depth == 7
    assert plan_row(row([1, 2, 3], [4], max_new_tokens=4, suffix=False), settings, engine(), 7, 7).depth == 2
    tight = plan_row(r, settings, engine(max_context=8), 7, cap=7)  # anchor at 3: slots 4..7 left
    assert (tight.room, tight.depth, tight.drafter_budget) == (4, 4, 4)
    budgeted = plan_row(r, settings, engine(), 7, cap=3)  # the verification budget's depth for the row
    assert (budgeted.wanted, budgeted.depth, budgeted.drafter_budget) == (7, 3, 3)


def test_a_plain_round_drafts_nothing_but_remembers_what_it_could_have():
    plan = plan_row(row([1, 2, 3], [4], suffix=False), DecodingSettings("dflash", 8), engine(), 7, cap=0)
    assert (plan.wanted, plan.depth, plan.drafter_budget, plan.copy, plan.suffix) == (7, 0, 0, None, [])


def test_ar_never_drafts():
    plan = plan_row(row([1, 2, 3], [4], suffix=False), DecodingSettings(), engine(), 0, cap=0)
    assert (plan.wanted, plan.depth, plan.drafter_budget, plan.uses_drafter) == (0, 0, 0, False)


def test_the_chain_policy_copies_after_a_long_match_and_drafts_otherwise():
    text = [5, 6, 7, 8, 9, 10, 5, 6, 7]  # the suffix 5 6 7 occurred before, followed by 8 9 10
    settings = DecodingSettings("dflash", 8, suffix_first=3)
    plan = plan_row(row(text[:-1], text[-1:]), settings, engine(), 7, cap=7)
    assert plan.copy == [8, 9, 10, 5, 6, 7, 8] and plan.drafter_budget == 0 and plan.suffix == []
    assert (plan.stage_anchor, plan.stage_position) == (7, plan.root_position)
    longer = DecodingSettings("dflash", 8, suffix_first=4)  # a 3-token match is not long enough
    plan = plan_row(row(text[:-1], text[-1:]), longer, engine(), 7, cap=7)
    assert plan.copy is None and plan.drafter_budget == 7
    assert plan.suffix == []  # the round drafts as set: the policy alone adds no suffix branch
    branch = DecodingSettings("dflash", 8, suffix=True, suffix_first=4)
    plan = plan_row(row(text[:-1], text[-1:]), branch, engine(), 7, cap=7)
    assert plan.copy is None and plan.suffix == [8, 9, 10, 5, 6, 7, 8]  # with --suffix the match joins as a branch


def test_the_suffix_branch_is_what_the_settings_say_and_the_chains_only_guard_sees_it():
    """One rule: the suffix branch is verified with `suffix` (or as the method suffix's chain),
    never because the chain policy is on; an engine that verifies chains only exactly runs the
    policy alone and refuses the branch."""
    from loopspec.errors import LoopspecError
    from loopspec.runtime.proposal import check_engine_runs

    text = [5, 6, 7, 8, 9, 10, 5, 6, 7]
    chains_only = SimpleNamespace(
        has_drafter=True,
        chains_only=True,
        precision="int8",
        samples_drafts=True,
        drafter_cfg=ZLAB,
        max_context=100,
        target_cfg=SimpleNamespace(family="qwen3", linear_attention=None),
    )
    policy_alone = DecodingSettings("dflash", 8, suffix_first=4)
    check_engine_runs(chains_only, policy_alone)  # chains only: accepted
    assert not policy_alone.verifies_trees and not policy_alone.suffix_branch
    # the branch the guard sees is the branch the plan verifies: none here, in any round
    for tokens in (text, [1, 2, 3, 4], [5, 6, 7, 5, 6]):
        plan = plan_row(row(tokens[:-1], tokens[-1:]), policy_alone, chains_only, 7, cap=7)
        assert plan.suffix == []
    for settings in (
        DecodingSettings("dflash", 8, suffix=True),
        DecodingSettings("dflash", 8, suffix=True, suffix_first=4),
        DecodingSettings("dloop", 4, 2, tree_budget=4),
    ):
        assert settings.verifies_trees
        with pytest.raises(LoopspecError, match="verifies chains exactly"):
            check_engine_runs(chains_only, settings)
    alone = DecodingSettings("suffix", 8)  # the method's continuation alone is a chain
    check_engine_runs(SimpleNamespace(chains_only=True, has_drafter=False), alone)
    assert alone.suffix_branch and not alone.verifies_trees
    assert plan_row(row(text[:-1], text[-1:]), alone, chains_only, 7, cap=7).suffix == [8, 9, 10, 5, 6, 7, 8]


def test_the_drafter_extends_a_copy_from_its_last_token_in_the_room_it_leaves():
    text = [5, 6, 7, 8, 9, 10, 5, 6, 7]
    settings = DecodingSettings("dflash", 4, suffix_first=3, suffix_then_draft=True)
    r = row(text[:-1], text[-1:], max_new_tokens=6)  # 4 tokens wanted after the bonus: the copy takes 3
    plan = plan_row(r, settings, engine(), 3, cap=3)
    assert plan.copy == [8, 9, 10] and plan.extends
    assert (plan.stage_anchor, plan.stage_position) == (10, r.position + 3)
    assert plan.drafter_budget == 1  # one stage drafts 3, but only 4 - 3 tokens are still wanted after the copy
    tree = row_tree(plan, Drafted(torch.tensor([[11, 0]]), torch.zeros(1, 2), [1]), settings, tree_span=0)
    assert tree.tokens == [7, 8, 9, 10, 11] and tree.is_chain
    assert plan.later_stage_tokens(4) == 1 and plan.later_stage_tokens(2) == 0
