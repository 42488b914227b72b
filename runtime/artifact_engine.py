"""What every backend over exported engines shares (ONNX Runtime, TensorRT): the caches and the
four calls of TorchEngine's interface, bound by the names the EngineSpecs declare, and the batched
calls of runtime/batch.py's batch-engine interface (`open_batch`).

The engine owns the target's K/V [L, 1, kvh, max, hd] and the drafter's context K/V
[N, 1, kvh, max, hd] as static buffers with lengths. Each call passes the valid prefix as
`past_*` / `context_*` with its length (the graphs take dense inputs, so the prefix is copied once
per call) and writes the K/V the graph returns for the new positions at the current length;
rollback moves the length. A backend supplies `_open` (one runner per engine:
`run(**tensors) → {output: tensor}`), the buffers' dtype and device; everything else is here, so
runtime/loop.py and runtime/batch.py run any of them.

`ArtifactBatchEngine` does the same for rows 0..B-1 of buffers [layers, max_rows, kvh, max, hd]
with one length per row: each call passes the rows' prefix as wide as the longest row plus every
row's length (the graphs mask the rest), and writes the new K/V back at each row's own length.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loopspec.engines.manifest import Manifest, read_manifest
from loopspec.engines.specs import DRAFTER_BLOCK, DRAFTER_CONTEXT, DRAFTER_CONTEXT_HIDDEN, TARGET_VERIFY, EngineSpec
from loopspec.errors import LoopspecError
from loopspec.model.drafter import DrafterConfig
from loopspec.model.target import BatchKVCache, TargetConfig
from loopspec.weights import read_json


class StaticKV:
    """K/V buffers [layers, 1, kv_heads, max_length, head_dim] + a length (rollback = set the length)."""

    def __init__(self, num_layers: int, num_kv_heads: int, max_length: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu")):
        self.k = torch.zeros(num_layers, 1, num_kv_heads, max_length, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.max_length = max_length
        self.length = 0

    def valid(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.length
        return self.k[:, :, :, :n].contiguous(), self.v[:, :, :, :n].contiguous()

    def append(self, k: torch.Tensor, v: torch.Tensor, what: str) -> None:
        T = k.shape[3]
        if self.length + T > self.max_length:
            raise LoopspecError(f"{what} of {self.length + T} exceeds {self.max_length}")
        self.k[:, :, :, self.length:self.length + T] = k
        self.v[:, :, :, self.length:self.length + T] = v
        self.length += T

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length} from {self.length}")
        self.length = length


class ArtifactEngine:
    backend = ""
    device = torch.device("cpu")

    def __init__(self, artifact_dir: str | Path, max_context: int | None = None):
        self.artifact_dir = Path(artifact_dir)
        self.manifest = read_manifest(self.artifact_dir)
        self._check(self.manifest)
        if "past_lengths" not in self.manifest.spec(TARGET_VERIFY).input_names:
            raise LoopspecError(f"{self.artifact_dir} was exported without the batch dim and row lengths "
                                "(an older loopspec): export it again")
        self.target_cfg = TargetConfig.from_hf(read_json(self.artifact_dir / "target" / "config.json", "target config"))
        self.drafter_cfg = (DrafterConfig.from_zlab(read_json(self.artifact_dir / "drafter" / "config.json",
                                                              "drafter config"))
                            if self.manifest.has_drafter else None)
        spec_limit = self.manifest.spec(TARGET_VERIFY).ranges["tokens"][2]  # the exported max context
        self.max_context = min(max_context or spec_limit, spec_limit)
        names = [TARGET_VERIFY] + ([DRAFTER_CONTEXT, DRAFTER_CONTEXT_HIDDEN, DRAFTER_BLOCK] if self.has_drafter else [])
        self.runners = {n: self._open(self.manifest.path(n), self.manifest.spec(n)) for n in names}
        t, d = self.target_cfg, self.drafter_cfg
        self.cache = StaticKV(t.num_layers, t.num_kv_heads, self.max_context, t.head_dim,
                              self._dtype(TARGET_VERIFY, "past_key"), self.device)
        self.context = (StaticKV(d.num_layers, d.num_kv_heads, self.max_context, d.head_dim,
                                 self._dtype(DRAFTER_BLOCK, "context_key"), self.device) if d is not None else None)
        self.block_size = d.block_size if d is not None else 1
        self.mask_token_id = d.mask_token_id if d is not None else None
        self.vocab_size = t.vocab_size

    # ---- what a backend supplies -----------------------------------------------------------------
    def _check(self, manifest: Manifest) -> None:
        """Refuse artifacts this backend cannot run (stage, precision, hardware)."""

    def _open(self, path: Path, spec: EngineSpec):
        raise NotImplementedError

    def _dtype(self, engine: str, tensor: str) -> torch.dtype:
        return torch.float32

    # ---- lifecycle -------------------------------------------------------------------------------
    @property
    def has_drafter(self) -> bool:
        return self.drafter_cfg is not None

    def reset(self) -> None:
        self.cache.length = 0
        if self.context is not None:
            self.context.length = 0

    @property
    def target_length(self) -> int:
        return self.cache.length

    @property
    def context_length(self) -> int:
        return self.context.length if self.context is not None else 0

    # ---- target_verify ---------------------------------------------------------------------------
    def target_verify(self, input_ids: list[int], all_logits: bool = True,
                      want_taps: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run tokens after the KV cache → logits [T, V] (or [1, V], on the CPU) and taps [T, n*H]
        (on the engine's device; None when not wanted or without a drafter)."""
        start, T = self.cache.length, len(input_ids)
        if start + T > self.max_context:
            raise LoopspecError(f"sequence of {start + T} tokens exceeds the context of {self.max_context}")
        past_key, past_value = self.cache.valid()
        out = self.runners[TARGET_VERIFY].run(
            input_ids=torch.tensor([input_ids], dtype=torch.long),
            positions=torch.arange(start, start + T)[None],
            logit_index=torch.arange(T) if all_logits else torch.tensor([T - 1]),
            past_key=past_key, past_value=past_value, past_lengths=torch.tensor([start]))
        self.cache.append(out["new_key"], out["new_value"], "sequence")
        taps = out["taps"][0] if want_taps and self.has_drafter else None
        return out["logits"][0].float().cpu(), taps

    def target_rollback(self, length: int) -> None:
        self.cache.rollback(length)

    # ---- drafter_context -------------------------------------------------------------------------
    def _append_context(self, engine: str, name: str, features: torch.Tensor) -> None:
        start, T = self.context.length, features.shape[0]
        out = self.runners[engine].run(**{name: features[None], "positions": torch.arange(start, start + T)[None]})
        self.context.append(out["context_key"], out["context_value"], "drafter context")

    def drafter_context(self, taps: torch.Tensor) -> None:
        """Append the context features of taps [T, n*H] at the next positions."""
        self._append_context(DRAFTER_CONTEXT, "taps", taps)

    def drafter_context_hidden(self, hidden: torch.Tensor) -> None:
        """Append H-dim pseudo-features [T, H] (the drafter's own hidden states) at the next positions."""
        self._append_context(DRAFTER_CONTEXT_HIDDEN, "hidden", hidden)

    def context_rollback(self, length: int) -> None:
        self.context.rollback(length)

    # ---- drafter_block ---------------------------------------------------------------------------
    def drafter_block(self, anchor: int, position: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One stage on [anchor, MASK × (k-1)] at positions position .. position+k-1.

        → drafts [k-1] (target ids, CPU), their log-probs [k-1] (CPU), final-norm hidden states [k, H]."""
        ids = torch.full((1, block_size), self.mask_token_id, dtype=torch.long)
        ids[0, 0] = anchor
        context_key, context_value = self.context.valid()
        out = self.runners[DRAFTER_BLOCK].run(block_ids=ids, positions=torch.arange(position, position + block_size)[None],
                                              context_key=context_key, context_value=context_value,
                                              context_lengths=torch.tensor([self.context.length]))
        return out["draft_ids"][0].cpu(), out["draft_logprobs"][0].float().cpu(), out["hidden"][0]

    # ---- batched calls ---------------------------------------------------------------------------
    @property
    def max_batch(self) -> int:
        """The most rows one call of these engines takes (the exported `batch` range)."""
        return min(self.manifest.spec(n).ranges["batch"][2] for n in self.runners)

    def open_batch(self, max_rows: int) -> "ArtifactBatchEngine":
        """The batched calls over these engines' runners, with buffers for `max_rows` rows."""
        if not 1 <= max_rows <= self.max_batch:
            raise LoopspecError(f"max batch size {max_rows} is outside the exported engines' batch range "
                                f"[1, {self.max_batch}] ({self.artifact_dir})")
        return ArtifactBatchEngine(self, max_rows)


def _prefix(cache: BatchKVCache, rows: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `width` slots of `rows` as dense inputs [layers, R, kvh, width, hd] (one copy)."""
    if rows == list(range(len(rows))):  # the live rows are packed at the front: a slice
        return cache.k[:, :len(rows), :, :width].contiguous(), cache.v[:, :len(rows), :, :width].contiguous()
    index = torch.tensor(rows, device=cache.k.device)
    return cache.k[:, index, :, :width], cache.v[:, index, :, :width]


class ArtifactBatchEngine:
    """runtime/batch.py's batch-engine calls over an ArtifactEngine's runners: a target BatchKVCache
    and a drafter-context BatchKVCache of `max_rows` rows, rows 0..B-1 per call."""

    def __init__(self, engine: ArtifactEngine, max_rows: int):
        self.runners, self.device = engine.runners, engine.device
        self.max_rows, self.max_context, self.block_size = max_rows, engine.max_context, engine.block_size
        self.has_drafter, self.mask_token_id = engine.has_drafter, engine.mask_token_id
        t, d = engine.target_cfg, engine.drafter_cfg
        self.cache = BatchKVCache(t.num_layers, max_rows, t.num_kv_heads, self.max_context, t.head_dim,
                                  engine._dtype(TARGET_VERIFY, "past_key"), self.device)
        self.context = (BatchKVCache(d.num_layers, max_rows, d.num_kv_heads, self.max_context, d.head_dim,
                                     engine._dtype(DRAFTER_BLOCK, "context_key"), self.device)
                        if d is not None else None)

    def _positions(self, starts: torch.Tensor, width: int) -> torch.Tensor:
        # [R, width]: each row from its own length; right padding may run past the end (clamped, never stored)
        return (starts[:, None] + torch.arange(width)[None, :]).clamp_max(self.max_context - 1)

    def _target(self, rows: list[int], tokens: list[list[int]], all_logits: bool) -> dict[str, torch.Tensor]:
        """Rows 0..R-1 run their tokens (right-padded) after their own KV; the first len(tokens[b])
        new K/V of row b are stored at its length."""
        width = max(len(t) for t in tokens)
        ids = torch.zeros(len(tokens), width, dtype=torch.long)  # [R, T]
        for b, t in enumerate(tokens):
            ids[b, :len(t)] = torch.tensor(t)
        counts = torch.tensor([len(t) for t in tokens])
        row_index = torch.tensor(rows)
        starts = self.cache.lengths[row_index]
        if int((starts + counts).max()) > self.max_context:
            raise LoopspecError(f"sequence of {int((starts + counts).max())} tokens exceeds the context of {self.max_context}")
        past_key, past_value = _prefix(self.cache, rows, int(starts.max()))
        out = self.runners[TARGET_VERIFY].run(
            input_ids=ids, positions=self._positions(starts, width),
            logit_index=torch.arange(width) if all_logits else torch.tensor([width - 1]),
            past_key=past_key, past_value=past_value, past_lengths=starts)
        self.cache.write(out["new_key"], out["new_value"], row_index, counts)
        return out

    def prefill(self, row: int, prompt_ids: list[int], want_taps: bool) -> torch.Tensor:
        """Run a prompt alone into `row`, start its drafter context when `want_taps` → the last
        position's logits [V] (on the CPU)."""
        self.cache.lengths[row] = 0
        out = self._target([row], [prompt_ids], all_logits=False)
        if want_taps:
            self.context.lengths[row] = 0
            self._append_context(DRAFTER_CONTEXT, "taps", [row], out["taps"], torch.tensor([len(prompt_ids)]))
        return out["logits"][0, -1].float().cpu()

    def verify(self, tokens: list[list[int]], want_taps: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows 0..B-1 run their tokens after their own KV → logits [B, T, V] (CPU), taps [B, T, n*H]
        (T = the longest row; rows' padding positions are junk)."""
        out = self._target(list(range(len(tokens))), tokens, all_logits=True)
        taps = out["taps"] if want_taps and self.has_drafter else None
        return out["logits"].float().cpu(), taps

    def target_rollback(self, lengths: list[int]) -> None:
        """Rows 0..B-1 keep their first lengths[b] KV slots."""
        lengths = torch.tensor(lengths)
        if bool((lengths > self.cache.lengths[:len(lengths)]).any()):
            raise ValueError("cannot roll a row forward")
        self.cache.lengths[:len(lengths)] = lengths

    def _append_context(self, engine: str, name: str, rows: list[int], features: torch.Tensor,
                        counts: torch.Tensor) -> None:
        row_index = torch.tensor(rows)
        positions = self._positions(self.context.lengths[row_index], features.shape[1])  # [R, T]
        out = self.runners[engine].run(**{name: features, "positions": positions})
        self.context.write(out["context_key"], out["context_value"], row_index, counts)

    def append_context(self, taps: torch.Tensor, counts: list[int]) -> None:
        """Rows 0..B-1 append the context features of their first counts[b] taps [B, T, n*H]."""
        self._append_context(DRAFTER_CONTEXT, "taps", list(range(taps.shape[0])), taps, torch.tensor(counts))

    def append_pseudo_context(self, rows: list[int], hidden: torch.Tensor) -> None:
        """DLoop: `rows` append H-dim pseudo-features hidden [R, T, H] (the drafter's own states)."""
        self._append_context(DRAFTER_CONTEXT_HIDDEN, "hidden", rows, hidden.contiguous(),
                             torch.full((len(rows),), hidden.shape[1]))

    def context_lengths(self, rows: list[int]) -> list[int]:
        return self.context.lengths[rows].tolist() if self.context is not None else [0] * len(rows)

    def context_rollback(self, rows: list[int], lengths: list[int]) -> None:
        self.context.lengths[rows] = torch.tensor(lengths)

    def draft(self, rows: list[int], anchors: list[int], positions: list[int],
              block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One stage for each of `rows`: [anchor, MASK × (k-1)] at positions .. positions+k-1 on the
        row's own context → drafts [R, k-1] (target ids, CPU), their log-probs [R, k-1] (CPU),
        final-norm hidden [R, k, H]."""
        R, k = len(rows), block_size
        lengths = self.context.lengths[torch.tensor(rows)]  # [R]
        context_key, context_value = _prefix(self.context, rows, int(lengths.max()))
        ids = torch.full((R, k), self.mask_token_id, dtype=torch.long)
        ids[:, 0] = torch.tensor(anchors)
        out = self.runners[DRAFTER_BLOCK].run(block_ids=ids, positions=torch.tensor(positions)[:, None] + torch.arange(k),
                                              context_key=context_key, context_value=context_value,
                                              context_lengths=lengths)
        return out["draft_ids"].cpu(), out["draft_logprobs"].float().cpu(), out["hidden"]

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst)
        if self.context is not None:
            self.context.move_row(src, dst)
