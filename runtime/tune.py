"""`loopspec tune`: sweep DLoop's gate threshold × max stages (× block size) on calibration prompts,
then the draft-tree budget × the suffix branch on the best of them, then the chain policy's match
length (suffix_first) on the best chain and the best tree; keep the fastest setting whose greedy
output equals plain decoding, and store it with the drafter.

The DLoop paper uses one global threshold that must be re-swept per deployment; this does the sweep
on the machine that will serve — and the tree budget above all depends on it: verifying N + 1
tokens costs about one step on a GPU but grows with N on a CPU.
"""

from __future__ import annotations

import itertools
import sys
import time

from loopspec.errors import LoopspecError
from loopspec.settings import DecodingSettings
from loopspec.stats import acceptance_length
from loopspec.tuned import store_setting  # noqa: F401 (where a result is stored: loopspec/tuned.py)


def measure(
    pipe, prompts: list[list[int]], settings, reference: list[list[int]], ar_seconds: float, max_new_tokens: int
) -> dict:
    """One setting on the prompts (after a short warm-up): speed, τ, nodes per verification, lossless."""
    pipe.run(prompts[0], settings, max_new_tokens=8)
    t0 = time.perf_counter()
    outs = [pipe.run(p, settings, max_new_tokens=max_new_tokens) for p in prompts]
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.tokens) for o in outs)
    nodes = [n for o in outs for n in o.stats.nodes_per_round]
    return {
        "block_size": settings.block_size,
        "max_stages": settings.max_stages,
        "gate_threshold": settings.gate_threshold,
        "tree_budget": settings.tree_budget,
        "suffix": settings.suffix,
        "suffix_first": settings.suffix_first,
        "suffix_then_draft": settings.suffix_then_draft,
        "tokens_per_s": tokens / seconds,
        "speedup_vs_ar": ar_seconds / seconds,
        "tau": acceptance_length(o.stats for o in outs) or 1.0,
        "nodes_per_verification": sum(nodes) / max(len(nodes), 1),
        "lossless": [o.tokens for o in outs] == reference,
    }


# each grid's flag and the DecodingSettings knob its values set
GRID = {
    "thresholds": ("--thresholds", "gate_threshold"),
    "stages": ("--stages", "max_stages"),
    "block_sizes": ("--block-sizes", "block_size"),
    "tree_budgets": ("--tree-budgets", "tree_budget"),
    "suffix_firsts": ("--suffix-firsts", "suffix_first"),
}


def check_grid(**grids) -> None:
    """Refuse, before anything runs, a grid value (GRID: thresholds, stages, block_sizes,
    tree_budgets, suffix_firsts) that the decoding settings would refuse: each is tried as a DLoop
    setting, so the rule is the settings' own (loopspec/settings.py), said under tune's flag."""
    for name, values in grids.items():
        flag, knob = GRID[name]
        if values is not None and not values:
            raise LoopspecError(f"{flag} needs at least one value")
        for value in values or ():
            try:
                DecodingSettings("dloop", **({"block_size": 2} | {knob: value}))
            except LoopspecError as e:
                raise LoopspecError(f"{flag} {value}: {e}") from None


