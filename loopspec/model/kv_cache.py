"""The one KV cache type: static K/V buffers with a length per row, the target's and the drafter
context's on every backend; where one forward's new K/V go (KVWrite) and which slots its queries see.
A hybrid target's cache (RecurrentCache) is one too, holding its linear-attention layers' states besides."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from loopspec.errors import LoopspecError


class KVWrite(NamedTuple):
    """Where one forward's new K/V go in a KVCache, and which key slots its queries see.

    Exactly one form: `start` (every token of every row at slots start.., all rows at one length);
    `slots` alone (one row, token t at slots[t]: the CUDA-graph replays, whose slots are a static
    tensor); or `slots` with `row_index`/`token_index` (ragged rows: only real tokens are stored)."""

    rows: slice  # the forward's rows in the cache
    keys: int  # key slots 0..keys-1 are read (the caller's mask hides what a query must not see)
    start: int | None = None
    slots: torch.Tensor | None = None  # [P]
    row_index: torch.Tensor | None = None  # [P] forward row of each stored (row, token) pair
    token_index: torch.Tensor | None = None  # [P]


def one_block(starts: torch.Tensor, counts: torch.Tensor, width: int) -> int | None:
    """The common start slot when every row writes all `width` tokens from one length (a dense slice
    then stores them), else None."""
    if bool((counts == width).all()) and bool((starts == starts[0]).all()):
        return int(starts[0])
    return None


def attention_mask(starts: torch.Tensor, width: int, keys: int, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Which of the first `keys` slots each of `width` new tokens sees, its row's new tokens stored
    from starts[b] [B] on → bool [B, width, keys]: every slot before starts[b] (the committed
    history) and, among the new tokens, those tree_mask[b, t] marks (default: tokens 0 .. t, the
    causal chain). Stale slots past a row's tokens are never seen."""
    rel = torch.arange(keys)[None, :] - starts[:, None]  # [B, keys]: the slot's index among the new tokens
    if tree_mask is None:
        new = rel[:, None, :] <= torch.arange(width)[None, :, None]  # [B, T, keys]
    else:
        index = rel.clamp(0, width - 1)[:, None, :].expand(-1, width, -1)  # [B, T, keys]
        new = torch.gather(tree_mask, 2, index) & (rel < width)[:, None, :]
    return (rel < 0)[:, None, :] | new


