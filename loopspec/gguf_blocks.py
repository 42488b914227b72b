"""A GGUF target's matrices as the file stores them: ggml blocks of 32 weights, by loopspec name.

Q4_1 block (20 bytes): fp16 scale d, fp16 minimum m, 16 bytes of 4-bit codes q (byte j holds
element j in its low nibble and element j + 16 in its high one); w = d·q + m.
Q8_0 block (34 bytes): fp16 scale d, 32 int8 codes q; w = d·q.
Blocks run along K (a matrix's input dim) inside each output row, so reordering or stacking rows
(llama.cpp's q/k row permutation undone, q/k/v and gate/up fused as `weights.hf_to_target_state`
fuses them) keeps every block whole.

numpy + the `gguf` reader only; the ONNX side is engines/gguf_export.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loopspec.errors import LoopspecError

BLOCK = 32
SUPER_BLOCK = 256  # the K-quants' super-block
# bytes per block, and the weights a block holds (along K)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_WEIGHTS = {kind: SUPER_BLOCK if kind.endswith("_K") else BLOCK for kind in BLOCK_BYTES}
SUPPORTED_TYPES = tuple(BLOCK_BYTES) + ("F32", "F16")
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # the `gguf` package's own quantizer writes these


@dataclass
class BlockProduct:
    """A matrix [N, K] in the form a block product computes with, exactly the file's weights:
    w[n, k] = scales[n, k // block] · (codes[n, k] − zero_point) + minimums[n, k // 32] (no minimum
    term where `minimums` is None). `codes` uint8 in 0 .. 2^bits − 1; every scale and minimum is the
    fp32 product of the file's fp16 scale and its integer sub-block scale (exact: at most 18 of fp32's
    24 significand bits), so the expansion equals the `gguf` package's dequantization bit for bit."""

    kind: str  # the GGUF type(s) it holds ("Q4_K", or "Q4_K+Q6_K" for rows of both stacked)
    bits: int  # 4 or 8: the codes' width in the product (5- and 6-bit codes ride in 8 bits)
    block: int  # weights per scale along K: 32, or 16 (Q6_K)
    codes: np.ndarray  # uint8 [N, K]
    zero_point: int
    scales: np.ndarray  # float32 [N, K / block]
    minimums: np.ndarray | None  # float32 [N, K / 32]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> np.ndarray:
        n, k = self.codes.shape
        q = (self.codes.astype(np.int16) - self.zero_point).astype(np.float32).reshape(n, k // self.block, self.block)
        w = (self.scales[..., None] * q).reshape(n, k)
        if self.minimums is None:
            return w
        return (w.reshape(n, k // BLOCK, BLOCK) + self.minimums[..., None]).reshape(n, k)


def _fp16(raw: np.ndarray) -> np.ndarray:
    """Bytes [..., 2] → their fp16 value as float32 [...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """ggml's 4-bit layout [..., m] → codes [..., 2m]: byte j holds element j (low) and j + m (high)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """A 32-bit little-endian mask [..., 4] → its `count` low bits [..., count] (bit i of the word)."""
    word = np.ascontiguousarray(qh).view(np.uint32)  # [..., 1]
    return ((word >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes → 8 six-bit sub-block scales and 8 six-bit minimums (ggml's packing:
    bytes 0-3 hold scales 0-3 (low 6 bits) and scales 4-7's high 2 bits, bytes 4-7 minimums 0-3 and
    minimums 4-7's high 2 bits, bytes 8-11 scales 4-7's and minimums 4-7's low 4 bits)."""
    d, m, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    minimums = np.concatenate([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales, minimums


def _product(kind: str, b: np.ndarray) -> BlockProduct:
    """The exact product form of blocks b uint8 [N, blocks, bytes] of `kind` (ggml's layouts)."""
    n, nb, _ = b.shape
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        d = _fp16(b[..., 0:2])  # [N, nb]
        minimums = _fp16(b[..., 2:4]) if kind in ("Q4_1", "Q5_1") else None
        rest = b[..., 4:] if minimums is not None else b[..., 2:]
        if kind == "Q8_0":
            codes, bits, zero = (rest.view(np.int8).astype(np.int16) + 128).astype(np.uint8), 8, 128
        elif kind.startswith("Q4"):
            codes, bits, zero = _nibbles(rest), 4, 8 if kind == "Q4_0" else 0
        else:  # Q5: a 32-bit mask of fifth bits, then the low nibbles
            codes = _nibbles(rest[..., 4:]) | (_high_bits(rest[..., 0:4], BLOCK) << 4)
            bits, zero = 8, 16 if kind == "Q5_0" else 0
        return BlockProduct(kind, bits, BLOCK, codes.reshape(n, nb * BLOCK), zero, d, minimums)
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])  # [N, nb]
        sc, mn = _k_scales(b[..., 4:16])  # [N, nb, 8] each
        scales = (d[..., None] * sc.astype(np.float32)).reshape(n, nb * 8)
        minimums = -(dmin[..., None] * mn.astype(np.float32)).reshape(n, nb * 8)
        if kind == "Q4_K":  # 4 chunks of 32 bytes, each holding sub-blocks 2j (low) and 2j + 1 (high)
            codes, bits = _nibbles(b[..., 16:].reshape(n, nb, 4, 32)), 4
        else:  # then 32 bytes of high bits: bit j of byte i is the fifth bit of element i of sub-block j
            qh, ql = b[..., 16:48], b[..., 48:].reshape(n, nb, 4, 32)
            high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [N, nb, 8, 32]
            codes, bits = _nibbles(ql).reshape(n, nb, 8, 32) | (high << 4), 8
        return BlockProduct(kind, bits, BLOCK, codes.reshape(n, nb * SUPER_BLOCK).astype(np.uint8), 0, scales, minimums)
    if kind == "Q6_K":  # 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 d
        ql, qh = b[..., 0:128].reshape(n, nb, 2, 64), b[..., 128:192].reshape(n, nb, 2, 32)
        low = _nibbles(ql).reshape(n, nb, 2, 4, 32)  # per half: elements 0-31, 32-63, 64-95, 96-127
        high = (qh[..., None, :] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [N, nb, 2, 4, 32]
        codes = (low | (high << 4)).reshape(n, nb * SUPER_BLOCK)
        d = _fp16(b[..., 208:210])  # [N, nb]
        scales = (d[..., None] * b[..., 192:208].view(np.int8).astype(np.float32)).reshape(n, nb * 16)
        return BlockProduct(kind, 8, 16, codes, 32, scales, None)
    raise LoopspecError(f"no block product for GGUF type {kind}")


@dataclass
class BlockMatrix:
    """One matrix [N, K] in its GGUF type: `blocks` uint8 [N, K / weights per block, bytes per
    block] for a block type, float32 values [N, K] for F32 / F16."""

    kind: str
    blocks: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        if self.kind in BLOCK_BYTES:
            return self.blocks.shape[0], self.blocks.shape[1] * BLOCK_WEIGHTS[self.kind]
        return tuple(self.blocks.shape)

    def product(self) -> BlockProduct:
        """The exact form a block product computes with (`BlockProduct`)."""
        return _product(self.kind, self.blocks)

    def dequantize(self) -> np.ndarray:
        """The fp32 expansion [N, K], equal to the `gguf` package's dequantization."""
        if self.kind not in BLOCK_BYTES:
            return self.blocks
        return self.product().dequantize()

    def rows(self, index: np.ndarray) -> "BlockMatrix":
        return BlockMatrix(self.kind, self.blocks[index])


def quantize_blocks(weight: np.ndarray, kind: str) -> BlockMatrix:
    """A float matrix [N, K] (K a multiple of 32) as ggml blocks of `kind` ("Q8_0" or "Q4_1"), by the
    `gguf` package's reference quantizer (round to nearest, as llama.cpp's converter writes them):
    a matrix that has no GGUF of its own, such as a trained drafter's, gets the same block products."""
    from gguf import GGMLQuantizationType, quants

    if kind not in QUANTIZABLE:
        raise LoopspecError(f"cannot quantize to {kind!r} blocks (choose from {', '.join(QUANTIZABLE)})")
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if weight.ndim != 2 or weight.shape[1] % BLOCK:
        raise LoopspecError(
            f"{kind} blocks need a matrix whose rows are a multiple of {BLOCK} long, got shape {weight.shape}"
        )
    data = quants.quantize(weight, GGMLQuantizationType[kind])  # uint8 [N, K/32 · bytes]
    return BlockMatrix(kind, data.reshape(weight.shape[0], -1, BLOCK_BYTES[kind]))


def stack_rows(parts: list[BlockMatrix]) -> "BlockMatrix | BlockProduct":
    """The parts' rows one after another (a fused projection). Parts of one type stay that type's
    blocks; parts of several block types (a Q4_K_M file's q/k in Q4_K and v in Q6_K, say) become one
    product form they all fit exactly (`common_product`)."""
    kinds = {p.kind for p in parts}
    if len(kinds) == 1:
        return BlockMatrix(parts[0].kind, np.concatenate([p.blocks for p in parts]))
    unblocked = sorted(k for k in kinds if k not in BLOCK_BYTES)
    if unblocked:
        raise LoopspecError(
            f"cannot fuse {unblocked[0]} rows with block rows ({', '.join(sorted(kinds))}) into one product"
        )
    return common_product([p.product() for p in parts])


def common_product(parts: list[BlockProduct]) -> BlockProduct:
    """Products of several forms stacked by rows in one form that holds each exactly: the smallest
    block (a scale repeated over its halves), 8-bit codes where any part has them or where zero points
    differ (codes re-offset to one zero point), minimums (zero where a part has none) where any has."""
    forms = {(p.bits, p.block, p.zero_point, p.minimums is None) for p in parts}
    kind = "+".join(dict.fromkeys(p.kind for p in parts))
    block = min(p.block for p in parts)
    if len(forms) == 1:
        bits, zero = parts[0].bits, parts[0].zero_point
    else:
        bits, zero = 8, 128
    codes, scales, minimums = [], [], []
    for p in parts:
        codes.append((p.codes.astype(np.int16) - p.zero_point + zero).astype(np.uint8))
        scales.append(np.repeat(p.scales, p.block // block, axis=1))
        n, k = p.shape
        minimums.append(p.minimums if p.minimums is not None else np.zeros((n, k // BLOCK), np.float32))
    with_minimums = any(p.minimums is not None for p in parts)
    return BlockProduct(
        kind,
        bits,
        block,
        np.concatenate(codes),
        zero,
        np.concatenate(scales),
        np.concatenate(minimums) if with_minimums else None,
    )


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (its RoPE pairs adjacent dims, HF's the two
    halves of a head): row (h, half, i) of the HF matrix is row (h, i, half) of the GGUF one."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def read_tensors(path: str | Path) -> tuple[dict[str, BlockMatrix], str]:
    """Every tensor of a GGUF file → ({GGUF name: BlockMatrix}, architecture). Unsupported tensor
    types are refused here, by name."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise LoopspecError(f"GGUF file does not exist: {path}")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/struct errors on garbage
        raise LoopspecError(f"cannot read GGUF file {path}: {e}") from None
    field = reader.get_field("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "?"
    out = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise LoopspecError(
                f"{path.name}: tensor {t.name} is {kind}; the GGUF block engine computes with "
                f"{', '.join(SUPPORTED_TYPES)}: run this file with --precision fp32 (its weights expanded to fp32)"
            )
        data = np.asarray(t.data)
        if kind in BLOCK_BYTES:
            n = data.shape[0] if data.ndim == 2 else 1
            blocks = data.reshape(n, -1, BLOCK_BYTES[kind])  # [N, K / weights per block, bytes]
        else:
            blocks = data.astype(np.float32)
        out[t.name] = BlockMatrix(kind, blocks)
    return out, arch


def target_blocks(
    path: str | Path, num_layers: int, num_heads: int, num_kv_heads: int, tie_word_embeddings: bool
) -> dict[str, BlockMatrix]:
    """A Llama GGUF's matrices under the names of loopspec's `Target` (qkv_proj, gate_up_proj fused;
    q/k rows in HF order): {"embed_tokens.weight", "lm_head.weight", "layers.i.self_attn.qkv_proj.weight", ...}."""
    tensors, arch = read_tensors(path)
    if arch != "llama":
        raise LoopspecError(f"{Path(path).name}: the GGUF block export supports llama GGUFs, not {arch!r}")

    def take(name: str) -> BlockMatrix:
        if name not in tensors:
            raise LoopspecError(f"{Path(path).name} lacks tensor {name!r}")
        return tensors[name]

    out = {"embed_tokens.weight": take("token_embd.weight")}
    out["lm_head.weight"] = (
        out["embed_tokens.weight"] if tie_word_embeddings or "output.weight" not in tensors else take("output.weight")
    )
    for i in range(num_layers):
        b = f"blk.{i}."
        q, k = take(b + "attn_q.weight"), take(b + "attn_k.weight")
        q = q.rows(unpermute_rows(q.shape[0], num_heads))
        k = k.rows(unpermute_rows(k.shape[0], num_kv_heads))
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        out[a + "qkv_proj.weight"] = stack_rows([q, k, take(b + "attn_v.weight")])
        out[a + "o_proj.weight"] = take(b + "attn_output.weight")
        out[m + "gate_up_proj.weight"] = stack_rows([take(b + "ffn_gate.weight"), take(b + "ffn_up.weight")])
        out[m + "down_proj.weight"] = take(b + "ffn_down.weight")
    return out
