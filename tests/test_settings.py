"""The decoding settings value refuses, in one line, every knob that cannot apply (loopspec/settings.py):
built directly (the Python API), resolved from flags (CLI, server, bench) or swept by tune."""

import math

import pytest

from loopspec.errors import LoopspecError
from loopspec.model.dflash import DrafterConfig
from loopspec.runtime.tune import check_grid
from loopspec.settings import KNOBS, METHODS, DecodingSettings, check_knobs_apply, knobs_for, resolve_settings


def drafter():
    return DrafterConfig(
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


# a value each knob may take where it applies, different from its field's default
GIVEN = {
    "block_size": 4,
    "max_stages": 3,
    "gate_threshold": -1.0,
    "gate": "confidence",
    "adaptive": True,
    "tree_budget": 4,
    "suffix": True,
    "suffix_first": 3,
    "suffix_then_draft": True,
    "draft_sampling": "drafter",
    "shared_suffix": 8,
    "tree_kind": "dynamic",
    "tree_top_k": 2,
    "tree_depth": 2,
}


def test_every_knob_has_a_value_to_plant():
    assert set(GIVEN) == set(KNOBS)


@pytest.mark.parametrize("name", list(KNOBS))
def test_a_knob_given_for_a_method_it_does_not_apply_to_is_refused_by_resolve(name):
    """Every knob, every method outside its Knob.methods: one line naming the flag and the method;
    a knob is never dropped on the way (the old resolve_settings returned `ar` bare, whatever was given)."""
    knob = KNOBS[name]
    refused = [m for m in METHODS if m not in knob.methods]
    for method in refused:
        with pytest.raises(LoopspecError, match=f"^{knob.flag} does not apply to method {method}: it needs "):
            resolve_settings(method, drafter(), **{name: GIVEN[name]})
    assert refused or name in ("block_size", "adaptive")  # (block size and adaptive apply to every drafting method)


@pytest.mark.parametrize("name", list(KNOBS))
def test_a_knob_set_for_a_method_it_does_not_apply_to_is_refused_when_built(name):
    knob = KNOBS[name]
    for method in (m for m in METHODS if m not in knob.methods):
        block = {} if method == "ar" or name == "block_size" else {"block_size": 4}
        with pytest.raises(LoopspecError, match=f"^{knob.flag} does not apply to method {method}"):
            DecodingSettings(method, **block, **{name: GIVEN[name]})


def test_knobs_that_apply_are_taken():
    s = resolve_settings("dloop", drafter(), gate_threshold=-2.0, max_stages=3, adaptive=False)
    assert (s.gate_threshold, s.max_stages, s.adaptive) == (-2.0, 3, False)
    assert resolve_settings("dflash", drafter()).adaptive is True  # on unless turned off
    assert resolve_settings("suffix", None, block_size=5, adaptive=False).block_size == 5
    assert resolve_settings("ar", None) == DecodingSettings()
    assert resolve_settings("ar", None, **{name: None for name in KNOBS}) == DecodingSettings()
    # a knob given as its off value asks for nothing, so any method takes it ...
    off = dict(
        block_size=1,
        max_stages=1,
        adaptive=False,
        tree_budget=0,
        suffix=False,
        suffix_first=0,
        suffix_then_draft=False,
        draft_sampling="walk",
    )
    assert resolve_settings("ar", None, **off) == DecodingSettings()
    assert resolve_settings("suffix", None, **(off | {"block_size": 6})).tree_budget == 0
    # ... but a gate threshold or a gate type describes a gate, whatever its value
    for name, value in (("gate_threshold", -0.5), ("gate", "logprob")):
        with pytest.raises(LoopspecError, match=f"^{KNOBS[name].flag} does not apply to method dflash"):
            resolve_settings("dflash", drafter(), **{name: value})


def test_bench_gives_each_method_what_applies_and_refuses_what_applies_to_none():
    knobs = {name: None for name in KNOBS} | {"gate_threshold": -1.0, "tree_budget": 4}
    assert knobs_for("dloop", knobs) == {"gate_threshold": -1.0, "tree_budget": 4}
    assert knobs_for("dflash", knobs) == {"tree_budget": 4}
    assert knobs_for("suffix", knobs) == {}
    check_knobs_apply(["ar", "dflash", "dloop"], knobs)
    with pytest.raises(LoopspecError, match="^--gate-threshold does not apply to methods ar, dflash: it needs dloop"):
        check_knobs_apply(["ar", "dflash", "dflash"], knobs)
    with pytest.raises(LoopspecError, match="^--tree-budget does not apply to method suffix"):
        check_knobs_apply(["suffix"], knobs | {"gate_threshold": None})


@pytest.mark.parametrize("threshold", [math.inf, -math.inf, math.nan])
def test_the_gate_threshold_is_finite(threshold):
    with pytest.raises(LoopspecError, match=r"^the gate threshold \(--gate-threshold\) must be a finite number"):
        DecodingSettings("dloop", 4, 2, gate_threshold=threshold)
    with pytest.raises(LoopspecError, match="finite"):
        resolve_settings("dloop", drafter(), gate_threshold=threshold)


def test_drafts_sampled_from_the_drafter_need_a_sampling_run():
    s = DecodingSettings("dflash", 4, draft_sampling="drafter")
    s.check_sampling(greedy=False)
    with pytest.raises(LoopspecError, match="^--draft-sampling drafter samples drafts at temperature > 0"):
        s.check_sampling(greedy=True)
    DecodingSettings("dflash", 4).check_sampling(greedy=True)  # the walk: greedy or not
    with pytest.raises(LoopspecError, match="^--draft-sampling does not apply to method ar"):
        resolve_settings("ar", None, draft_sampling="drafter")


def test_the_suffix_branch_is_one_rule():
    """`suffix` is the branch; the chain policy neither needs nor adds it; the method suffix's own
    continuation is a chain; a tree is a tree budget or the branch beside the drafter."""
    cases = {
        DecodingSettings("dflash", 8, suffix_first=3): (False, False, True),
        DecodingSettings("dflash", 8, suffix_first=3, suffix=True): (True, True, True),
        DecodingSettings("dflash", 8, suffix=True): (True, True, True),
        DecodingSettings("dflash", 8, tree_budget=4): (False, True, False),
        DecodingSettings("suffix", 8): (True, False, True),
        DecodingSettings("dflash", 8): (False, False, False),
    }
    for settings, (branch, trees, index) in cases.items():
        assert (settings.suffix_branch, settings.verifies_trees, settings.uses_suffix) == (branch, trees, index), (
            settings
        )
    policy = resolve_settings("dloop", drafter(), suffix=False, suffix_first=3)  # --no-suffix --suffix-first 3
    assert (policy.suffix, policy.suffix_first, policy.suffix_branch) == (False, 3, False)
    assert "suffix" in KNOBS["suffix_first"].help and "--suffix" in KNOBS["suffix_first"].help


def test_tune_refuses_a_grid_value_by_the_settings_rule():
    check_grid(thresholds=[-1.0, -0.5], stages=[1, 4], block_sizes=None, tree_budgets=[0, 8], suffix_firsts=[0, 2, 6])
    for grid, says in (
        (dict(thresholds=[-1.0, math.inf]), "--thresholds inf: the gate threshold"),
        (dict(thresholds=[math.nan]), "--thresholds nan: the gate threshold"),
        (dict(stages=[0]), "--stages 0: max stages must be >= 1"),
        (dict(block_sizes=[1]), "--block-sizes 1: dloop needs a block size >= 2"),
        (dict(tree_budgets=[-1]), "--tree-budgets -1: tree budget must be >= 0"),
        (dict(suffix_firsts=[7]), "--suffix-firsts 7: suffix-first match length must be 2..6"),
        (dict(stages=[]), "--stages needs at least one value"),
    ):
        with pytest.raises(LoopspecError, match="^" + says.replace("(", r"\(").replace(")", r"\)")):
            check_grid(**grid)
