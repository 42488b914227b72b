"""What every serving framework's part of a bundle shares: the framework record, the launch settings,
launch scripts, the README and the manifest."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.model.draft_head import DRAFT_CANDIDATES
from loopspec.model.drafter_kinds import DEEPSPEC_BLOCK, DrafterKind
from loopspec.model.target import TargetConfig
from loopspec.weights import TargetSource, file_sha256

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
HF_TARGET, GGUF_TARGET = "hf", "gguf"  # what a framework serves: the HF checkpoint in target/, or the GGUF file


@dataclass
class LaunchSettings:
    """What every framework's launch needs to know about the pair."""

    name: str  # served model name
    tp: int
    block_size: int
    drafts: int  # drafts per verification: block_size - 1 (z-lab's convention, EAGLE-3's steps) or block_size
    mask_token_id: int | None  # None: a chain drafter fills no block with a mask token (EAGLE-3)
    target_layer_ids: list[int]  # loopspec's taps: the output of target layer i
    precision: str | None
    max_batch_size: int  # requests decoding at once
    max_context: int  # tokens per request, prompt + output
    drafter: DrafterConfig
    draft_vocab: int | None = None  # the drafter's reduced draft vocabulary (d2t), None: it drafts over all
    threads: int | None = None  # a CPU framework's default threads in its launch script (None: all cores)
    tree_budget: int = 0  # the setting's draft-tree nodes per verification (0: the chain; EAGLE-3 only)

    @property
    def kind(self) -> DrafterKind:
        return self.drafter.kind

    @property
    def tree_nodes(self) -> int:
        """The draft-tree nodes one verification checks (0: the chain): the setting's tree budget, at most
        what loopspec's tree over these steps holds (the chain and its DRAFT_CANDIDATES ranked candidates
        at each depth: runtime/proposal.py, loopspec/tree.py best_first)."""
        return min(self.tree_budget, DRAFT_CANDIDATES * self.drafts)

    @property
    def tree_depth(self) -> int:
        """The drafter steps a tree takes: the chain's, or fewer where the tree has fewer nodes."""
        return min(self.drafts, self.tree_nodes)

    @property
    def tree_topk(self) -> int:
        """The candidates a tree takes at each step: loopspec's ranked candidates, at most its nodes."""
        return min(DRAFT_CANDIDATES, self.tree_nodes)

    @property
    def verified_tokens(self) -> int:
        """Tokens one request verifies in a step: its anchor and its drafts (a tree's nodes, or the chain)."""
        return 1 + (self.tree_nodes or self.drafts)

    @property
    def max_num_tokens(self) -> int:
        """Tokens one forward may carry: a whole prompt of max_context, or every request's block."""
        return max(self.max_context, self.max_batch_size * max(self.block_size, self.verified_tokens))


@dataclass
class BundleParts:
    """What the frameworks' files are written from, resolved once."""

    drafter: Drafter  # as loaded: with its reduced draft vocabulary (d2t) when it has one
    drafter_dir: Path
    source: TargetSource
    target_dir: Path | None  # the HF checkpoint (None when only GGUF frameworks are asked for)
    target_cfg: TargetConfig | None
    dtype: str  # of the unquantized weights written
    precision: str | None
    calib_prompts: str | None
    calib_size: int | None


