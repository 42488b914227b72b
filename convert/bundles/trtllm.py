"""TensorRT-LLM: trtllm-serve on the HF checkpoint with the z-lab drafter (DFlash), a DSpark drafter
(DSpark) or an EAGLE-3 drafter (Eagle3). It has no DFlash2 model: `DFlashDecodingConfig` runs z-lab
DFlash drafters (DFlash2DraftModel's convolutions and selector are not in its DFlash drafter).

Facts this module relies on (TensorRT-LLM >= 1.3, LLM API reference `DFlashDecodingConfig`; re-check
on upgrades): `speculative_config` with `decoding_type: DFlash`, `speculative_model`, `max_draft_len`
(drafted tokens per step, at most block_size - 1), `mask_token_id`, `target_layer_ids`;
`CudaGraphConfig` (`enable_padding`, `max_batch_size`); `tensor_parallel_size`, `max_batch_size`,
`max_seq_len`, `max_num_tokens` are LLM API arguments. trtllm-serve (tensorrt_llm/commands/serve.py)
reads that YAML with `--config`, alias `--extra_llm_api_options` (the older spelling, accepted by every
1.x), and applies it AFTER its own flags (`update_llm_args_with_extra_dict`): the YAML wins, so tensor
parallelism is set there only, never also as `--tp_size`. `--served-model-name` names the model in
/v1/models (TensorRT-LLM pull request 11711; without it the name is the model directory's). The DFlash
worker sizes its drafter context arena from max_batch_size + 1 slots x max_seq_len
(speculative/dflash.py), so both are always written: the defaults (2048 requests, the model's whole
context) fill small GPUs.

DSpark (LLM API reference `DSparkDecodingConfig`, present since 1.3.0rc27;
_torch/models/modeling_dspark.py, "Standalone DSpark drafters"): `decoding_type: DSpark` with
`speculative_model`, `max_draft_len`, `block_size`, `mask_token_id`, `target_layer_ids`, `markov_rank`,
`markov_head_type`. A standalone drafter (its own checkpoint, `model_type` qwen3) runs DFlash's block
decode plus the DSpark heads: the `shift_label` slot convention is on unless the drafter's config says
false (slot 0 holds the anchor and every slot j drafts the token after it: DeepSpec's convention, so
max_draft_len = block_size), the Markov head is the vanilla one only (`markov_head.markov_w1/w2`;
gated / rnn are refused), markov_rank 0 runs no Markov bias (a DeepSpec DFlash drafter), and the
confidence head (`confidence_head.proj`) is loaded. Its `decoding_type: DFlash` refuses a drafter that
declares DSpark heads.

Confidence-scheduled verification is left out of the YAML. Its fields have changed between releases
(1.4.0rc4: `enable_confidence_scheduling`, `confidence_cost_table_path`, `confidence_calibration_path`,
`confidence_min_predicted_gain`; later `confidence_sps_table_path`, `confidence_sts_path`,
`confidence_verify_len_tiers`, `enable_ragged_verify`). In the latest code read
(tensorrt_llm/_torch/speculative/dspark_planner.py @ 7fbff6f, `load_runtime_sps_cost_table` /
`validate_sps_cost_table_payload`; tests/unittest/llmapi/test_dspark_workload_admission_config.py) the
cost table at `confidence_sps_table_path` must be `schema_version: 2`: `cost_tables` of whole-step times
keyed by the rank-local CUDA-graph batch size G and verifier tokens V (a V = 0 native cell for every G),
one `measurements` entry per cell with the `source_result_sha256` of the run that measured it,
`minimum_predicted_gain`, and an `engine_fingerprint` (`gpu`, `gpu_count`, `gpu_snapshot_sha256`,
`runtime_snapshot`, `source_head`, `source_diff_sha256`, `topology`, `max_draft_len`, the rank-local and
global graph batch sizes) with its `engine_fingerprint_sha256`; the loader compares that fingerprint
field by field with a separate live fingerprint of the running engine
(`confidence_sps_live_fingerprint_path`) and refuses any other schema; and startup turns the feature off
unless `confidence_admission_receipt_path` / `confidence_admission_receipt_sha256` name a workload
receipt whose body hashes that table and fingerprint. A bundle written on a CPU has no such engine to
fingerprint, and loopspec's own step-cost table (`loopspec costs`) times loopspec's engine, not
TensorRT-LLM's CUDA-graph steps, so none of these fields is written; `confidence_sts_path` (per-position
temperatures fitted by TensorRT-LLM's calibration run) is left out with them.

EAGLE-3 (LLM API reference `Eagle3DecodingConfig`; tensorrt_llm/llmapi/llm_args.py
`EagleDecodingConfig.validate_eagle_config`): `decoding_type: Eagle3` with `speculative_model`
(validation alias `speculative_model_dir`, the older spelling), `max_draft_len` (the drafter steps),
`eagle3_layers_to_capture` (the target layers whose outputs it fuses; default {1, L//2 - 1, L - 4}, the
same layers as vLLM's entering-stream default (2, L/2, L - 3): loopspec's taps as they are). A chain
leaves the tree fields out (`max_total_draft_tokens` = max_draft_len). `eagle3_one_model` (the faster
one-model path, default true) is in the older references and gone from 1.3.0rc27's on, where the
one-model path is the only one; the LLM API refuses a field it does not have, so the YAML leaves it out
and gets the one-model path on every release. A draft tree is EAGLE-2's dynamic tree on the PyTorch
backend (pull requests 12062 / 13081; documented in 1.4.0rc4's speculative-decoding guide):
`use_dynamic_tree: true`, `dynamic_tree_max_topK` (candidates expanded per step) and
`max_total_draft_tokens` (nodes verified), with max_draft_len <= max_total_draft_tokens <=
dynamic_tree_max_topK · max_draft_len; the guide says it does not run on sliding-window or MLA targets
(gpt-oss, DeepSeek). The static tree (`eagle_choices`) is deprecated and was removed later. Its EAGLE-3
drafter reads none of the EAGLE-3 config switches (`EAGLE3_SWITCHES_READ`).
Which drafter kinds it takes, and why it refuses the rest, is `trtllm_kind_refusal`.
"""

