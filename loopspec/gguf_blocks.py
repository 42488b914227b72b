"""A GGUF target's matrices as the file stores them: ggml blocks of 32 weights, by loopspec name;
and what each dense architecture's file holds (`ARCHITECTURES`: llama, qwen2, qwen3), its metadata read
as the target's config.

Q4_1 block (20 bytes): fp16 scale d, fp16 minimum m, 16 bytes of 4-bit codes q (byte j holds
element j in its low nibble and element j + 16 in its high one); w = d·q + m.
Q8_0 block (34 bytes): fp16 scale d, 32 int8 codes q; w = d·q.
Blocks run along K (a matrix's input dim) inside each output row, so reordering or stacking rows
(llama.cpp's q/k row permutation undone, q/k/v and gate/up fused as `weights.hf_to_target_state`
fuses them) keeps every block whole.

numpy + the `gguf` reader (loopspec.model read inside the functions that build a config); the ONNX
side is engines/gguf_export.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from loopspec.errors import LoopspecError

if TYPE_CHECKING:
    from loopspec.model.target import TargetConfig

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
    if not kinds & set(BLOCK_BYTES):  # F32 and F16 values (biases): both held as float32 already
        return BlockMatrix("F32", np.concatenate([p.blocks for p in parts]))
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


def _open(path: str | Path):
    """A GGUFReader over `path`, or one line saying why there is none."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise LoopspecError(f"GGUF file does not exist: {path}")
    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/struct errors on garbage
        raise LoopspecError(f"cannot read GGUF file {path}: {e}") from None


def _architecture_name(reader) -> str:
    field = reader.get_field("general.architecture")
    return field.contents() if field is not None else "?"


def read_tensors(path: str | Path) -> tuple[dict[str, BlockMatrix], str]:
    """Every tensor of a GGUF file → ({GGUF name: BlockMatrix}, architecture). Unsupported tensor
    types are refused here, by name."""
    path = Path(path)
    reader = _open(path)
    return _tensors(reader, path), _architecture_name(reader)


def _tensors(reader, path: Path) -> dict[str, BlockMatrix]:
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
    return out


# --------------------------------------------------------------------------------------------------
# The dense architectures: what llama.cpp's converter wrote, per architecture


@dataclass(frozen=True)
class GgufArchitecture:
    """One llama.cpp architecture the block engine builds: the loopspec family it is, whether the
    converter reordered q/k rows, and the tensors its layers hold beyond `LAYER_TENSORS`."""

    name: str  # general.architecture, and the prefix of its metadata keys
    family: str  # loopspec's target family (loopspec.model.families), whose record reads the config
    # llama.cpp's converter permutes q/k rows (weights and biases) for llama only: its llama RoPE turns
    # adjacent pairs, HF's the two halves of a head; Qwen2/Qwen3 files keep HF's order (their RoPE in
    # llama.cpp is the NEOX kind, which turns halves)
    permute_qk: bool
    layer_extras: tuple[tuple[str, tuple[str, ...]], ...] = ()


# per layer: a Target name ← the GGUF tensor(s) stacked by rows into it (blk.i. prefixed)
LAYER_TENSORS = (
    ("self_attn.qkv_proj.weight", ("attn_q.weight", "attn_k.weight", "attn_v.weight")),
    ("self_attn.o_proj.weight", ("attn_output.weight",)),
    ("mlp.gate_up_proj.weight", ("ffn_gate.weight", "ffn_up.weight")),
    ("mlp.down_proj.weight", ("ffn_down.weight",)),
    ("input_layernorm.weight", ("attn_norm.weight",)),
    ("post_attention_layernorm.weight", ("ffn_norm.weight",)),
)

ARCHITECTURES = {
    a.name: a
    for a in (
        GgufArchitecture("llama", "llama", permute_qk=True),
        # Qwen2: q/k/v carry biases (F32), added after the block product
        GgufArchitecture(
            "qwen2",
            "qwen2",
            permute_qk=False,
            layer_extras=(("self_attn.qkv_proj.bias", ("attn_q.bias", "attn_k.bias", "attn_v.bias")),),
        ),
        # Qwen3: an RMSNorm per head on q and on k before RoPE, no biases
        GgufArchitecture(
            "qwen3",
            "qwen3",
            permute_qk=False,
            layer_extras=(
                ("self_attn.q_norm.weight", ("attn_q_norm.weight",)),
                ("self_attn.k_norm.weight", ("attn_k_norm.weight",)),
            ),
        ),
    )
}


def gguf_architecture(name: str, file: str) -> GgufArchitecture:
    if name not in ARCHITECTURES:
        raise LoopspecError(
            f"{file}: the GGUF block engine builds {', '.join(ARCHITECTURES)} GGUFs, not {name!r} "
            f"(its general.architecture): run this file with --precision fp32"
        )
    return ARCHITECTURES[name]