@dataclass(frozen=True)
class ServingFramework:
    """One serving framework a bundle targets."""

    name: str  # its --engine word and its folder in the bundle
    title: str  # in prose
    target: str  # HF_TARGET (the checkpoint in target/ with the z-lab drafter/) or GGUF_TARGET (the target GGUF)
    support: tuple[str, ...]  # its row of the support matrix (SUPPORT_COLUMNS)
    launch_files: Callable[[LaunchSettings], dict[str, str]]  # {path in the bundle: text}
    # why it cannot serve a drafter of this kind (None: it can): written in its module, answering for every
    # family (DFlash and DSpark by block convention and heads, DFlash2 by selector, EAGLE-3 by the switches
    # its reader implements)
    kind_refusal: Callable[[DrafterKind], str | None]
    # its own files beside the launch files and the shared drafter/ and target/
    write_parts: Callable[[BundleParts, Path], None] | None = None
    readme_launch: Callable[[LaunchSettings], list[str]] | None = None  # what the README's launch section adds
    readme_uses: Callable[[LaunchSettings], list[str]] | None = None  # its files under "What each engine uses"
    # the README line of the reduced draft vocabulary it drafts over (None: it drafts over the full one, and
    # full_vocab_reason says why)
    reduced_vocab_line: Callable[[int], str] | None = None
    full_vocab_reason: str | None = None
    manifest_entry: Callable[[LaunchSettings], dict] | None = None  # its own key in manifest.json
    manifest_entry_with_drafting: bool = False  # that key sits beside drafts_per_block, else after files
    tree_refusal: str | None = None  # why it cannot verify a draft tree of an EAGLE-3 drafter (None: it can)
    # whether its files for a drafter of this kind are made from the target's HF checkpoint even when it serves
    # a GGUF (llama.cpp's own converter reads the target's config.json and tokenizer); None: never
    reads_checkpoint: Callable[[DrafterKind], bool] | None = None

    def refuses(self, kind: DrafterKind, tree_budget: int = 0) -> str | None:
        """Why it cannot serve a drafter of this kind with this setting's tree (None: it can)."""
        return self.kind_refusal(kind) or (self.tree_refusal if tree_budget else None)


# --------------------------------------------------------------------------------------------------
# what a bundle asks of a drafter's kind


def drafts_in_steps(kind: DrafterKind) -> bool:
    """A bundle sets how many drafts (and which tree) its engines draft per verification from the decoding
    setting: a chain drafter runs any number of steps; a block drafter drafts its block."""
    return kind.chain


def serves_its_draft_vocab(kind: DrafterKind) -> bool:
    """Every framework that takes it reads its reduced draft vocabulary (d2t, its own lm_head rows) from
    one drafter directory: EAGLE-3's readers all do; a block drafter's bundle writes drafter/ over the
    full vocabulary, since TensorRT-LLM and SGLang draft with the target's lm_head."""
    return kind.chain


def eagle3_switch_refusal(kind: DrafterKind, title: str, switches_read: tuple[str, ...]) -> str | None:
    """Why the framework `title`, whose EAGLE-3 reader implements the config switches `switches_read`, cannot
    serve this EAGLE-3 drafter (None: it can). Every framework runs SpecForge's LlamaForCausalLMEagle3
    drafter as loopspec saves it; a switch its reader does not implement would be silently dropped there,
    so it is refused here; what a framework cannot take of a setting (a draft tree) is its tree_refusal."""
    unread = [name for name in (kind.eagle3.switched_on if kind.eagle3 else ()) if name not in switches_read]
    if not unread:
        return None
    return (
        f"{title}'s EAGLE-3 reader does not implement {', '.join(unread)} (this drafter's config.json turns "
        f"{'it' if len(unread) == 1 else 'them'} on), so it would draft with a different model"
    )


# --------------------------------------------------------------------------------------------------
# launch scripts


def _quote(word: str) -> str:
    """A shell word: a script variable ("$PORT") expanded in double quotes, anything else quoted as is."""
    if len(word) > 1 and word[0] == "$" and word[1:].replace("_", "").isalnum():
        return f'"{word}"'
    return shlex.quote(word)


def _command(argv: list[str]) -> str:
    """A shell command: the program and its positional words on the first line, then one flag (and its
    value) per line, every argument quoted; extra flags given to the script pass through ("$@")."""
    i = 0
    while i < len(argv) and not argv[i].startswith("--"):
        i += 1
    lines = [" ".join(_quote(a) for a in argv[:i])]
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            lines.append(f"{argv[i]} {_quote(argv[i + 1])}")
            i += 2
        else:
            lines.append(_quote(argv[i]))
            i += 1
    return "exec " + " \\\n    ".join(lines + ['"$@"']) + "\n"


def launch_script(title: str, argv: list[str], settings: str = "") -> str:
    return (
        "#!/bin/sh\n"
        f"# Serve this bundle with {title}: target + drafter. Extra flags are passed on.\n"
        "set -eu\n"
        'cd "$(dirname "$0")/.."  # paths below are relative to the bundle root\n' + settings + _command(argv)
    )


# --------------------------------------------------------------------------------------------------
# README and manifest

