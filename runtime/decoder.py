"""The decoder: prefill → draft → gate → verify → accept → commit/rollback, for every row at once.

A `Decoder` keeps one `Row` per live sequence (its committed tokens, sampling parameters and own
generator, stop tokens, token budget and stats) over an Engine's rows
(engines/protocol.py) and `step()` runs ONE round for all of them (`_round`, read top to bottom):

1. plan (runtime/proposal.py `plan_row`): what each row proposes — its depth, the drafter's stages,
   the suffix index's copy or branch, or nothing on a plain round;
2. draft (`draft_round`): every drafting row runs its stages — DLoop: each row's own gate decides
   whether it adds a stage; the rows still drafting share one drafter forward per stage — and each
   row's tree is built (`row_tree`);
3. verify: ONE target forward over every row's `[anchor, drafts…]`, right-padded, each row at its
   own position and KV length;
4. accept per row with the pure functions of `loopspec.decoding`, then commit: each row keeps its
   accepted path's KV, drops the rest, and appends only its accepted taps to its drafter context.

`ar` is block size 1 (nothing drafted: verifying the anchor alone yields the next token), so every
speedup is measured by identical code. Nothing a row computes depends on the other rows, so a row
commits the same tokens in any batch. `generate()` decodes one request: a decoder with one row.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from loopspec.decoding import SamplingParams, next_token, speculative_accept, tree_accept
from loopspec.engines.backends import torch_engine
from loopspec.engines.protocol import Engine
from loopspec.errors import LoopspecError
from loopspec.settings import DecodingSettings, resolve_settings
from loopspec.runtime.budget import VerifyBudget
from loopspec.runtime.constraint import masked
from loopspec.runtime.proposal import (
    AdaptiveFallback,
    Drafted,
    RowPlan,
    check_engine_runs,
    draft_round,
    drafter_sampling,
    plan_row,
    row_tree,
)
from loopspec.stats import GenerationStats, acceptance_length
from loopspec.suffix_library import SuffixLibrary
from loopspec.tree import DraftTree, SuffixIndex, tree_masks


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
    scope: Hashable = None  # whose earlier outputs its suffix index may read (the shared library's scope)
    started: float = 0.0
    draft_hits: float = 0.0  # drafts it accepted, and verifications that rejected one, fading (the budget's estimate)
    draft_misses: float = 0.0
    # its grammar (runtime/constraint.py Constraint: prune / masks / allowed / commit), None: unconstrained
    constraint: object | None = None
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


def path_taps(taps: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
    """The taps [B, T, n·H] of each row's accepted path (node indices), left-aligned → [B, P, n·H]."""
    if all(p == list(range(len(p))) for p in paths):  # chains: the paths are prefixes already
        return taps
    index = torch.zeros(len(paths), max(len(p) for p in paths), dtype=torch.long)
    for b, p in enumerate(paths):
        index[b, : len(p)] = torch.tensor(p)
    return taps.gather(1, index.to(taps.device)[..., None].expand(-1, -1, taps.shape[-1]))


