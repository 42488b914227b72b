"""ONNX Runtime backend: the four exported engines behind the interface of TorchEngine.

The engine owns the caches as static numpy buffers with lengths: the target's K/V
[L, 1, kvh, max, hd] and the drafter's context K/V [N, 1, kvh, max, hd]. Each call passes the valid
prefix as `past_*` / `context_*` and writes the K/V the graph returns for the new positions at the
current length; rollback moves the length. Results are torch tensors (zero-copy views of the arrays
ONNX Runtime returns), so runtime/loop.py runs unchanged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from loopspec.engines.manifest import read_manifest
from loopspec.engines.ort import EngineSession, check_precision
from loopspec.engines.specs import DRAFTER_BLOCK, DRAFTER_CONTEXT, DRAFTER_CONTEXT_HIDDEN, TARGET_VERIFY
from loopspec.errors import LoopspecError
from loopspec.model.drafter import DrafterConfig
from loopspec.model.target import TargetConfig
from loopspec.weights import read_json


class StaticKV:
    """K/V buffers [layers, 1, kv_heads, max_length, head_dim] + a length (rollback = set the length)."""

    def __init__(self, num_layers: int, num_kv_heads: int, max_length: int, head_dim: int):
        self.k = np.zeros((num_layers, 1, num_kv_heads, max_length, head_dim), dtype=np.float32)
        self.v = np.zeros_like(self.k)
        self.max_length = max_length
        self.length = 0

    def valid(self) -> tuple[np.ndarray, np.ndarray]:
        # one contiguous copy of the valid prefix per call: ONNX Runtime takes dense inputs only
        n = self.length
        return np.ascontiguousarray(self.k[:, :, :, :n]), np.ascontiguousarray(self.v[:, :, :, :n])

    def append(self, k: np.ndarray, v: np.ndarray, what: str) -> None:
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


class OrtEngine:
    backend = "onnxruntime"
    device = torch.device("cpu")

    def __init__(self, onnx_dir: str | Path, max_context: int | None = None, num_threads: int | None = None):
        self.onnx_dir = Path(onnx_dir)
        self.manifest = read_manifest(self.onnx_dir)
        check_precision(self.manifest.precision, str(self.onnx_dir))
        if num_threads:
            torch.set_num_threads(num_threads)
        self.target_cfg = TargetConfig.from_hf(read_json(self.onnx_dir / "target" / "config.json", "target config"))
        self.drafter_cfg = (DrafterConfig.from_zlab(read_json(self.onnx_dir / "drafter" / "config.json", "drafter config"))
                            if self.manifest.has_drafter else None)
        spec_limit = self.manifest.spec(TARGET_VERIFY).ranges["tokens"][2]  # the exported max context
        self.max_context = min(max_context or spec_limit, spec_limit)
        names = [TARGET_VERIFY] + ([DRAFTER_CONTEXT, DRAFTER_CONTEXT_HIDDEN, DRAFTER_BLOCK] if self.has_drafter else [])
        self.sessions = {n: EngineSession(self.manifest.path(n), self.manifest.spec(n), num_threads) for n in names}
        t = self.target_cfg
        self.cache = StaticKV(t.num_layers, t.num_kv_heads, self.max_context, t.head_dim)
        d = self.drafter_cfg
        self.context = StaticKV(d.num_layers, d.num_kv_heads, self.max_context, d.head_dim) if d is not None else None
        self.block_size = d.block_size if d is not None else 1
        self.mask_token_id = d.mask_token_id if d is not None else None
        self.vocab_size = t.vocab_size

    @property
    def has_drafter(self) -> bool:
        return self.drafter_cfg is not None

    # ---- lifecycle -------------------------------------------------------------------------------
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
        """Run tokens after the KV cache → logits [T, V] (or [1, V]) and taps [T, n*H] (None when
        not wanted or without a drafter)."""
        start, T = self.cache.length, len(input_ids)
        if start + T > self.max_context:
            raise LoopspecError(f"sequence of {start + T} tokens exceeds the context of {self.max_context}")
        past_key, past_value = self.cache.valid()
        out = self.sessions[TARGET_VERIFY].run(
            input_ids=np.asarray([input_ids], dtype=np.int64),
            positions=np.arange(start, start + T, dtype=np.int64)[None],
            logit_index=np.arange(T, dtype=np.int64) if all_logits else np.asarray([T - 1], dtype=np.int64),
            past_key=past_key, past_value=past_value)
        self.cache.append(out["new_key"], out["new_value"], "sequence")
        taps = torch.from_numpy(out["taps"][0]) if want_taps and self.has_drafter else None
        return torch.from_numpy(out["logits"][0]), taps

    def target_rollback(self, length: int) -> None:
        self.cache.rollback(length)

    # ---- drafter_context -------------------------------------------------------------------------
    def _append_context(self, engine: str, name: str, features: torch.Tensor) -> None:
        start, T = self.context.length, features.shape[0]
        out = self.sessions[engine].run(**{name: np.ascontiguousarray(features.numpy()[None], dtype=np.float32),
                                           "positions": np.arange(start, start + T, dtype=np.int64)[None]})
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

        → drafts [k-1] (target ids), their log-probs [k-1], final-norm hidden states [k, H]."""
        ids = np.full((1, block_size), self.mask_token_id, dtype=np.int64)
        ids[0, 0] = anchor
        context_key, context_value = self.context.valid()
        out = self.sessions[DRAFTER_BLOCK].run(
            block_ids=ids, positions=np.arange(position, position + block_size, dtype=np.int64)[None],
            context_key=context_key, context_value=context_value)
        return (torch.from_numpy(out["draft_ids"][0]), torch.from_numpy(out["draft_logprobs"][0]),
                torch.from_numpy(out["hidden"][0]))
