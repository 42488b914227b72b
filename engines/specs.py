"""The four engines' inputs and outputs, declared once as data.

ONNX export takes names and dynamic axes from these specs, the runtime binds inputs and outputs by
these names, and a TensorRT builder turns `ranges` into optimization profiles (`profile_shapes()`).

Every engine takes a symbolic `batch` of rows (1 .. max_batch): one request, or several decoded
together, each at its own position with its own number of valid K/V slots (`past_lengths`,
`context_lengths`: the graphs mask the slots past a row's length, so rows of different lengths share
one dense past of the longest row's width, with room for the call's new tokens). KV tensors are laid
out `[layers, batch, kv_heads, length, head_dim]`, the layout of the reference caches; the target's
past comes one tensor per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loopspec.errors import LoopspecError
from loopspec.model.draft_head import DRAFT_CANDIDATES

DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "bool")

TARGET_VERIFY = "target_verify"
TARGET_STEP = "target_step"  # target_verify's chains-only fused form (engines/target_step.py)
DRAFTER_CONTEXT = "drafter_context"
DRAFTER_CONTEXT_HIDDEN = "drafter_context_hidden"
DRAFTER_BLOCK = "drafter_block"
ENGINE_NAMES = (TARGET_VERIFY, DRAFTER_CONTEXT, DRAFTER_CONTEXT_HIDDEN, DRAFTER_BLOCK)
DRAFTER_ENGINES = (DRAFTER_CONTEXT, DRAFTER_CONTEXT_HIDDEN, DRAFTER_BLOCK)

PAST_KINDS = ("past_key", "past_value")  # target_verify's per-layer past inputs: past_key_0, past_value_0, ...
MAX_BATCH = 16  # rows per engine call, by default (the server's --max-batch-size must fit)
# rows × tokens of every target_verify call that continues a sequence: a one-row product takes
# another kernel than a batch's rows do (measured on AVX2: ONNX Runtime's 4-bit MatMulNBits differs
# in the last bits between 1 row and ≥ 2, and not among ≥ 2), so where an engine measures that
# (ArtifactEngine._measure_lone_step_width), a lone one-token step carries one padding token and
# computes what the same row computes in any batch or verification
MIN_PRODUCT_ROWS = 2
# the batch TensorRT tunes its kernels for: one sequence, the latency path of `generate` and `bench`
OPT_BATCH = 1


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy/ONNX name: float32, int64, ...
    dims: tuple[int | str, ...]  # ints are fixed, strings are symbolic (named in EngineSpec.ranges)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise LoopspecError(f"tensor {self.name}: unknown dtype {self.dtype!r} (known: {', '.join(DTYPES)})")

    def shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        """Concrete shape with the symbolic dims taken from `sizes`."""
        return tuple(d if isinstance(d, int) else sizes[d] for d in self.dims)

    def dynamic_axes(self) -> dict[int, str]:
        return {axis: d for axis, d in enumerate(self.dims) if isinstance(d, str)}

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "dims": list(self.dims)}

    @classmethod
    def from_dict(cls, d: dict) -> "TensorSpec":
        return cls(d["name"], d["dtype"], tuple(d["dims"]))


@dataclass(frozen=True)
class EngineSpec:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    ranges: dict[str, tuple[int, int, int]]  # symbolic input dim → (min, opt, max)

    def __post_init__(self):
        for t in self.inputs:
            for d in t.dims:
                if isinstance(d, str) and d not in self.ranges:
                    raise LoopspecError(f"engine {self.name}: input {t.name} dim {d!r} has no range")
        for dim, (lo, opt, hi) in self.ranges.items():
            if not 0 <= lo <= opt <= hi:
                raise LoopspecError(
                    f"engine {self.name}: range of {dim!r} must be 0 <= min <= opt <= max, got {(lo, opt, hi)}"
                )

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        """{tensor name: {axis: symbolic name}} for every input and output (torch.onnx.export's form)."""
        return {t.name: t.dynamic_axes() for t in self.inputs + self.outputs if t.dynamic_axes()}

    def profile_shapes(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """{input: (min_shape, opt_shape, max_shape)} — one TensorRT optimization profile."""
        pick = [{d: r[i] for d, r in self.ranges.items()} for i in range(3)]
        return {t.name: tuple(t.shape(sizes) for sizes in pick) for t in self.inputs}

    def check_input(self, name: str, shape: tuple[int, ...]) -> None:
        """Refuse a shape outside the declared dims/ranges (a clear error instead of a backend crash)."""
        spec = next((t for t in self.inputs if t.name == name), None)
        if spec is None:
            raise LoopspecError(f"engine {self.name} has no input {name!r}")
        if len(shape) != len(spec.dims):
            raise LoopspecError(f"engine {self.name}: {name} must have {len(spec.dims)} dims, got shape {shape}")
        for axis, (d, n) in enumerate(zip(spec.dims, shape)):
            if isinstance(d, int) and d != n:
                raise LoopspecError(f"engine {self.name}: {name} axis {axis} must be {d}, got {n}")
            if isinstance(d, str) and not self.ranges[d][0] <= n <= self.ranges[d][2]:
                lo, _, hi = self.ranges[d]
                raise LoopspecError(f"engine {self.name}: {name} {d}={n} is outside [{lo}, {hi}]")

    def narrowed(self, dim: str, max_value: int) -> "EngineSpec":
        """The same engine with dim's range cut at max_value (e.g. a TensorRT plan built for fewer
        rows than the ONNX graph takes: TensorRT sizes its memory for the profile's largest shapes)."""
        lo, opt, hi = self.ranges[dim]
        if not lo <= max_value <= hi:
            raise LoopspecError(f"engine {self.name}: {dim} max {max_value} is outside the exported range [{lo}, {hi}]")
        return EngineSpec(
            self.name, self.inputs, self.outputs, {**self.ranges, dim: (lo, min(opt, max_value), max_value)}
        )

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "ranges": {k: list(v) for k, v in self.ranges.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> "EngineSpec":
        try:
            return cls(
                d["name"],
                tuple(TensorSpec.from_dict(t) for t in d["inputs"]),
                tuple(TensorSpec.from_dict(t) for t in d["outputs"]),
                {k: tuple(v) for k, v in d["ranges"].items()},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise LoopspecError(f"malformed engine spec: {e!r}") from None


# --------------------------------------------------------------------------------------------------
# The four engines


def batch_range(max_batch: int) -> tuple[int, int, int]:
    if max_batch < 1:
        raise LoopspecError(f"max batch must be >= 1, got {max_batch}")
    return (1, min(OPT_BATCH, max_batch), max_batch)


def target_verify_spec(
    target, num_taps: int, max_context: int, max_verify: int = 16, max_batch: int = MAX_BATCH
) -> EngineSpec:
    """Tokens + absolute positions + the cache's past K/V → logits at `logit_index`, taps, new K/V.

    `target` is a TargetConfig. The past comes one input per layer (`past_key_i`, `past_value_i`
    [B, kvh, past, hd]), as wide as the longest row's length plus the call's tokens (`past_width`):
    the graph writes each row's new K/V into its slots itself. It returns only the new tokens' K/V;
    the runtime writes them into its static cache at each row's length (rollback = moving the
    length). Row b's past slot j is seen iff j < past_lengths[b]; new token i sees the new tokens j with
    tree_mask[b, i, j] — the causal chain (j <= i) for prefill and chains, a draft tree's ancestor mask
    (loopspec.tree.tree_masks) otherwise, its nodes at positions past length + depth (right padding is
    never seen by a real token). `logit_index` picks the positions whose logits are needed, the same for
    every row (all for verification, the last one for a prefill), so a long prefill does not pay the
    lm_head for every prompt token. num_taps 0: no taps output (plain `ar`)."""
    L, kvh, hd = target.num_layers, target.num_kv_heads, target.head_dim
    kv = (L, "batch", kvh)
    past = tuple(
        TensorSpec(f"{kind}_{i}", "float32", ("batch", kvh, "past", hd)) for i in range(L) for kind in PAST_KINDS
    )
    inputs = (
        TensorSpec("input_ids", "int64", ("batch", "tokens")),
        TensorSpec("positions", "int64", ("batch", "tokens")),
        TensorSpec("logit_index", "int64", ("logits",)),
        TensorSpec("past_lengths", "int64", ("batch",)),
        TensorSpec("tree_mask", "bool", ("batch", "tokens", "tokens")),
    ) + past
    outputs = [TensorSpec("logits", "float32", ("batch", "logits", target.vocab_size))]
    if num_taps:
        outputs.append(TensorSpec("taps", "float32", ("batch", "tokens", num_taps * target.hidden_size)))
    outputs += [
        TensorSpec("new_key", "float32", kv + ("tokens", hd)),
        TensorSpec("new_value", "float32", kv + ("tokens", hd)),
    ]
    # each past with the new K/V written into its room (`present_of`): a backend that can bind an
    # output to an input's memory (ONNX Runtime) makes the graph write into the cache in place
    outputs += [TensorSpec(present_of(t.name), "float32", t.dims) for t in past]
    max_verify = min(max_verify, max_context)
    # the past has room for the call's tokens (a one-token step's padding token too): past >= tokens
    ranges = {
        "batch": batch_range(max_batch),
        "tokens": (1, max_verify, max_context),
        "logits": (1, max_verify, max_context),
        "past": (1, max_context // 2, max_context + max_verify),
    }
    return EngineSpec(TARGET_VERIFY, inputs, tuple(outputs), ranges)


def row_past_name(kind: str, layer: int, row: int) -> str:
    return f"{kind}_{layer}_{row}"


def step_spec(cfg, num_taps: int, rows: int, max_context: int, max_verify: int = 16) -> EngineSpec:
    """The step graph for `rows` rows: tokens (right-padded to a common width) after each row's own
    K/V → logits at `logit_index`, taps, and each row's past with the new K/V written in.

    `seqlens_k[r]` is row r's length plus the call's width minus 1 and `total_sequence_length[r]` its
    length plus the width (GroupQueryAttention's inputs); row r's past is one row of the cache,
    [1, kvh, slots, hd], with room for the call's tokens, and its present output is the same buffer."""
    L, kvh, hd = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    past = tuple(
        TensorSpec(row_past_name(kind, i, r), "float32", (1, kvh, "past", hd))
        for i in range(L)
        for r in range(rows)
        for kind in ("past_key", "past_value")
    )
    inputs = (
        TensorSpec("input_ids", "int64", (rows, "tokens")),
        TensorSpec("logit_index", "int64", ("logits",)),
        TensorSpec("seqlens_k", "int32", (rows,)),
        TensorSpec("total_sequence_length", "int32", (rows,)),
    ) + past
    outputs = [TensorSpec("logits", "float32", (rows, "logits", cfg.vocab_size))]
    if num_taps:
        outputs.append(TensorSpec("taps", "float32", (rows, "tokens", num_taps * cfg.hidden_size)))
    outputs += [TensorSpec(t.name.replace("past_", "present_", 1), "float32", t.dims) for t in past]
    ranges = {
        "tokens": (1, max_verify, max_context),
        "logits": (1, max_verify, max_context),
        "past": (MIN_PRODUCT_ROWS, max_context // 2, max_context + max_verify),  # room for the copied query
    }
    return EngineSpec(TARGET_STEP, inputs, tuple(outputs), ranges)


def present_of(past_name: str) -> str:
    """The output holding input `past_name` (past_key_3) with the call's new K/V written in: present_key_3."""
    return past_name.replace("past_", "present_", 1)


def past_width(lengths, tokens: int) -> int:
    """The width of the past (or context) K/V a call passes: room for every row's new tokens after
    its own length."""
    return int(max(lengths)) + tokens


def with_room(past: np.ndarray, tokens: int) -> np.ndarray:
    """Past (or context) K/V [..., W, hd] with `tokens` zero slots after it: what a call adding
    `tokens` new positions after a past of exactly W valid slots passes."""
    return np.pad(past, [(0, 0)] * (past.ndim - 2) + [(0, tokens), (0, 0)])


def past_layers(spec: EngineSpec) -> tuple[int, int, int]:
    """target_verify's (layers, kv heads, head dim), read from its per-layer past inputs."""
    first = next(t for t in spec.inputs if t.name == f"{PAST_KINDS[0]}_0")
    return sum(t.name.startswith(f"{PAST_KINDS[0]}_") for t in spec.inputs), first.dims[1], first.dims[3]


def past_feeds(past_key, past_value) -> dict:
    """target_verify's per-layer past inputs from stacked K/V [L, B, kvh, W, hd] (views, no copy)."""
    return {
        f"{kind}_{i}": t[i] for i in range(past_key.shape[0]) for kind, t in zip(PAST_KINDS, (past_key, past_value))
    }


def _context_kv_outputs(drafter) -> tuple[TensorSpec, ...]:
    kv = (drafter.num_layers, "batch", drafter.num_kv_heads, "tokens", drafter.head_dim)
    return (TensorSpec("context_key", "float32", kv), TensorSpec("context_value", "float32", kv))


def drafter_context_spec(drafter, max_context: int, max_verify: int = 16, max_batch: int = MAX_BATCH) -> EngineSpec:
    """Taps [B, T, n·H] + positions → every drafter layer's context K/V (the fused KV injection:
    fc → hidden_norm → one matmul for all layers' K and V → k_norm → RoPE). `drafter` is a DrafterConfig."""
    inputs = (
        TensorSpec("taps", "float32", ("batch", "tokens", drafter.num_taps * drafter.hidden_size)),
        TensorSpec("positions", "int64", ("batch", "tokens")),
    )
    return EngineSpec(
        DRAFTER_CONTEXT,
        inputs,
        _context_kv_outputs(drafter),
        {"batch": batch_range(max_batch), "tokens": (1, min(max_verify, max_context), max_context)},
    )


def drafter_context_hidden_spec(
    drafter, max_context: int, block_size: int | None = None, max_batch: int = MAX_BATCH
) -> EngineSpec:
    """The drafter's own H-dim hidden states (DLoop pseudo-features) + positions → context K/V
    (no fc / hidden_norm: pseudo-features enter where hidden_norm(fc(taps)) would)."""
    block_size = block_size or drafter.block_size
    inputs = (
        TensorSpec("hidden", "float32", ("batch", "tokens", drafter.hidden_size)),
        TensorSpec("positions", "int64", ("batch", "tokens")),
    )
    return EngineSpec(
        DRAFTER_CONTEXT_HIDDEN,
        inputs,
        _context_kv_outputs(drafter),
        {"batch": batch_range(max_batch), "tokens": (1, block_size - 1, max_context)},
    )


def drafter_block_spec(
    drafter, max_context: int, block_size: int | None = None, max_block: int | None = None, max_batch: int = MAX_BATCH
) -> EngineSpec:
    """Block ids [anchor, MASK…] + positions + context K/V → each drafting position's best draft
    target-token ids (rank-ordered; rank 0 is the chain, the others are the branches of a draft
    tree), their log-probs and the final-norm hidden states; with a confidence head, its estimate
    per drafting position too. The drafting positions are the block's by the drafter's block
    convention: drafts = block - 1 (z-lab's), or = block (DeepSpec's). A DSpark drafter's Markov
    correction and a DFlash2 drafter's selector walk run inside the graph. Row b's context slot j is
    seen iff j < context_lengths[b]; the block sees all of itself (a DFlash2 drafter's layers: within
    their window, causally where its config says so). The context K/V has room for the block after
    every row's length (`past_width`)."""
    block_size = block_size or drafter.block_size
    max_block = max(max_block or block_size, block_size)
    N, kvh, hd = drafter.num_layers, drafter.num_kv_heads, drafter.head_dim
    inputs = (
        TensorSpec("block_ids", "int64", ("batch", "block")),
        TensorSpec("positions", "int64", ("batch", "block")),
        TensorSpec("context_key", "float32", (N, "batch", kvh, "context", hd)),
        TensorSpec("context_value", "float32", (N, "batch", kvh, "context", hd)),
        TensorSpec("context_lengths", "int64", ("batch",)),
    )
    candidates = drafter.kind.ranked_candidates(drafter.vocab_size, DRAFT_CANDIDATES)  # a d2t map keeps more rows
    outputs = (
        TensorSpec("draft_ids", "int64", ("batch", "drafts", candidates)),
        TensorSpec("draft_logprobs", "float32", ("batch", "drafts", candidates)),
        TensorSpec("hidden", "float32", ("batch", "block", drafter.hidden_size)),
    )
    outputs += tuple(TensorSpec(name, "float32", ("batch", "drafts")) for name in drafter.kind.added_graph_outputs)
    ranges = {
        "batch": batch_range(max_batch),
        "block": (2, block_size, max_block),
        "context": (2, max_context // 2, max_context + max_block),
    }  # room for the block: >= length + k
    return EngineSpec(DRAFTER_BLOCK, inputs, outputs, ranges)


def engine_specs(
    target,
    drafter=None,
    *,
    max_context: int,
    max_verify: int | None = None,
    block_size: int | None = None,
    max_block: int | None = None,
    max_batch: int = MAX_BATCH,
) -> dict[str, EngineSpec]:
    """Every engine for a target (TargetConfig) and an optional drafter (DrafterConfig), by name."""
    if max_context < 2:
        raise LoopspecError(f"max context must be at least 2, got {max_context}")
    block_size = block_size or (drafter.block_size if drafter is not None else 1)
    max_verify = max_verify or block_size
    specs = {
        TARGET_VERIFY: target_verify_spec(
            target, drafter.num_taps if drafter is not None else 0, max_context, max_verify, max_batch
        )
    }
    if drafter is not None:
        specs[DRAFTER_CONTEXT] = drafter_context_spec(drafter, max_context, max_verify, max_batch)
        specs[DRAFTER_CONTEXT_HIDDEN] = drafter_context_hidden_spec(drafter, max_context, block_size, max_batch)
        specs[DRAFTER_BLOCK] = drafter_block_spec(drafter, max_context, block_size, max_block, max_batch)
    return specs
