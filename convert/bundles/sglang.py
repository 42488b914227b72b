"""SGLang: sglang.launch_server on the HF checkpoint with the z-lab drafter (DFLASH), a DSpark drafter
(DSPARK) or an EAGLE-3 drafter (EAGLE3).

Facts this module relies on (docs.sglang.io speculative decoding; z-lab model cards; re-check on
upgrades): `python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH
--speculative-draft-model-path DRAFTER --speculative-num-draft-tokens k` (the block size, anchor
included; newer releases also spell it `--speculative-dflash-block-size` and require both to agree
when both are set), `--tp-size N`, `--context-length`, `--max-running-requests`,
`--served-model-name`; `--speculative-draft-model-quantization unquant` keeps the drafter unquantized
when the target is.

DFlash2 (pull request 35371; python/sglang/srt/models/dflash.py `DFlash2DraftModel`,
speculative/dflash_utils.py `parse_dflash_draft_config`; in 0.5.19 to 0.5.23, not in 0.5.18): the same
DFLASH launch; the model class comes from the drafter's `architectures`, and `dflash_config` gives
`conv_kernel_size` / `conv_group_size` (both or neither), `selector_rank` / `selector_top_k` (both or
neither), `output_multiplier` (> 0) and `final_logit_softcapping` (0: none). The selector's codebooks
are [vocab_size, rank] over the full vocabulary and its candidates come from the target's lm_head.
Attention per layer: `layer_types` (full / sliding, `sliding_window` including the query token) and the
top-level `is_causal` (absent: causal on sliding layers only). The block's embeddings are scaled by the
target model's own DFlash noise scale (1 for every target family loopspec serves), not by the
drafter's `input_embedding_scale`, which these releases do not read.

DSpark (python/sglang/srt/arg_groups/speculative_hook.py `_handle_dspark`,
python/sglang/srt/speculative/dspark_components/dspark_config.py; SGLang 0.5.16's release notes
introduce it): `--speculative-algorithm DSPARK --speculative-draft-model-path DRAFTER
--speculative-dspark-block-size GAMMA` (gamma: the drafts per block), and `--speculative-num-draft-tokens`,
when given, must equal gamma + 1 (the verify window, anchor included). The draft config is read from
`dspark_config`, the top level or the `dspark_`-prefixed keys: `markov_rank` must be > 0 (it refuses a
drafter without a Markov head), `markov_head_type` one of vanilla / gated / rnn, `mask_token_id`
required; block slot k drafts the token at anchor+k+1 (DeepSpec's convention; a drafter trained with
slot j drafting anchor+j would draft one position off). Confidence-scheduled (ragged) verification is
switched by the environment (`SGLANG_RAGGED_VERIFY_MODE`) and fed by `--speculative-dspark-sps-table-path`
(speculative/dspark_components/dspark_sps.py: `SpsCostTable` {sample_batch_tokens, sample_steps_per_sec,
max_batch_tokens} or `SpsAdditiveCostTable` {bias_seconds, bs_probes, alpha_seconds, m_probes,
theta_seconds}) / `--speculative-dspark-confidence-sts-path` (dspark_sts.py: `temperatures` per position),
SGLang's own step measurements and calibration; the bundle leaves them out (loopspec's step-cost table
times loopspec's engine, not SGLang's).

EAGLE-3 (SGLang 0.5.23: python/sglang/srt/arg_groups/speculative_hook.py `_handle_eagle_family`,
speculative/eagle_utils.py `organize_draft_results`, models/llama_eagle3.py):
`--speculative-algorithm EAGLE3 --speculative-draft-model-path DRAFTER --speculative-num-steps D
--speculative-eagle-topk K --speculative-num-draft-tokens N`. A chain is topk 1 with N = D + 1 (with
topk 1 SGLang resets N to D + 1 anyway). A tree (EAGLE-2's dynamic tree) expands the topk best paths
by their topk candidates at each of D steps and verifies the N - 1 best of the topk + (D - 1)·topk²
candidates (its score list) beside the root, so N - 1 <= topk + (D - 1)·topk². The draft's layers
are `midlayer` → `layers.0`, `d2t` becomes its hot-token map (target id = draft id + d2t), `t2d` is
skipped; the tap layers are `eagle_config.eagle_aux_hidden_state_layer_ids`, numbered as the output
of layer i (the target captures layer i + 1's input: models/llama.py `set_eagle3_layers_to_capture`).
Without `--speculative-num-steps` SGLang picks its own steps, topk and draft tokens, so all three are
always written. Which drafter kinds it takes, and why it refuses the rest, is `sglang_kind_refusal`.
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

TITLE = "SGLang"
DFLASH2_MIN_VERSION = "0.5.19"  # the first release with DFlash2DraftModel (0.5.18 has none)
# the EAGLE-3 config switches its reader implements (SGLang 0.5.23 models/llama_eagle3.py): fc_norm (or its
# older name use_aux_norm), norm_before_fc, norm_output
EAGLE3_SWITCHES_READ = ("fc_norm", "norm_before_fc", "norm_output")


def sglang_kind_refusal(kind: DrafterKind) -> str | None:
    """Why SGLang cannot serve a drafter of this kind (None: it can): z-lab DFlash (DFLASH); a drafter of
    DeepSpec's block convention with a Markov head, any of the three (DSPARK); a DFlash2 drafter whose
    input_embedding_scale is 1 (DFLASH); an EAGLE-3 drafter whose switches its reader implements (EAGLE3)."""
    if kind.name == "eagle3":
        return eagle3_switch_refusal(kind, "SGLang", EAGLE3_SWITCHES_READ)
    if kind.name == "dflash2":
        if kind.selector is not None and kind.selector.input_embedding_scale != 1.0:
            return (
                f"SGLang's DFLASH (0.5.19 to 0.5.23) does not read dflash_config.input_embedding_scale "
                f"({kind.selector.input_embedding_scale:g} in this drafter): it would draft with unscaled "
                "embeddings"
            )
        return None
    if kind.plain:
        return None  # z-lab DFlash: DFLASH
    if kind.convention is not DEEPSPEC_BLOCK:
        return (
            "SGLang's DSPARK reads block slot k as the draft of the token at anchor+k+1 (DeepSpec's block "
            "convention), and this drafter's heads were trained in z-lab's (position i drafts the token at "
            "anchor+i): SGLang would draft one position off"
        )
    if kind.markov is None:
        return (
            "SGLang's DSPARK requires a Markov head (markov_rank > 0), and this drafter has none; its DFLASH "
            "reads z-lab's block convention"
        )
    return None  # DSPARK, any of the three Markov heads


def zlab_dflash_reader(kind: DrafterKind) -> bool:
    """SGLang's DFLASH runs it: z-lab's block convention and no DSpark head; a DFlash2 drafter's model is
    picked there from its checkpoint (`DFlash2DraftModel`)."""
    return kind.plain or kind.selector is not None


def speculative_argv(s: LaunchSettings) -> list[str]:
    """DFLASH for a z-lab DFlash drafter (the block size, anchor included); DSPARK for a DSpark drafter
    of DeepSpec's block convention (gamma = its drafts per block, and the verify window gamma + 1);
    EAGLE3 for an EAGLE-3 drafter (its steps, topk and verified tokens: the setting's chain or tree)."""
    if drafts_in_steps(s.kind):
        steps, topk = (s.tree_depth, s.tree_topk) if s.tree_nodes else (s.drafts, 1)
        return [
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            "./drafter",
            "--speculative-num-steps",
            str(steps),
            "--speculative-eagle-topk",
            str(topk),
            "--speculative-num-draft-tokens",
            str(s.verified_tokens),
        ]
    if zlab_dflash_reader(s.kind):  # a DFlash2 drafter too: SGLang picks its model from the architecture
        return [
            "--speculative-algorithm",
            "DFLASH",
            "--speculative-draft-model-path",
            "./drafter",
            "--speculative-num-draft-tokens",
            str(s.block_size),
        ]
    return [
        "--speculative-algorithm",
        "DSPARK",
        "--speculative-draft-model-path",
        "./drafter",
        "--speculative-dspark-block-size",
        str(s.drafts),
        "--speculative-num-draft-tokens",
        str(s.drafts + 1),
    ]


def sglang_files(s: LaunchSettings) -> dict[str, str]:
    argv = [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "./target",
        "--served-model-name",
        s.name,
        "--tp-size",
        str(s.tp),
        "--context-length",
        str(s.max_context),
        "--max-running-requests",
        str(s.max_batch_size),
        *speculative_argv(s),
    ]
    if s.precision is not None:  # SGLang quantizes the drafter like the target unless told otherwise
        argv += ["--speculative-draft-model-quantization", "unquant"]
    return {"sglang/launch.sh": launch_script(TITLE, argv)}


def _readme_launch(s: LaunchSettings) -> list[str]:
    if drafts_in_steps(s.kind):
        shape = (
            f"a dynamic tree: `--speculative-num-steps {s.tree_depth} --speculative-eagle-topk {s.tree_topk} "
            f"--speculative-num-draft-tokens {s.verified_tokens}` (the {s.tree_nodes} best of its candidates "
            "and the root)"
            if s.tree_nodes
            else f"a chain: `--speculative-num-steps {s.drafts} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {s.verified_tokens}`"
        )
        return [
            "",
            f"SGLang runs the EAGLE-3 drafter with `--speculative-algorithm EAGLE3` as {shape}, reading the "
            "taps from `eagle_config.eagle_aux_hidden_state_layer_ids` and its reduced vocabulary from `d2t`.",
        ]
    if s.kind.selector:
        return [
            "",
            f"SGLang (>= {DFLASH2_MIN_VERSION}) runs the DFlash2 drafter with `--speculative-algorithm DFLASH` "
            f"and `--speculative-num-draft-tokens {s.block_size}` (the block, anchor included), building its "
            "`DFlash2DraftModel` (the grouped dynamic convolutions and the candidate selector over the target's "
            "lm_head) from `drafter/`'s architecture and `dflash_config`.",
        ]
    if s.kind.plain:
        return []
    lines = [
        "",
        f"SGLang runs the DSpark drafter with `--speculative-algorithm DSPARK` (SGLang >= 0.5.16), "
        f"`--speculative-dspark-block-size {s.drafts}` (drafts per block) and `--speculative-num-draft-tokens "
        f"{s.drafts + 1}` (the verify window, anchor included).",
    ]
    if s.kind.confidence:
        lines[-1] += (
            " Its confidence-scheduled (ragged) verification is left off: it is switched by "
            "`SGLANG_RAGGED_VERIFY_MODE` and reads `--speculative-dspark-sps-table-path` (SGLang's own "
            "decode-step throughput by batch tokens: `sample_batch_tokens`, `sample_steps_per_sec`, or "
            "`bias_seconds` / `alpha_seconds` / `theta_seconds`) and `--speculative-dspark-confidence-sts-path` "
            "(per-position `temperatures` fitted to its confidence head), which SGLang's profiler and "
            "calibration tools measure on the serving GPU; loopspec's step-cost table (`loopspec costs`) "
            "times loopspec's engine, not SGLang's, so neither is written. Every step verifies the whole "
            "block (outputs are the same either way)."
        )
    return lines


SGLANG = ServingFramework(
    name="sglang",
    title=TITLE,
    target=HF_TARGET,
    support=(
        "yes (`DFLASH`)",
        "DeepSpec block convention, a Markov head required (`DSPARK`)",
        "chains and trees (`EAGLE3`)",
        f"yes (`DFLASH`, >= {DFLASH2_MIN_VERSION}; `input_embedding_scale` 1 only)",
        "no",
        "EAGLE-3 only (`d2t`); DFLASH drafts over the full vocab",
        "yes (modelopt checkpoint)",
        "Blackwell only",
        "yes (`--tp-size`)",
    ),
    launch_files=sglang_files,
    kind_refusal=sglang_kind_refusal,
    readme_launch=_readme_launch,
    full_vocab_reason=(
        "SGLang's DFLASH drafter has no lm_head of its own: it drafts with the target's lm_head over "
        "the full vocabulary and ignores a d2t tensor."
    ),
)
