"""What every row proposes for one verification: the round's plan, the drafter's stages, the tree.

A row's proposal has three possible sources: the drafter (one stage, or DLoop's stages while the
row's gate opens), its committed text's suffix index (a branch of the drafter's tree; or, with the
chain policy, the whole chain, the drafter skipped or drafting on from the copy's end), or nothing
(a plain round: the anchor alone). One function decides each row's part of the round
(`plan_row` → a `RowPlan`), one runs the drafter for the rows that draft (`draft_round`) and one
builds the tree the target verifies (`row_tree`). The decoder (runtime/decoder.py) reads them in
that order; the verification rule (loopspec.decoding) does not care where a node came from, so
whatever is proposed here, the output is the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loopspec.engines.protocol import Engine
from loopspec.errors import LoopspecError
from loopspec.model.draft_head import DRAFT_CANDIDATES
from loopspec.precisions import REGISTRY as PRECISIONS
from loopspec.settings import DecodingSettings
from loopspec.tree import DraftTree, DynamicTree, Lattice, draft_tree


class AdaptiveFallback:
    """Decode autoregressively while drafting does not pay, and probe again later.

    Drafting pays when the rolling τ per second of a drafting round beats one token per second of a
    plain round: τ / t_round(draft) > 1 / t_round(ar). Both round costs and τ are measured on the
    rounds it decides (exponential moving averages). When drafting loses,
    `backoff` plain rounds follow (8, doubling on each consecutive loss up to 64), then drafting is
    probed again. Only the number of drafted tokens changes, never greedy output; seeded sampling
    stays exact in distribution but is no longer replayable token for token."""

    def __init__(self, alpha: float = 0.3, min_rounds: int = 3, backoff: int = 8, max_backoff: int = 64):
        self.alpha, self.min_rounds, self.initial_backoff, self.max_backoff = alpha, min_rounds, backoff, max_backoff
        self.backoff = backoff
        self.tau = self.t_draft_round = self.t_ar_round = None
        self.plain_left = 1  # one plain round first: it measures t_round(ar)
        self.draft_rounds = 0
        self.rounds_since_probe = 0
        self.fallback_rounds = 0
        self.switches = 0

    def _ema(self, old, new):
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def want_draft(self) -> bool:
        return self.plain_left <= 0

    def record(self, drafted: bool, committed: int, seconds: float) -> None:
        if not drafted:
            self.t_ar_round = self._ema(self.t_ar_round, seconds)
            self.plain_left -= 1
            if self.draft_rounds:  # a backoff round (the first calibration round is not a fallback)
                self.fallback_rounds += 1
            return
        self.draft_rounds += 1
        self.tau = self._ema(self.tau, committed)
        self.t_draft_round = self._ema(self.t_draft_round, seconds)
        self.rounds_since_probe += 1
        if self.rounds_since_probe < self.min_rounds or self.t_ar_round is None:
            return
        if self.tau / self.t_draft_round < 1.0 / self.t_ar_round:
            self.plain_left = self.backoff
            self.backoff = min(self.max_backoff, self.backoff * 2)
            self.switches += 1
            self.rounds_since_probe = 0
            self.tau = None  # the next probe judges on fresh evidence
        else:
            self.backoff = self.initial_backoff


@dataclass
class Drafted:
    """One row's drafter output for one verification: the candidates at every drafted depth."""

    candidates: torch.Tensor  # [D, C] target ids, rank-ordered (rank 0: the argmax chain)
    logprobs: torch.Tensor  # [D, C]
    stage_sizes: list[int]  # depths each stage drafted, in order (they sum to D)
    # the confidence head's estimate at each depth [D] (DSpark: P(accepted | the depths before were));
    # None when the drafter has none
    confidence: torch.Tensor | None = None
    # drafts sampled from the drafter (draft_sampling "drafter"): the distribution q each depth's
    # draft was drawn from [D, V]; None for argmax drafts
    q: torch.Tensor | None = None
    # tree kind "dynamic": every node the drafter grew (EAGLE-2's tree; candidates then hold each
    # depth's best nodes, rank 0 the path to the deepest best one); None otherwise
    dynamic: DynamicTree | None = None
    # a DFlash2 drafter's selector lattice over the drafted depths (trees are its best paths); None otherwise
    lattice: Lattice | None = None

    @property
    def stages(self) -> int:
        return len(self.stage_sizes)


def gate_score(gate: str, logprobs: torch.Tensor, confidence: torch.Tensor | None) -> float:
    """A stage's DLoop gate score: the summed log-probs of its argmax drafts (logprobs [D, C]), or the
    summed log of the confidence head's per-draft acceptance estimates (confidence [D]) — each an
    estimated log-probability that the whole stage is accepted."""
    if gate == "confidence":
        return float(torch.log(confidence.float().clamp_min(1e-30)).sum())
    return float(logprobs[:, 0].sum())


