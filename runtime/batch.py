"""Batched speculative decoding: several sequences per engine call, each accepting its own number of
tokens.

A `BatchedDecoder` keeps one `Row` per live sequence (committed tokens, sampling parameters and its
own generator, stop tokens, token budget, stats) and `step()` runs ONE round for all of them:

1. draft: every drafting row runs its stages (DLoop: each row's own gate decides whether it adds a
   stage); the rows still drafting share one drafter forward per stage;
2. verify: ONE target forward over every row's `[anchor, drafts…]`, right-padded, each row at its own
   position and KV length;
3. accept per row with the shared pure functions of `loopspec.decoding`, then roll back each row's
   rejected KV and append only its accepted taps to its drafter context.

`ar` is block size 1 (no drafting), `dflash` one stage, `dloop` gated stages (the logic of
`loop.draft_chain`, per row). Nothing a row computes depends on the other rows, so a batched row
commits the same tokens as the same request decoded alone by `loop.generate` (adaptive fallback off).

The decoder talks to a *batch engine*: the calls below on rows 0..B-1 of batched caches (live rows
stay packed at the front: retiring a row moves the last one into its place). `TorchBatchEngine` is
the PyTorch one; the exported backends (ONNX Runtime, TensorRT) have theirs
(`runtime/artifact_engine.ArtifactBatchEngine`, opened by the engine's `open_batch`); an engine with
only the single-sequence calls (`target_verify`, `drafter_block`, ...) is served through
`SingleRowBatchEngine`, one row at a time (`open_batch` picks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable

import torch

from loopspec.decoding import SamplingParams, greedy_accept, next_token, probabilities, speculative_accept
from loopspec.errors import LoopspecError
from loopspec.runtime.loop import AdaptiveFallback, GenerationStats


# --------------------------------------------------------------------------------------------------
# Batch engines


class TorchBatchEngine:
    """The batched calls of the PyTorch backend over a TorchEngine's (prepacked) modules: a target
    BatchKVCache and a drafter-context BatchKVCache with `max_rows` rows each."""

    def __init__(self, engine, max_rows: int):
        self.target, self.drafter = engine.target, engine.drafter
        self.has_drafter = self.drafter is not None
        self.device = self.target.embed_tokens.weight.device
        self.max_rows, self.max_context, self.block_size = max_rows, engine.max_context, engine.block_size
        self.draft_head, self.draft_ids, self.mask_token_id = engine.draft_head, engine.draft_ids, engine.mask_token_id
        self.cache = self.target.new_batch_cache(self.max_context, max_rows)
        self.context = None
        if self.drafter is not None:
            d = self.drafter.cfg
            p = self.drafter.fc.weight
            from loopspec.model.target import BatchKVCache

            self.context = BatchKVCache(d.num_layers, max_rows, d.num_kv_heads, self.max_context, d.head_dim,
                                        dtype=p.dtype, device=p.device)

    @torch.inference_mode()
    def prefill(self, row: int, prompt_ids: list[int], want_taps: bool) -> torch.Tensor:
        """Run a prompt alone into `row` (the single-sequence path on a view of the row), start its
        drafter context when `want_taps` → the last position's logits [V]."""
        view = self.cache.row(row)
        view.length = 0
        out = self.target(torch.tensor([prompt_ids], device=self.device), view, want_taps=want_taps,
                          last_logits_only=True)
        self.cache.lengths[row] = view.length
        if want_taps:
            self.context.lengths[row] = 0
            self._append_context(torch.tensor([row]), self.drafter.features(out.taps), torch.tensor([len(prompt_ids)]))
        return out.logits[0, -1]

    @torch.inference_mode()
    def verify(self, tokens: list[list[int]], want_taps: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows 0..B-1 run their tokens after their own KV → logits [B, T, V], taps [B, T, n*H] (T =
        the longest row; rows' padding positions are junk)."""
        width = max(len(t) for t in tokens)
        ids = torch.zeros(len(tokens), width, dtype=torch.long)  # right padding (never stored)
        for b, t in enumerate(tokens):
            ids[b, :len(t)] = torch.tensor(t)
        counts = torch.tensor([len(t) for t in tokens])
        out = self.target.forward_ragged(ids.to(self.device), counts, self.cache,
                                         want_taps=want_taps and self.has_drafter)
        return out.logits, out.taps

    def target_rollback(self, lengths: list[int]) -> None:
        """Rows 0..B-1 keep their first lengths[b] KV slots."""
        lengths = torch.tensor(lengths)
        if bool((lengths > self.cache.lengths[:len(lengths)]).any()):
            raise ValueError("cannot roll a row forward")
        self.cache.lengths[:len(lengths)] = lengths

    @torch.inference_mode()
    def append_context(self, taps: torch.Tensor, counts: list[int]) -> None:
        """Rows 0..B-1 append the context features of their first counts[b] taps [B, T, n*H]."""
        rows = torch.arange(taps.shape[0])
        self._append_context(rows, self.drafter.features(taps), torch.tensor(counts))

    @torch.inference_mode()
    def append_pseudo_context(self, rows: list[int], hidden: torch.Tensor) -> None:
        """DLoop: `rows` append H-dim pseudo-features hidden [R, T, H] (the drafter's own states)."""
        self._append_context(torch.tensor(rows), hidden, torch.full((len(rows),), hidden.shape[1]))

    def _append_context(self, rows: torch.Tensor, features: torch.Tensor, counts: torch.Tensor) -> None:
        positions = self.context.lengths[rows][:, None] + torch.arange(features.shape[1])[None, :]  # [R, T]
        k, v = self.drafter.context_kv(features, positions.clamp_max(self.max_context - 1).to(self.device))
        self.context.write(k, v, rows, counts)

    def context_lengths(self, rows: list[int]) -> list[int]:
        return self.context.lengths[rows].tolist() if self.context is not None else [0] * len(rows)

    def context_rollback(self, rows: list[int], lengths: list[int]) -> None:
        self.context.lengths[rows] = torch.tensor(lengths)

    @torch.inference_mode()
    def draft(self, rows: list[int], anchors: list[int], positions: list[int],
              block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One stage for each of `rows`: [anchor, MASK × (k-1)] at positions .. positions+k-1 on the
        row's own context → drafts [R, k-1], their log-probs [R, k-1], final-norm hidden [R, k, H]."""
        R, k = len(rows), block_size
        lengths = self.context.lengths[rows]  # [R]
        width = int(lengths.max())
        if rows == list(range(R)):  # the live rows are packed at the front: a view, no copy
            ctx_k, ctx_v = self.context.k[:, :R, :, :width], self.context.v[:, :R, :, :width]
        else:
            index = torch.tensor(rows, device=self.device)
            ctx_k, ctx_v = self.context.k[:, index, :, :width], self.context.v[:, index, :, :width]
        mask = None
        if bool((lengths != width).any()):  # shorter contexts hide their stale slots; the block sees all
            seen = torch.arange(width + k)[None, :]
            mask = ((seen < lengths[:, None]) | (seen >= width))[:, None, None, :].to(self.device)  # [R, 1, 1, width + k]
        ids = torch.full((R, k), self.mask_token_id, dtype=torch.long)
        ids[:, 0] = torch.tensor(anchors)
        ids = ids.to(self.device)
        pos = (torch.tensor(positions)[:, None, None] + torch.arange(k)).to(self.device)  # [R, 1, k]
        hidden = self.drafter(self.target.embed_tokens(ids), pos, ctx_k, ctx_v, mask)  # [R, k, H]
        logits = self.draft_head(hidden[:, 1:])  # [R, k-1, V] (or [R, k-1, Vd])
        best, drafts = logits.max(-1)
        logprobs = best - torch.logsumexp(logits, dim=-1)
        if self.draft_ids is not None:
            drafts = self.draft_ids[drafts]
        return drafts, logprobs, hidden

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst)
        if self.context is not None:
            self.context.move_row(src, dst)


class SingleRowBatchEngine:
    """The batch calls for an engine that has only the single-sequence ones (one KV cache): a batch
    of at most one row, so its requests run one at a time (still exact)."""

    max_rows = 1

    def __init__(self, engine):
        self.engine = engine
        self.max_context, self.block_size = engine.max_context, engine.block_size
        self.has_drafter = getattr(engine, "has_drafter", getattr(engine, "drafter", None) is not None)

    def prefill(self, row: int, prompt_ids: list[int], want_taps: bool) -> torch.Tensor:
        self.engine.reset()
        logits, taps = self.engine.target_verify(prompt_ids, all_logits=False, want_taps=want_taps)
        if want_taps:
            self.engine.drafter_context(taps)
        return logits[-1]

    def verify(self, tokens: list[list[int]], want_taps: bool):
        (row,) = tokens
        logits, taps = self.engine.target_verify(row, want_taps=want_taps)
        return logits[None], (taps[None] if taps is not None else None)

    def target_rollback(self, lengths: list[int]) -> None:
        self.engine.target_rollback(lengths[0])

    def append_context(self, taps: torch.Tensor, counts: list[int]) -> None:
        self.engine.drafter_context(taps[0, :counts[0]])

    def append_pseudo_context(self, rows: list[int], hidden: torch.Tensor) -> None:
        self.engine.drafter_context_hidden(hidden[0])

    def context_lengths(self, rows: list[int]) -> list[int]:
        return [self.engine.context_length for _ in rows]

    def context_rollback(self, rows: list[int], lengths: list[int]) -> None:
        self.engine.context_rollback(lengths[0])

    def draft(self, rows, anchors, positions, block_size):
        drafts, logprobs, hidden = self.engine.drafter_block(anchors[0], positions[0], block_size)
        return drafts[None], logprobs[None], hidden[None]

    def move_row(self, src: int, dst: int) -> None:
        raise AssertionError("a single-row batch never moves rows")


def open_batch(engine, max_rows: int):
    """The batch engine for `engine`: its own batched calls when the backend has them (`open_batch`
    method, or the torch backend), else one row at a time over its single-sequence calls."""
    if max_rows < 1:
        raise LoopspecError(f"max batch size must be >= 1, got {max_rows}")
    if hasattr(engine, "open_batch"):
        return engine.open_batch(max_rows)
    if getattr(engine, "backend", None) == "torch":
        return TorchBatchEngine(engine, max_rows)
    return SingleRowBatchEngine(engine)


# --------------------------------------------------------------------------------------------------
# Decoder


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
    finish: str = ""  # "" while live; then stop | length | context | error
    error: str = ""

    @property
    def position(self) -> int:
        """The anchor's position (it is not in the KV cache yet)."""
        return self.prompt_len + len(self.tokens) - 1


@dataclass(frozen=True)
class Method:
    """How every row drafts: block size 1 = ar; max_stages 1 = dflash; more = dloop. `adaptive`: the
    batch decodes plainly while drafting does not pay (`loop.AdaptiveFallback` on whole steps: a
    step's cost is the batch's, so the decision is the batch's). It changes speed, never greedy
    output; seeded sampling is then exact in distribution but no longer replayable token for token."""

    block_size: int = 1
    max_stages: int = 1
    gate_threshold: float = -0.5
    adaptive: bool = False


def method_for(pipe, name: str, block_size: int | None = None, gate_threshold: float | None = None,
               max_stages: int | None = None, adaptive: bool = False) -> Method:
    """The Method of `ar` | `dflash` | `dloop` for a Pipeline (its drafter's block size and tuned DLoop setting)."""
    k = pipe.block_size_for(name, block_size)
    loop = pipe.dloop_settings(gate_threshold, max_stages) if name == "dloop" else {"max_stages": 1}
    return Method(block_size=k, adaptive=adaptive and k > 1, **loop)


class BatchedDecoder:
    """Continuous batching over a batch engine: `admit` prefills a request into a free row, `step`
    runs one round for every live row and retires the rows that finished; `cancel` retires one."""

    def __init__(self, engine, method: Method = Method()):
        if method.block_size < 1 or method.max_stages < 1:
            raise LoopspecError(f"block size and max stages must be >= 1, got {method}")
        if method.block_size > 1 and not engine.has_drafter:
            raise LoopspecError("a drafter is needed for block size > 1")
        self.engine, self.method = engine, method
        self.drafting = method.block_size > 1
        self.fallback = AdaptiveFallback() if method.adaptive and self.drafting else None
        self.rows: list[Row] = []

    @property
    def free_rows(self) -> int:
        return self.engine.max_rows - len(self.rows)

    def admit(self, key: Hashable, prompt_ids: list[int], *, max_new_tokens: int,
              params: SamplingParams = SamplingParams(), seed: int = 0,
              stop_token_ids: frozenset[int] = frozenset()) -> tuple[Row, list[int]]:
        """Prefill a new sequence into a free row → (its Row, its first token(s)). A row that is
        already finished (first token a stop token, or max_new_tokens 1) is not kept."""
        if not prompt_ids:
            raise LoopspecError("empty prompt")
        if max_new_tokens < 1:
            raise LoopspecError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt_ids) >= self.engine.max_context:
            raise LoopspecError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.engine.max_context}")
        if not self.free_rows:
            raise LoopspecError("no free row in the batch")
        row = Row(key=key, prompt_len=len(prompt_ids), max_new_tokens=max_new_tokens, params=params,
                  generator=torch.Generator().manual_seed(seed), stop_token_ids=frozenset(stop_token_ids))
        row.stats.prompt_tokens = len(prompt_ids)
        t0 = time.perf_counter()
        logits = self.engine.prefill(len(self.rows), prompt_ids, want_taps=self.drafting)
        anchor = next_token(logits, params, row.generator)
        row.stats.prefill_s = time.perf_counter() - t0
        self._commit(row, [anchor])
        if not row.finish:
            self.rows.append(row)
        return row, [anchor]

    def step(self) -> list[tuple[Row, list[int]]]:
        """One draft → verify → accept round over every live row → [(row, its new tokens)]; rows
        that finished (see Row.finish) are retired. A row whose acceptance fails ends with
        finish 'error'; the others go on."""
        rows = self.rows
        if not rows:
            return []
        t0 = time.perf_counter()
        budgets = [self._draft_budget(r) for r in rows]
        plain = self.fallback is not None and not self.fallback.want_draft()
        drafts, stages = self._draft([0] * len(rows) if plain else budgets)
        t1 = time.perf_counter()
        logits, taps = self.engine.verify([[r.tokens[-1]] + d.tolist() for r, d in zip(rows, drafts)],
                                          want_taps=self.drafting)
        results = []
        for b, row in enumerate(rows):
            try:
                results.append(self._accept(row, drafts[b], logits[b, :drafts[b].numel() + 1]))
            except Exception as e:  # noqa: BLE001 — one row's failure must not end the others
                row.finish, row.error = "error", f"{type(e).__name__}: {e}"
                results.append((0, None))
        t2 = time.perf_counter()
        if self.fallback is not None and any(budgets):  # committed tokens per row per step, and its cost
            self.fallback.record(drafted=not plain, committed=sum(a + 1 for a, _ in results) / len(rows),
                                 seconds=t2 - t0)
        # Commit: each row keeps its anchor and accepted drafts; only their taps enter its context.
        kept = [r.position + accepted + 1 for r, (accepted, _) in zip(rows, results)]
        self.engine.target_rollback(kept)
        if self.drafting:
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
            stats.later_stage_tokens += max(0, accepted - (self.method.block_size - 1))
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
        return new

    def _draft_budget(self, row: Row) -> int:
        if not self.drafting:
            return 0
        remaining = row.max_new_tokens - len(row.tokens)
        room = self.engine.max_context - row.position - 1  # drafts that fit after the anchor
        return max(0, min(self.method.max_stages * (self.method.block_size - 1), remaining - 1, room))

    def _draft(self, budgets: list[int]) -> tuple[list[torch.Tensor], list[int]]:
        """Every row's draft chain (design §4, `loop.draft_chain` per row) → (drafts per row, stages)."""
        k, max_context = self.method.block_size, self.engine.max_context
        chains: list[list[torch.Tensor]] = [[] for _ in budgets]
        stages = [0] * len(budgets)
        live = [b for b, n in enumerate(budgets) if n > 0]
        anchors = {b: self.rows[b].tokens[-1] for b in live}
        positions = {b: self.rows[b].position for b in live}
        start_lengths = dict(zip(live, self.engine.context_lengths(live)))
        while live:
            going, pseudo = [], []
            by_size: dict[int, list[int]] = {}
            for b in live:  # a stage that would run past the context is shorter; those go together
                by_size.setdefault(min(k, max_context - positions[b]), []).append(b)
            for size, group in by_size.items():
                drafts, logprobs, hidden = self.engine.draft(group, [anchors[b] for b in group],
                                                             [positions[b] for b in group], size)
                for i, b in enumerate(group):
                    chains[b].append(drafts[i])
                    stages[b] += 1
                    drafted = sum(d.numel() for d in chains[b])
                    next_position = positions[b] + size - 1
                    if (stages[b] >= self.method.max_stages or drafted >= budgets[b]
                            or max_context - next_position < k
                            or float(logprobs[i].sum()) < self.method.gate_threshold):
                        continue
                    going.append(b)
                    pseudo.append(hidden[i, 1:])  # positions .. +k-2 get feature(p) = z(p+1)
                    anchors[b], positions[b] = int(drafts[i, -1]), next_position
            if going:
                self.engine.append_pseudo_context(going, torch.stack(pseudo))
            live = going
        multi = [b for b in start_lengths if stages[b] > 1]
        if multi:  # the pseudo-context never outlives the round
            self.engine.context_rollback(multi, [start_lengths[b] for b in multi])
        empty = torch.empty(0, dtype=torch.long)
        return [torch.cat(c)[:n] if c else empty for c, n in zip(chains, budgets)], stages

    def _accept(self, row: Row, drafts: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
        if row.params.greedy:
            return greedy_accept(drafts, logits)
        return speculative_accept(drafts, None, probabilities(logits, row.params), row.generator)

    def _retire(self, b: int) -> None:
        last = len(self.rows) - 1
        if b != last:  # keep the live rows packed at the front of the caches
            self.engine.move_row(last, b)
            self.rows[b] = self.rows[last]
        self.rows.pop()


def decode_together(decoder: BatchedDecoder, requests: list[dict]) -> dict[Hashable, Row]:
    """Admit `requests` (kwargs of `admit`, with a `key`) as rows free up and step until all are done
    → {key: finished Row}. The plain continuous-batching loop, without a server."""
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
