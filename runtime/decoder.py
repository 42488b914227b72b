"""The decoder: prefill → draft → gate → verify → accept → commit/rollback, for every row at once.

A `Decoder` keeps one `Row` per live sequence (its committed tokens, sampling parameters and own
generator, stop tokens, token budget and stats) over an Engine's rows
(engines/protocol.py) and `step()` runs ONE round for all of them:

1. draft (`draft_round`): every drafting row runs its stages — DLoop: each row's own gate decides
   whether it adds a stage; the rows still drafting share one drafter forward per stage;
2. verify: ONE target forward over every row's `[anchor, drafts…]`, right-padded, each row at its
   own position and KV length;
3. accept per row with the pure functions of `loopspec.decoding`, then roll back each row's rejected
   KV and append only its accepted taps to its drafter context.

`ar` is block size 1 (nothing drafted: verifying the anchor alone yields the next token), so every
speedup is measured by identical code. Nothing a row computes depends on the other rows, so a row
commits the same tokens in any batch. `generate()` decodes one request: a decoder with one row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from loopspec.decoding import SamplingParams, next_token, speculative_accept, tree_accept
from loopspec.engines.backends import torch_engine
from loopspec.engines.protocol import Engine
from loopspec.errors import LoopspecError
from loopspec.model.drafter import DRAFT_CANDIDATES
from loopspec.settings import DecodingSettings
from loopspec.stats import GenerationStats
from loopspec.tree import DraftTree, SuffixIndex, draft_tree, tree_masks


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
class GenerationResult:
    tokens: list[int]
    stats: GenerationStats
    settings: DecodingSettings


@dataclass
class Row:
    """One live sequence. `tokens` are the committed new tokens; the last one is the anchor."""

    key: Hashable  # the caller's handle for this sequence
    prompt_len: int
    max_new_tokens: int
    params: SamplingParams
    generator: torch.Generator
    stop_token_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    suffix_index: SuffixIndex | None = None  # the committed text (prompt + tokens), when suffix drafting
    started: float = 0.0
    finish: str = ""  # "" while live; then stop | length | context | error | cancelled
    error: str = ""

    @property
    def position(self) -> int:
        """The anchor's position (it is not in the KV cache yet)."""
        return self.prompt_len + len(self.tokens) - 1


@dataclass
class Prefilling:
    """A row whose prompt is prefilled in chunks, one chunk a step, in an engine row of its own."""

    row: Row
    prompt_ids: list[int]
    slot: int  # its engine row until the prompt is in (then it joins the live rows)
    done: int = 0  # prompt tokens in its caches


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


