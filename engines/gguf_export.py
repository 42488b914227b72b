"""The target's matrices as the GGUF's own blocks, for ONNX Runtime's `com.microsoft::MatMulNBits`.

Q4_1 (w = d·q + m per block of 32 along K) becomes
    y = MatMulNBits(x; codes q, scales d, uint8 zero points 0; bits 4, block 32)   # x · (d·q)ᵀ
      + blocksum(x) · M                                                             # the minimums
where blocksum(x) [rows, K/32] sums x over each block and M [K/32, N] holds every output column's
block minimums: Σ_k x_k·(d·q_k + m) = d·Σ x_k·q_k + m·Σ x_k inside a block, so the sum is exact.
The minimum is not folded into a float zero point (m = -d·z needs z = -m/d, rarely a code, and float
zero points send ONNX Runtime down a path ≈ 12x slower than fp32 MatMul). Codes are stored as the
op reads them: [N, K/32, 16] bytes, two consecutive K elements per byte, the first in the low nibble
(ggml's byte j holds elements j and j + 16 instead). Without a zero-point input MatMulNBits
subtracts 8, so the zero points 0 are given explicitly (measured: the same speed).

Q8_0 (w = d·q, q int8) becomes MatMulNBits bits 8 with codes q + 128 and the default zero point 128
(exact: (q + 128) - 128 = q). Only at `accuracy_level` 4: at level 1 ONNX Runtime's 8-bit kernel
took 1.1 ms for one 1-row 576×1536 product against 52 µs for fp32 MatMul, so with fp32 activations
the Q8_0 lm_head runs as its fp32 expansion, which is exact (an fp16 scale times an int8 code needs 19
of fp32's 24 significand bits). The embedding's Gather reads one fp32 row of the same expansion.

Two arithmetics, one precision name each (the artifact manifest records them):
  gguf-fp32act  accuracy_level 1: fp32 activations, the product of the fp32 expansion up to fp32
                rounding (validated against the PyTorch fp32 reference)
  gguf-int8act  accuracy_level 4: activations quantized to int8 per block of 32 inside MatMulNBits
                (llama.cpp's arithmetic for these types; AVX512-VNNI where the CPU has it); the
                minimum term stays fp32. A different, fixed model: lossless decoding is relative to
                its own plain decoding, which its target_verify reproduces bit for bit (chains and
                draft trees): the attention's softmax sums in integers and its value product runs
                over [past ; new] (engines/export.py `attend`), and no product has a single row
                (engines/artifact_engine.py).

The drafter engines follow the activations: with int8 activations the drafter's own linears become
Q8_0 blocks quantized from its weights and its draft head the GGUF's Q8_0 lm_head rows of the draft
vocabulary (`block_drafter`); with fp32 activations they stay fp32. A drafter changes only which
tokens are proposed, never what a round commits.

The modules compute, eagerly, the fp32 expansion's product (the reference); their ONNX graph is
emitted by `symbolic` (TorchScript exporter), so engines/export.py traces them like any linear
(`exports_itself`).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from torch import nn

from loopspec.engines.export import fixed_linear
from loopspec.errors import LoopspecError
from loopspec.precisions import precision_names
from loopspec.gguf_blocks import BLOCK, BlockMatrix, quantize_blocks
from loopspec.model.dflash import Drafter
from loopspec.model.drafter_kinds import require_quantized_export
from loopspec.model.target import Target

ACCURACY_LEVEL = {"gguf-fp32act": 1, "gguf-int8act": 4}  # precision → MatMulNBits accuracy_level
PRECISIONS = precision_names(weights=("gguf",))  # loopspec/precisions.py
assert set(ACCURACY_LEVEL) == set(PRECISIONS), "one accuracy level per GGUF-block precision"
DRAFTER_BLOCKS = "Q8_0"  # a drafter's own linears with int8 activations (measured: docs/benchmarks.md)
ACTIVATIONS = {"gguf-fp32act": "fp32", "gguf-int8act": "int8 (per block of 32, inside MatMulNBits)"}


def check_precision(precision: str) -> None:
    if precision not in ACCURACY_LEVEL:
        raise LoopspecError(f"unknown GGUF block precision {precision!r} (choose from {', '.join(PRECISIONS)})")


def _typed_like(g_out, x, n: int):
    """Give the custom node's output x's type with the last dim n (ONNX Runtime knows the op's shape
    rule; the exporter does not, and says so on every node otherwise)."""
    sizes = x.type().varyingSizes()
    if sizes is not None:
        g_out.setType(x.type().with_sizes(sizes[:-1] + [n]))
    return g_out


def _block_reshape(g, x, k_blocks: int):
    """x [B, T, K] → [B, T, K/32, 32] (0 copies the input's B, -1 infers T)."""
    shape = g.op("Constant", value_t=torch.tensor([0, -1, k_blocks, BLOCK], dtype=torch.int64))
    return g.op("Reshape", x, shape)


class _Q41Product(torch.autograd.Function):
    """x [B, T, K] · (d·q + m)ᵀ → [B, T, N]."""

    @staticmethod
    def forward(ctx, x, codes, scales, zero_points, minimum, accuracy_level: int):
        n, kb, _ = codes.shape
        q = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(n, kb, BLOCK).float()  # [N, K/32, 32]
        w = scales.reshape(n, kb, 1) * q + minimum.t()[..., None]  # [N, K/32, 32]
        return torch.matmul(x, w.reshape(n, kb * BLOCK).t())

    @staticmethod
    def symbolic(g, x, codes, scales, zero_points, minimum, accuracy_level: int):
        n, kb, _ = codes.type().sizes()
        y = _typed_like(
            g.op(
                "com.microsoft::MatMulNBits",
                x,
                codes,
                scales,
                zero_points,
                K_i=kb * BLOCK,
                N_i=n,
                bits_i=4,
                block_size_i=BLOCK,
                accuracy_level_i=accuracy_level,
            ),
            x,
            n,
        )
        sums = g.op(
            "ReduceSum", _block_reshape(g, x, kb), g.op("Constant", value_t=torch.tensor([-1])), keepdims_i=0
        )  # [B, T, K/32]
        return g.op("Add", y, g.op("MatMul", sums, minimum))


class _Q80Product(torch.autograd.Function):
    """x [B, T, K] · (d·q)ᵀ → [B, T, N], codes stored as q + 128."""

    @staticmethod
    def forward(ctx, x, codes, scales, accuracy_level: int):
        n, kb, _ = codes.shape
        w = scales.reshape(n, kb, 1) * (codes.float() - 128.0)  # [N, K/32, 32]
        return torch.matmul(x, w.reshape(n, kb * BLOCK).t())

    @staticmethod
    def symbolic(g, x, codes, scales, accuracy_level: int):
        n, kb, _ = codes.type().sizes()
        return _typed_like(
            g.op(
                "com.microsoft::MatMulNBits",
                x,
                codes,
                scales,
                K_i=kb * BLOCK,
                N_i=n,
                bits_i=8,
                block_size_i=BLOCK,
                accuracy_level_i=accuracy_level,
            ),
            x,
            n,
        )


class Q41Linear(nn.Module):
    """A bias-free linear whose weight [N, K] is Q4_1 blocks, in MatMulNBits' layout."""

    exports_itself = True  # engines/export.py's `linear` calls the module

    def __init__(self, matrix: BlockMatrix, accuracy_level: int):
        super().__init__()
        n, k = matrix.shape
        q = matrix.codes()  # [N, K] in 0..15
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, k // BLOCK, BLOCK // 2)
        self.register_buffer("codes", torch.from_numpy(np.ascontiguousarray(packed)))  # uint8 [N, K/32, 16]
        self.register_buffer("scales", torch.from_numpy(matrix.scales().reshape(-1)))  # [N·K/32]
        zero_bytes = n * ((k // BLOCK + 1) // 2)  # two 4-bit zero points per byte, rows padded to a byte
        self.register_buffer("zero_points", torch.zeros(zero_bytes, dtype=torch.uint8))
        self.register_buffer("minimum", torch.from_numpy(np.ascontiguousarray(matrix.minimums().T)))  # [K/32, N]
        self.accuracy_level = accuracy_level

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise LoopspecError(f"Q41Linear takes [B, T, K] activations, got {tuple(x.shape)}")
        return _Q41Product.apply(x, self.codes, self.scales, self.zero_points, self.minimum, self.accuracy_level)


class Q80Linear(nn.Module):
    """A bias-free linear whose weight [N, K] is Q8_0 blocks: MatMulNBits bits 8 (int8 activations)."""

    exports_itself = True

    def __init__(self, matrix: BlockMatrix, accuracy_level: int):
        super().__init__()
        n, k = matrix.shape
        shifted = (matrix.codes().astype(np.int16) + 128).astype(np.uint8).reshape(n, k // BLOCK, BLOCK)
        self.register_buffer("codes", torch.from_numpy(shifted))  # uint8 [N, K/32, 32]
        self.register_buffer("scales", torch.from_numpy(matrix.scales().reshape(-1)))  # [N·K/32]
        self.accuracy_level = accuracy_level

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Q80Product.apply(x, self.codes, self.scales, self.accuracy_level)

    @classmethod
    def fused(cls, parts: list["Q80Linear"]) -> "Q80Linear":
        """The parts' rows one after another (engines/export.py `fused_linear`): blocks run along K
        inside each row, so stacking quantized rows is the quantization of the stacked matrix."""
        if len({p.accuracy_level for p in parts}) != 1:
            raise LoopspecError("cannot fuse block products of different accuracy levels into one")
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.register_buffer("codes", torch.cat([p.codes for p in parts]))  # [ΣN, K/32, 32]
        fused.register_buffer("scales", torch.cat([p.scales for p in parts]))  # [ΣN·K/32]
        fused.accuracy_level = parts[0].accuracy_level
        return fused


def block_linear(matrix: BlockMatrix, precision: str) -> nn.Module | None:
    """The module computing one matrix's product in `precision`; None: the fp32 Linear stays (F32/F16
    tensors, and Q8_0 with fp32 activations, whose fp32 expansion is exact and fast)."""
    level = ACCURACY_LEVEL[precision]
    if matrix.kind == "Q4_1":
        return Q41Linear(matrix, level)
    if matrix.kind == "Q8_0" and level == ACCURACY_LEVEL["gguf-int8act"]:
        return Q80Linear(matrix, level)
    return None


def check_expansion(name: str, matrix: BlockMatrix, weight: torch.Tensor) -> None:
    """The blocks must be the reference's weights (the same GGUF): their expansion equals it exactly."""
    expanded = matrix.dequantize()
    if tuple(expanded.shape) != tuple(weight.shape) or not np.array_equal(expanded, weight.detach().numpy()):
        raise LoopspecError(
            f"the GGUF's {name} ({matrix.kind}) does not expand to the target's weight: the GGUF "
            f"and the target checkpoint differ"
        )


def block_target(target: Target, blocks: dict[str, BlockMatrix], precision: str) -> tuple[Target, dict]:
    """A copy of `target` whose linears compute with the GGUF's blocks (`blocks`: from
    loopspec.gguf_blocks.target_blocks) → (copy, {how each GGUF type runs: count of products})."""
    check_precision(precision)
    out = copy.deepcopy(target)
    counts: dict[str, int] = {}
    for name, matrix in blocks.items():
        if name == "embed_tokens.weight":
            check_expansion(name, matrix, target.embed_tokens.weight)
            continue  # the Gather reads the fp32 expansion (one row per token)
        parent_name, _, leaf = name.removesuffix(".weight").rpartition(".")
        parent = out.get_submodule(parent_name) if parent_name else out
        linear = getattr(parent, leaf)
        if getattr(linear, "bias", None) is not None:
            raise LoopspecError(f"{name}: the GGUF block export supports bias-free linears")
        check_expansion(name, matrix, linear.weight)
        module = block_linear(matrix, precision)
        how = f"{matrix.kind} as {'fp32 MatMul' if module is None else type(module).__name__}"
        counts[how] = counts.get(how, 0) + 1
        if module is not None:
            setattr(parent, leaf, module)
    return out, counts


def block_drafter(drafter: Drafter, lm_head: BlockMatrix, precision: str) -> tuple[Drafter, nn.Module, dict] | None:
    """What the drafter engines compute in `precision`: with int8 activations, a copy of `drafter`
    whose linears (its layers' projections and fc) are Q8_0 blocks quantized from its own weights,
    and its draft head the target GGUF's own `lm_head` blocks, the draft vocabulary's rows → (copy,
    head module, the manifest's account). None with fp32 activations: there every block product is
    slower than fp32 (module doc), so the drafter stays fp32.

    The drafter's arithmetic changes only which tokens are proposed: what a round commits is the
    target's, so the output stays the engine's own plain decoding (validation reports the drafter's
    τ against its fp32 reference)."""
    level = ACCURACY_LEVEL[precision]
    if level != ACCURACY_LEVEL["gguf-int8act"]:
        return None
    require_quantized_export(
        drafter.cfg.kind, f"precision {precision} (its drafter graphs compute with {DRAFTER_BLOCKS} blocks)"
    )
    out = copy.deepcopy(drafter)
    products, kept = 0, 0
    for parent in [out] + [m for layer in out.layers for m in (layer.self_attn, layer.mlp)]:
        for leaf, linear in list(parent.named_children()):
            if not isinstance(linear, nn.Linear) or (parent is out and leaf != "fc"):
                continue
            if linear.bias is not None or linear.in_features % BLOCK:  # no blocks along K: stays fp32
                kept += 1
                continue
            setattr(
                parent, leaf, Q80Linear(quantize_blocks(linear.weight.detach().float().numpy(), DRAFTER_BLOCKS), level)
            )
            products += 1
    rows = lm_head if drafter.draft_ids is None else lm_head.rows(drafter.draft_ids.numpy())
    head = block_linear(rows, precision)
    if head is None:  # an F32/F16 lm_head in the GGUF: its rows as they are
        head = fixed_linear(torch.from_numpy(rows.dequantize()))
    account = {
        "products": f"{products} {DRAFTER_BLOCKS} (quantized from its weights, round to nearest) "
        f"as {Q80Linear.__name__}" + (f", {kept} fp32 (a bias, or rows not in blocks of {BLOCK})" if kept else ""),
        "draft_head": f"the GGUF's lm_head ({lm_head.kind}), {rows.shape[0]} rows",
        "activations": ACTIVATIONS[precision],
    }
    return out, head, account


def precision_options(
    target: Target, precision: str, gguf_path: str | Path | None, drafter: Drafter | None = None
) -> dict:
    """export_engines' keyword arguments for `precision`: nothing for fp32; for a `gguf-*` precision
    the target over the blocks of `gguf_path` (the GGUF `target` was expanded from), the drafter's
    block products where they pay (`block_drafter`), the manifest's account of weights and arithmetic."""
    from loopspec.engines.manifest import source_hashes
    from loopspec.gguf_blocks import target_blocks

    if precision == "fp32":
        return {"precision": precision}
    check_precision(precision)
    if gguf_path is None:
        raise LoopspecError(
            f"precision {precision} needs the target's GGUF file (a target given as 'default' or FILE.gguf)"
        )
    cfg = target.cfg
    blocks = target_blocks(gguf_path, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings)
    verify_target, counts = block_target(target, blocks, precision)
    path = Path(gguf_path)
    settings = {
        "weights": {
            "format": "gguf blocks",
            "file": source_hashes(path.parent, [path.name]),
            "products": counts,
            "embedding": "fp32 expansion (Gather)",
        },
        "arithmetic": {
            "activations": ACTIVATIONS[precision],
            "matmulnbits_accuracy_level": ACCURACY_LEVEL[precision],
            "q4_1_minimum": "blocksum(x) @ M in fp32",
        },
    }
    options = {"precision": precision, "verify_target": verify_target, "extra_settings": settings}
    quantized = block_drafter(drafter, blocks["lm_head.weight"], precision) if drafter is not None else None
    if quantized is not None:
        options["draft_drafter"], options["draft_head"], settings["drafter"] = quantized
    return options