from __future__ import annotations

from loopspec.convert.bundles.common import (
    HF_TARGET,
    LaunchSettings,
    ServingFramework,
    drafts_in_steps,
    eagle3_switch_refusal,
    launch_script,
)
from loopspec.model.drafter_kinds import DEEPSPEC_BLOCK, DrafterKind

TITLE = "TensorRT-LLM >= 1.3"
DSPARK_MIN_VERSION = "1.3.0rc27"  # the first release whose LLM API reference has DSparkDecodingConfig
CONFIDENCE_SCHEDULING_VERSION = "1.4.0rc4"  # its enable_confidence_scheduling, with the older field names
EAGLE3_TREE_VERSION = "1.4.0rc4"  # the release whose guide documents EAGLE-3's dynamic tree (PyTorch backend)
EAGLE3_SWITCHES_READ = ()  # the EAGLE-3 config switches its reader implements: none


def trtllm_kind_refusal(kind: DrafterKind) -> str | None:
    """Why TensorRT-LLM cannot serve a drafter of this kind (None: it can): z-lab DFlash (DFlash); a drafter
    of DeepSpec's block convention with a vanilla Markov head or none (DSpark); an EAGLE-3 drafter with no
    switch on (Eagle3); no DFlash2 drafter."""
    if kind.name == "eagle3":
        return eagle3_switch_refusal(kind, "TensorRT-LLM", EAGLE3_SWITCHES_READ)
    if kind.name == "dflash2":
        return (
            "TensorRT-LLM's DFlashDecodingConfig runs z-lab DFlash drafters only: it has no DFlash2 model "
            "(no grouped dynamic convolutions, no candidate selector for DFlash2DraftModel)"
        )
    if kind.plain:
        return None  # z-lab DFlash: decoding_type DFlash
    if kind.convention is not DEEPSPEC_BLOCK:
        return (
            "TensorRT-LLM's standalone DSpark drafter drafts from the anchor's own block position (DeepSpec's "
            "block convention, its shift_label default), and this drafter's heads were trained in z-lab's "
            "(position i drafts the token at anchor+i): TensorRT-LLM would draft one position off"
        )
    if kind.markov is not None and kind.markov.head_type != "vanilla":
        return (
            f"TensorRT-LLM's standalone DSpark drafter implements the vanilla Markov head only (markov_w1, "
            f"markov_w2), not this drafter's {kind.markov.head_type} head"
        )
    return None  # DeepSpec's convention: decoding_type DSpark (markov_rank 0 for a DeepSpec DFlash drafter)


