"""What every backend over exported engines shares (ONNX Runtime, TensorRT): the caches and the
four calls of TorchEngine's interface, bound by the names the EngineSpecs declare.

The engine owns the target's K/V [L, 1, kvh, max, hd] and the drafter's context K/V
[N, 1, kvh, max, hd] as static buffers with lengths. Each call passes the valid prefix as
`past_*` / `context_*` (the graphs take dense inputs, so the prefix is copied once per call) and
writes the K/V the graph returns for the new positions at the current length; rollback moves the
length. A backend supplies `_open` (one runner per engine: `run(**tensors) → {output: tensor}`),
the buffers' dtype and device; everything else is here, so runtime/loop.py runs any of them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loopspec.engines.manifest import Manifest, read_manifest
from loopspec.engines.specs import DRAFTER_BLOCK, DRAFTER_CONTEXT, DRAFTER_CONTEXT_HIDDEN, TARGET_VERIFY, EngineSpec
from loopspec.errors import LoopspecError
from loopspec.model.drafter import DrafterConfig
from loopspec.model.target import TargetConfig
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
            past_key=past_key, past_value=past_value)
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
                                              context_key=context_key, context_value=context_value)
        return out["draft_ids"][0].cpu(), out["draft_logprobs"][0].float().cpu(), out["hidden"][0]