@dataclass(frozen=True)
class SlotGrowth:
    """How a KVCache's buffers follow the rows' lengths: `step` slots at a time, up to `limit` (the
    widest past a call may pass). Widening copies the valid slots once per `step` new positions of the
    longest row; every call then reads at most step - 1 slots more than its rows need. A buffer more
    than `shrink_after` steps wider than the rows need (a long request ended) is narrowed."""

    step: int
    limit: int
    shrink_after: int = 4

    def fit(self, needed: int, slots: int) -> int:
        if needed > self.limit:
            raise LoopspecError(f"a past of {needed} slots exceeds the engines' widest ({self.limit})")
        wanted = min(-(-needed // self.step) * self.step, self.limit)
        if wanted > slots or slots - wanted >= self.shrink_after * self.step:
            return wanted
        return slots


class KVCache:
    """Static K/V buffers [layers, rows, kv_heads, max_length, head_dim] for up to `rows` sequences,
    each with its own length (`lengths` [rows], on the host). Rolling back is lowering a length.

    The one cache type: the target's KV cache and the drafter's context are both one of these, on
    every backend. Callers keep their live rows packed at the front (`swap_rows` fills a hole), so
    a call over rows 0..B-1 reads a view, not a copy."""

    def __init__(
        self,
        num_layers: int,
        rows: int,
        num_kv_heads: int,
        max_length: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        growth: "SlotGrowth | None" = None,
    ):
        """growth None: the buffers hold max_length slots from the start, at fixed addresses (what a
        captured CUDA graph reads). With a SlotGrowth they hold as many slots as the rows need,
        rounded up to its step, and are reallocated when that changes (`dense_prefix`)."""
        self.growth = growth
        slots = max_length if growth is None else growth.step
        shape = (num_layers, rows, num_kv_heads, slots, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_length = max_length
        self.lengths = torch.zeros(rows, dtype=torch.long)

    @property
    def slots(self) -> int:
        """How many slots the buffers hold per row: max_length, or what the rows need (`growth`)."""
        return self.k.shape[3]

    def _fit(self, needed: int) -> None:
        """With `growth`: reallocate the buffers to growth.fit(needed, slots) slots, keeping every
        row's valid slots; the slots past them start at zero (finite, as a masked slot must be)."""
        if self.growth is None:
            return
        slots = self.growth.fit(max(needed, int(self.lengths.max())), self.slots)
        if slots == self.slots:
            return
        keep = int(self.lengths.max())
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[:3] + (slots,) + old.shape[4:])
            new[:, :, :, :keep] = old[:, :, :, :keep]
            setattr(self, name, new)

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    def make_room(self, needed: int) -> None:
        """Buffers of at least `needed` slots (with `growth`; without, they hold max_length already):
        what a graph that writes its new K/V into the buffers itself needs before its call."""
        if needed > self.slots:
            self._fit(needed)

    def advance(self, rows: list[int], counts: torch.Tensor | list[int]) -> None:
        """Rows `rows` hold counts[i] more slots, written by the caller into the buffers themselves."""
        rows, counts = torch.as_tensor(rows, dtype=torch.long), torch.as_tensor(counts, dtype=torch.long)
        ends = self.lengths[rows] + counts
        if int(ends.max()) > min(self.max_length, self.slots):
            raise LoopspecError(f"sequence of {int(ends.max())} exceeds the context of {self.max_length}")
        self.lengths[rows] = ends

    def append(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: list[int] | None = None,
        counts: torch.Tensor | list[int] | None = None,
    ) -> None:
        """Every layer at once: the first counts[i] entries of k/v [N, R, kvh, T, hd] row i go to cache
        row rows[i] (default i) at its length, which advances by counts[i] (default T)."""
        R, T = k.shape[1], k.shape[3]
        rows = torch.arange(R) if rows is None else torch.as_tensor(rows, dtype=torch.long)
        counts = torch.full((R,), T) if counts is None else torch.as_tensor(counts, dtype=torch.long)
        starts = self.lengths[rows]
        if int((starts + counts).max()) > self.max_length:
            raise LoopspecError(f"sequence of {int((starts + counts).max())} exceeds the context of {self.max_length}")
        if int((starts + counts).max()) > self.slots:
            self._fit(int((starts + counts).max()))
        first, s = int(rows[0]), one_block(starts, counts, T)
        if s is not None and rows.tolist() == list(range(first, first + R)):  # one block of slots: a slice
            self.k[:, first : first + R, :, s : s + T] = k
            self.v[:, first : first + R, :, s : s + T] = v
            self.lengths[rows] = starts + counts
            return
        i, t = (torch.arange(T)[None, :] < counts[:, None]).nonzero(as_tuple=True)  # valid (row, token) pairs
        dev = self.k.device
        slots, dest, i, t = (starts[i] + t).to(dev), rows[i].to(dev), i.to(dev), t.to(dev)
        self.k[:, dest, :, slots] = k[:, i, :, t].to(self.k.dtype)  # [P, N, kvh, hd] on both sides
        self.v[:, dest, :, slots] = v[:, i, :, t].to(self.v.dtype)
        self.lengths[rows] = starts + counts

    def rollback(self, lengths: list[int] | torch.Tensor, rows: list[int] | None = None) -> None:
        """Rows `rows` (default 0..len(lengths)-1) keep their first lengths[i] slots."""
        lengths = torch.as_tensor(lengths, dtype=torch.long)
        rows = torch.arange(lengths.numel()) if rows is None else torch.as_tensor(rows, dtype=torch.long)
        if bool((lengths < 0).any()) or bool((lengths > self.lengths[rows]).any()):
            raise ValueError(
                f"cannot roll a row forward (or below 0): rows {rows.tolist()} of lengths "
                f"{self.lengths[rows].tolist()} to {lengths.tolist()}"
            )
        self.lengths[rows] = lengths

    def commit(self, starts: list[int], kept: list[list[int]]) -> None:
        """Rows 0..B-1 keep, of the tokens last stored from starts[b] on, those at offsets kept[b]
        (ascending, from 0: a draft tree's accepted path), moved to slots starts[b], starts[b] + 1, …;
        the rest is rolled back. A prefix (the chain) moves nothing."""
        for b, (start, offsets) in enumerate(zip(starts, kept)):
            if offsets != list(range(len(offsets))):
                src = torch.tensor(offsets, device=self.k.device) + start
                dst = torch.arange(len(offsets), device=self.k.device) + start
                self.k[:, b, :, dst] = self.k[:, b, :, src]  # the gather reads before the scatter writes
                self.v[:, b, :, dst] = self.v[:, b, :, src]
        self.rollback([s + len(o) for s, o in zip(starts, kept)])

    def prefix(self, rows: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `width` slots of `rows` → K, V [layers, R, kvh, width, hd] (a view for rows that
        follow each other); slots past the buffer (room asked for beyond the max length) are zeros."""
        first = rows[0]
        if rows == list(range(first, first + len(rows))):
            k, v = self.k[:, first : first + len(rows), :, :width], self.v[:, first : first + len(rows), :, :width]
        else:
            index = torch.tensor(rows, device=self.k.device)
            k, v = self.k[:, index, :, :width], self.v[:, index, :, :width]
        if width > self.slots:
            pad = [0, 0, 0, width - self.slots]  # hd, then the slots
            k, v = torch.nn.functional.pad(k, pad), torch.nn.functional.pad(v, pad)
        return k, v

    def dense_prefix(self, rows: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """At least the first `width` slots of `rows`, K, V [layers, R, kvh, W >= width, hd]. With
        `growth` the buffers are first fitted to the rows and W is all of their slots, so each layer
        of rows that follow each other is one contiguous block: a call passes the cache itself, not a
        copy of it (a copy of the whole past every call: 4.6 ms of a 31 ms step at 1024 positions).
        Slots past a row's length hold anything finite; a call masks them."""
        if self.growth is None:
            return self.prefix(rows, width)
        self._fit(width)
        return self.prefix(rows, self.slots)

    def swap_rows(self, a: int, b: int) -> None:
        """Rows a and b exchange their slots and lengths (only the valid slots are copied)."""
        n, pair = int(self.lengths[[a, b]].max()), [b, a]
        self.k[:, [a, b], :, :n] = self.k[:, pair, :, :n]  # the gather copies before the write
        self.v[:, [a, b], :, :n] = self.v[:, pair, :, :n]
        self.lengths[[a, b]] = self.lengths[pair]

    def plan(self, first_row: int, counts: torch.Tensor, width: int) -> KVWrite:
        """The write of one forward over rows first_row.. (counts [R] real tokens each, right-padded
        to `width`): real tokens go at each row's length; padding is never stored."""
        R = counts.shape[0]
        rows = slice(first_row, first_row + R)
        starts = self.lengths[rows]
        keys = int((starts + counts).max())
        if keys > self.max_length:
            raise LoopspecError(f"sequence of {keys} tokens exceeds the context of {self.max_length}")
        start = one_block(starts, counts, width)
        if start is not None:
            return KVWrite(rows, keys, start=start)
        row_index, token_index = (torch.arange(width)[None, :] < counts[:, None]).nonzero(as_tuple=True)
        dev = self.k.device
        return KVWrite(
            rows,
            keys,
            slots=(starts[row_index] + token_index).to(dev),
            row_index=row_index.to(dev),
            token_index=token_index.to(dev),
        )

    def attended(self, layer: int, k: torch.Tensor, v: torch.Tensor, step, window: int | None):
        """An attention layer's new k, v [B, kvh, T, hd] stored as `step` (LayerStep) writes them → the
        keys, values [B, kvh, S, hd] its queries attend to and their mask ([B, 1, T, S] or None): here
        the first `step.write.keys` slots, a window's keys hidden by the mask (a WindowedCache keeps a
        sliding layer's window only)."""
        keys, values = self.store(layer, k, v, step.write)
        return keys, values, step.mask_for(window)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, write: KVWrite) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new k, v [R, kvh, T, hd] as `write` says → the keys/values its queries
        attend to, [R, kvh, write.keys, hd] (masked per query by the caller)."""
        cache_k, cache_v = self.k[layer, write.rows], self.v[layer, write.rows]  # views [R, kvh, S, hd]
        if write.start is not None:
            cache_k[:, :, write.start : write.start + k.shape[2]] = k
            cache_v[:, :, write.start : write.start + k.shape[2]] = v
        elif write.row_index is None:
            cache_k.index_copy_(2, write.slots, k)
            cache_v.index_copy_(2, write.slots, v)
        else:
            cache_k[write.row_index, :, write.slots] = k[write.row_index, :, write.token_index]  # [P, kvh, hd]
            cache_v[write.row_index, :, write.slots] = v[write.row_index, :, write.token_index]
        return cache_k[:, :, : write.keys], cache_v[:, :, : write.keys]


class RecurrentCache(KVCache):
    """A hybrid target's cache: K/V buffers for its attention layers only and, for each linear-attention
    layer, every row's conv state (the last conv_kernel - 1 inputs of its causal conv, in the model's
    dtype) and recurrent state (fp32, as the delta rule runs), valid at the row's `state_lengths`.

    A state is tied to a length. A forward that starts at a row's length other than its state length
    first restores the state kept at that length: length 0 is the zero state (a new request), any
    other must lie inside the row's latest forward, which kept the state before and after each of its
    tokens (when it `keep_states`: every forward that returns each position's logits, up to
    `snapshot_window` tokens); else it refuses in one line. So rolling back stays lowering a length,
    as for the KV cache. A recurrent state follows one path: `commit` keeps chains, not tree paths.

    `dims` is the family's linear-attention config (conv_kernel, conv_dim, num_value_heads,
    key_head_dim, value_head_dim)."""

    def __init__(
        self,
        linear: list[bool],
        dims,
        rows: int,
        num_kv_heads: int,
        max_length: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        snapshot_window: int = 64,
    ):
        attention = [i for i, is_linear in enumerate(linear) if not is_linear]
        super().__init__(len(attention), rows, num_kv_heads, max_length, head_dim, dtype=dtype, device=device)
        self.kv_slot = {layer: slot for slot, layer in enumerate(attention)}
        self.state_slot = {
            layer: slot for slot, layer in enumerate(i for i, is_linear in enumerate(linear) if is_linear)
        }
        n, self.conv_width = len(self.state_slot), dims.conv_kernel - 1
        self.conv = torch.zeros(n, rows, dims.conv_dim, self.conv_width, dtype=dtype, device=device)
        self.recurrent = torch.zeros(
            n, rows, dims.num_value_heads, dims.key_head_dim, dims.value_head_dim, dtype=torch.float32, device=device
        )
        self.state_lengths = torch.zeros(rows, dtype=torch.long)
        self.snapshot_window = snapshot_window
        # what the rows' latest forwards kept: conv inputs [n, rows, conv_dim, conv_width + S - 1] and
        # states [n, rows, S, Hv, dk, dv], slot j holding length kept_from[r] + j up to kept_to[r];
        # S grows to the widest forward that kept its states (+ 1)
        self.conv_kept = self.conv[:, :, :, :0].clone()
        self.recurrent_kept = self.recurrent[:, :, None][:, :, :0].clone()
        self.kept_from = torch.zeros(rows, dtype=torch.long)
        self.kept_to = torch.full((rows,), -1, dtype=torch.long)  # below kept_from: nothing kept

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, write: KVWrite) -> tuple[torch.Tensor, torch.Tensor]:
        return super().store(self.kv_slot[layer], k, v, write)

    def plan(self, first_row: int, counts: torch.Tensor, width: int) -> KVWrite:
        write = super().plan(first_row, counts, width)
        for row in range(first_row, first_row + counts.shape[0]):
            self._restore(row)
        return write

    def _restore(self, row: int) -> None:
        """The row's states at its length: kept, or zero at length 0."""
        length = int(self.lengths[row])
        if length == int(self.state_lengths[row]):
            return
        if length == 0:
            self.conv[:, row] = 0
            self.recurrent[:, row] = 0
        elif int(self.kept_from[row]) <= length <= int(self.kept_to[row]):
            j = length - int(self.kept_from[row])
            self.conv[:, row] = self.conv_kept[:, row, :, j : j + self.conv_width]
            self.recurrent[:, row] = self.recurrent_kept[:, row, j]
        else:
            kept = (
                f"lengths {int(self.kept_from[row])}..{int(self.kept_to[row])}"
                if self.kept_to[row] >= self.kept_from[row]
                else "none"
            )
            raise LoopspecError(
                f"row {row}'s linear-attention state at length {length} is not kept (it is at "
                f"{int(self.state_lengths[row])}; its latest forward kept {kept}): a hybrid target "
                "rolls back only inside its latest forward"
            )
        self.state_lengths[row] = length

    def states(self, layer: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s conv states [R, conv_dim, conv_width] and recurrent states [R, Hv, dk, dv] of
        `rows`, at their lengths (views)."""
        slot = self.state_slot[layer]
        return self.conv[slot, rows], self.recurrent[slot, rows]

    def kept_states(self, layer: int, rows: slice, width: int) -> torch.Tensor | None:
        """Where a forward of `width` tokens writes the recurrent states it keeps, [R, width + 1, Hv, dk,
        dv]: slot j, the state after j tokens; None past the snapshot window (nothing kept)."""
        if width > self.snapshot_window:
            return None
        if self.recurrent_kept.shape[2] < width + 1:  # grown once to the widest such forward
            for name, dim, grow in (("recurrent_kept", 2, width + 1), ("conv_kept", 3, self.conv_width + width)):
                old = getattr(self, name)
                shape = list(old.shape)
                shape[dim] = grow
                # a normal tensor even inside an inference-mode forward: swap_rows writes it outside one
                with torch.inference_mode(False):
                    new = torch.zeros(shape, dtype=old.dtype, device=old.device)
                    new.narrow(dim, 0, old.shape[dim]).copy_(old)
                setattr(self, name, new)
        return self.recurrent_kept[self.state_slot[layer], rows, : width + 1]

    def keep(
        self, layer: int, rows: slice, window: torch.Tensor, final: torch.Tensor, counts: torch.Tensor, kept: bool
    ) -> None:
        """After layer `layer` ran a forward over `rows` from their lengths: the conv inputs it saw, window
        [R, conv_dim, conv_width + T] (the states before the forward, then the T new inputs), and its
        final recurrent states [R, Hv, dk, dv] become the rows' states at length + counts [R] (host);
        `kept`: the states inside the forward were written to kept_states and stay restorable."""
        slot, starts = self.state_slot[layer], self.lengths[rows]
        R, C, _ = window.shape
        index = counts.to(window.device)[:, None, None] + torch.arange(self.conv_width, device=window.device)
        self.conv[slot, rows] = torch.gather(window, 2, index.expand(R, C, -1))  # each row's last inputs
        self.recurrent[slot, rows] = final
        if kept:
            self.conv_kept[slot, rows, :, : window.shape[2]] = window
        self.state_lengths[rows] = starts + counts
        self.kept_from[rows] = starts
        self.kept_to[rows] = starts + counts if kept else starts - 1

    def commit(self, starts: list[int], kept: list[list[int]]) -> None:
        if any(offsets != list(range(len(offsets))) for offsets in kept):
            raise LoopspecError(
                "a linear-attention state follows one path: a hybrid target keeps verified chains, "
                "not draft-tree paths (verify chains: --tree-budget 0 --no-suffix)"
            )
        super().commit(starts, kept)

    def swap_rows(self, a: int, b: int) -> None:
        super().swap_rows(a, b)
        pair = [b, a]
        for name in ("conv", "recurrent", "conv_kept", "recurrent_kept"):
            buffer = getattr(self, name)
            buffer[:, [a, b]] = buffer[:, pair]  # the gather copies before the write
        for lengths in (self.state_lengths, self.kept_from, self.kept_to):
            lengths[[a, b]] = lengths[pair]


class WindowedCache(KVCache):
    """The cache of a target with sliding-window layers: K/V buffers over the whole context for its
    full-attention layers, and for each sliding layer a ring of `window - 1 + verify_span` slots per
    row — what the window needs, not the context. Position p sits in ring slot p % ring; each slot
    records the position it holds (`ring_positions`, -1: none).

    A forward's queries at positions >= a row's length see its ring's slots holding positions in
    [length - window + 1, length) and the forward's own new keys (`window_keys`); then the new K/V
    go into the ring (of a wider forward, its last `ring` tokens). A forward of up to `verify_span`
    tokens overwrites only positions below length - window + 1, so rolling back into it (lowering a
    length, as for any KVCache) finds the window it needs; a row whose window was overwritten (rolled
    back into a longer forward) is refused in one line. Draft-tree paths move inside the ring as in
    the buffers (`commit`)."""

    def __init__(
        self,
        sliding: list[bool],
        window: int,
        rows: int,
        num_kv_heads: int,
        max_length: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        verify_span: int = 64,
    ):
        full = [i for i, is_sliding in enumerate(sliding) if not is_sliding]
        super().__init__(len(full), rows, num_kv_heads, max_length, head_dim, dtype=dtype, device=device)
        self.kv_slot = {layer: slot for slot, layer in enumerate(full)}
        self.ring_slot = {layer: slot for slot, layer in enumerate(i for i, s in enumerate(sliding) if s)}
        self.window, self.ring = window, window - 1 + verify_span
        shape = (len(self.ring_slot), rows, num_kv_heads, self.ring, head_dim)
        self.ring_k = torch.zeros(shape, dtype=dtype, device=device)
        self.ring_v = torch.zeros(shape, dtype=dtype, device=device)
        self.ring_positions = torch.full((rows, self.ring), -1, dtype=torch.long, device=device)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, write: KVWrite) -> tuple[torch.Tensor, torch.Tensor]:
        return super().store(self.kv_slot[layer], k, v, write)

    def plan(self, first_row: int, counts: torch.Tensor, width: int) -> KVWrite:
        write = super().plan(first_row, counts, width)
        for row in range(first_row, first_row + counts.shape[0]):
            length = int(self.lengths[row])
            held = self.ring_positions[row]
            needed = min(self.window - 1, length)
            if int(((held >= length - needed) & (held < length)).sum()) != needed:
                raise LoopspecError(
                    f"row {row} rolled back to length {length}, past what its sliding-window layers "
                    f"keep (the last {self.ring} positions of its latest forward)"
                )
        return write

    def attended(self, layer: int, k: torch.Tensor, v: torch.Tensor, step, window: int | None):
        """A sliding layer's keys and values for the forward `step` (LayerStep) of new k, v
        [B, kvh, T, hd] → keys, values [B, kvh, ring + T, hd] (the ring, then the new ones) and the
        mask [B, 1, T, ring + T]: a query at position p sees a ring slot holding a position in
        (p - window, length) and, among the new tokens, those the forward's own mask lets it see whose
        positions are > p - window. The new K/V are then stored in the ring. A full layer: as any KVCache."""
        if layer not in self.ring_slot:
            return super().attended(layer, k, v, step, window)
        if window != self.window:
            raise LoopspecError(f"a sliding layer of window {window} in a cache of window {self.window}")
        rows, write = step.write.rows, step.write
        slot = self.ring_slot[layer]
        B, T = k.shape[0], k.shape[2]
        starts = self.lengths[rows].to(k.device)  # [B]: the forward's rows start at their lengths
        queries = step.positions  # [B, T]
        held = self.ring_positions[rows]  # [B, ring]
        past = (held >= 0) & (held < starts[:, None])  # [B, ring]: committed positions, not rolled-back ones
        old = past[:, None, :] & (held[:, None, :] > queries[:, :, None] - window)  # [B, T, ring]
        new_slots = (starts[:, None] + torch.arange(T, device=k.device)).clamp_max(write.keys - 1)  # [B, T]
        if step.mask is None:  # one token per row at one length: it sees itself
            among_new = torch.ones(B, 1, 1, dtype=torch.bool, device=k.device)
        else:
            among_new = torch.gather(step.mask[:, 0], 2, new_slots[:, None, :].expand(B, T, T))  # [B, T, T]
        among_new = among_new & (queries[:, None, :] > queries[:, :, None] - window)
        if step.counts is not None:  # a padding token's K/V are junk: no query sees them
            among_new = among_new & (
                torch.arange(T, device=k.device)[None, None, :] < step.counts.to(k.device)[:, None, None]
            )
        mask = torch.cat([old, among_new], dim=-1)[:, None]  # [B, 1, T, ring + T]
        keys = torch.cat([self.ring_k[slot, rows], k], dim=2)
        values = torch.cat([self.ring_v[slot, rows], v], dim=2)
        self._store_ring(slot, rows, k, v, starts, step.counts)
        return keys, values, mask

    def _store_ring(self, slot: int, rows: slice, k, v, starts: torch.Tensor, counts: torch.Tensor | None) -> None:
        """Each row's real new tokens, the last `ring` of them, into ring slots (start + t) % ring."""
        B, T = k.shape[0], k.shape[2]
        counts = torch.full((B,), T) if counts is None else counts
        counts = counts.to(k.device)
        t = torch.arange(T, device=k.device)
        keep = (t[None, :] < counts[:, None]) & (t[None, :] >= counts[:, None] - self.ring)  # [B, T]
        b, t = keep.nonzero(as_tuple=True)
        position = starts[b] + t  # the slot index a chain token has (a tree's path is moved by `commit`)
        ring_index = position % self.ring
        first = rows.start
        self.ring_k[slot, first + b, :, ring_index] = k[b, :, t]  # [P, kvh, hd]
        self.ring_v[slot, first + b, :, ring_index] = v[b, :, t]
        if slot == len(self.ring_slot) - 1:  # every sliding layer stored the same positions: record them once
            self.ring_positions[first + b, ring_index] = position

    def commit(self, starts: list[int], kept: list[list[int]]) -> None:
        for b, (start, offsets) in enumerate(zip(starts, kept)):
            if offsets != list(range(len(offsets))):
                src = (torch.tensor(offsets, device=self.ring_k.device) + start) % self.ring
                dst = (torch.arange(len(offsets), device=self.ring_k.device) + start) % self.ring
                self.ring_k[:, b, :, dst] = self.ring_k[:, b, :, src]  # the gather reads before the scatter writes
                self.ring_v[:, b, :, dst] = self.ring_v[:, b, :, src]
                self.ring_positions[b, dst] = dst.new_tensor(range(start, start + len(offsets)))
        super().commit(starts, kept)

    def swap_rows(self, a: int, b: int) -> None:
        super().swap_rows(a, b)
        pair = [b, a]
        self.ring_k[:, [a, b]] = self.ring_k[:, pair]  # the gather copies before the write
        self.ring_v[:, [a, b]] = self.ring_v[:, pair]
        self.ring_positions[[a, b]] = self.ring_positions[pair]