def trtllm_options(s: LaunchSettings) -> dict:
    """The LLM API options trtllm-serve reads from YAML."""
    if drafts_in_steps(s.kind):
        spec = eagle3_speculative_config(s)
    elif s.kind.plain:
        spec = {
            "decoding_type": "DFlash",
            "speculative_model": "./drafter",
            "max_draft_len": s.block_size - 1,
            "mask_token_id": s.mask_token_id,
            "target_layer_ids": list(s.target_layer_ids),
        }
    else:
        spec = dspark_speculative_config(s)
    return {
        "tensor_parallel_size": s.tp,
        "max_batch_size": s.max_batch_size,
        "max_seq_len": s.max_context,
        "max_num_tokens": s.max_num_tokens,
        "cuda_graph_config": {"enable_padding": True, "max_batch_size": s.max_batch_size},
        "speculative_config": spec,
    }


def dspark_speculative_config(s: LaunchSettings) -> dict:
    """`DSparkDecodingConfig` for a drafter of DeepSpec's block convention: every block position drafts,
    so max_draft_len is the block size; markov_rank 0 (no Markov head) runs no Markov bias."""
    markov = s.kind.markov
    spec = {
        "decoding_type": "DSpark",
        "speculative_model": "./drafter",
        "max_draft_len": s.drafts,
        "block_size": s.block_size,
        "mask_token_id": s.mask_token_id,
        "target_layer_ids": list(s.target_layer_ids),
        "markov_rank": markov.rank if markov else 0,
    }
    if markov:
        spec["markov_head_type"] = markov.head_type
    return spec


def eagle3_speculative_config(s: LaunchSettings) -> dict:
    """`Eagle3DecodingConfig`: the drafter's steps as max_draft_len and its taps as the layers to capture;
    a tree setting adds the dynamic tree's candidates per step and the nodes it verifies."""
    spec = {
        "decoding_type": "Eagle3",
        "speculative_model": "./drafter",
        "max_draft_len": s.tree_depth if s.tree_nodes else s.drafts,
        "eagle3_layers_to_capture": list(s.target_layer_ids),
    }
    if s.tree_nodes:
        spec.update(use_dynamic_tree=True, dynamic_tree_max_topK=s.tree_topk, max_total_draft_tokens=s.tree_nodes)
    return spec


def trtllm_files(s: LaunchSettings) -> dict[str, str]:
    import yaml  # PyYAML comes with transformers

    options = "# TensorRT-LLM LLM API options (trtllm-serve --extra_llm_api_options / --config)\n"
    options += yaml.safe_dump(trtllm_options(s), sort_keys=False)
    # no --tp_size: the YAML's tensor_parallel_size is the one trtllm-serve applies (it overrides flags)
    argv = [
        "trtllm-serve",
        "./target",
        "--backend",
        "pytorch",
        "--served-model-name",
        s.name,
        "--extra_llm_api_options",
        "./trtllm/extra_llm_api_options.yaml",
    ]
    return {"trtllm/extra_llm_api_options.yaml": options, "trtllm/launch.sh": launch_script(TITLE, argv)}