def sweep(
    pipe,
    prompts: list[list[int]],
    *,
    thresholds,
    stages,
    block_sizes,
    max_new_tokens: int,
    tree_budgets=(0,),
    suffix_options=(False,),
    suffix_firsts=(0,),
    progress: bool = True,
) -> list[dict]:
    """Tokens/s of every setting on the same prompts, with losslessness checked: the DLoop grid with
    the chain, then every tree budget × suffix choice on the fastest chain setting found, then every
    chain-policy match length, each variant (copy alone; copy then the drafter), on that chain and on
    the best tree setting."""
    from tqdm import tqdm

    check_grid(
        thresholds=thresholds,
        stages=stages,
        block_sizes=block_sizes,
        tree_budgets=tree_budgets,
        suffix_firsts=suffix_firsts,
    )
    ar = pipe.settings("ar")
    reference = [pipe.run(p, ar, max_new_tokens=max_new_tokens).tokens for p in prompts]
    t0 = time.perf_counter()
    for p in prompts:
        pipe.run(p, ar, max_new_tokens=max_new_tokens)
    ar_seconds = time.perf_counter() - t0
    grid = []
    for k, s, g in itertools.product(block_sizes, stages, thresholds):
        if s == 1 and g != thresholds[0]:
            continue  # one stage: the gate never decides anything
        grid.append(
            pipe.settings(
                "dloop", block_size=k, max_stages=s, gate_threshold=g, adaptive=False, tree_budget=0, suffix=False
            )
        )
    trees = [(n, x) for n, x in itertools.product(tree_budgets, suffix_options) if (n, x) != (0, False)]
    firsts = [m for m in suffix_firsts if m]
    bar = tqdm(total=len(grid) + len(trees) + 4 * len(firsts), desc="tuning", disable=not progress, file=sys.stderr)
    rows = []
    for settings in grid:
        rows.append(measure(pipe, prompts, settings, reference, ar_seconds, max_new_tokens))
        bar.update()
    if trees:
        best = choose(rows)
        for budget, suffix in trees:
            settings = pipe.settings(
                "dloop",
                block_size=best["block_size"],
                max_stages=best["max_stages"],
                gate_threshold=best["gate_threshold"],
                adaptive=False,
                tree_budget=budget,
                suffix=suffix,
            )
            rows.append(measure(pipe, prompts, settings, reference, ar_seconds, max_new_tokens))
            bar.update()
    if firsts:
        best_chain, best = choose([r for r in rows if not r["tree_budget"] and not r["suffix"]]), choose(rows)
        for base in [best_chain] + ([best] if best is not best_chain else []):
            for m, then_draft in itertools.product(firsts, (False, True)):  # both variants of the policy
                settings = pipe.settings(
                    "dloop",
                    block_size=base["block_size"],
                    max_stages=base["max_stages"],
                    gate_threshold=base["gate_threshold"],
                    adaptive=False,
                    tree_budget=base["tree_budget"],
                    suffix=base["suffix"],
                    suffix_first=m,
                    suffix_then_draft=then_draft,
                )
                rows.append(measure(pipe, prompts, settings, reference, ar_seconds, max_new_tokens))
                bar.update()
    bar.close()
    return rows


def choose(rows: list[dict]) -> dict:
    """The fastest lossless setting, where extra stages, tree nodes and the suffix branch count only
    when they raise τ.

    Each can only pay through a longer accepted chain: a multi-stage setting whose τ is not above
    the one-stage τ of its block size, or a tree / suffix setting whose τ is not above the chain's
    of the same stages, runs the same verifications plus extra work, so any edge it shows on the
    clock is timing noise, not a gain to store. The chain policy (suffix_first) is exempt: it pays
    by skipping the drafter's stage, whatever τ does."""
    good = [r for r in rows if r["lossless"]]
    if not good:
        raise LoopspecError("no setting reproduced plain decoding; nothing stored")

    def plain(r):  # verifies the drafter's chain (or, by the chain policy, a copy in its place)
        return not r.get("tree_budget") and not r.get("suffix")

    def chain(r):  # the reference τ: the drafter's chain every round
        return plain(r) and not r.get("suffix_first")

    one_stage_tau = {r["block_size"]: r["tau"] for r in good if r["max_stages"] == 1 and chain(r)}
    chain_tau = {(r["block_size"], r["max_stages"], r["gate_threshold"]): r["tau"] for r in good if chain(r)}
    eligible = [
        r
        for r in good
        if (r["max_stages"] == 1 or r["tau"] > one_stage_tau.get(r["block_size"], 0.0))
        and (plain(r) or r["tau"] > chain_tau.get((r["block_size"], r["max_stages"], r["gate_threshold"]), 0.0))
    ]
    return max(eligible, key=lambda r: r["tokens_per_s"])
