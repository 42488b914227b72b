"""vLLM: `vllm serve` on the HF checkpoint with the z-lab drafter (method dflash), a DSpark drafter
of DeepSpec's block convention (method dspark), or an EAGLE-3 drafter (method eagle3).

Facts this module relies on (re-check on upgrades):
- DFlash (speculative decoding docs; z-lab/dflash README; vllm/model_executor/models/qwen3_dflash.py):
  `vllm serve TARGET --speculative-config '{"method": "dflash", "model": DRAFTER,
  "num_speculative_tokens": k - 1}'`, `--tensor-parallel-size N`, `--max-model-len`,
  `--max-num-seqs`, `--served-model-name`; the mask token and tap layers come from the drafter's
  config.json (`dflash_config`). A reduced draft vocabulary is read as `draft_vocab_size` (config.json),
  a `d2t` tensor (target id = draft id + d2t) and the drafter's own `lm_head.weight` of
  draft_vocab_size rows, from any *.safetensors file in the drafter directory. A modelopt
  checkpoint's quantization is read from the target's config.
- DSpark (vllm/config/speculative.py, vllm/model_executor/models/qwen3_dspark.py): the method is
  `dspark`, detected from `architectures: ["Qwen3DSparkModel"]` and also given explicitly here;
  `num_speculative_tokens` is the block size, since the block [anchor, mask x (k-1)] yields k drafts
  (every position drafts the token after it: DeepSpec's convention). The mask token and taps are read
  from `dflash_config`, else the top level. Its Markov head has `markov_w1` / `markov_w2` only (the
  vanilla head; `markov_head_type` is not read, so another head would be run as vanilla), the
  confidence head is `confidence_head.proj` (with bias) over [h ; W1[prev]] or h by
  `confidence_head_with_markov`. `load_weights` prefixes `model.` to DeepSpec's bare names; the
  `embed_tokens` / `lm_head` copies DeepSpec saves are optional (the target's are shared when absent),
  so drafter/ leaves them out. A reduced draft vocabulary is `draft_vocab_size`, `d2t`, an `lm_head` of
  the draft rows and a `markov_w2` of the draft rows (its bias is computed over the draft vocabulary).
  `enable_adaptive_verification` (vllm/config/speculative.py, default false, method dspark only) sizes
  each step's verification budget from the confidence head's per-request acceptance estimates and the
  current load, with step costs vLLM profiles itself (v1/worker/gpu/spec_decode/adaptive_verification.py);
  it changes how many drafts are verified, never which tokens are accepted. It is set for a drafter with
  a confidence head.
- EAGLE-3 (vLLM 0.33: vllm/config/speculative.py, vllm/transformers_utils/configs/eagle.py,
  vllm/model_executor/models/llama_eagle3.py, registry `LlamaForCausalLMEagle3` → `Eagle3LlamaForCausalLM`):
  `{"method": "eagle3", "model": DRAFTER, "num_speculative_tokens": n}`, n the drafter steps per
  verification (a chain: vLLM 0.33 has no draft-tree setting). The draft config is wrapped in
  `EAGLEConfig`; the model reads `hidden_size`, `num_hidden_layers` (1), `rms_norm_eps`,
  `draft_vocab_size` (default vocab_size), `target_hidden_size` (default hidden_size),
  `norm_before_residual`, `eagle_config.use_aux_hidden_state` / `norm_before_fc`, `fc_norm` and
  `norm_output` (EAGLE 3.1: the next step's state is the final-normed output; off, the output before
  the final norm), each as loopspec runs it (the drafter's config.json carries them at the top level).
  The target's tap layers are the top-level `eagle_aux_hidden_state_layer_ids`, else `eagle_config`'s,
  taken as given (v1/worker/gpu_model_runner.py, v1/worker/gpu/spec_decode/eagle/
  eagle3_utils.py); id j is the stream entering target layer j (the model appends its aux state after
  layer j-1: model_executor/models/llama.py), loopspec's tap j-1. Weights: `midlayer.` is mapped to
  `layers.0.`, `d2t` to `draft_id_to_target_id` (target id = draft id + d2t), `t2d` skipped, the
  `embed_tokens` of the target shared when the drafter has none.
- DFlash2 (vLLM 0.28's release notes, pull request 52816; vLLM 0.33: model_executor/models/
  qwen3_dflash2.py, registry `DFlash2DraftModel` → `DFlash2Qwen3ForCausalLM`, v1/worker/gpu/spec_decode/
  __init__.py): the same `method: dflash` line, `num_speculative_tokens` k - 1; vLLM keeps the
  architecture (EAGLEConfig prefixes "DFlash" only to names without it) and picks its DFlash2 speculator
  from `DFlash2DraftModel`. The model reads `dflash_config` only (not the top level) for
  `conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`, `input_embedding_scale`,
  `output_multiplier`, `final_logit_softcapping` (0: none); the convolution's block is
  1 + num_speculative_tokens; the codebooks are [vocab_size, rank] (the full vocabulary) and the
  candidates come from the target's lm_head. Per layer: `is_causal` at the top level (else
  `dflash_config.causal`, else causal on sliding layers), `layer_types` with the top-level
  `sliding_window`. Only the V2 model runner has the candidate head: the V1 runner refuses "DFlash
  candidate-head drafts" (config/vllm.py), and V2 is the default where Triton has a GPU.
Which drafter kinds it takes, and why it refuses the rest, is `vllm_kind_refusal`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from loopspec.convert.bundles.common import (
    DTYPES,
    HF_TARGET,
    BundleParts,
    LaunchSettings,
    ServingFramework,
    drafts_in_steps,
    eagle3_switch_refusal,
    launch_script,
    serves_its_draft_vocab,
)
from loopspec.convert.bundles.hf_checkpoint import full_vocab_drafter
from loopspec.errors import LoopspecError
from loopspec.model.dflash import Drafter
from loopspec.model.drafter_kinds import DEEPSPEC_BLOCK, DrafterKind
from loopspec.weights import read_json, read_safetensors, write_safetensors

TITLE = "vLLM"
DFLASH2_MIN_VERSION = "0.28"  # the release that added DFlash2 (pull request 52816)
VLLM_DRAFTER = "vllm/drafter"  # the reduced-vocabulary drafter, for vLLM
# the EAGLE-3 config switches its reader implements (vLLM 0.33 models/llama_eagle3.py): all four
EAGLE3_SWITCHES_READ = ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual")


def vllm_kind_refusal(kind: DrafterKind) -> str | None:
    """Why vLLM cannot serve a drafter of this kind (None: it can): z-lab DFlash (method dflash); a DSpark
    drafter of DeepSpec's block convention with a vanilla Markov head (method dspark); every DFlash2 drafter
    (method dflash); an EAGLE-3 drafter whose switches its reader implements (method eagle3)."""
    if kind.name == "eagle3":
        return eagle3_switch_refusal(kind, "vLLM", EAGLE3_SWITCHES_READ)
    if kind.name == "dflash2":
        return None  # method dflash: vLLM's Qwen3 DFlash2 model reads every DFlash2 field
    if kind.plain:
        return None  # z-lab DFlash: method dflash
    if kind.convention is not DEEPSPEC_BLOCK:
        return (
            "vLLM's DSpark drafts from the anchor's own block position (DeepSpec's block convention: position "
            "i drafts the token at anchor+i+1), and this drafter's heads were trained in z-lab's (position i "
            "drafts the token at anchor+i): vLLM would draft one position off"
        )
    if kind.markov is None:
        return (
            "vLLM's Qwen3 DSpark model always builds a Markov head, and this drafter has none (markov_rank 0) "
            "to load into it"
        )
    if kind.markov.head_type != "vanilla":
        return (
            f"vLLM's DSpark Markov head is the vanilla one only (markov_w1, markov_w2), not this drafter's "
            f"{kind.markov.head_type} head"
        )
    return None


def vllm_method(s: LaunchSettings) -> str:
    """eagle3 for an EAGLE-3 drafter, dspark for a drafter written in DeepSpec's layout (its block
    convention), else dflash."""
    if drafts_in_steps(s.kind):
        return "eagle3"
    return "dspark" if s.kind.convention is DEEPSPEC_BLOCK else "dflash"


def adaptive_verification(s: LaunchSettings) -> bool:
    """vLLM sizes each step's verification budget from the DSpark confidence head (method dspark only)."""
    return vllm_method(s) == "dspark" and s.kind.estimates_acceptance


