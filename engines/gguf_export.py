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
from loopspec.gguf_blocks import BLOCK, BLOCK_BYTES, BlockMatrix, BlockProduct, quantize_blocks
from loopspec.model.dflash import Drafter
from loopspec.model.drafter_kinds import require_quantized_export
from loopspec.model.target import Target

ACCURACY_LEVEL = {"gguf-fp32act": 1, "gguf-int8act": 4, "gguf-fused": 4}  # precision → MatMulNBits accuracy_level
PRECISIONS = precision_names(weights=("gguf",))  # loopspec/precisions.py
assert set(ACCURACY_LEVEL) == set(PRECISIONS), "one accuracy level per GGUF-block precision"
DRAFTER_BLOCKS = "Q8_0"  # a drafter's own linears with int8 activations (measured: docs/benchmarks.md)
ACTIVATIONS = {
    "gguf-fp32act": "fp32",
    "gguf-int8act": "int8 (per block of 32, inside MatMulNBits)",
    "gguf-fused": "int8 (per block of 32, inside MatMulNBits)",
}


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


# MatMulNBits subtracts this from every code when no zero-point input is given
DEFAULT_ZERO_POINT = {4: 8, 8: 128}


class _BlockProduct(torch.autograd.Function):
    """x [B, T, K] · wᵀ → [B, T, N], w = scales·(codes − zero point) per block (+ minimums per 32)."""

    @staticmethod
    def forward(ctx, x, codes, scales, zero_points, minimum, bits: int, block: int, accuracy_level: int):
        n, kb, _ = codes.shape
        if bits == 4:  # two consecutive K elements per byte, the first in the low nibble
            codes = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(n, kb, block)
        zero = 0.0 if zero_points is not None else float(DEFAULT_ZERO_POINT[bits])  # explicit zero points: 0
        w = (scales.reshape(n, kb, 1) * (codes.float() - zero)).reshape(n, kb * block)
        if minimum is not None:
            w = (w.reshape(n, -1, BLOCK) + minimum.t()[..., None]).reshape(n, kb * block)
        return torch.matmul(x, w.t())

    @staticmethod
    def symbolic(g, x, codes, scales, zero_points, minimum, bits: int, block: int, accuracy_level: int):
        n, kb, _ = codes.type().sizes()
        inputs = [x, codes, scales] + ([zero_points] if zero_points is not None else [])
        y = _typed_like(
            g.op(
                "com.microsoft::MatMulNBits",
                *inputs,
                K_i=kb * block,
                N_i=n,
                bits_i=bits,
                block_size_i=block,
                accuracy_level_i=accuracy_level,
            ),
            x,
            n,
        )
        if minimum is None:
            return y
        sums = g.op(
            "ReduceSum",
            _block_reshape(g, x, kb * block // BLOCK),
            g.op("Constant", value_t=torch.tensor([-1])),
            keepdims_i=0,
        )  # [B, T, K/32]
        return g.op("Add", y, g.op("MatMul", sums, minimum))


class BlockLinear(nn.Module):
    """A linear whose weight [N, K] is a GGUF's blocks (`BlockProduct`: Q4_0, Q4_1, Q4_K as 4-bit
    codes; Q5_0, Q5_1, Q5_K, Q6_K, Q8_0 as 8-bit codes), in MatMulNBits' layout: the weights are
    exactly the file's, whose minimums (Q4_1, Q5_1, the K-quants' sub-block minimums) run as the
    correction term blocksum(x) · M (module doc). A bias (the file's F32 vector: Qwen2's q/k/v) is
    added in fp32 after the product, as llama.cpp adds it."""

    exports_itself = True  # engines/export.py's `linear` calls the module

    def __init__(self, product: BlockProduct, accuracy_level: int, bias: np.ndarray | None = None):
        super().__init__()
        n, k = product.shape
        self.bits, self.block, self.kind = product.bits, product.block, product.kind
        self.accuracy_level = accuracy_level
        codes = product.codes.astype(np.int16)
        if product.bits == 8 or product.zero_point == DEFAULT_ZERO_POINT[4]:
            # the op's default zero point: 8-bit codes shifted to it (exact: c − z + 128 − 128 = c − z)
            codes = codes - product.zero_point + DEFAULT_ZERO_POINT[product.bits]
            zero_points = None
        else:  # 4-bit codes with zero point 0 (Q4_1, Q4_K): given explicitly, two per byte, rows padded
            if product.zero_point != 0:
                raise LoopspecError(f"4-bit block codes with zero point {product.zero_point} have no product form")
            zero_points = torch.zeros(n * ((k // product.block + 1) // 2), dtype=torch.uint8)
        codes = codes.astype(np.uint8).reshape(n, k // product.block, product.block)
        if product.bits == 4:
            codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
        self.register_buffer("codes", torch.from_numpy(np.ascontiguousarray(codes)))  # uint8 [N, K/block, ...]
        self.register_buffer("scales", torch.from_numpy(np.ascontiguousarray(product.scales).reshape(-1)))
        self.register_buffer("zero_points", zero_points)
        minimum = None if product.minimums is None else torch.from_numpy(np.ascontiguousarray(product.minimums.T))
        self.register_buffer("minimum", minimum)  # [K/32, N]
        if bias is not None and tuple(bias.shape) != (n,):
            raise LoopspecError(f"a bias of shape {tuple(bias.shape)} for a block product of {n} outputs")
        self.register_buffer("bias", None if bias is None else torch.from_numpy(np.array(bias, dtype=np.float32)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise LoopspecError(f"BlockLinear takes [B, T, K] activations, got {tuple(x.shape)}")
        y = _BlockProduct.apply(
            x, self.codes, self.scales, self.zero_points, self.minimum, self.bits, self.block, self.accuracy_level
        )
        return y if self.bias is None else y + self.bias

    @classmethod
    def fused(cls, parts: list["BlockLinear"]) -> "BlockLinear":
        """The parts' rows one after another (engines/export.py `fused_linear`): blocks run along K
        inside each row, so stacking block rows is the blocks of the stacked matrix."""
        forms = {(p.bits, p.block, p.accuracy_level, p.zero_points is None, p.minimum is None) for p in parts}
        if len(forms) != 1:
            raise LoopspecError("cannot fuse block products of different forms into one")
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        first = parts[0]
        fused.bits, fused.block, fused.accuracy_level = first.bits, first.block, first.accuracy_level
        fused.kind = "+".join(dict.fromkeys(p.kind for p in parts))
        fused.register_buffer("codes", torch.cat([p.codes for p in parts]))
        fused.register_buffer("scales", torch.cat([p.scales for p in parts]))
        zero = None if first.zero_points is None else torch.cat([p.zero_points for p in parts])
        fused.register_buffer("zero_points", zero)
        fused.register_buffer("minimum", None if first.minimum is None else torch.cat([p.minimum for p in parts], 1))
        biases = None  # a part without a bias adds zeros to its outputs
        if any(p.bias is not None for p in parts):
            biases = torch.cat([p.bias if p.bias is not None else torch.zeros(p.codes.shape[0]) for p in parts])
        fused.register_buffer("bias", biases)
        return fused


def block_linear(
    matrix: "BlockMatrix | BlockProduct", precision: str, bias: np.ndarray | None = None
) -> nn.Module | None:
    """The module computing one matrix's product (plus `bias`) in `precision`; None: the fp32 Linear
    stays, with its own bias (F32/F16 tensors, and 8-bit codes with fp32 activations, whose fp32
    expansion is exact and faster: module doc)."""
    level = ACCURACY_LEVEL[precision]
    if isinstance(matrix, BlockMatrix) and matrix.kind not in BLOCK_BYTES:
        return None
    product = matrix.product() if isinstance(matrix, BlockMatrix) else matrix
    if product.bits == 8 and level != ACCURACY_LEVEL["gguf-int8act"]:
        return None
    return BlockLinear(product, level, bias)


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
    loopspec.gguf_blocks `GgufTarget.blocks`) → (copy, {how each GGUF type runs: count of products}).
    Every vector (norms, q/k norms, biases) must equal the target's too: the norms stay its fp32
    ones, a bias goes with its product."""
    check_precision(precision)
    missing = sorted(set(target.state_dict()) - set(blocks))
    if missing:  # a tensor the target computes with that the file does not hold (Qwen3's q_norm, say)
        raise LoopspecError(f"the GGUF holds no {missing[0]} of the target: the GGUF and the target checkpoint differ")
    out = copy.deepcopy(target)
    counts: dict[str, int] = {}
    for name, matrix in blocks.items():
        if name == "embed_tokens.weight":
            check_expansion(name, matrix, target.embed_tokens.weight)
            continue  # the Gather reads the fp32 expansion (one row per token)
        if len(matrix.shape) == 1:
            check_expansion(name, matrix, target.get_parameter(name))
            continue
        parent_name, _, leaf = name.removesuffix(".weight").rpartition(".")
        parent = out.get_submodule(parent_name) if parent_name else out
        linear = getattr(parent, leaf)
        bias = blocks.get(name.removesuffix(".weight") + ".bias")
        if (getattr(linear, "bias", None) is None) != (bias is None):
            which = ("the target's", "the GGUF's") if bias is None else ("the GGUF's", "the target's")
            raise LoopspecError(
                f"{name}: {which[0]} linear has a bias, {which[1]} none: the GGUF and the target checkpoint differ"
            )
        check_expansion(name, matrix, linear.weight)
        module = block_linear(matrix, precision, None if bias is None else bias.dequantize())
        how = f"{matrix.kind} as {'fp32 MatMul' if module is None else f'{module.bits}-bit {type(module).__name__}'}"
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
            blocks = quantize_blocks(linear.weight.detach().float().numpy(), DRAFTER_BLOCKS)
            setattr(parent, leaf, BlockLinear(blocks.product(), level))
            products += 1
    rows = lm_head if drafter.draft_ids is None else lm_head.rows(drafter.draft_ids.numpy())
    head = block_linear(rows, precision)
    if head is None:  # an F32/F16 lm_head in the GGUF: its rows as they are
        head = fixed_linear(torch.from_numpy(rows.dequantize()))
    account = {
        "products": f"{products} {DRAFTER_BLOCKS} (quantized from its weights, round to nearest) "
        f"as {BlockLinear.__name__}" + (f", {kept} fp32 (a bias, or rows not in blocks of {BLOCK})" if kept else ""),
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
    from loopspec.gguf_blocks import check_target_config, read_gguf_target

    if precision == "fp32":
        return {"precision": precision}
    check_precision(precision)
    if gguf_path is None:
        raise LoopspecError(
            f"precision {precision} needs the target's GGUF file (a target given as 'default' or FILE.gguf)"
        )
    gguf = read_gguf_target(gguf_path)
    check_target_config(target.cfg, gguf)  # the graphs take shapes, norms and RoPE from target.cfg
    blocks = gguf.blocks()
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