def gguf_metadata(path: str | Path) -> dict:
    """A GGUF file's scalar metadata {key: value} (the tokenizer's arrays are not read)."""
    return _scalars(_open(path))


def gguf_sizes(path: str | Path) -> dict:
    """What a GGUF of any architecture declares of its sizes, as config fields: the head size
    (`<arch>.attention.key_length`, where given) and the vocabulary (token_embd's rows; the token list
    may be shorter)."""
    reader = _open(path)
    arch, out = _architecture_name(reader), {}
    field = reader.get_field(f"{arch}.attention.key_length")
    if field is not None:
        out["head_dim"] = int(field.contents())
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            out["vocab_size"] = int(t.shape[-1])  # ggml order: the row length first
    return out


def _scalars(reader) -> dict:
    from gguf import GGUFValueType

    return {k: f.contents() for k, f in reader.fields.items() if f.types and f.types[0] != GGUFValueType.ARRAY}


def _rope_scaling(meta: dict, a: str, file: str) -> dict | None:
    """RoPE scaling as the metadata declares it (llama.cpp writes linear and YaRN there; llama3's
    per-frequency factors are a `rope_freqs` tensor instead, compared in `check_target_config`)."""
    kind = meta.get(f"{a}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{a}.rope.scaling.factor"])}
    if kind == "yarn":
        out = {
            "rope_type": "yarn",
            "factor": float(meta[f"{a}.rope.scaling.factor"]),
            "original_max_position_embeddings": int(meta[f"{a}.rope.scaling.original_context_length"]),
        }
        for key, hf in (
            ("yarn_beta_fast", "beta_fast"),
            ("yarn_beta_slow", "beta_slow"),
            ("yarn_attn_factor", "attention_factor"),
        ):
            if f"{a}.rope.scaling.{key}" in meta:
                out[hf] = float(meta[f"{a}.rope.scaling.{key}"])
        return out
    raise LoopspecError(f"{file}: RoPE scaling {kind!r} is not supported (supported: none, linear, yarn)")