def vllm_speculative_config(s: LaunchSettings) -> dict:
    own_vocab_dir = s.draft_vocab is not None and not serves_its_draft_vocab(s.kind)
    drafter = f"./{VLLM_DRAFTER}" if own_vocab_dir else "./drafter"
    spec = {"method": vllm_method(s), "model": drafter, "num_speculative_tokens": s.drafts}
    if adaptive_verification(s):
        spec["enable_adaptive_verification"] = True
    return spec


def vllm_files(s: LaunchSettings) -> dict[str, str]:
    argv = [
        "vllm",
        "serve",
        "./target",
        "--served-model-name",
        s.name,
        "--tensor-parallel-size",
        str(s.tp),
        "--max-model-len",
        str(s.max_context),
        "--max-num-seqs",
        str(s.max_batch_size),
        "--speculative-config",
        json.dumps(vllm_speculative_config(s)),
    ]
    return {"vllm/launch.sh": launch_script(TITLE, argv)}


def _write_parts(parts: BundleParts, tmp: Path) -> None:
    """vllm/drafter/ when the drafter has a reduced draft vocabulary."""
    draft_ids = parts.drafter.draft_ids
    if draft_ids is None or serves_its_draft_vocab(parts.drafter.cfg.kind):  # an EAGLE-3 drafter/ carries its d2t
        return
    lm_head = target_lm_head(parts.target_dir, parts.target_cfg.tie_word_embeddings)
    write_vllm_drafter(full_vocab_drafter(parts.drafter), draft_ids, lm_head, tmp / VLLM_DRAFTER, DTYPES[parts.dtype])