def draft_round(engine: Engine, settings: DecodingSettings, anchors: list[int], positions: list[int],
                budgets: list[int], sampling: list | None = None) -> list[Drafted]:
    """Draft stages for one verification of rows 0..B-1 (DLoop: the gate decides each next stage) → what each row drafted (at most
    `budget` depths). A row with budget 0 drafts nothing.

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
    k, max_context = settings.block_size, engine.max_context
    first = engine.drafter_cfg.first_draft  # block positions before the first draft (0 or 1)
    stages: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = [[] for _ in budgets]
    distributions: list[list[torch.Tensor]] = [[] for _ in budgets]  # q of each stage, when sampled
    anchors, positions = list(anchors), list(positions)
    start_lengths = dict(zip(live, engine.context_lengths(live)))
    while live:
        going, pseudo = [], []
        by_size: dict[int, list[int]] = {}
        for b in live:  # a stage that would run past the context is shorter; those go together
            by_size.setdefault(min(k, max_context - positions[b]), []).append(b)
        for size, group in by_size.items():
            stage = engine.draft(group, [anchors[b] for b in group], [positions[b] for b in group], size,
                                 **({"sampling": [sampling[b] for b in group]} if sampling is not None else {}))
            drafts, logprobs, hidden = stage  # [R, size-first, C] ids and log-probs, [R, size, H]
            confidence = stage.confidence  # [R, size-first], None without a confidence head
            for i, b in enumerate(group):
                stages[b].append((drafts[i], logprobs[i], None if confidence is None else confidence[i]))
                if sampling is not None:
                    distributions[b].append(stage.q[i])
                drafted = sum(d.shape[0] for d, _, _ in stages[b])
                # the last draft sits at the anchor's position + the stage's drafts
                next_position = positions[b] + drafts.shape[1]
                if (len(stages[b]) >= settings.max_stages or drafted >= budgets[b]
                        or max_context - next_position < k
                        or gate_score(settings.gate, logprobs[i], None if confidence is None else confidence[i])
                        < settings.gate_threshold):
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
    for row_stages, row_q, n in zip(stages, distributions, budgets):
        if not row_stages:
            out.append(nothing)
            continue
        sizes, left = [], n
        for d, _, _ in row_stages:  # at most `budget` depths in all
            sizes.append(min(d.shape[0], left))
            left -= sizes[-1]
        confidence = (torch.cat([c for _, _, c in row_stages])[:n] if all(c is not None for _, _, c in row_stages)
                      else None)
        out.append(Drafted(torch.cat([d for d, _, _ in row_stages])[:n], torch.cat([lp for _, lp, _ in row_stages])[:n],
                           [m for m in sizes if m], confidence, torch.cat(row_q)[:n] if row_q else None))
    return out


def path_taps(taps: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
    """The taps [B, T, n·H] of each row's accepted path (node indices), left-aligned → [B, P, n·H]."""
    if all(p == list(range(len(p))) for p in paths):  # chains: the paths are prefixes already
        return taps
    index = torch.zeros(len(paths), max(len(p) for p in paths), dtype=torch.long)
    for b, p in enumerate(paths):
        index[b, :len(p)] = torch.tensor(p)
    return taps.gather(1, index.to(taps.device)[..., None].expand(-1, -1, taps.shape[-1]))