def draft_round(
    engine: Engine,
    settings: DecodingSettings,
    anchors: list[int],
    positions: list[int],
    budgets: list[int],
    sampling: list | None = None,
) -> list[Drafted]:
    """Draft stages for one verification of rows 0..B-1 (DLoop: the gate decides each next stage) → what
    each row drafted (at most `budget` depths). A row with budget 0 drafts nothing.

    Stage 1 drafts [anchor, MASK…] on the target context. While the gate score of a row's newest
    stage (the sum of its argmax drafts' log-probs) is >= the gate threshold and it ran fewer than
    max_stages, the row's next stage drafts from that stage's last argmax draft, its context
    extended — temporarily — with the stage's own final-norm hidden states as pseudo-features
    (feature(p) = z(p+1)). The gate only decides whether to ADD a stage: a drafted block is never
    dropped or cut for its own score.

    `sampling` (draft_sampling "drafter"): each row's (SamplingParams, generator); the engine samples
    every draft from the drafter's q (the gate then sums the sampled drafts' log q, and a later stage
    is anchored on the last sampled draft), and each Drafted carries q."""
    C = DRAFT_CANDIDATES
    nothing = Drafted(torch.empty(0, C, dtype=torch.long), torch.empty(0, C), [])
    live = [b for b, n in enumerate(budgets) if n > 0]
    if not live:  # plain rounds (ar, the fallback, no room left): nothing to ask the engine
        return [nothing] * len(budgets)
    if settings.dynamic_tree is not None:
        return dynamic_round(engine, settings, anchors, positions, budgets)
    k, max_context = settings.block_size, engine.max_context
    first = engine.drafter_cfg.first_draft  # block positions before the first draft (0 or 1)
    stages: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = [[] for _ in budgets]
    distributions: list[list[torch.Tensor]] = [[] for _ in budgets]  # q of each stage, when sampled
    lattices: list[list[Lattice]] = [[] for _ in budgets]  # a DFlash2 selector's, per stage
    anchors, positions = list(anchors), list(positions)
    start_lengths = dict(zip(live, engine.context_lengths(live)))
    while live:
        going, pseudo = [], []
        by_size: dict[int, list[int]] = {}
        for b in live:  # a stage that would run past the context is shorter; those go together
            by_size.setdefault(min(k, max_context - positions[b]), []).append(b)
        for size, group in by_size.items():
            stage = engine.draft(
                group,
                [anchors[b] for b in group],
                [positions[b] for b in group],
                size,
                **({"sampling": [sampling[b] for b in group]} if sampling is not None else {}),
            )
            drafts, logprobs, hidden = stage  # [R, size-first, C] ids and log-probs, [R, size, H]
            confidence = stage.confidence  # [R, size-first], None without a confidence head
            for i, b in enumerate(group):
                stages[b].append((drafts[i], logprobs[i], None if confidence is None else confidence[i]))
                if sampling is not None:
                    distributions[b].append(stage.q[i])
                if stage.lattice is not None:
                    lattices[b].append(stage.lattice.row(i))
                drafted = sum(d.shape[0] for d, _, _ in stages[b])
                # the last draft sits at the anchor's position + the stage's drafts
                next_position = positions[b] + drafts.shape[1]
                if (
                    len(stages[b]) >= settings.max_stages
                    or drafted >= budgets[b]
                    or max_context - next_position < k
                    or gate_score(settings.gate, logprobs[i], None if confidence is None else confidence[i])
                    < settings.gate_threshold
                ):
                    continue
                going.append(b)
                # the pseudo-feature of position p is the state that drafted p+1 (the target's tap at p
                # predicts p+1 likewise): block positions first.. cover the anchor's .. the last draft's
                pseudo.append(hidden[i, first:])
                anchors[b], positions[b] = int(drafts[i, -1, 0]), next_position
        if going:
            engine.append_pseudo_context(going, torch.stack(pseudo))
        live = going
    multi = [b for b in start_lengths if len(stages[b]) > 1]
    if multi:  # the pseudo-context never outlives the round
        engine.context_rollback(multi, [start_lengths[b] for b in multi])
    out = []
    for row_stages, row_q, row_lattices, n in zip(stages, distributions, lattices, budgets):
        if not row_stages:
            out.append(nothing)
            continue
        sizes, left = [], n
        for d, _, _ in row_stages:  # at most `budget` depths in all
            sizes.append(min(d.shape[0], left))
            left -= sizes[-1]
        confidence = (
            torch.cat([c for _, _, c in row_stages])[:n] if all(c is not None for _, _, c in row_stages) else None
        )
        candidates = torch.cat([d for d, _, _ in row_stages])[:n]
        lattice = Lattice.join(row_lattices, candidates[:, 0].tolist(), n) if row_lattices else None
        out.append(
            Drafted(
                candidates,
                torch.cat([lp for _, lp, _ in row_stages])[:n],
                [m for m in sizes if m],
                confidence,
                torch.cat(row_q)[:n] if row_q else None,
                lattice=lattice,
            )
        )
    return out


