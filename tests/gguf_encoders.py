"""GGUF block encoders written from the public format (ggml's block layouts), for tests: a float
matrix → blocks of a type, round to nearest. The `gguf` package quantizes Q4_0, Q4_1, Q5_0, Q5_1 and
Q8_0 itself (`quantize_blocks`); these write the K-quants it cannot (Q4_K, Q5_K, Q6_K), and `pack`
writes blocks from chosen codes and scales, so a test knows what each block holds."""

import numpy as np

QK = 256  # a K-quant super-block


def fp16_bytes(values: np.ndarray) -> np.ndarray:
    """float [...] → their fp16 bytes [..., 2]."""
    return np.ascontiguousarray(values.astype(np.float16)).view(np.uint8).reshape(*values.shape, 2)


def pack_k_scales(scales: np.ndarray, minimums: np.ndarray) -> np.ndarray:
    """8 six-bit scales and 8 six-bit minimums [..., 8] → ggml's 12 bytes [..., 12]: bytes 0-3 hold
    scales 0-3 and the top 2 bits of scales 4-7, bytes 4-7 minimums 0-3 and the top 2 bits of
    minimums 4-7, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and minimums 4-7 (high)."""
    s, m = scales.astype(np.uint8), minimums.astype(np.uint8)
    out = np.zeros((*s.shape[:-1], 12), np.uint8)
    out[..., 0:4] = s[..., 0:4] | ((s[..., 4:8] >> 4) << 6)
    out[..., 4:8] = m[..., 0:4] | ((m[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (s[..., 4:8] & 0x0F) | ((m[..., 4:8] & 0x0F) << 4)
    return out


def pack(kind: str, codes: np.ndarray, d: np.ndarray, sub_scales=None, dmin=None, sub_minimums=None) -> np.ndarray:
    """Blocks uint8 [N, blocks, bytes] of `kind` holding `codes` [N, K] (each type's unsigned code
    range) with fp16 scale d [N, blocks] (and dmin, the K-quants' integer sub-block scales and
    minimums [N, blocks, 8 or 16]; Q4_1 / Q5_1 take their fp16 minimum as dmin)."""
    n, k = codes.shape
    c = codes.astype(np.uint8)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        b = c.reshape(n, k // 32, 32)
        low = (b[..., :16] & 0x0F) | ((b[..., 16:] & 0x0F) << 4)  # byte j: elements j and j + 16
        parts = [fp16_bytes(d)] + ([fp16_bytes(dmin)] if kind in ("Q4_1", "Q5_1") else [])
        if kind.startswith("Q5"):
            fifth = ((b >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
            parts.append(np.ascontiguousarray(fifth.sum(-1, dtype=np.uint32)).view(np.uint8).reshape(n, k // 32, 4))
        return np.concatenate(parts + [low], axis=-1)
    if kind == "Q8_0":
        return np.concatenate([fp16_bytes(d), codes.astype(np.int8).view(np.uint8).reshape(n, k // 32, 32)], -1)
    b = c.reshape(n, k // QK, QK)
    if kind in ("Q4_K", "Q5_K"):
        head = [fp16_bytes(d), fp16_bytes(dmin), pack_k_scales(sub_scales, sub_minimums)]
        chunks = b.reshape(n, k // QK, 4, 2, 32)  # sub-blocks 2j and 2j + 1 share 32 bytes
        low = (chunks[..., 0, :] & 0x0F) | ((chunks[..., 1, :] & 0x0F) << 4)
        if kind == "Q4_K":
            return np.concatenate(head + [low.reshape(n, k // QK, 128)], -1)
        fifth = (b.reshape(n, k // QK, 8, 32) >> 4) & 1  # bit j of byte i: sub-block j, element i
        qh = (fifth << np.arange(8, dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8)
        return np.concatenate(head + [qh, low.reshape(n, k // QK, 128)], -1)
    if kind == "Q6_K":  # per half of 128: chunks 0-3 of 32
        halves = b.reshape(n, k // QK, 2, 4, 32)
        ql = np.concatenate(
            [
                (halves[..., 0, :] & 0x0F) | ((halves[..., 2, :] & 0x0F) << 4),
                (halves[..., 1, :] & 0x0F) | ((halves[..., 3, :] & 0x0F) << 4),
            ],
            axis=-1,
        )  # [N, nb, 2, 64]
        qh = ((halves >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(-2, dtype=np.uint8)  # [N, nb, 2, 32]
        scales = sub_scales.astype(np.int8).view(np.uint8)
        return np.concatenate([ql.reshape(n, k // QK, 128), qh.reshape(n, k // QK, 64), scales, fp16_bytes(d)], -1)
    raise ValueError(kind)


def quantize_k(w: np.ndarray, kind: str) -> np.ndarray:
    """A float matrix [N, K] (K a multiple of 256) → `kind` blocks (Q4_K, Q5_K or Q6_K), round to nearest:
    each sub-block's scale (and minimum) as a 6-bit (Q6_K: int8) multiple of the super-block's fp16 one."""
    n, k = w.shape
    nb = k // QK
    if kind == "Q6_K":
        groups = w.reshape(n, nb, 16, 16)
        step = np.abs(groups).max(-1) / 31 + 1e-12  # [N, nb, 16]
        d = (np.abs(step).max(-1) / 127).astype(np.float16).astype(np.float32)  # [N, nb]
        sc = np.clip(np.round(step / d[..., None]), 1, 127)
        q = np.clip(np.round(groups / (d[..., None, None] * sc[..., None])) + 32, 0, 63)
        return pack(kind, q.reshape(n, k), d, sub_scales=sc)
    levels = 15 if kind == "Q4_K" else 31
    sub = w.reshape(n, nb, 8, 32)
    low = np.minimum(sub.min(-1), 0.0)
    step = (sub.max(-1) - low) / levels + 1e-12  # [N, nb, 8]
    d = (step.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-low).max(-1) / 63 + 1e-12).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / d[..., None]), 1, 63)
    mn = np.clip(np.round(-low / dmin[..., None]), 0, 63)
    q = np.clip(np.round((sub + (dmin[..., None] * mn)[..., None]) / (d[..., None] * sc)[..., None]), 0, levels)
    return pack(kind, q.reshape(n, k), d, sub_scales=sc, dmin=dmin, sub_minimums=mn)