def _readme_launch(s: LaunchSettings) -> list[str]:
    lines = [
        "",
        "`trtllm/extra_llm_api_options.yaml` holds `tensor_parallel_size`, `max_batch_size`, "
        f"`max_seq_len`, `max_num_tokens`, the `speculative_config` ({_decoding_type(s)}) "
        "and `cuda_graph_config`; "
        "trtllm-serve reads it with `--extra_llm_api_options` (alias `--config`) and lets it override "
        "its own flags, so change those values in the YAML, not with `--tp_size` and the like. "
        "`--served-model-name` needs a trtllm-serve that has it (TensorRT-LLM pull request 11711); on "
        "an older one remove that line and the model is named after its directory (`target`).",
    ]
    if drafts_in_steps(s.kind):
        spec = eagle3_speculative_config(s)
        lines += [
            "",
            f"The EAGLE-3 drafter runs as `decoding_type: Eagle3` (`Eagle3DecodingConfig`) with "
            f"`max_draft_len: {spec['max_draft_len']}` and `eagle3_layers_to_capture: {s.target_layer_ids}` (the "
            "target layers whose outputs it fuses), on TensorRT-LLM's one-model path (its default; "
            "`eagle3_one_model` is left out: releases from 1.3.0rc27 on no longer have the field and would "
            "refuse it).",
        ]
        if s.tree_nodes:
            lines[-1] += (
                f" The draft tree is its dynamic tree (`use_dynamic_tree`, `dynamic_tree_max_topK: "
                f"{s.tree_topk}`, `max_total_draft_tokens: {s.tree_nodes}`), which needs TensorRT-LLM >= "
                f"{EAGLE3_TREE_VERSION} and a target without sliding-window or MLA attention (not gpt-oss)."
            )
        return lines
    if s.kind.plain:
        return lines
    lines += [
        "",
        f"The DSpark drafter needs TensorRT-LLM >= {DSPARK_MIN_VERSION} (`DSparkDecodingConfig`): "
        f"`decoding_type: DSpark` with `max_draft_len: {s.drafts}` (DeepSpec's block convention: every one of "
        f"the {s.block_size} block positions drafts), `block_size`, `mask_token_id`, `target_layer_ids`, "
        "`markov_rank`"
        + (" and `markov_head_type`" if s.kind.markov else " (0: no Markov head)")
        + ". TensorRT-LLM runs the vanilla Markov head only.",
    ]
    if s.kind.confidence:
        lines += [
            "",
            "Confidence-scheduled verification is left out of the YAML (every step verifies the whole "
            "block; outputs are the same either way). TensorRT-LLM's current code reads it from "
            "`enable_confidence_scheduling` with `confidence_sps_table_path`, "
            "`confidence_sps_live_fingerprint_path`, `confidence_admission_receipt_path` and "
            f"`confidence_admission_receipt_sha256` ({CONFIDENCE_SCHEDULING_VERSION} spelled them "
            "`confidence_cost_table_path`, `confidence_calibration_path`, "
            "`confidence_min_predicted_gain`): the cost table must be "
            "`schema_version: 2`, whole-step times per CUDA-graph batch size and verifier-token count with an "
            "`engine_fingerprint` (GPU, GPU snapshot hash, runtime snapshot, source head and diff hash, "
            "topology, graph batch sizes) that the loader compares field by field with a fingerprint taken "
            "from the live TensorRT-LLM engine, and startup switches the feature off without a workload "
            "receipt that hashes both. No such engine exists where this bundle was written, and loopspec's "
            "own step-cost table (`loopspec costs`) times loopspec's engine rather than TensorRT-LLM's, so "
            "none of these fields is written: the table and fingerprint come from TensorRT-LLM on the serving "
            "GPU, and the receipt from a reviewed deployment package (TensorRT-LLM ships no public command "
            "that writes one).",
        ]
    return lines


def _decoding_type(s: LaunchSettings) -> str:
    return "Eagle3" if drafts_in_steps(s.kind) else "DFlash" if s.kind.plain else "DSpark"


TRTLLM = ServingFramework(
    name="trtllm",
    title=TITLE,
    target=HF_TARGET,
    support=(
        "yes (`DFlashDecodingConfig`)",
        f"DeepSpec block convention, vanilla Markov head or none (`DSparkDecodingConfig`, >= {DSPARK_MIN_VERSION})",
        f"chains; dynamic trees >= {EAGLE3_TREE_VERSION} (`Eagle3DecodingConfig`)",
        "no (`DFlashDecodingConfig` only)",
        "no",
        "EAGLE-3 only (`d2t`); DFlash / DSpark draft over the full vocab",
        "yes (modelopt checkpoint)",
        "Blackwell only",
        "yes (`tensor_parallel_size`)",
    ),
    launch_files=trtllm_files,
    kind_refusal=trtllm_kind_refusal,
    readme_launch=_readme_launch,
    # checked against TensorRT-LLM's source; see docs/serving.md
    full_vocab_reason=(
        "TensorRT-LLM's DFlash drafter always takes the target's lm_head (full vocabulary) when it "
        "loads, and the backbone it builds has no d2t, so the worker's d2t lookup finds none; it also "
        "reads draft_vocab_size from the drafter's config.json to size its tensor-parallel gather and "
        "rejection-sampling buffers, so drafter/ carries neither d2t nor draft_vocab_size."
    ),
)
