"""TensorRT-LLM: trtllm-serve on the HF checkpoint with the z-lab drafter.

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
"""

from __future__ import annotations

from loopspec.convert.bundles.common import HF_TARGET, LaunchSettings, ServingFramework, launch_script

TITLE = "TensorRT-LLM >= 1.3"


def trtllm_options(s: LaunchSettings) -> dict:
    """The LLM API options trtllm-serve reads from YAML."""
    spec = {"decoding_type": "DFlash", "speculative_model": "./drafter", "max_draft_len": s.block_size - 1,
            "mask_token_id": s.mask_token_id, "target_layer_ids": list(s.target_layer_ids)}
    return {"tensor_parallel_size": s.tp, "max_batch_size": s.max_batch_size, "max_seq_len": s.max_context,
            "max_num_tokens": s.max_num_tokens,
            "cuda_graph_config": {"enable_padding": True, "max_batch_size": s.max_batch_size},
            "speculative_config": spec}


def trtllm_files(s: LaunchSettings) -> dict[str, str]:
    import yaml  # PyYAML comes with transformers

    options = "# TensorRT-LLM LLM API options (trtllm-serve --extra_llm_api_options / --config)\n"
    options += yaml.safe_dump(trtllm_options(s), sort_keys=False)
    # no --tp_size: the YAML's tensor_parallel_size is the one trtllm-serve applies (it overrides flags)
    argv = ["trtllm-serve", "./target", "--backend", "pytorch", "--served-model-name", s.name,
            "--extra_llm_api_options", "./trtllm/extra_llm_api_options.yaml"]
    return {"trtllm/extra_llm_api_options.yaml": options, "trtllm/launch.sh": launch_script(TITLE, argv)}


def _readme_launch(s: LaunchSettings) -> list[str]:
    return ["", "`trtllm/extra_llm_api_options.yaml` holds `tensor_parallel_size`, `max_batch_size`, "
            "`max_seq_len`, `max_num_tokens`, the `speculative_config` (DFlash) and `cuda_graph_config`; "
            "trtllm-serve reads it with `--extra_llm_api_options` (alias `--config`) and lets it override "
            "its own flags, so change those values in the YAML, not with `--tp_size` and the like. "
            "`--served-model-name` needs a trtllm-serve that has it (TensorRT-LLM pull request 11711); on "
            "an older one remove that line and the model is named after its directory (`target`)."]


TRTLLM = ServingFramework(
    name="trtllm", title=TITLE, target=HF_TARGET,
    support=("yes (`DFlashDecodingConfig`)", "no", "no (full vocab)", "yes (modelopt checkpoint)", "Blackwell only",
             "yes (`tensor_parallel_size`)"),
    launch_files=trtllm_files, readme_launch=_readme_launch,
    # checked against TensorRT-LLM's source; see docs/serving.md
    full_vocab_reason=("TensorRT-LLM's DFlash drafter always takes the target's lm_head (full vocabulary) when it "
                       "loads, and the backbone it builds has no d2t, so the worker's d2t lookup finds none; it also "
                       "reads draft_vocab_size from the drafter's config.json to size its tensor-parallel gather and "
                       "rejection-sampling buffers, so drafter/ carries neither d2t nor draft_vocab_size."))