def target_lm_head(target_dir: Path, tied: bool) -> torch.Tensor:
    """The target's output projection [V, H] (its embedding when tied), read from the one shard holding it."""
    from safetensors import safe_open

    names = ("model.embed_tokens.weight", "embed_tokens.weight") if tied else ("lm_head.weight",)
    for shard in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in names:
                if name in f.keys():
                    return f.get_tensor(name)
    raise LoopspecError(f"the target {target_dir} has no {names[0]} tensor")


def write_vllm_drafter(
    model: Drafter, draft_ids: torch.Tensor, lm_head: torch.Tensor, dst: Path, dtype: torch.dtype
) -> None:
    """The drafter as vLLM's DFlash model reads a reduced draft vocabulary: `draft_vocab_size` in
    config.json, `d2t` (target id = draft id + d2t) and its own lm_head of the draft rows."""
    model.save(dst, dtype=dtype)
    cfg = read_json(dst / "config.json", "drafter config")
    cfg["draft_vocab_size"] = int(draft_ids.numel())
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_safetensors({"d2t": (draft_ids - torch.arange(draft_ids.numel())).to(torch.int64)}, dst / "d2t.safetensors")
    write_safetensors({"lm_head.weight": lm_head[draft_ids].to(dtype).contiguous()}, dst / "lm_head.safetensors")
    if model.markov_head is not None:  # vLLM's DSpark adds the Markov bias over the draft rows: W2 of those rows
        state = read_safetensors(dst / "model.safetensors")
        name = "markov_head.markov_w2.weight"
        state[name] = state[name][draft_ids].contiguous()
        write_safetensors(state, dst / "model.safetensors")


def _reduced_vocab_line(vocab: int) -> str:
    return (
        f"  - vLLM: reduced, from `{VLLM_DRAFTER}/` (`draft_vocab_size: {vocab}` in config.json, "
        "`d2t.safetensors`, and `lm_head.safetensors` with the target's lm_head rows of the draft "
        "tokens, since vLLM's DFlash model computes draft logits with its own head of that size)."
    )


def _manifest_entry(s: LaunchSettings) -> dict:
    entry = {"method": vllm_method(s), "num_speculative_tokens": s.drafts}
    if adaptive_verification(s):
        entry["enable_adaptive_verification"] = True
    return entry


def _readme_launch(s: LaunchSettings) -> list[str]:
    if drafts_in_steps(s.kind):
        return [
            "",
            f"vLLM runs the EAGLE-3 drafter with `method: eagle3` and `num_speculative_tokens: {s.drafts}` "
            "(drafter steps per verification, a chain), reading `drafter/` as its `LlamaForCausalLMEagle3` "
            "model and the taps from `eagle_aux_hidden_state_layer_ids`.",
        ]
    if s.kind.selector:
        return [
            "",
            f"vLLM (>= {DFLASH2_MIN_VERSION}) runs the DFlash2 drafter with `method: dflash` and "
            f"`num_speculative_tokens: {s.drafts}`, picking its DFlash2 model (the grouped dynamic convolutions and "
            "the candidate selector over the target's lm_head) from `drafter/`'s `architectures: "
            '["DFlash2DraftModel"]`. It runs on vLLM\'s V2 model runner, the default where Triton has a GPU; '
            "`VLLM_USE_V2_MODEL_RUNNER=0` is refused for it.",
        ]
    if not adaptive_verification(s):
        return []
    return [
        "",
        "vLLM's `--speculative-config` sets `enable_adaptive_verification`: each step vLLM verifies as many "
        "of a request's drafts as the confidence head's acceptance estimates and the current load make worth "
        "their cost (step costs it profiles itself), instead of the whole block. It changes how many drafts are "
        "verified, never which tokens are accepted, so outputs stay the target's; set it to false to verify "
        "every draft. It needs vLLM >= 0.28 (its adaptive speculative token budget for DSpark) and full CUDA "
        "graphs (vLLM's configuration refuses it otherwise, e.g. with `--enforce-eager` or on the CPU).",
    ]


VLLM = ServingFramework(
    name="vllm",
    title=TITLE,
    target=HF_TARGET,
    support=(
        "yes (`method: dflash`)",
        "DeepSpec block convention, vanilla Markov head (`method: dspark`, `enable_adaptive_verification`)",
        "chains (`method: eagle3`)",
        f"yes (`method: dflash`, >= {DFLASH2_MIN_VERSION}, V2 model runner)",
        "no",
        "yes (`draft_vocab_size` + `d2t`)",
        "yes (modelopt checkpoint)",
        "Blackwell only",
        "yes (`--tensor-parallel-size`)",
    ),
    launch_files=vllm_files,
    kind_refusal=vllm_kind_refusal,
    readme_launch=_readme_launch,
    write_parts=_write_parts,
    reduced_vocab_line=_reduced_vocab_line,
    manifest_entry=_manifest_entry,
    manifest_entry_with_drafting=True,
    tree_refusal=(
        "vLLM 0.33 drafts EAGLE-3 as a chain of num_speculative_tokens: its speculative config has no "
        "draft-tree setting (bundle the chain: --tree-budget 0)"
    ),
)
