"""TensorRT backend: the four engines' plans behind the interface of TorchEngine.

Mirrors the ONNX Runtime backend (runtime/ort_engine.py) on the GPU: the engine owns the target's K/V
[L, 1, kvh, max, hd] and the drafter's context K/V [N, 1, kvh, max, hd] as static CUDA buffers with
lengths; each call passes the valid prefix as `past_*` / `context_*` and writes the K/V the plan
returns for the new positions at the current length; rollback moves the length. The plans take dense
inputs, so the valid prefix is copied once per call (device to device).

Inputs and outputs are bound by the names their EngineSpec declares. Results follow the torch
engine's contract: logits, drafts and log-probs come back on the CPU, taps and hidden states stay on
the GPU. tensorrt is imported lazily: without it, or without a GPU, a clear error.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loopspec.engines.manifest import read_manifest
from loopspec.engines.specs import DRAFTER_BLOCK, DRAFTER_CONTEXT, DRAFTER_CONTEXT_HIDDEN, TARGET_VERIFY, EngineSpec
from loopspec.engines.trt import check_precision_supported, cuda_capability, require_tensorrt, torch_dtype
from loopspec.errors import LoopspecError
from loopspec.model.drafter import DrafterConfig
from loopspec.model.target import TargetConfig
from loopspec.weights import read_json


class DeviceKV:
    """K/V buffers [layers, 1, kv_heads, max_length, head_dim] on the GPU + a length."""

    def __init__(self, num_layers: int, num_kv_heads: int, max_length: int, head_dim: int, dtype, device):
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


class Plan:
    """One deserialized engine and its execution context; `run(**inputs)` → {output name: tensor}."""

    def __init__(self, trt, runtime, path: Path, spec: EngineSpec, device: torch.device):
        self.engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise LoopspecError(f"TensorRT cannot load the plan {path} (built by another TensorRT version or GPU?)")
        self.context = self.engine.create_execution_context()
        self.spec, self.device = spec, device
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        if sorted(names) != sorted(spec.input_names + spec.output_names):
            raise LoopspecError(f"plan {path} does not match its spec {spec.name}: tensors {names}")
        self.dtypes = {n: torch_dtype(trt, self.engine.get_tensor_dtype(n)) for n in names}
        self.empty = torch.zeros(1, device=device)  # an address for zero-size tensors (the first past)

    def _bind(self, name: str, tensor: torch.Tensor) -> None:
        self.context.set_tensor_address(name, tensor.data_ptr() if tensor.numel() else self.empty.data_ptr())

    def run(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        keep = []  # the bound inputs must live until the plan has run
        for name in self.spec.input_names:
            t = inputs[name]
            self.spec.check_input(name, tuple(t.shape))
            t = t.to(self.device, self.dtypes[name]).contiguous()
            keep.append(t)
            self.context.set_input_shape(name, tuple(t.shape))
            self._bind(name, t)
        outputs = {}
        for name in self.spec.output_names:
            shape = tuple(self.context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise LoopspecError(f"engine {self.spec.name}: output {name} has an undetermined shape {shape}")
            outputs[name] = torch.empty(shape, dtype=self.dtypes[name], device=self.device)
            self._bind(name, outputs[name])
        if not self.context.execute_async_v3(torch.cuda.current_stream(self.device).cuda_stream):
            raise LoopspecError(f"TensorRT failed to run {self.spec.name}")
        return outputs


class TrtEngine:
    backend = "tensorrt"

    def __init__(self, plan_dir: str | Path, max_context: int | None = None):
        trt = require_tensorrt()
        capability, device_name = cuda_capability()
        self.plan_dir = Path(plan_dir)
        self.manifest = read_manifest(self.plan_dir)
        if self.manifest.stage != "tensorrt":
            raise LoopspecError(f"{plan_dir} holds {self.manifest.stage} artifacts, not TensorRT plans "
                                "(build them with: loopspec convert trt --onnx DIR --out DIR)")
        check_precision_supported(self.manifest.precision, capability, device_name)
        built = self.manifest.data.get("settings", {}).get("compute_capability")
        here = f"{capability[0]}.{capability[1]}"
        if built is not None and built != here:
            raise LoopspecError(f"{plan_dir} was built for compute capability {built}; {device_name} is {here}: "
                                "rebuild the plans on this GPU")
        self.device = torch.device("cuda")
        self.target_cfg = TargetConfig.from_hf(read_json(self.plan_dir / "target" / "config.json", "target config"))
        self.drafter_cfg = (DrafterConfig.from_zlab(read_json(self.plan_dir / "drafter" / "config.json", "drafter config"))
                            if self.manifest.has_drafter else None)
        spec_limit = self.manifest.spec(TARGET_VERIFY).ranges["tokens"][2]  # the exported max context
        self.max_context = min(max_context or spec_limit, spec_limit)
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        names = [TARGET_VERIFY] + ([DRAFTER_CONTEXT, DRAFTER_CONTEXT_HIDDEN, DRAFTER_BLOCK] if self.has_drafter else [])
        self.plans = {n: Plan(trt, runtime, self.manifest.path(n), self.manifest.spec(n), self.device) for n in names}
        t = self.target_cfg
        kv_dtype = self.plans[TARGET_VERIFY].dtypes["past_key"]
        self.cache = DeviceKV(t.num_layers, t.num_kv_heads, self.max_context, t.head_dim, kv_dtype, self.device)
        d = self.drafter_cfg
        self.context = None
        if d is not None:
            ctx_dtype = self.plans[DRAFTER_BLOCK].dtypes["context_key"]
            self.context = DeviceKV(d.num_layers, d.num_kv_heads, self.max_context, d.head_dim, ctx_dtype, self.device)
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
        """Run tokens after the KV cache → logits [T, V] (or [1, V], CPU) and taps [T, n*H] (GPU; None
        when not wanted or without a drafter)."""
        start, T = self.cache.length, len(input_ids)
        if start + T > self.max_context:
            raise LoopspecError(f"sequence of {start + T} tokens exceeds the context of {self.max_context}")
        past_key, past_value = self.cache.valid()
        out = self.plans[TARGET_VERIFY].run(
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
        out = self.plans[engine].run(**{name: features[None], "positions": torch.arange(start, start + T)[None]})
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

        → drafts [k-1] (target ids, CPU), their log-probs [k-1] (CPU), final-norm hidden states [k, H] (GPU)."""
        ids = torch.full((1, block_size), self.mask_token_id, dtype=torch.long)
        ids[0, 0] = anchor
        context_key, context_value = self.context.valid()
        out = self.plans[DRAFTER_BLOCK].run(block_ids=ids, positions=torch.arange(position, position + block_size)[None],
                                            context_key=context_key, context_value=context_value)
        return out["draft_ids"][0].cpu(), out["draft_logprobs"][0].float().cpu(), out["hidden"][0]
