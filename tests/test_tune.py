"""`loopspec tune`'s choice: the fastest lossless setting, extra stages only when they raise τ."""

import pytest

from loopspec.errors import LoopspecError
from loopspec.runtime.tune import choose


def row(k, stages, gate, tau, speed, lossless=True):
    return {"block_size": k, "max_stages": stages, "gate_threshold": gate, "tau": tau, "tokens_per_s": speed,
            "lossless": lossless}


def test_more_stages_without_more_tau_is_noise():
    rows = [row(8, 1, -0.5, 1.74, 46.3), row(8, 3, -8.0, 1.74, 49.6), row(8, 2, -4.0, 1.74, 47.0)]
    assert choose(rows) == rows[0]


def test_more_stages_that_raise_tau_and_speed_win():
    rows = [row(8, 1, -0.5, 3.0, 40.0), row(8, 3, -1.0, 3.6, 44.0), row(16, 1, -0.5, 3.2, 38.0)]
    assert choose(rows) == rows[1]


def test_lossy_settings_never_chosen():
    rows = [row(8, 1, -0.5, 1.5, 30.0), row(8, 2, -0.5, 2.5, 60.0, lossless=False)]
    assert choose(rows) == rows[0]
    with pytest.raises(LoopspecError, match="no setting reproduced plain decoding"):
        choose([row(8, 1, -0.5, 1.5, 30.0, lossless=False)])


def test_without_a_one_stage_row_every_setting_counts():
    rows = [row(8, 2, -0.5, 1.5, 30.0), row(8, 3, -0.5, 1.5, 31.0)]
    assert choose(rows) == rows[1]


def test_the_chain_policy_counts_without_more_tau():
    """suffix_first pays by skipping drafter stages: it may win at the chain's τ (or below it)."""
    chain = row(4, 1, -0.5, 2.0, 40.0) | {"tree_budget": 0, "suffix": False}
    policy = row(4, 1, -0.5, 1.9, 44.0) | {"tree_budget": 0, "suffix": False, "suffix_first": 3}
    suffix_branch = row(4, 1, -0.5, 2.0, 46.0) | {"tree_budget": 0, "suffix": True}  # no more τ: noise
    assert choose([chain, policy, suffix_branch]) == policy
