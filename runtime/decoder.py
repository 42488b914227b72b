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

from loopspec.decoding import SamplingParams, greedy_accept, next_token, probabilities, speculative_accept
from loopspec.errors import LoopspecError
from loopspec.settings import DecodingSettings
from loopspec.stats import GenerationStats


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
    started: float = 0.0
    finish: str = ""  # "" while live; then stop | length | context | error | cancelled
    error: str = ""

    @property
    def position(self) -> int:
        """The anchor's position (it is not in the KV cache yet)."""
        return self.prompt_len + len(self.tokens) - 1


def draft_round(engine, settings: DecodingSettings, anchors: list[int], positions: list[int],
                budgets: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """Draft stages for one verification of rows 0..B-1 (design §4) → (drafts per row [≤ budget],
    stages per row). A row with budget 0 drafts nothing.

    Stage 1 drafts [anchor, MASK…] on the target context. While the gate score of a row's newest
    stage (the sum of its drafts' log-probs) is >= the gate threshold and it ran fewer than
    max_stages, the row's next stage drafts from that stage's last draft, its context extended —
    temporarily — with the stage's own final-norm hidden states as pseudo-features (feature(p) =
    z(p+1)). The gate only decides whether to ADD a stage: a drafted block is never dropped or cut
    for its own score."""
    empty = torch.empty(0, dtype=torch.long)
    live = [b for b, n in enumerate(budgets) if n > 0]
    if not live:  # plain rounds (ar, the fallback, no room left): nothing to ask the engine
        return [empty] * len(budgets), [0] * len(budgets)
    k, max_context = settings.block_size, engine.max_context
    chains: list[list[torch.Tensor]] = [[] for _ in budgets]
    stages = [0] * len(budgets)
    anchors, positions = list(anchors), list(positions)
    start_lengths = dict(zip(live, engine.context_lengths(live)))
    while live:
        going, pseudo = [], []
        by_size: dict[int, list[int]] = {}
        for b in live:  # a stage that would run past the context is shorter; those go together
            by_size.setdefault(min(k, max_context - positions[b]), []).append(b)
        for size, group in by_size.items():
            drafts, logprobs, hidden = engine.draft(group, [anchors[b] for b in group], [positions[b] for b in group],
                                                    size)
            for i, b in enumerate(group):
                chains[b].append(drafts[i])
                stages[b] += 1
                drafted = sum(d.numel() for d in chains[b])
                next_position = positions[b] + size - 1
                if (stages[b] >= settings.max_stages or drafted >= budgets[b]
                        or max_context - next_position < k
                        or float(logprobs[i].sum()) < settings.gate_threshold):
                    continue
                going.append(b)
                pseudo.append(hidden[i, 1:])  # positions .. +k-2 get feature(p) = z(p+1)
                anchors[b], positions[b] = int(drafts[i, -1]), next_position
        if going:
            engine.append_pseudo_context(going, torch.stack(pseudo))
        live = going
    multi = [b for b in start_lengths if stages[b] > 1]
    if multi:  # the pseudo-context never outlives the round
        engine.context_rollback(multi, [start_lengths[b] for b in multi])
    return [torch.cat(c)[:n] if c else empty for c, n in zip(chains, budgets)], stages


def accept(row: Row, drafts: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
    """The lossless acceptance rule of design §3 for one row → (accepted drafts, bonus token)."""
    if row.params.greedy:
        return greedy_accept(drafts, logits)
    return speculative_accept(drafts, None, probabilities(logits, row.params), row.generator)


class Decoder:
    """Continuous batching over an engine's rows: `admit` prefills a request into a free row, `step`
    runs one round for every live row and retires the rows that finished; `cancel` retires one.
    Live rows stay packed at the front of the caches (retiring a row moves the last one into its place).

    The adaptive fallback (settings.adaptive, or `fallback` given) decides for the rows a step verifies
    together: their verification is right-padded to the widest row, so one row decoding plainly beside
    drafting rows saves nothing, and a step's cost is the batch's. For one request it is that
    request's own fallback."""

    def __init__(self, engine, settings: DecodingSettings = DecodingSettings(),
                 fallback: AdaptiveFallback | None = None):
        if settings.drafting and not engine.has_drafter:
            raise LoopspecError("a drafter is needed for block size > 1")
        self.engine, self.settings = engine, settings
        if fallback is None and settings.adaptive:
            fallback = AdaptiveFallback()
        self.fallback = fallback if settings.drafting else None
        self.rows: list[Row] = []

    @property
    def free_rows(self) -> int:
        return self.engine.max_rows - len(self.rows)

    def admit(self, key: Hashable, prompt_ids: list[int], *, max_new_tokens: int,
              params: SamplingParams = SamplingParams(), seed: int = 0, generator: torch.Generator | None = None,
              stop_token_ids: frozenset[int] | set[int] = frozenset()) -> tuple[Row, list[int]]:
        """Prefill a new sequence into a free row → (its Row, its first token). A row that is already
        finished (first token a stop token, or max_new_tokens 1) is not kept."""
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
                  started=time.perf_counter())
        row.stats.prompt_tokens, row.stats.drafting = len(prompt_ids), self.settings.drafting
        logits = self.engine.prefill(len(self.rows), prompt_ids, want_taps=self.settings.drafting)
        anchor = next_token(logits, params, row.generator)
        row.stats.prefill_s = time.perf_counter() - row.started
        self._commit(row, [anchor])
        if not row.finish:
            self.rows.append(row)
        return row, [anchor]

    def step(self) -> list[tuple[Row, list[int]]]:
        """One draft → verify → accept round over every live row → [(row, its new tokens)]; rows that
        finished (see Row.finish) are retired. A row whose acceptance fails ends with finish 'error';
        the others go on."""
        rows = self.rows
        if not rows:
            return []
        t0 = time.perf_counter()
        possible = [self._draft_budget(r) for r in rows]
        plain = self.fallback is not None and not self.fallback.want_draft()
        budgets = [0 if plain else n for n in possible]
        drafts, stages = draft_round(self.engine, self.settings, [r.tokens[-1] for r in rows],
                                     [r.position for r in rows], budgets)
        t1 = time.perf_counter()
        logits, taps = self.engine.verify([[r.tokens[-1]] + d.tolist() for r, d in zip(rows, drafts)],
                                          want_taps=self.settings.drafting)
        results = []
        for b, row in enumerate(rows):
            try:
                results.append(accept(row, drafts[b], logits[b, :drafts[b].numel() + 1]))
            except Exception as e:  # noqa: BLE001 — one row's failure must not end the others
                row.finish, row.error = "error", f"{type(e).__name__}: {e}"
                results.append((0, None))
        t2 = time.perf_counter()
        if self.fallback is not None and any(possible):  # committed tokens per row per step, and its cost
            self.fallback.record(drafted=not plain, committed=sum(a + 1 for a, _ in results) / len(rows),
                                 seconds=t2 - t0)
        # Commit: each row keeps its anchor and accepted drafts; only their taps enter its context.
        self.engine.target_rollback([r.position + accepted + 1 for r, (accepted, _) in zip(rows, results)])
        if self.settings.drafting:
            self.engine.append_context(taps, [accepted + 1 for accepted, _ in results])
        events = []
        for b, row in enumerate(rows):
            accepted, bonus = results[b]
            if row.finish:  # failed in acceptance
                events.append((row, []))
                continue
            stats = row.stats
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            stats.accepted_per_round.append(accepted)
            stats.stages_per_round.append(stages[b])
            stats.later_stage_tokens += max(0, accepted - (self.settings.block_size - 1))
            if self.fallback is not None:
                stats.fallback_rounds += plain and possible[b] > 0 and self.fallback.draft_rounds > 0
                stats.fallback_switches = self.fallback.switches
            events.append((row, self._commit(row, drafts[b][:accepted].tolist() + [bonus])))
        for b in reversed(range(len(rows))):
            if rows[b].finish:
                self._retire(b)
        return events

    def cancel(self, key: Hashable) -> Row | None:
        """Retire the live row of `key` (a cancelled or timed-out request) → that row, if live."""
        for b, row in enumerate(self.rows):
            if row.key == key:
                row.finish = row.finish or "cancelled"
                self._retire(b)
                return row
        return None

    # ---- internals ---------------------------------------------------------------------------------
    def _commit(self, row: Row, new: list[int]) -> list[int]:
        """Append new tokens up to a stop token; set finish when the row is done → the tokens kept."""
        for i, token in enumerate(new):
            if token in row.stop_token_ids:
                new, row.finish = new[:i + 1], "stop"
                break
        row.tokens += new
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

    def _draft_budget(self, row: Row) -> int:
        if not self.settings.drafting:
            return 0
        remaining = row.max_new_tokens - len(row.tokens)
        room = self.engine.max_context - row.position - 1  # drafts that fit after the anchor
        return max(0, min(self.settings.max_drafts, remaining - 1, room))

    def _retire(self, b: int) -> None:
        last = len(self.rows) - 1
        if b != last:  # keep the live rows packed at the front of the caches
            self.engine.move_row(last, b)
            self.rows[b] = self.rows[last]
        self.rows.pop()


def decode_all(decoder: Decoder, requests: list[dict]) -> dict[Hashable, Row]:
    """Admit `requests` (kwargs of `admit`, with a `key`) as rows free up and step until all are done
    → {key: finished Row}. Continuous batching without a server (training data is made with it)."""
    waiting, done = list(requests), {}
    while waiting or decoder.rows:
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
    from loopspec.runtime.torch_engine import TorchEngine

    engine = TorchEngine(target, None, max(len(p) for p in prompts) + max_new_tokens, max_rows=len(prompts))
    seeds = torch.randint(1 << 62, (len(prompts),), generator=generator).tolist()
    done = decode_all(Decoder(engine), [dict(key=b, prompt_ids=p, max_new_tokens=max_new_tokens, params=params,
                                             seed=seeds[b], stop_token_ids=frozenset(stop_token_ids))
                                        for b, p in enumerate(prompts)])
    return [(done[b].tokens, done[b].finish if done[b].finish == "stop" else "length") for b in range(len(prompts))]


def generate(engine, prompt_ids: list[int], settings: DecodingSettings = DecodingSettings(), *,
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
