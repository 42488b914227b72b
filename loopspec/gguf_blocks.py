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
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
SUPPORTED_TYPES = ("Q4_1", "Q8_0", "F32", "F16")


@dataclass
class BlockMatrix:
    """One matrix [N, K] in its GGUF type: `blocks` uint8 [N, K/32, bytes per block] for Q4_1 / Q8_0,
    float32 values [N, K] for F32 / F16."""

    kind: str
    blocks: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        if self.kind in BLOCK_BYTES:
            return self.blocks.shape[0], self.blocks.shape[1] * BLOCK
        return tuple(self.blocks.shape)

    def scales(self) -> np.ndarray:
        """d of every block → float32 [N, K/32]."""
        return np.ascontiguousarray(self.blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)

    def minimums(self) -> np.ndarray:
        """Q4_1's m of every block → float32 [N, K/32]."""
        return np.ascontiguousarray(self.blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)

    def codes(self) -> np.ndarray:
        """Q4_1: uint8 [N, K] in 0..15; Q8_0: int8 [N, K]."""
        n, kb, _ = self.blocks.shape
        if self.kind == "Q4_1":
            packed = self.blocks[..., 4:]  # [N, K/32, 16]
            return np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(n, kb * BLOCK)
        return np.ascontiguousarray(self.blocks[..., 2:]).view(np.int8).reshape(n, kb * BLOCK)

    def dequantize(self) -> np.ndarray:
        """The fp32 expansion [N, K], computed as gguf's reader computes it (d·q + m in fp32)."""
        if self.kind not in BLOCK_BYTES:
            return self.blocks
        n, kb, _ = self.blocks.shape
        q = self.codes().reshape(n, kb, BLOCK).astype(np.float32)
        w = self.scales()[..., None] * q  # [N, K/32, 32]
        if self.kind == "Q4_1":
            w = w + self.minimums()[..., None]
        return w.reshape(n, kb * BLOCK)

    def rows(self, index: np.ndarray) -> "BlockMatrix":
        return BlockMatrix(self.kind, self.blocks[index])


def quantize_blocks(weight: np.ndarray, kind: str) -> BlockMatrix:
    """A float matrix [N, K] (K a multiple of 32) as ggml blocks of `kind` ("Q8_0" or "Q4_1"), by the
    `gguf` package's reference quantizer (round to nearest, as llama.cpp's converter writes them):
    a matrix that has no GGUF of its own, such as a trained drafter's, gets the same block products."""
    from gguf import GGMLQuantizationType, quants

    if kind not in BLOCK_BYTES:
        raise LoopspecError(f"cannot quantize to {kind!r} blocks (choose from {', '.join(BLOCK_BYTES)})")
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if weight.ndim != 2 or weight.shape[1] % BLOCK:
        raise LoopspecError(
            f"{kind} blocks need a matrix whose rows are a multiple of {BLOCK} long, got shape {weight.shape}"
        )
    data = quants.quantize(weight, GGMLQuantizationType[kind])  # uint8 [N, K/32 · bytes]
    return BlockMatrix(kind, data.reshape(weight.shape[0], -1, BLOCK_BYTES[kind]))


def stack_rows(parts: list[BlockMatrix]) -> BlockMatrix:
    """The parts' rows one after another (a fused projection), all of one type."""
    kinds = {p.kind for p in parts}
    if len(kinds) != 1:
        raise LoopspecError(f"cannot fuse matrices of different GGUF types {sorted(kinds)} into one product")
    return BlockMatrix(parts[0].kind, np.concatenate([p.blocks for p in parts]))


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
                f"{path.name}: tensor {t.name} is {kind}; the GGUF block export supports {', '.join(SUPPORTED_TYPES)}"
            )
        data = np.asarray(t.data)
        if kind in BLOCK_BYTES:
            n = data.shape[0] if data.ndim == 2 else 1
            blocks = data.reshape(n, -1, BLOCK_BYTES[kind])  # [N, K/32, bytes]
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