class Decoder:
    """Continuous batching over an engine's rows: `admit` prefills a request into a free row, `step`
    runs one round for every live row and retires the rows that finished; `cancel` retires one.
    Live rows stay packed at the front of the caches (retiring a row moves the last one into its place).

    `pacing` decides how much each step verifies (settings.adaptive; runtime/budget.py `pacing`): the
    verification budget (runtime/budget.py) chooses each row's depth, zero included, and the width
    from a step-cost table; without one, the adaptive fallback decides for the rows a step verifies
    together (their verification is right-padded to the widest row, so one row decoding plainly
    beside drafting rows saves nothing, and a step's cost is the batch's; for one request it is that
    request's own fallback). Either changes what is verified, never the output.

    With settings.shared_suffix, the decoder owns a suffix library (loopspec/suffix_library.py): a
    row that finishes files its output under its scope, and later rows of that scope propose from it."""

    def __init__(
        self,
        engine: Engine,
        settings: DecodingSettings = DecodingSettings(),
        pacing: AdaptiveFallback | VerifyBudget | None = None,
        prefill_chunk: int | None = None,
    ):
        check_engine_runs(engine, settings)
        self.engine, self.settings = engine, settings
        self.max_drafts = settings.drafts_with(engine.drafter_cfg)
        if pacing is None and settings.adaptive:
            pacing = AdaptiveFallback()
        self.pacing = pacing if settings.drafting else None
        if prefill_chunk is not None and prefill_chunk < 1:
            raise LoopspecError(f"prefill chunk must be >= 1 token, got {prefill_chunk}")
        # a longer prompt is prefilled `prefill_chunk` tokens a step, between the live rows' rounds,
        # so admitting it does not stall them (None: every prompt whole, at admission)
        self.prefill_chunk = prefill_chunk
        self.rows: list[Row] = []
        self.prefilling: list[Prefilling] = []
        # finished rows' outputs, read by later rows of the same scope (settings.shared_suffix; None: off)
        self.library = SuffixLibrary(settings.shared_suffix) if settings.shared_suffix else None

    @property
    def free_rows(self) -> int:
        return self.engine.max_rows - len(self.rows) - len(self.prefilling)

    def admit(
        self,
        key: Hashable,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
        seed: int = 0,
        generator: torch.Generator | None = None,
        stop_token_ids: frozenset[int] | set[int] = frozenset(),
        constraint=None,
        scope: Hashable = None,
    ) -> tuple[Row, list[int]]:
        """Prefill a new sequence into a free row → (its Row, its first token). `scope` (opaque,
        hashable): the shared suffix library's scope its suffix index reads and its output is filed
        under (the server's tenant; rows of one scope share). A row that is already
        finished (first token a stop token, or max_new_tokens 1) is not kept. A prompt longer than
        `prefill_chunk` is only registered → (its Row, []): `step` prefills it chunk by chunk and
        returns its first token when the last chunk is in. `constraint`: the row's grammar
        (runtime/constraint.py), which every token it commits obeys."""
        if not prompt_ids:
            raise LoopspecError("empty prompt")
        if max_new_tokens < 1:
            raise LoopspecError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt_ids) >= self.engine.max_context:
            raise LoopspecError(
                f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.engine.max_context}"
            )
        if not self.free_rows:
            raise LoopspecError("no free row in the batch")
        if constraint is not None and self.settings.draft_sampling == "drafter" and not params.greedy:
            raise LoopspecError("structured output verifies drafts by the walk: use --draft-sampling walk")
        row = Row(
            key=key,
            prompt_len=len(prompt_ids),
            max_new_tokens=max_new_tokens,
            params=params,
            generator=generator or torch.Generator().manual_seed(seed),
            stop_token_ids=frozenset(stop_token_ids),
            started=time.perf_counter(),
            constraint=constraint,
            scope=scope,
            suffix_index=SuffixIndex(prompt_ids, shared=None if self.library is None else self.library.view(scope))
            if self.settings.uses_suffix
            else None,
        )
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
        rows, settings, engine = self.rows, self.settings, self.engine
        if not rows:
            return []
        t0 = time.perf_counter()
        budget = self.pacing if isinstance(self.pacing, VerifyBudget) else None
        fallback = self.pacing if isinstance(self.pacing, AdaptiveFallback) else None
        plain = fallback is not None and not fallback.want_draft()
        plans = [plan_row(row, settings, engine, self.max_drafts, 0 if plain else self.max_drafts) for row in rows]
        if budget is not None:  # each row's depth this step, zero included
            plans = [
                plan if cap >= plan.depth else plan_row(row, settings, engine, self.max_drafts, cap)
                for row, plan, cap in zip(rows, plans, budget.before_drafting(rows, plans))
            ]
        drafted = draft_round(
            engine,
            settings,
            [p.stage_anchor for p in plans],
            [p.stage_position for p in plans],
            [p.drafter_budget for p in plans],
            drafter_sampling(rows, settings),
        )
        trees = [row_tree(plan, d, settings, engine.tree_span) for plan, d in zip(plans, drafted)]
        if budget is not None:  # each row keeps its likeliest nodes, up to the width that pays
            trees = budget.after_drafting(rows, plans, drafted, trees, sum(p.drafter_budget > 0 for p in plans))
        # a grammar drops the drafts it rejects, with their descendants (last: its masks are the verified tree's)
        trees = [t if row.constraint is None else row.constraint.prune(t) for row, t in zip(rows, trees)]
        t1 = time.perf_counter()
        masks = None if all(t.is_chain for t in trees) else tree_masks(trees, max(len(t) for t in trees))
        logits, taps = engine.verify([t.tokens for t in trees], want_taps=settings.uses_drafter, tree_masks=masks)
        results = [
            self._accept(row, tree, d, _constrained(row, tree, logits[b, : len(tree)]))
            for b, (row, tree, d) in enumerate(zip(rows, trees, drafted))
        ]
        t2 = time.perf_counter()
        paths = [path for path, _ in results]
        if budget is not None:
            budget.record(rows, plans, drafted, trees, paths, seconds=t2 - t0)
        elif fallback is not None and any(p.wanted for p in plans):  # committed tokens per row per step, and its cost
            fallback.record(drafted=not plain, committed=sum(map(len, paths)) / len(rows), seconds=t2 - t0)
        # Commit: each row keeps its anchor and accepted path, moved into place; only their taps
        # enter its drafter context.
        engine.target_commit([r.position for r in rows], paths)
        if settings.uses_drafter:
            engine.append_context(path_taps(taps, paths), [len(p) for p in paths])
        events = []
        for row, plan, d, tree, (path, bonus) in zip(rows, plans, drafted, trees, results):
            if row.finish:  # failed in acceptance
                events.append((row, []))
                continue
            self._record(row, plan, d, tree, path, plain, t1 - t0, t2 - t1)
            events.append((row, self._commit(row, [tree.tokens[n] for n in path[1:]] + [bonus])))
        for b in reversed(range(len(rows))):
            if rows[b].finish:
                self._retire(b)
        return events

    @staticmethod
    def _accept(row: Row, tree: DraftTree, drafted: Drafted, logits: torch.Tensor) -> tuple[list[int], int | None]:
        """The row's accepted path (node indices from the anchor's 0) and bonus: speculative sampling
        against q where its drafts were sampled from the drafter, else the walk. A row whose
        acceptance fails ends with finish 'error' (its path the anchor alone); the others go on."""
        try:
            if drafted.q is None or row.params.greedy:
                return tree_accept(tree, logits, row.params, row.generator)
            accepted, bonus = speculative_accept(
                tree.tokens[1:], drafted.q[: tree.drafts], logits, row.params, row.generator
            )
            return list(range(accepted + 1)), bonus
        except Exception as e:  # noqa: BLE001 — one row's failure must not end the others
            row.finish, row.error = "error", f"{type(e).__name__}: {e}"
            return [0], None

    def _record(
        self,
        row: Row,
        plan: RowPlan,
        drafted: Drafted,
        tree: DraftTree,
        path: list[int],
        plain: bool,
        draft_s: float,
        verify_s: float,
    ) -> None:
        """The round in the row's stats."""
        stats, accepted = row.stats, len(path) - 1
        stats.draft_s += draft_s
        stats.verify_s += verify_s
        stats.accepted_per_round.append(accepted)
        stats.stages_per_round.append(plan.stages(drafted) if tree.drafts else 0)  # 0: it verified no draft
        stats.nodes_per_round.append(tree.drafts)
        stats.suffix_tokens += sum(tree.from_suffix[n] and not tree.from_drafter[n] for n in path[1:])
        stats.later_stage_tokens += plan.later_stage_tokens(accepted)
        if isinstance(self.pacing, AdaptiveFallback):
            stats.fallback_rounds += plain and plan.wanted > 0 and self.pacing.draft_rounds > 0
            stats.fallback_switches = self.pacing.switches
        elif self.pacing is not None:  # the budget verified no draft where the row could have
            stats.fallback_rounds += plan.wanted > 0 and not tree.drafts

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
        chunk = pending.prompt_ids[pending.done : pending.done + self.prefill_chunk]
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
        if row.constraint is not None:
            logits = masked(logits, row.constraint.allowed())
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
        """Append new tokens up to a stop token, or up to the token that completes the row's grammar
        (its constraint advances over each); set finish when the row is done → the tokens kept."""
        for i, token in enumerate(new):
            if token in row.stop_token_ids or (row.constraint is not None and row.constraint.commit(token)):
                new, row.finish = new[: i + 1], "stop"
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

    def _retire(self, b: int) -> None:
        row = self.rows[b]
        if self.library is not None and row.finish != "error":  # its output, for the scope's later rows
            self.library.add(row.scope, row.suffix_index.tokens[: row.prompt_len], row.tokens)
        last = len(self.rows) - 1
        if b != last:  # keep the live rows packed at the front of the caches
            self.engine.swap_rows(last, b)
            self.rows[b] = self.rows[last]
        self.rows.pop()