class Decoder:
    """Continuous batching over an engine's rows: `admit` prefills a request into a free row, `step`
    runs one round for every live row and retires the rows that finished; `cancel` retires one.
    Live rows stay packed at the front of the caches (retiring a row moves the last one into its place).

    The adaptive fallback (settings.adaptive, or `fallback` given) decides for the rows a step verifies
    together: their verification is right-padded to the widest row, so one row decoding plainly beside
    drafting rows saves nothing, and a step's cost is the batch's. For one request it is that
    request's own fallback."""

    def __init__(self, engine: Engine, settings: DecodingSettings = DecodingSettings(),
                 fallback: AdaptiveFallback | None = None, prefill_chunk: int | None = None):
        if settings.uses_drafter and not engine.has_drafter:
            raise LoopspecError(f"{settings.method} needs a drafter")
        if engine.chains_only and (settings.tree_budget or settings.suffix):
            raise LoopspecError("this engine verifies chains exactly, not trees (its arithmetic is not order-exact: "
                                f"{engine.precision}): "
                                "use --tree-budget 0 --no-suffix, or --method suffix")
        if settings.gate == "confidence" and not (engine.has_drafter and engine.drafter_cfg.confidence_head):
            raise LoopspecError("the confidence gate needs a drafter with a confidence head (a DSpark drafter); "
                                "use --gate logprob")
        if settings.draft_sampling == "drafter" and not engine.samples_drafts:
            raise LoopspecError(f"draft sampling 'drafter' needs the drafter's whole distribution, which the "
                                f"{engine.backend} engine's drafter does not return (it returns its top "
                                "candidates): use --backend torch, or --draft-sampling walk")
        self.engine, self.settings = engine, settings
        self.max_drafts = settings.drafts_with(engine.drafter_cfg)
        if fallback is None and settings.adaptive:
            fallback = AdaptiveFallback()
        self.fallback = fallback if settings.drafting else None
        if prefill_chunk is not None and prefill_chunk < 1:
            raise LoopspecError(f"prefill chunk must be >= 1 token, got {prefill_chunk}")
        # a longer prompt is prefilled `prefill_chunk` tokens a step, between the live rows' rounds,
        # so admitting it does not stall them (None: every prompt whole, at admission)
        self.prefill_chunk = prefill_chunk
        self.rows: list[Row] = []
        self.prefilling: list[Prefilling] = []

    @property
    def free_rows(self) -> int:
        return self.engine.max_rows - len(self.rows) - len(self.prefilling)

    def admit(self, key: Hashable, prompt_ids: list[int], *, max_new_tokens: int,
              params: SamplingParams = SamplingParams(), seed: int = 0, generator: torch.Generator | None = None,
              stop_token_ids: frozenset[int] | set[int] = frozenset()) -> tuple[Row, list[int]]:
        """Prefill a new sequence into a free row → (its Row, its first token). A row that is already
        finished (first token a stop token, or max_new_tokens 1) is not kept. A prompt longer than
        `prefill_chunk` is only registered → (its Row, []): `step` prefills it chunk by chunk and
        returns its first token when the last chunk is in."""
        if not prompt_ids:
            raise LoopspecError("empty prompt")
        if max_new_tokens < 1:
            raise LoopspecError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt_ids) >= self.engine.max_context:
            raise LoopspecError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.engine.max_context}")
        if not self.free_rows:
            raise LoopspecError("no free row in the batch")
        row = Row(key=key, prompt_len=len(prompt_ids), max_new_tokens=max_new_tokens, params=params,
                  generator=generator or torch.Generator().manual_seed(seed), stop_token_ids=frozenset(stop_token_ids),
                  started=time.perf_counter(),
                  suffix_index=SuffixIndex(prompt_ids) if self.settings.uses_suffix else None)
        row.stats.prompt_tokens, row.stats.drafting = len(prompt_ids), self.settings.drafting
        if self.prefill_chunk is not None and len(prompt_ids) > self.prefill_chunk:
            self.prefilling.append(Prefilling(row, list(prompt_ids), self._free_slot()))
            return row, []
        self._clear(len(self.rows))
        logits = self.engine.prefill(len(self.rows), prompt_ids, want_taps=self.settings.uses_drafter)
        return row, self._start(row, logits)

    def step(self) -> list[tuple[Row, list[int]]]:
        """One chunk of the oldest prompt still prefilling (its row joins when its prompt is in), then
        one draft → verify → accept round over every live row → [(row, its new tokens)]; rows that
        finished (see Row.finish) are retired. A row whose acceptance fails ends with finish 'error';
        the others go on."""
        events = self._prefill_chunk() if self.prefilling else []
        return events + self._round()

    def _round(self) -> list[tuple[Row, list[int]]]:
        rows, settings = self.rows, self.settings
        if not rows:
            return []
        t0 = time.perf_counter()
        possible = [self._draft_depth(r) for r in rows]
        plain = self.fallback is not None and not self.fallback.want_draft()
        depths = [0 if plain else n for n in possible]
        # the chain policy: a row whose text just repeated a long enough n-gram verifies the
        # continuation of its earlier occurrence and skips the drafter this round
        copying = [bool(settings.suffix_first and depths[b] and row.suffix_index.longest_match()[0] >= settings.suffix_first)
                   for b, row in enumerate(rows)]
        copies = [row.suffix_index.continuation(depths[b]) if copying[b] else None for b, row in enumerate(rows)]
        # the policy's second variant: the drafter's stage drafts on from the copy's last token
        extend = [bool(c) and settings.suffix_then_draft for c in copies]
        anchors = [c[-1] if x else r.tokens[-1] for r, c, x in zip(rows, copies, extend)]
        positions = [r.position + (len(c) if x else 0) for r, c, x in zip(rows, copies, extend)]
        budgets = [self._drafter_budget(row, depths[b], copies[b], extend[b]) for b, row in enumerate(rows)]
        # real-q sampling: only when a row samples (greedy rows draft the argmax either way)
        sampling = ([(r.params, r.generator) for r in rows]
                    if settings.draft_sampling == "drafter" and not all(r.params.greedy for r in rows) else None)
        drafted = draft_round(self.engine, settings, anchors, positions, budgets, sampling)
        trees = [self._tree(row, drafted[b], depths[b], copies[b]) for b, row in enumerate(rows)]
        t1 = time.perf_counter()
        masks = None if all(t.is_chain for t in trees) else tree_masks(trees, max(len(t) for t in trees))
        logits, taps = self.engine.verify([t.tokens for t in trees], want_taps=settings.uses_drafter,
                                          tree_masks=masks)
        results: list[tuple[list[int], int | None]] = []
        for b, row in enumerate(rows):
            try:
                results.append(self._accept(trees[b], drafted[b], logits[b, :len(trees[b])], row))
            except Exception as e:  # noqa: BLE001 — one row's failure must not end the others
                row.finish, row.error = "error", f"{type(e).__name__}: {e}"
                results.append(([0], None))
        t2 = time.perf_counter()
        paths = [path for path, _ in results]
        if self.fallback is not None and any(possible):  # committed tokens per row per step, and its cost
            self.fallback.record(drafted=not plain, committed=sum(len(p) for p in paths) / len(rows), seconds=t2 - t0)
        # Commit: each row keeps its anchor and accepted path, moved into place; only their taps
        # enter its drafter context.
        self.engine.target_commit([r.position for r in rows], paths)
        if settings.uses_drafter:
            self.engine.append_context(path_taps(taps, paths), [len(p) for p in paths])
        events = []
        for b, row in enumerate(rows):
            (path, bonus), tree = results[b], trees[b]
            if row.finish:  # failed in acceptance
                events.append((row, []))
                continue
            stats, accepted = row.stats, len(path) - 1
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            stats.accepted_per_round.append(accepted)
            stats.stages_per_round.append(drafted[b].stages if settings.uses_drafter and not copying[b]
                                          else int(depths[b] > 0) + (drafted[b].stages if extend[b] else 0))
            stats.nodes_per_round.append(tree.drafts)
            stats.suffix_tokens += sum(tree.from_suffix[n] and not tree.from_drafter[n] for n in path[1:])
            if settings.uses_drafter and not copying[b]:
                stats.later_stage_tokens += max(0, accepted - self.engine.drafter_cfg.drafts_per_block(settings.block_size))
            elif extend[b]:  # the drafter's stage came after the copy
                stats.later_stage_tokens += max(0, accepted - len(copies[b]))
            if self.fallback is not None:
                stats.fallback_rounds += plain and possible[b] > 0 and self.fallback.draft_rounds > 0
                stats.fallback_switches = self.fallback.switches
            events.append((row, self._commit(row, [tree.tokens[n] for n in path[1:]] + [bonus])))
        for b in reversed(range(len(rows))):
            if rows[b].finish:
                self._retire(b)
        return events

    @staticmethod
    def _accept(tree: DraftTree, drafted: Drafted, logits: torch.Tensor, row: Row) -> tuple[list[int], int]:
        """The row's accepted path (node indices from the anchor's 0) and bonus: speculative sampling
        against q where its drafts were sampled from the drafter, else the walk."""
        if drafted.q is None or row.params.greedy:
            return tree_accept(tree, logits, row.params, row.generator)
        accepted, bonus = speculative_accept(tree.tokens[1:], drafted.q[:tree.drafts], logits, row.params,
                                             row.generator)
        return list(range(accepted + 1)), bonus

    def cancel(self, key: Hashable) -> Row | None:
        """Retire the row of `key` (a cancelled or timed-out request) → that row, if live or prefilling."""
        for b, row in enumerate(self.rows):
            if row.key == key:
                row.finish = row.finish or "cancelled"
                self._retire(b)
                return row
        for pending in self.prefilling:
            if pending.row.key == key:
                pending.row.finish = pending.row.finish or "cancelled"
                self.prefilling.remove(pending)  # its engine row is free again
                return pending.row
        return None

    # ---- prefill -----------------------------------------------------------------------------------
    def _prefill_chunk(self) -> list[tuple[Row, list[int]]]:
        """The next chunk of the oldest prefilling prompt; when it is the last, the row joins the
        live rows (its caches swapped to the end of theirs) → [(row, [its first token])], else []."""
        pending = self.prefilling[0]
        chunk = pending.prompt_ids[pending.done:pending.done + self.prefill_chunk]
        logits = self.engine.prefill(pending.slot, chunk, want_taps=self.settings.uses_drafter, start=pending.done)
        pending.done += len(chunk)
        if pending.done < len(pending.prompt_ids):
            return []
        self.prefilling.pop(0)
        target = len(self.rows)
        if pending.slot != target:  # whatever sits there (a free row, or a prompt still prefilling) takes its slot
            self.engine.swap_rows(pending.slot, target)
            for other in self.prefilling:
                if other.slot == target:
                    other.slot = pending.slot
        return [(pending.row, self._start(pending.row, logits))]

    def _start(self, row: Row, logits: torch.Tensor) -> list[int]:
        """A prefilled row's first token from its prompt's last logits; it joins the live rows unless done."""
        anchor = next_token(logits, row.params, row.generator)
        row.stats.prefill_s = time.perf_counter() - row.started
        self._commit(row, [anchor])
        if not row.finish:
            self.rows.append(row)
        return [anchor]

    def _free_slot(self) -> int:
        """The lowest engine row that neither a live row nor a prefilling prompt holds."""
        held = {p.slot for p in self.prefilling}
        return next(i for i in range(len(self.rows), self.engine.max_rows) if i not in held)

    def _clear(self, slot: int) -> None:
        """Make engine row `slot` free: a prefilling prompt there moves to another free row."""
        for pending in self.prefilling:
            if pending.slot == slot:
                held = {p.slot for p in self.prefilling}
                free = next(i for i in range(len(self.rows), self.engine.max_rows) if i not in held)
                self.engine.swap_rows(slot, free)
                pending.slot = free

    # ---- internals ---------------------------------------------------------------------------------
    def _commit(self, row: Row, new: list[int]) -> list[int]:
        """Append new tokens up to a stop token; set finish when the row is done → the tokens kept."""
        for i, token in enumerate(new):
            if token in row.stop_token_ids:
                new, row.finish = new[:i + 1], "stop"
                break
        row.tokens += new
        if row.suffix_index is not None:
            row.suffix_index.extend(new)
        row.stats.new_tokens = len(row.tokens)
        if not row.finish:
            if len(row.tokens) >= row.max_new_tokens:
                row.finish = "length"
            elif row.position >= self.engine.max_context:  # the anchor itself no longer fits
                row.finish = "context"
        if row.finish:
            row.stats.finish_reason = row.finish
            row.stats.total_s = time.perf_counter() - row.started
        return new

    def _draft_depth(self, row: Row) -> int:
        """How deep this round may draft: the method's most drafts, no more than the tokens still
        wanted after the bonus, nor than the context holds after the anchor."""
        if not self.settings.drafting:
            return 0
        remaining = row.max_new_tokens - len(row.tokens)
        return max(0, min(self.max_drafts, remaining - 1, self._room(row)))

    def _drafter_budget(self, row: Row, depth: int, copy: list[int] | None, extend: bool) -> int:
        """Drafts the drafter may add this round: none for ar and suffix, nor beside a plain copy;
        after a copy (suffix_then_draft) one stage in the room the copy leaves — a later stage's
        pseudo-context would sit at the context's end, not after the copy's gap."""
        if not self.settings.uses_drafter or (copy is not None and not extend):
            return 0
        if extend:
            wanted = row.max_new_tokens - len(row.tokens) - 1 - len(copy)  # tokens still wanted after the copy
            stage = self.engine.drafter_cfg.drafts_per_block(self.settings.block_size)
            return max(0, min(stage, self._room(row) - len(copy), wanted))
        return depth

    def _room(self, row: Row) -> int:
        return self.engine.max_context - row.position - 1  # nodes that fit after the anchor

    def _tree(self, row: Row, drafted: Drafted, depth: int, copy: list[int] | None = None) -> DraftTree:
        """The row's draft tree for this round: the drafter's nodes, and the suffix branch (the chain
        policy's `copy`: the suffix's continuation as the chain, extended by what the drafter drafted
        from its end)."""
        if copy is not None:
            tree = DraftTree.root(row.tokens[-1])
            tree.add_branch(copy, self._room(row))
            node = len(tree) - 1
            for token in drafted.candidates[:, 0].tolist():  # empty unless suffix_then_draft
                node = tree.add(node, token, from_drafter=True)
            return tree
        suffix = row.suffix_index.continuation(depth) if row.suffix_index is not None and depth else []
        tree = draft_tree(row.tokens[-1], drafted.candidates, drafted.logprobs, drafted.stage_sizes,
                          tree_budget=self.settings.tree_budget, suffix=suffix, max_nodes=self._room(row))
        span, first = self.engine.tree_span, row.position
        if span and not tree.is_chain and first // span != (first + len(tree) - 1) // span:
            # the tree's slots straddle a block of the engine's value product (engines/protocol.py):
            # this round verifies the drafter's chain, which sits where plain decoding puts it
            tree = draft_tree(row.tokens[-1], drafted.candidates, drafted.logprobs, drafted.stage_sizes,
                              tree_budget=0, suffix=[], max_nodes=self._room(row))
        return tree

    def _retire(self, b: int) -> None:
        last = len(self.rows) - 1
        if b != last:  # keep the live rows packed at the front of the caches
            self.engine.swap_rows(last, b)
            self.rows[b] = self.rows[last]
        self.rows.pop()