def _hf_config(reader, path: Path) -> tuple[GgufArchitecture, dict]:
    """A dense GGUF's metadata as the config.json its family reads (loopspec.model.families), and the
    architecture's record: `<arch>.block_count`, `.embedding_length`, `.feed_forward_length`,
    `.attention.head_count(_kv)`, `.attention.key_length` (else embedding / heads),
    `.attention.layer_norm_rms_epsilon`, `.rope.freq_base`, `.rope.scaling.*`, `.context_length`; the
    vocabulary is token_embd's rows, and the head is tied where the file has no output.weight (as
    llama.cpp reads it)."""
    arch = gguf_architecture(_architecture_name(reader), path.name)
    meta, a = _scalars(reader), arch.name
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}  # ggml order: the row length first

    def need(key: str):
        if f"{a}.{key}" not in meta:
            raise LoopspecError(f"{path.name} lacks the metadata key {a}.{key}")
        return meta[f"{a}.{key}"]

    if "token_embd.weight" not in shapes:
        raise LoopspecError(f"{path.name} lacks tensor 'token_embd.weight'")
    for key in ("attention.head_count", "attention.head_count_kv"):  # a list: heads per layer (not dense)
        if f"{a}.{key}" in reader.fields and f"{a}.{key}" not in meta:
            raise LoopspecError(f"{path.name}: {a}.{key} varies per layer, which the {a} decoder does not compute")
    heads, hidden = int(need("attention.head_count")), int(need("embedding_length"))
    head_dim = int(meta.get(f"{a}.attention.key_length", hidden // heads))
    for key in ("attention.value_length", "rope.dimension_count"):  # partial rotary: no dense family computes it
        if int(meta.get(f"{a}.{key}", head_dim)) != head_dim:
            raise LoopspecError(
                f"{path.name}: {a}.{key} {meta[f'{a}.{key}']} differs from the head size {head_dim}, "
                f"which the {a} decoder does not compute"
            )
    hf = {
        "model_type": arch.family,
        "vocab_size": shapes["token_embd.weight"][-1],
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{a}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{a}.rope.freq_base", 10000.0)),  # llama.cpp's default base
        "max_position_embeddings": int(meta.get(f"{a}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in shapes,
    }
    scaling = _rope_scaling(meta, a, path.name)
    if scaling is not None:
        hf["rope_scaling"] = scaling
    for key, hf_key in (
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
    ):
        if key in meta:
            hf[hf_key] = int(meta[key])
    return arch, hf


@dataclass
class GgufTarget:
    """A dense GGUF read once: its architecture's record, its metadata as a config, its tensors."""

    path: Path
    architecture: GgufArchitecture
    hf_config: dict
    tensors: dict[str, BlockMatrix]  # by GGUF name

    @property
    def config(self) -> TargetConfig:
        from loopspec.model.families import target_config

        return target_config(self.hf_config)

    def take(self, name: str) -> BlockMatrix:
        if name not in self.tensors:
            raise LoopspecError(f"{self.path.name} lacks tensor {name!r}")
        return self.tensors[name]

    def blocks(self) -> dict[str, BlockMatrix]:
        """The tensors under the names of loopspec's `Target` (q/k/v and gate/up fused, q/k rows in HF
        order): {"embed_tokens.weight", "lm_head.weight", "norm.weight",
        "layers.i.self_attn.qkv_proj.weight", "layers.i.input_layernorm.weight", ...} and the
        architecture's extras (Qwen2's "layers.i.self_attn.qkv_proj.bias", Qwen3's q_norm / k_norm)."""
        cfg = self.config
        out = {"embed_tokens.weight": self.take("token_embd.weight")}
        out["lm_head.weight"] = out["embed_tokens.weight"] if cfg.tie_word_embeddings else self.take("output.weight")
        out["norm.weight"] = self.take("output_norm.weight")
        heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
        for i in range(cfg.num_layers):
            for name, parts in LAYER_TENSORS + self.architecture.layer_extras:
                rows = []
                for part in parts:
                    matrix = self.take(f"blk.{i}.{part}")
                    stem = part.partition(".")[0]
                    if self.architecture.permute_qk and stem in heads:
                        matrix = matrix.rows(unpermute_rows(matrix.shape[0], heads[stem]))
                    rows.append(matrix)
                out[f"layers.{i}.{name}"] = rows[0] if len(rows) == 1 else stack_rows(rows)
        return out


def read_gguf_target(path: str | Path) -> GgufTarget:
    """A dense GGUF (an architecture of `ARCHITECTURES`) read once; others refused in one line."""
    path = Path(path)
    reader = _open(path)
    arch, hf = _hf_config(reader, path)  # the architecture is refused before any tensor's type
    return GgufTarget(path, arch, hf, _tensors(reader, path))


def target_blocks(path: str | Path) -> dict[str, BlockMatrix]:
    """A dense GGUF's tensors under the names of loopspec's `Target` (`GgufTarget.blocks`)."""
    return read_gguf_target(path).blocks()


# what the graphs compute with, compared as they are (eps and theta: as the file's fp32 holds them)
SAME_FIELDS = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
SAME_FIELDS += ("head_dim", "tie_word_embeddings", "attention_bias", "qk_norm")


def check_target_config(cfg: TargetConfig, gguf: GgufTarget) -> None:
    """The target's config must be what the GGUF declares: its shapes, norms' epsilon, tied head, RoPE
    base and scaling (a `rope_freqs` tensor is llama.cpp's llama3 scaling: factors dividing each
    frequency). Otherwise the graphs would compute another model than the file's: one line."""
    from loopspec.model.target import rope_inv_freq

    theirs, name = gguf.config, gguf.path.name

    def differs(what: str, value, target_value) -> LoopspecError:
        return LoopspecError(
            f"{name} declares {what} {value}, the target {target_value}: the GGUF and the target checkpoint differ"
        )

    for field in SAME_FIELDS:
        if getattr(theirs, field) != getattr(cfg, field):
            raise differs(field, getattr(theirs, field), getattr(cfg, field))
    for field in ("rms_norm_eps", "rope_theta"):
        if np.float32(getattr(theirs, field)) != np.float32(getattr(cfg, field)):
            raise differs(field, getattr(theirs, field), getattr(cfg, field))
    factors = gguf.tensors.get("rope_freqs.weight")
    if factors is not None and cfg.rope_scaling is None:
        # transformers' GGUF reader drops rope_freqs, so the fp32 expansion of such a file has no
        # scaling; the block graphs compute what that reference computes (its decoding stays lossless
        # relative to it), so this is the expansion's gap and is not refused here
        return
    freqs, scale = rope_inv_freq(theirs.head_dim, theirs.rope_theta, theirs.rope_scaling)
    freqs = freqs.numpy() if factors is None else freqs.numpy() / factors.dequantize().reshape(-1)
    target_freqs, target_scale = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    if freqs.shape != tuple(target_freqs.shape) or not np.allclose(freqs, target_freqs.numpy(), rtol=1e-5, atol=0):
        declared = "its rope_freqs' factors" if factors is not None else f"scaling {theirs.rope_scaling}"
        raise differs("RoPE", declared, f"scaling {cfg.rope_scaling}")
    if not np.isclose(scale, target_scale, rtol=1e-6):
        raise differs("a RoPE attention factor", scale, target_scale)
