"""A calibrated model's quantized Linears in deployment form — the tensors modelopt's export
primitives compute — shared by the quantize stage (convert/quantize.py) and the checkpoint writer
(convert/quant_checkpoint.py). modelopt is imported lazily."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loopspec.convert.qdq import PRECISIONS
from loopspec.errors import LoopspecError

UNQUANTIZED_DTYPE = torch.bfloat16  # norms, embeddings and excluded layers, as modelopt exports them


@dataclass
class QuantizedWeight:
    """One calibrated Linear in deployment form (modelopt's export math)."""

    precision: str  # "fp8" | "nvfp4"
    weight: torch.Tensor  # fp8: float8_e4m3fn [out, in]; nvfp4: uint8 [out, in/2] (two e2m1 per byte, low nibble first)
    weight_scale: torch.Tensor  # fp8: fp32 scalar; nvfp4: float8_e4m3fn [out, in/16]
    weight_scale_2: torch.Tensor | None  # nvfp4: fp32 scalar (global)
    input_scale: torch.Tensor  # fp32 scalar
    bias: torch.Tensor | None
    block_size: int  # 0 (per tensor) or 16

    def rows(self, start: int, stop: int) -> "QuantizedWeight":
        """The slice of output rows [start, stop) (scalars shared): a fused module's parts."""
        per_row = self.weight_scale.dim() > 0
        return QuantizedWeight(
            self.precision,
            self.weight[start:stop],
            self.weight_scale[start:stop] if per_row else self.weight_scale,
            self.weight_scale_2,
            self.input_scale,
            None if self.bias is None else self.bias[start:stop],
            self.block_size,
        )

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Checkpoint tensors under `prefix` (copies: the parts of a fused module share scalars)."""
        out = {"weight": self.weight, "weight_scale": self.weight_scale, "input_scale": self.input_scale}
        if self.weight_scale_2 is not None:
            out["weight_scale_2"] = self.weight_scale_2
        if self.bias is not None:
            out["bias"] = self.bias.to(UNQUANTIZED_DTYPE)
        return {prefix + k: v.clone() for k, v in out.items()}


def quantized_weight(module: nn.Module) -> QuantizedWeight | None:
    """Deployment tensors of one calibrated Linear, None when its quantizers are disabled."""
    from modelopt.torch.export import quant_utils as qu

    fmt = qu.get_quantization_format(module)
    if fmt is None:
        return None
    if fmt not in PRECISIONS:
        raise LoopspecError(f"unexpected modelopt quantization format {fmt!r}")
    weight = module.weight.detach().float()
    scale = qu.get_weight_scaling_factor(module)
    scale_2 = qu.get_weight_scaling_factor_2(module)
    block = qu.get_weight_block_size(module)
    packed = qu.to_quantized_weight(weight, scale, fmt, scale_2, block)
    input_scale = qu.get_activation_scaling_factor(module)
    if input_scale is None:
        raise LoopspecError("a quantized linear without a calibrated input range (was calibration run?)")
    if fmt == "fp8":
        scale = scale.float().reshape(())
    return QuantizedWeight(
        fmt,
        packed,
        scale,
        None if scale_2 is None else scale_2.float().reshape(()),
        input_scale.float().reshape(()),
        None if module.bias is None else module.bias.detach(),
        block,
    )


def quantized_weights(model: nn.Module) -> dict[str, QuantizedWeight]:
    """{module name: QuantizedWeight} for every quantized Linear of a calibrated model."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and hasattr(module, "weight_quantizer"):
            q = quantized_weight(module)
            if q is not None:
                out[name] = q
    return out
