"""The verification budget: how many drafts each row verifies this step, zero included.

A step verifies every live row at once, right-padded to the widest, so its cost is the step-cost
table's (runtime/step_costs.py) at (rows, width), plus one drafter stage over the rows that draft.
Each row's drafts survive with some probability; verifying n of them commits, in expectation,
1 + the sum of their survival probabilities (a node is committed only if its whole path is). The
budget picks, for the whole batch, what maximizes expected committed tokens per second:

1. before drafting (`before_drafting`), from each row's own acceptance so far (drafts accepted per
   rejection, shrunk toward the batch's): the width, and which rows draft at all (one stage over fewer
   rows costs less) — width 1 is a plain step, nothing drafted;
2. after drafting (`after_drafting`), from each node's own estimate (the drafter's probability of
   its token, the confidence head's where there is one, the length of the suffix index's match, each
   calibrated against what verifications accepted): the width again, each row keeping its most likely
   nodes (every node is less likely than its parent, so they form a tree).

Both estimates learn from every verification (`record`), and the table's times are scaled by what
plain and drafting steps really took (the runtime's own work around the engine included), so a
table that flatters drafting corrects itself. Only what is verified changes; the output never does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loopspec.engines.protocol import Engine
from loopspec.runtime.proposal import AdaptiveFallback, Drafted, RowPlan
from loopspec.runtime.step_costs import StepCosts
from loopspec.settings import DecodingSettings
from loopspec.tree import DraftTree

BINS = 10  # calibration bins over a node's raw estimate
PRIOR = 4.0  # pseudo-observations behind a raw estimate, and behind the batch's rate in a row's
# a suffix node's raw estimate: by the length of the match it continues (2..6 tokens → 0.3..0.9),
# each length its own calibration bin, so what a length's continuations really do is learned apart
SUFFIX_RAW_PER_MATCHED_TOKEN = 0.15
ALPHA = 0.2  # how fast the table's scale follows the measured steps
# a row's counts fade by this much a step, drafted or not: its estimate follows what it writes now, and
# a row that stopped drafting drifts back to the batch's estimate (plus the doubt below) and is tried again
FADE = 0.97
DOUBT = 0.3  # optimism of an estimate resting on few verifications: + DOUBT / sqrt(1 + their count)


def best_step(
    gains: list[list[float]],
    needs_drafter: list[bool],
    costs: StepCosts,
    stage_drafts: int,
    scale: tuple[float, float] = (1.0, 1.0),
) -> tuple[int, list[int]]:
    """Before drafting: gains[b][d] = row b's expected accepted drafts if it verifies d (gains[b][0] = 0;
    len - 1 = the most it may) → (width, each row's depth). Rows that need the drafter (needs_drafter)
    cost one stage per `stage_drafts` depths over the rows drafting; the others (copies of the text)
    draft for free. `scale`: (plain, drafting) multipliers of the table's times."""
    rows = len(gains)
    best_value, best = rows / (costs.verify(rows, 1) * scale[0]), (1, [0] * rows)
    for width in range(2, max(len(g) for g in gains) + 1):
        depth = [min(len(g) - 1, width - 1) for g in gains]
        free = sum(g[d] for g, d, drafts in zip(gains, depth, needs_drafter) if not drafts)
        ranked = sorted((b for b in range(rows) if needs_drafter[b] and depth[b]), key=lambda b: -gains[b][depth[b]])
        stages = math.ceil((width - 1) / max(stage_drafts, 1))
        for taken in range(len(ranked) + 1):
            gain = free + sum(gains[b][depth[b]] for b in ranked[:taken])
            seconds = costs.verify(rows, width) + stages * costs.draft(taken) if taken else costs.verify(rows, width)
            value = (rows + gain) / (seconds * scale[1])
            if value > best_value:
                chosen = set(ranked[:taken])
                best_value, best = (
                    value,
                    (width, [d if (b in chosen or not needs_drafter[b]) else 0 for b, d in enumerate(depth)]),
                )
    return best


def best_width(
    survivals: list[list[float]], costs: StepCosts, drafted_s: float, scale: tuple[float, float] = (1.0, 1.0)
) -> int:
    """After drafting: survivals[b] = row b's node survival probabilities, most likely first; the
    drafter's time `drafted_s` is spent → the width (anchor included) with the most expected
    committed tokens per second."""
    rows = len(survivals)
    prefix = [[0.0] + list(_cumulative(s)) for s in survivals]
    best_value, best = -1.0, 1
    for width in range(1, max(len(p) for p in prefix) + 1):
        gain = sum(p[min(len(p), width) - 1] for p in prefix)
        plain = width == 1 and not drafted_s
        seconds = costs.verify(rows, width) * scale[0 if plain else 1] + drafted_s * scale[1]
        if (rows + gain) / seconds > best_value:
            best_value, best = (rows + gain) / seconds, width
    return best


def _cumulative(values):
    total = 0.0
    for v in values:
        total += v
        yield total


@dataclass
class Calibration:
    """How often a node whose parent was accepted is accepted, by its source and raw-estimate bin:
    calibrated p = (accepted + PRIOR · raw) / (tried + PRIOR)."""

    counts: dict[tuple[str, int], list[float]] = field(default_factory=dict)

    def p(self, source: str, raw: float) -> float:
        accepted, tried = self.counts.get((source, self._bin(raw)), (0.0, 0.0))
        return (accepted + PRIOR * raw) / (tried + PRIOR)

    def record(self, source: str, raw: float, accepted: bool) -> None:
        entry = self.counts.setdefault((source, self._bin(raw)), [0.0, 0.0])
        entry[0] += accepted
        entry[1] += 1

    @staticmethod
    def _bin(raw: float) -> int:
        return min(int(raw * BINS), BINS - 1)


class VerifyBudget:
    """Chooses what each step verifies from a step-cost table (see the module's docstring). One per
    decoder; a row's acceptance counts live on its Row (draft_hits, draft_misses)."""

    def __init__(self, costs: StepCosts, settings: DecodingSettings, stage_drafts: int):
        self.costs, self.settings, self.stage_drafts = costs, settings, stage_drafts
        self.calibration = Calibration()
        self.hits = self.misses = 0  # the batch's accepted drafts and rejections, over every row
        self.scale = [1.0, 1.0]  # measured / table seconds: plain steps, drafting steps
        self.plain_steps = self.drafting_steps = 0
        self._predicted = (0.0, False)

    def rate(self, row) -> float:
        """A row's per-draft acceptance: its (fading) counts shrunk toward the batch's (which starts at
        0.5), made optimistic while they are few, so that a row is tried before it is judged."""
        batch = (self.hits + 1) / (self.hits + self.misses + 2)
        seen = row.draft_hits + row.draft_misses
        return min(0.95, (row.draft_hits + PRIOR * batch) / (seen + PRIOR) + DOUBT / math.sqrt(1 + seen))

    def before_drafting(self, rows, plans: list[RowPlan]) -> list[int]:
        """Each row's depth cap for this step (0: it drafts nothing)."""
        gains, needs = [], []
        for row, plan in zip(rows, plans):
            a = self.rate(row)
            gains.append([0.0] + list(_cumulative(a**i for i in range(1, plan.depth + 1))))
            needs.append(plan.drafter_budget > 0)
        return best_step(gains, needs, self.costs, self.stage_drafts, tuple(self.scale))[1]

    def after_drafting(
        self, rows, plans: list[RowPlan], drafted: list[Drafted], trees: list[DraftTree], drafter_rows: int
    ) -> list[DraftTree]:
        """The trees cut to the chosen width, each row keeping its most likely nodes."""
        survival = [
            _survival(tree, [self.p(*e) for e in self.node_estimates(row, plan, d, tree)])
            for row, plan, d, tree in zip(rows, plans, drafted, trees)
        ]
        survivals = [sorted(s[1:], reverse=True) for s in survival]
        stages = max((d.stages for d in drafted), default=0)
        drafted_s = stages * self.costs.draft(drafter_rows) if drafter_rows else 0.0
        width = best_width(survivals, self.costs, drafted_s, tuple(self.scale))
        self._predicted = (drafted_s + self.costs.verify(len(rows), width), width > 1 or drafted_s > 0)
        return [_keep_likeliest(tree, s, width) for tree, s in zip(trees, survival)]

    def node_estimates(self, row, plan: RowPlan, drafted: Drafted, tree: DraftTree) -> list[tuple[str, float]]:
        """Each node's (source, raw estimate) that its token is accepted once its parent is (node 0: the anchor)."""
        offset = len(plan.copy) if plan.copy is not None else 0  # a drafter extending a copy drafts after it
        out = [("anchor", 1.0)]
        matched = row.suffix_index.match_length() if row.suffix_index is not None else 0
        suffix_raw = min(0.95, SUFFIX_RAW_PER_MATCHED_TOKEN * max(matched, 2))
        ids, logprobs = drafted.candidates.tolist(), drafted.logprobs.float().tolist()
        confidence = drafted.confidence.float().tolist() if drafted.confidence is not None else None
        for node in range(1, len(tree)):
            source, raw = "suffix", suffix_raw
            depth = tree.depths[node] - 1 - offset
            if tree.from_drafter[node] and 0 <= depth < len(ids) and tree.tokens[node] in ids[depth]:
                rank = ids[depth].index(tree.tokens[node])
                source, raw = "drafter", math.exp(logprobs[depth][rank])
                if confidence is not None and rank == 0:
                    source, raw = "confidence", confidence[depth]
            out.append((source, min(max(raw, 0.0), 1.0)))
        return out

    def p(self, source: str, raw: float) -> float:
        return 1.0 if source == "anchor" else self.calibration.p(source, raw)

    def record(self, rows, plans, drafted, trees: list[DraftTree], paths: list[list[int]], *, seconds: float) -> None:
        """What the step accepted (each node whose parent was accepted: accepted or not) and what it took."""
        for row, plan, d, tree, path in zip(rows, plans, drafted, trees, paths):
            on_path = set(path)
            for node, (source, raw) in enumerate(self.node_estimates(row, plan, d, tree)):
                if node and tree.parents[node] in on_path:
                    self.calibration.record(source, raw, node in on_path)
            rejected = any(tree.parents[n] == path[-1] for n in range(1, len(tree)))
            row.draft_hits = FADE * row.draft_hits + len(path) - 1
            row.draft_misses = FADE * row.draft_misses + rejected
            self.hits = FADE * self.hits + len(path) - 1
            self.misses = FADE * self.misses + rejected
        predicted, drafting = self._predicted
        if predicted > 0:
            k = int(drafting)
            self.scale[k] = (1 - ALPHA) * self.scale[k] + ALPHA * seconds / predicted
            self.plain_steps += not drafting
            self.drafting_steps += drafting


def _survival(tree: DraftTree, estimates_p: list[float]) -> list[float]:
    """Each node's probability that its whole path is accepted, from per-node conditional estimates."""
    out = [1.0] * len(tree)
    for node in range(1, len(tree)):
        out[node] = out[tree.parents[node]] * estimates_p[node]
    return out


def _keep_likeliest(tree: DraftTree, survival: list[float], width: int) -> DraftTree:
    """The tree's anchor and its `width - 1` likeliest other nodes (ties: the earlier node), in order."""
    if len(tree) <= width:
        return tree
    kept = sorted(range(1, len(tree)), key=lambda n: (-survival[n], n))[: width - 1]
    return tree.subtree(sorted(kept))


def pacing(settings: DecodingSettings, engine: Engine, costs: StepCosts | None):
    """What decides how much each step verifies: the verification budget when a step-cost table is
    at hand, else the timing fallback (runtime/proposal.py AdaptiveFallback); None when the settings
    do not adapt (or do not draft)."""
    if not settings.adaptive or not settings.drafting:
        return None
    if costs is None:
        return AdaptiveFallback()
    stage_drafts = engine.drafter_cfg.drafts_per_block(settings.block_size) if settings.uses_drafter else 0
    return VerifyBudget(costs, settings, stage_drafts)
