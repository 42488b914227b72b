"""`loopspec tune`'s choice: the fastest lossless setting, extra stages only when they raise τ."""

import pytest

from loopspec.errors import LoopspecError
from loopspec.runtime.tune import choose


def row(k, stages, gate, tau, speed, lossless=True):
    return {
        "block_size": k,
        "max_stages": stages,
        "gate_threshold": gate,
        "tau": tau,
        "tokens_per_s": speed,
        "lossless": lossless,
    }


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


def test_a_tune_result_for_the_shipped_drafter_goes_to_the_user_store_and_wins(tiny_pair, tmp_path):
    """The shipped drafter sits in the installed package (perhaps read-only): its tune result goes to
    a per-user file named by its weights and the engine, its config.json stays as shipped, and
    the pipeline's settings take the user's result over the shipped one."""
    import dataclasses
    import json

    from loopspec.defaults import DEFAULT_DRAFTER_DIR
    from loopspec.runtime.pipeline import load_pipeline
    from loopspec.runtime.tune import store_setting
    from loopspec.tuned import is_shipped, user_setting, weights_key

    shipped_config = (DEFAULT_DRAFTER_DIR / "config.json").read_bytes()
    shipped = json.loads(shipped_config)["loopspec"]["tuned"]
    engine = "onnxruntime gguf-int8act"
    mine = {"block_size": 5, "max_stages": 3, "gate_threshold": -2.0, "tree_budget": 8, "suffix": True}
    assert mine != {k: shipped[engine][k] for k in mine}  # so that "wins" below is visible
    store = tmp_path / "store"
    path = store_setting(DEFAULT_DRAFTER_DIR, {**mine, "tau": 2.0}, engine, store=store)
    assert path == store / f"{weights_key(DEFAULT_DRAFTER_DIR)}-onnxruntime-gguf-int8act.json"
    assert json.loads(path.read_text()) == mine  # the setting only, not the sweep's measurements
    assert (DEFAULT_DRAFTER_DIR / "config.json").read_bytes() == shipped_config
    assert user_setting(DEFAULT_DRAFTER_DIR, engine, store) == mine
    assert user_setting(DEFAULT_DRAFTER_DIR, "torch", store) is None  # measured on another engine

    # a user's copy of the drafter is theirs: its result goes into its own config.json
    copy = tmp_path / "my-drafter"
    copy.mkdir()
    for f in DEFAULT_DRAFTER_DIR.glob("*.json"):
        (copy / f.name).write_bytes(f.read_bytes())
    assert is_shipped(DEFAULT_DRAFTER_DIR) and not is_shipped(copy)
    assert store_setting(copy, mine, engine, store=store) == copy / "config.json"
    assert json.loads((copy / "config.json").read_text())["loopspec"]["tuned"][engine] == mine
    assert user_setting(copy, engine, store) is None

    # resolution: a pipeline whose drafter came from the shipped directory takes the user's result
    target, drafter = tiny_pair
    pipe = load_pipeline(str(target), str(drafter), backend="torch")
    as_shipped = dataclasses.replace(pipe, drafter_dir=DEFAULT_DRAFTER_DIR, tuned_store=store)
    store_setting(DEFAULT_DRAFTER_DIR, mine, pipe.tuning_key, store=store)
    settings = as_shipped.settings("dloop")
    assert (
        settings.block_size,
        settings.max_stages,
        settings.gate_threshold,
        settings.tree_budget,
        settings.suffix,
    ) == (5, 3, -2.0, 8, True)
    assert pipe.settings("dloop").block_size == pipe.engine.drafter_cfg.block_size  # no user result: its own