def decode_all(decoder: Decoder, requests: list[dict]) -> dict[Hashable, Row]:
    """Admit `requests` (kwargs of `admit`, with a `key`) as rows free up and step until all are done
    → {key: finished Row}. Continuous batching without a server (training data is made with it)."""
    waiting, done = list(requests), {}
    while waiting or decoder.rows or decoder.prefilling:
        while waiting and decoder.free_rows:
            row, _ = decoder.admit(**waiting.pop(0))
            if row.finish:
                done[row.key] = row
        for row, _ in decoder.step():
            if row.finish:
                done[row.key] = row
    return done


def regenerate_responses(target, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: set[int],
                         params: SamplingParams, generator: torch.Generator) -> list[tuple[list[int], str]]:
    """The target's own responses to `prompts` (training data), decoded together plainly (`ar`, one
    row per prompt, each row seeded from `generator`) → per prompt (response tokens, finish reason)."""
    engine = torch_engine(target, None, max(len(p) for p in prompts) + max_new_tokens, max_rows=len(prompts))
    seeds = torch.randint(1 << 62, (len(prompts),), generator=generator).tolist()
    done = decode_all(Decoder(engine), [dict(key=b, prompt_ids=p, max_new_tokens=max_new_tokens, params=params,
                                             seed=seeds[b], stop_token_ids=frozenset(stop_token_ids))
                                        for b, p in enumerate(prompts)])
    return [(done[b].tokens, done[b].finish if done[b].finish == "stop" else "length") for b in range(len(prompts))]


def generate(engine: Engine, prompt_ids: list[int], settings: DecodingSettings = DecodingSettings(), *,
             max_new_tokens: int, params: SamplingParams = SamplingParams(), seed: int = 0,
             generator: torch.Generator | None = None, stop_token_ids: frozenset[int] | set[int] = frozenset(),
             fallback: AdaptiveFallback | None = None,
             on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """Decode one request up to `max_new_tokens` after `prompt_ids`: the decoder with one row."""
    decoder = Decoder(engine, settings, fallback)
    row, first = decoder.admit(None, prompt_ids, max_new_tokens=max_new_tokens, params=params, seed=seed,
                               generator=generator, stop_token_ids=stop_token_ids)
    if on_tokens:
        on_tokens(first)
    while decoder.rows:
        for _, new in decoder.step():
            if on_tokens and new:
                on_tokens(new)
    if row.finish == "error":
        raise LoopspecError(f"decoding failed: {row.error}")
    return GenerationResult(tokens=row.tokens, stats=row.stats, settings=settings)