# Which framework supports what, declared once (README and docs/serving.md print it): loopspec's own
# runtime, then each framework's row (ServingFramework.support)
SUPPORT_COLUMNS = (
    "DFlash",
    "DSpark",
    "EAGLE-3",
    "DFlash2",
    "DLoop",
    "d2t reduced vocab",
    "FP8",
    "NVFP4",
    "tensor parallel",
)
RUNTIME_SUPPORT = (
    "loopspec runtime",
    (
        "yes",
        "yes (every head and block convention)",
        "chains and trees (torch backend)",
        "chains and trees (torch backend)",
        "yes",
        "yes",
        "drafter (ONNX Runtime / TensorRT)",
        "TensorRT on Blackwell",
        "no (one device)",
    ),
)


def support_matrix_markdown(frameworks: list[ServingFramework]) -> str:
    rows = [RUNTIME_SUPPORT] + [(f.title, f.support) for f in frameworks]
    lines = ["| engine | " + " | ".join(SUPPORT_COLUMNS) + " |", "|---" * (len(SUPPORT_COLUMNS) + 1) + "|"]
    lines += [f"| {title} | " + " | ".join(row) + " |" for title, row in rows]
    return "\n".join(lines)


def draft_vocab_per_framework(
    frameworks: list[ServingFramework], draft_vocab_size: int | None, kind: DrafterKind | None = None
) -> dict:
    """{framework: draft vocabulary it drafts over}: the reduced size where the bundle carries it, else "full"."""
    every = kind is not None and serves_its_draft_vocab(kind)
    return {
        f.name: draft_vocab_size if draft_vocab_size and (every or f.reduced_vocab_line) else "full" for f in frameworks
    }


def _draft_vocab_lines(frameworks: list[ServingFramework], vocab: int | None, kind: DrafterKind) -> list[str]:
    if not vocab:
        return ["- Draft vocabulary: full (the drafter was trained on the whole vocabulary)."]
    if serves_its_draft_vocab(kind):
        return [
            f"- Draft vocabulary: reduced, {vocab} tokens, as the drafter was trained: every engine drafts "
            "with the drafter's own `lm_head` of those rows and maps them to target ids with `d2t` (target "
            "id = draft id + d2t), from `drafter/`"
            + (
                " (llama.cpp: the `d2t` tensor of absolute ids in its converted GGUF)."
                if any(f.name == "llamacpp" for f in frameworks)
                else "."
            )
        ]
    lines = [
        f"- Draft vocabulary: the drafter was trained with a reduced draft vocabulary of {vocab} tokens "
        "(`d2t`). Drafting over the full vocabulary instead keeps the output exact (verification "
        "decides) but can lower τ a little."
    ]
    lines += [f.reduced_vocab_line(vocab) for f in frameworks if f.reduced_vocab_line]
    lines += [f"  - {f.title}: full, from `drafter/`. {f.full_vocab_reason}" for f in frameworks if f.full_vocab_reason]
    return lines


def _convention_lines(s: LaunchSettings) -> list[str]:
    """The block convention, stated: which block outputs are drafts decides how a framework must run it."""
    if drafts_in_steps(s.kind):
        shape = (
            f"a draft tree of {s.tree_nodes} nodes per verification, {s.tree_depth} drafter steps deep with "
            f"{s.tree_topk} candidates a step"
            if s.tree_nodes
            else f"a chain of {s.drafts} drafts per verification (block size {s.block_size})"
        )
        trees = (
            " The engines grow their own trees (EAGLE-2's dynamic tree, best candidates first) within that "
            "budget, so a tree's nodes can differ from loopspec's; outputs are the target's either way."
            if s.tree_nodes
            else ""
        )
        return [
            f"Drafting: EAGLE-3, one drafter step per draft over the target's three fused taps; {shape}, "
            "from the decoding setting (`--block-size`, `--tree-budget`, else the drafter's stored setting)." + trees,
            "",
        ]
    if s.kind.selector:
        selector = s.kind.selector
        return [
            f"Drafting: DFlash2, z-lab's block. The block is [anchor, mask x {s.block_size - 1}]; block positions "
            f"1..{s.block_size - 1} each keep the target head's top {selector.top_k} candidates, and the candidate "
            f"selector's walk from the anchor picks one per position ({s.drafts} drafts), after "
            f"{selector.conv_taps}-tap grouped dynamic convolutions around every sublayer.",
            "",
        ]
    if s.kind.convention is DEEPSPEC_BLOCK:
        return [
            f"Block convention: DeepSpec's. The block is [anchor, mask x {s.block_size - 1}] and every block "
            f"position i drafts the token at anchor+i+1, so one block gives {s.drafts} drafts (vLLM "
            f"`num_speculative_tokens` {s.drafts}, llama.cpp `--spec-draft-n-max` {s.drafts}); the Markov "
            "head's first predecessor is the anchor. A z-lab DFlash reader (drafts from positions 1.., the "
            "token at anchor+i) would draft one position off, so the drafter is written for DSpark readers "
            "only (`Qwen3DSparkModel`, `dflash.sample_from_anchor` true).",
            "",
        ]
    if s.kind.heads:
        return [
            f"Block convention: z-lab's. The block is [anchor, mask x {s.block_size - 1}] and block positions "
            f"1..{s.block_size - 1} draft the token at their own position ({s.drafts} drafts); the Markov head's "
            "first predecessor is the anchor (`dflash.sample_from_anchor` false).",
            "",
        ]
    return []