def _constrained(row: Row, tree: DraftTree, logits: torch.Tensor) -> torch.Tensor:
    """A row's verified logits [nodes, V], masked by its grammar after each node's path."""
    return logits if row.constraint is None else masked(logits, row.constraint.masks(tree))


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


def regenerate_responses(
    target,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_token_ids: set[int],
    params: SamplingParams,
    generator: torch.Generator,
) -> list[tuple[list[int], str]]:
    """The target's own responses to `prompts` (training data), decoded together plainly (`ar`, one
    row per prompt, each row seeded from `generator`) → per prompt (response tokens, finish reason)."""
    engine = torch_engine(target, None, max(len(p) for p in prompts) + max_new_tokens, max_rows=len(prompts))
    seeds = torch.randint(1 << 62, (len(prompts),), generator=generator).tolist()
    done = decode_all(
        Decoder(engine),
        [
            dict(
                key=b,
                prompt_ids=p,
                max_new_tokens=max_new_tokens,
                params=params,
                seed=seeds[b],
                stop_token_ids=frozenset(stop_token_ids),
            )
            for b, p in enumerate(prompts)
        ],
    )
    return [(done[b].tokens, done[b].finish if done[b].finish == "stop" else "length") for b in range(len(prompts))]


def drafter_chain_tau(
    target,
    drafter,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_token_ids: set[int],
    block_size: int | None = None,
) -> dict:
    """τ of `drafter`'s chain on `prompts` (a training run's held-out prompts), decoded greedily as the
    runtime decodes them: `dflash` at the block size the settings resolve for the drafter (or
    `block_size`), the chain alone (no tree, no suffix branch), one row per prompt, and the adaptive
    fallback off, since its timing-driven plain rounds would make τ depend on the machine's load
    → {"tau": τ pooled over the prompts (None where no round drafted), "block_size", "tokens"}.

    The engine prepacks the modules it runs for inference, in place: it runs copies, so the caller's
    target and drafter (a training run's, between two optimizer steps) compute exactly as before."""
    settings = resolve_settings(
        "dflash", drafter.cfg, block_size=block_size, adaptive=False, tree_budget=0, suffix=False, suffix_first=0
    )
    with torch.no_grad():
        target, drafter = copy.deepcopy(target), copy.deepcopy(drafter)
    room = max(len(p) for p in prompts) + max_new_tokens + settings.block_size
    engine = torch_engine(target, drafter, room, max_rows=len(prompts))
    done = decode_all(
        Decoder(engine, settings),
        [
            dict(
                key=b,
                prompt_ids=p,
                max_new_tokens=max_new_tokens,
                params=SamplingParams(),
                seed=0,
                stop_token_ids=frozenset(stop_token_ids),
            )
            for b, p in enumerate(prompts)
        ],
    )
    rows = [done[b] for b in range(len(prompts))]
    return {
        "tau": acceptance_length(row.stats for row in rows),
        "block_size": settings.block_size,
        "tokens": sum(len(row.tokens) for row in rows),
    }


def generate(
    engine: Engine,
    prompt_ids: list[int],
    settings: DecodingSettings = DecodingSettings(),
    *,
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    seed: int = 0,
    generator: torch.Generator | None = None,
    stop_token_ids: frozenset[int] | set[int] = frozenset(),
    pacing: AdaptiveFallback | VerifyBudget | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    constraint=None,
) -> GenerationResult:
    """Decode one request up to `max_new_tokens` after `prompt_ids`: the decoder with one row
    (`constraint`: its grammar, runtime/constraint.py)."""
    decoder = Decoder(engine, settings, pacing)
    row, first = decoder.admit(
        None,
        prompt_ids,
        max_new_tokens=max_new_tokens,
        params=params,
        seed=seed,
        generator=generator,
        stop_token_ids=stop_token_ids,
        constraint=constraint,
    )
    if on_tokens:
        on_tokens(first)
    while decoder.rows:
        for _, new in decoder.step():
            if on_tokens and new:
                on_tokens(new)
    if row.finish == "error":
        raise LoopspecError(f"decoding failed: {row.error}")
    return GenerationResult(tokens=row.tokens, stats=row.stats, settings=settings)
