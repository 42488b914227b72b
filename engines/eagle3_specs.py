"""An EAGLE-3 drafter's two graphs (loopspec/model/eagle3.py), declared once as EngineSpecs beside the
target's `target_verify` (engines/specs.py): export names and dynamic axes, TensorRT profiles and the
runtime's binding all read them.

An EAGLE-3 context entry pairs the fused taps at position p with the token at p+1, so its K/V wait
for that token (engines/eagle3_context.py): the context keeps fused states, and a stage runs the
entries still pending as its first step. Hence two graphs:

- `eagle3_fuse`: the target's taps [B, T, 3·H_target] → the fused states fc(taps) [B, T, H], what
  `append_context` keeps (DLoop's pseudo-context states are the drafter's own, kept as they are);
- `eagle3_step`: entries (tokens [B, T], states [B, T, H], positions [B, T]) after each row's
  context K/V (one layer, [B, kvh, context, hd], with room for the T new entries after every row's
  `context_lengths`), causal among themselves → the new entries' K/V [B, kvh, T, hd] (the runtime
  writes them at each row's length) and, at each row's entry `logit_index`, the state the next step
  reads (the output before the final norm; after it with norm_output) and its best drafts as target ids (d2t applied in
  the graph) with their log-probs. A stage's first step runs the pending entries (T of them), every
  later step one entry per row.
"""

from __future__ import annotations

from loopspec.engines.specs import MAX_BATCH, TARGET_VERIFY, EngineSpec, TensorSpec, batch_range, target_verify_spec
from loopspec.model.draft_head import DRAFT_CANDIDATES

EAGLE3_FUSE = "eagle3_fuse"
EAGLE3_STEP = "eagle3_step"
EAGLE3_ENGINES = (EAGLE3_FUSE, EAGLE3_STEP)


def eagle3_fuse_spec(drafter, max_context: int, max_verify: int, max_batch: int = MAX_BATCH) -> EngineSpec:
    """Taps [B, T, 3·H_target] → states [B, T, H]. `drafter` is an Eagle3Config."""
    inputs = (TensorSpec("taps", "float32", ("batch", "tokens", drafter.num_taps * drafter.tap_width)),)
    outputs = (TensorSpec("states", "float32", ("batch", "tokens", drafter.hidden_size)),)
    return EngineSpec(
        EAGLE3_FUSE,
        inputs,
        outputs,
        {"batch": batch_range(max_batch), "tokens": (1, min(max_verify, max_context), max_context)},
    )


def eagle3_step_spec(drafter, max_context: int, max_batch: int = MAX_BATCH) -> EngineSpec:
    """Entries + the context K/V → new K/V, and at `logit_index` the state and the drafts (see the module doc)."""
    kvh, hd = drafter.num_kv_heads, drafter.head_dim
    candidates = min(DRAFT_CANDIDATES, drafter.draft_vocab_size)
    inputs = (
        TensorSpec("token_ids", "int64", ("batch", "tokens")),
        TensorSpec("states", "float32", ("batch", "tokens", drafter.hidden_size)),
        TensorSpec("positions", "int64", ("batch", "tokens")),
        TensorSpec("context_key", "float32", ("batch", kvh, "context", hd)),
        TensorSpec("context_value", "float32", ("batch", kvh, "context", hd)),
        TensorSpec("context_lengths", "int64", ("batch",)),
        TensorSpec("logit_index", "int64", ("batch",)),
    )
    outputs = (
        TensorSpec("draft_ids", "int64", ("batch", candidates)),
        TensorSpec("draft_logprobs", "float32", ("batch", candidates)),
        TensorSpec("state", "float32", ("batch", drafter.hidden_size)),
        TensorSpec("new_key", "float32", ("batch", kvh, "tokens", hd)),
        TensorSpec("new_value", "float32", ("batch", kvh, "tokens", hd)),
    )
    # the pending entries of a stage's first step: one after a verification's accepted tokens, a whole
    # prompt after a prefill; the context has room for them after every row's length
    ranges = {
        "batch": batch_range(max_batch),
        "tokens": (1, 1, max_context),
        "context": (1, max_context // 2, 2 * max_context),
    }
    return EngineSpec(EAGLE3_STEP, inputs, outputs, ranges)


def eagle3_engine_specs(
    target, drafter, *, max_context: int, block_size: int | None = None, max_batch: int = MAX_BATCH
) -> dict[str, EngineSpec]:
    """The target's graph (its three taps out) and the EAGLE-3 drafter's two, by name (a TargetConfig
    and an Eagle3Config)."""
    max_verify = block_size or drafter.block_size
    return {
        TARGET_VERIFY: target_verify_spec(target, drafter.num_taps, max_context, max_verify, max_batch),
        EAGLE3_FUSE: eagle3_fuse_spec(drafter, max_context, max_verify, max_batch),
        EAGLE3_STEP: eagle3_step_spec(drafter, max_context, max_batch),
    }