def dynamic_round(
    engine: Engine, settings: DecodingSettings, anchors: list[int], positions: list[int], budgets: list[int]
) -> list[Drafted]:
    """EAGLE-2's dynamic tree for rows 0..B-1 (settings.dynamic_tree): each row with a budget grows
    one of min(its depth, budget) steps (rows of one depth share the drafter's forwards) → Drafted
    carrying every node grown, and each depth's best nodes as its candidates."""
    shape, C = settings.dynamic_tree, DRAFT_CANDIDATES
    out = [Drafted(torch.empty(0, C, dtype=torch.long), torch.empty(0, C), [])] * len(budgets)
    by_depth: dict[int, list[int]] = {}
    for b, n in enumerate(budgets):
        if n > 0:
            by_depth.setdefault(min(shape.depth, n), []).append(b)
    for depth, group in by_depth.items():
        grown = engine.draft_dynamic(
            group, [anchors[b] for b in group], [positions[b] for b in group], shape.top_k, depth
        )
        for b, tree in zip(group, grown):
            candidates, logprobs = tree.ranked_candidates(C)
            out[b] = Drafted(candidates, logprobs, [depth], dynamic=tree)
    return out


@dataclass(frozen=True)
class RowPlan:
    """One row's part of a round: how deep it may draft and what fills that depth."""

    root: int  # the row's anchor token (the tree's root) and its position
    root_position: int
    room: int  # nodes that fit after the anchor in the context
    wanted: int  # the depth the row could verify (0: nothing left to draft), before the fallback's say
    depth: int  # the depth it verifies this round (0: a plain round)
    # the chain policy: the continuation of the text's earlier occurrence, verified as the chain
    # (None: the drafter's round, maybe with `suffix` as a branch)
    copy: list[int] | None
    extends: bool  # the drafter's one stage drafts on from the copy's last token
    stage_anchor: int  # where the drafter's first stage starts: token and position
    stage_position: int
    drafter_budget: int  # drafts the drafter may add (0: it does not run for this row)
    suffix: list[int]  # the suffix index's continuation, merged into the drafter's tree
    uses_drafter: bool
    stage_drafts: int  # drafts one drafter stage adds

    def stages(self, drafted: "Drafted") -> int:
        """Stages this round ran for the stats: the drafter's, with a copy counted as one."""
        if self.uses_drafter and self.copy is None:
            return drafted.stages
        return int(self.depth > 0) + (drafted.stages if self.extends else 0)

    def later_stage_tokens(self, accepted: int) -> int:
        """Accepted drafts past the first stage (DLoop's gain), or past the copy when the drafter extended it."""
        if self.uses_drafter and self.copy is None:
            return max(0, accepted - self.stage_drafts)
        return max(0, accepted - len(self.copy)) if self.extends else 0


def check_engine_runs(engine: Engine, settings: DecodingSettings) -> None:
    """Refuse, in one line, settings whose proposals this engine cannot draft or verify exactly."""
    if settings.uses_drafter and not engine.has_drafter:
        raise LoopspecError(f"{settings.method} needs a drafter")
    if engine.chains_only and settings.verifies_trees:
        target = engine.target_cfg
        why = (
            f"a {target.family} target's linear-attention state follows one path"
            if target.linear_attention is not None
            else f"its arithmetic is not order-exact: {engine.precision}"
        )
        instead = PRECISIONS[engine.precision].trees_instead if engine.precision in PRECISIONS else ""
        raise LoopspecError(
            f"this engine verifies chains exactly, not trees ({why}): "
            "use --tree-budget 0 --no-suffix, or --method suffix"
            + (f", or --precision {instead} (its engine verifies trees)" if instead else "")
        )
    drafts = settings.uses_drafter and engine.has_drafter
    if drafts and settings.suffix_then_draft and not engine.drafter_cfg.kind.drafts_past_a_gap:
        raise LoopspecError(
            f"an {engine.drafter_cfg.kind.title} drafter drafts from the end of its context only: "
            "drop --suffix-then-draft"
        )
    if settings.gate == "confidence" and not (engine.has_drafter and engine.drafter_cfg.kind.estimates_acceptance):
        raise LoopspecError(
            "the confidence gate needs a drafter with a confidence head (a DSpark drafter); use --gate logprob"
        )
    if settings.dynamic_tree is not None and not (engine.has_drafter and engine.drafter_cfg.kind.grows_dynamic_trees):
        raise LoopspecError(
            f"--tree-kind dynamic grows the tree one drafter step per depth, each node under its own "
            f"path (EAGLE-3 drafters); the {engine.drafter_cfg.kind.title} drafter drafts its block "
            "in one forward: use --tree-kind best-first"
        )
    if settings.dynamic_tree is not None and not engine.grows_dynamic_trees:
        raise LoopspecError(
            f"--tree-kind dynamic runs on the torch engine only (the {engine.backend} engine's "
            "EAGLE-3 graphs step one entry per row, without tree attention): use --backend torch, "
            "or --tree-kind best-first"
        )
    if settings.draft_sampling == "drafter" and not engine.samples_drafts:
        raise LoopspecError(
            f"draft sampling 'drafter' needs the drafter's whole distribution, which the "
            f"{engine.backend} engine's drafter does not return (it returns its top "
            "candidates): use --backend torch, or --draft-sampling walk"
        )