def _in_prose(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def readme(frameworks: list[ServingFramework], s: LaunchSettings, dtype: str, sources: dict, matrix: str) -> str:
    precision = s.precision or dtype
    hf = any(f.target == HF_TARGET for f in frameworks)
    lines = [
        f"# Serving bundle: {s.name}",
        "",
        f"Target `{s.name}` ({precision}, from `{sources['target']}`) with the {s.kind.title} drafter "
        f"`{sources['drafter']}` "
        f"(block size {s.block_size}, {s.drafts} drafts per block, taps {s.target_layer_ids}"
        + (f", mask token {s.mask_token_id}), " if s.mask_token_id is not None else "), ")
        + f"tensor parallel size {s.tp}, up to {s.max_batch_size} requests at once of up to "
        f"{s.max_context} tokens each (prompt + output). Every engine serves it as `{s.name}`.",
        "",
        *_convention_lines(s),
        "## Launch",
        "",
    ]
    lines += [f"- {f.title}: `sh {f.name}/launch.sh [extra engine flags]`" for f in frameworks]
    for f in frameworks:
        lines += f.readme_launch(s) if f.readme_launch else []
    lines += [
        "",
        "Every launch script changes into the bundle root first: the paths below are relative to it.",
        "",
        "## What each engine uses",
        "",
    ]
    if hf and s.kind.convention is DEEPSPEC_BLOCK:
        lines.append(
            '- `drafter/`: DeepSpec\'s DSpark format (`config.json` with `architectures: ["Qwen3DSparkModel"]`, '
            "`block_size`, `mask_token_id`, `target_layer_ids`, `markov_rank`, `markov_head_type`, "
            "`enable_confidence_head`, `confidence_head_with_markov` at the top level, mask and taps also in "
            "`dflash_config`; `model.safetensors` under DeepSpec's key names `markov_head.markov_w1/w2`, "
            "`confidence_head.proj`, without the `embed_tokens` / `lm_head` copies: vLLM shares the "
            f"target's), read by {_in_prose([f.title for f in frameworks if f.target == HF_TARGET])} "
            "as a DSpark drafter."
        )
    elif hf and drafts_in_steps(s.kind):
        lines.append(
            "- `drafter/`: SpecForge's EAGLE-3 layout (`config.json` with `architectures: "
            '["LlamaForCausalLMEagle3"]`, `draft_vocab_size`, the taps as '
            f"`eagle_aux_hidden_state_layer_ids` {[i + 1 for i in s.target_layer_ids]} at the top level (vLLM's "
            "and llama.cpp's numbering: the stream entering layer j) and in `eagle_config` "
            f"{s.target_layer_ids} (SGLang's: the output of layer i); `model.safetensors` with `fc`, "
            "`midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`, without `embed_tokens`: the target's is shared), "
            f"read by {_in_prose([f.title for f in frameworks if f.target == HF_TARGET])}."
        )
    elif hf and s.kind.selector:
        lines.append(
            '- `drafter/`: z-lab\'s DFlash2 layout (`config.json` with `architectures: ["DFlash2DraftModel"]`, '
            "`dflash_config` holding `block_size`, `mask_token_id`, `target_layer_ids`, `conv_kernel_size`, "
            "`conv_group_size`, `selector_rank`, `selector_top_k`, `output_multiplier`, "
            "`input_embedding_scale`; `is_causal`, `use_sliding_window`, `sliding_window` and `layer_types` "
            "at the top level; `model.safetensors` with DFlash's tensors plus `layers.i.attention_conv` / "
            "`layers.i.mlp_conv` (`base_kernel`, `kernel_projection.weight`) and `candidate_selector` "
            "(`hidden_projection.weight`, `predecessor_codebook`, `successor_codebook`), over the full "
            f"vocabulary), read by {_in_prose([f.title for f in frameworks if f.target == HF_TARGET])}, "
            "which pick their DFlash2 model from the architecture."
        )
    elif hf:
        lines.append(
            "- `drafter/`: z-lab DFlash format (`config.json` with `dflash_config.mask_token_id` and "
            "`target_layer_ids`, `model.safetensors`), read by TensorRT-LLM, vLLM and SGLang."
        )
    for f in frameworks:
        lines += f.readme_uses(s) if f.readme_uses else []
    lines += [
        *_draft_vocab_lines(frameworks, s.draft_vocab, s.kind),
        "- DLoop (several draft stages per verification) runs only in loopspec's own runtime; the "
        "engines run one draft stage per verification.",
    ]
    if hf:
        lines.append(
            "- `target/`: Hugging Face checkpoint"
            + (f", modelopt {s.precision.upper()}-quantized." if s.precision else f" in {dtype}.")
            + " Its config.json carries `rope_theta` beside `rope_parameters` for transformers-4 readers."
        )
    if s.precision == "nvfp4":
        lines.append("- NVFP4 kernels need a Blackwell GPU (compute capability >= 10.0); other GPUs refuse it.")
    lines += [
        "",
        "## Support matrix",
        "",
        matrix,
        "",
        "`manifest.json` lists the sha256 of every file, the sources' hashes and the tool versions.",
        "",
    ]
    return "\n".join(lines)


def manifest(out: Path, frameworks: list[ServingFramework], s: LaunchSettings, dtype: str, sources: dict) -> dict:
    import importlib.metadata as md

    import loopspec

    tools = {"loopspec": loopspec.__version__, "torch": torch.__version__}
    for package in ("transformers", "safetensors", "nvidia-modelopt", "gguf"):
        try:
            tools[package] = md.version(package)
        except md.PackageNotFoundError:
            pass
    files = {str(p.relative_to(out)): file_sha256(p) for p in sorted(out.rglob("*")) if p.is_file()}
    vocab = s.draft_vocab
    reasons = {
        f.name: f.full_vocab_reason
        for f in frameworks
        if vocab and f.full_vocab_reason and not serves_its_draft_vocab(s.kind)
    }
    entries = [f for f in frameworks if f.manifest_entry]
    # the manifest names its frameworks "engines", as bundles always have (scripts and users read it)
    return {
        "kind": "serving-bundle",
        "engines": [f.name for f in frameworks],
        "served_model_name": s.name,
        "tensor_parallel_size": s.tp,
        "max_batch_size": s.max_batch_size,
        "max_context": s.max_context,
        "precision": s.precision or dtype,
        "block_size": s.block_size,
        "mask_token_id": s.mask_token_id,
        "drafter_kind": s.kind.title,
        "block_convention": s.kind.convention.name,
        "drafts_per_block": s.drafts,
        **({"draft_tree_nodes": s.tree_nodes} if drafts_in_steps(s.kind) else {}),
        **{f.name: f.manifest_entry(s) for f in entries if f.manifest_entry_with_drafting},
        "target_layer_ids": s.target_layer_ids,
        "trained_draft_vocab_size": vocab,
        "draft_vocab": draft_vocab_per_framework(frameworks, vocab, s.kind),
        "full_draft_vocab_reasons": reasons,
        "sources": sources,
        "tools": tools,
        "files": files,
        **{f.name: f.manifest_entry(s) for f in entries if not f.manifest_entry_with_drafting},
    }