def plan_row(row, settings: DecodingSettings, engine: Engine, max_drafts: int, cap: int) -> RowPlan:
    """What a live row (runtime/decoder.py `Row`) drafts this round. It may verify up to the method's
    most drafts, no more than the tokens still wanted after the bonus, nor than the context holds
    after the anchor, and no more than `cap` (0: a plain round, the adaptive fallback's; the
    verification budget's choice for the row). The chain policy
    (suffix_first): a row whose text just repeated a long enough n-gram verifies the continuation
    of its earlier occurrence and skips the drafter (suffix_then_draft: the drafter's one stage
    drafts on from the copy's last token, in the room the copy leaves — a later stage's
    pseudo-context would sit at the context's end, not after the copy's gap)."""
    room = engine.max_context - row.position - 1
    left = row.max_new_tokens - len(row.tokens) - 1  # tokens still wanted after the bonus
    wanted = max(0, min(max_drafts, left, room)) if settings.drafting else 0
    depth = min(wanted, cap)
    index = row.suffix_index
    copy = (
        index.continuation(depth)
        if settings.suffix_first and depth and index.match_length() >= settings.suffix_first
        else None
    )
    extends = bool(copy) and settings.suffix_then_draft
    stage_drafts = engine.drafter_cfg.drafts_per_block(settings.block_size) if settings.uses_drafter else 0
    if not settings.uses_drafter or (copy is not None and not extends):
        budget = 0
    elif extends:
        budget = max(0, min(stage_drafts, room - len(copy), left - len(copy)))
    else:
        budget = depth
    return RowPlan(
        root=row.tokens[-1],
        root_position=row.position,
        room=room,
        wanted=wanted,
        depth=depth,
        copy=copy,
        extends=extends,
        stage_anchor=copy[-1] if extends else row.tokens[-1],
        stage_position=row.position + (len(copy) if extends else 0),
        drafter_budget=budget,
        suffix=index.continuation(depth) if copy is None and settings.suffix_branch and depth else [],
        uses_drafter=settings.uses_drafter,
        stage_drafts=stage_drafts,
    )


def drafter_sampling(rows, settings: DecodingSettings) -> list | None:
    """Each row's (SamplingParams, generator) when drafts are sampled from the drafter's q (draft
    sampling "drafter" and some row samples; greedy rows draft the argmax either way), else None."""
    if settings.draft_sampling != "drafter" or all(r.params.greedy for r in rows):
        return None
    return [(r.params, r.generator) for r in rows]


def row_tree(plan: RowPlan, drafted: Drafted, settings: DecodingSettings, tree_span: int) -> DraftTree:
    """The tree the target verifies for one row: the chain policy's copy (extended by what the drafter
    drafted from its end), else the drafter's nodes (its chain or best `tree_budget` nodes) with the
    suffix branch merged in."""
    if plan.copy is not None:
        tree = DraftTree.root(plan.root)
        tree.add_branch(plan.copy, plan.room)
        node = len(tree) - 1
        for token in drafted.candidates[:, 0].tolist():  # empty unless the drafter extends the copy
            node = tree.add(node, token, from_drafter=True)
        return tree
    tree = draft_tree(
        plan.root,
        drafted.candidates,
        drafted.logprobs,
        drafted.stage_sizes,
        tree_budget=settings.tree_budget,
        suffix=plan.suffix,
        max_nodes=plan.room,
        dynamic=drafted.dynamic,
        lattice=drafted.lattice,
    )
    first = plan.root_position
    if tree_span and not tree.is_chain and first // tree_span != (first + len(tree) - 1) // tree_span:
        # the tree's slots straddle a block of the engine's value product (engines/protocol.py):
        # this round verifies the drafter's chain, which sits where plain decoding puts it
        tree = draft_tree(
            plan.root,
            drafted.candidates,
            drafted.logprobs,
            drafted.stage_sizes,
            tree_budget=0,
            suffix=[],
            max_nodes=plan.room,
        )
    return tree
