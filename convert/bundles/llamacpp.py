"""llama.cpp: llama-server on the target GGUF (a copy in the bundle) with the drafter as a llama.cpp
`dflash` GGUF (a DSpark drafter with its heads, run as draft-dspark), or an EAGLE-3 or DFlash2 drafter
as llama.cpp's own converter reads it (run as draft-eagle3 / draft-dflash).

The GGUF format and the llama-server command line (the version vendored by llama-cpp-python 0.3.36)
are loopspec/engines/llamacpp.py's, with which block drafters its dflash GGUF holds
(`dflash_gguf_refusal`); which drafter kinds llama.cpp takes, and why it refuses the rest, is
`llamacpp_kind_refusal`. Its EAGLE-3 reader (the converter and the eagle3 graph, llama-cpp-python
0.3.36's) implements the switches norm_before_residual and norm_before_fc only
(`EAGLE3_SWITCHES_READ`). An EAGLE-3 GGUF is llama.cpp's `eagle3` architecture, which that
version's convert_hf_to_gguf.py writes from the SpecForge checkpoint and the target's config.json and
tokenizer (`--target-model-dir`); the bundle carries both, and its launch script converts once, with
the converter of the llama.cpp that built the llama-server, before it serves. llama.cpp drafts
EAGLE-3 as a chain of up to `--spec-draft-n-max` tokens (common/speculative.cpp): no draft tree.

A DFlash2 drafter goes the same way: that converter registers `DFlash2DraftModel` beside
`DFlashDraftModel` (conversion/qwen.py `DFlashModel`: the `dflash` architecture with
`dflash.conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`, `block_size`,
`target_layers` = the taps + 1, `logit_scale` (output_multiplier), `final_logit_softcapping`,
`embedding_scale` (input_embedding_scale), the window and `causal_attention` from `is_causal`; the
codebooks gain `.weight`; the tokenizer is the target's, from `--target-model-dir`). llama-server runs it
as `draft-dflash` and switches to the selector's walk when the GGUF has a selector
(common/speculative.cpp); its loader (src/models/dflash.cpp) refuses a drafter whose hidden size is
below selector_top_k x (selector_top_k + 1). DFlash2 reached llama.cpp's master with pull request
27816 (pull request 27342, August 2026); the llama.cpp llama-cpp-python 0.3.36 vendors (0c1e57098) has it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from loopspec.convert.bundles.common import (
    GGUF_TARGET,
    BundleParts,
    LaunchSettings,
    ServingFramework,
    drafts_in_steps,
    eagle3_switch_refusal,
    launch_script,
)
from loopspec.convert.bundles.hf_checkpoint import TOKENIZER_FILES
from loopspec.engines.llamacpp import cached_drafter_gguf, dflash_gguf_refusal, llama_server_command, spec_type
from loopspec.model.drafter_kinds import DrafterKind

TITLE = "llama.cpp"
LLAMACPP_TARGET = "llamacpp/target.gguf"
LLAMACPP_DRAFTER = "llamacpp/drafter.gguf"  # f32, with the reduced draft vocabulary when it has one
# an EAGLE-3 or DFlash2 drafter: what llama.cpp's convert_hf_to_gguf.py reads, and the script that runs it
LLAMACPP_EAGLE3 = "llamacpp/eagle3"  # the SpecForge checkpoint, f32
LLAMACPP_DFLASH2 = "llamacpp/dflash2"  # z-lab's DFlash2 checkpoint, f32
LLAMACPP_TARGET_CONFIG = "llamacpp/target-config"  # the target's config.json and tokenizer (--target-model-dir)
LLAMACPP_CONVERT = "llamacpp/convert.sh"
LLAMACPP_DFLASH2_VERSION = (
    "a llama.cpp from master after pull request 27816 (August 2026), e.g. the one llama-cpp-python 0.3.36 vendors"
)
# the EAGLE-3 config switches its reader implements (llama.cpp's converter and eagle3 graph, llama-cpp-python
# 0.3.36's)
EAGLE3_SWITCHES_READ = ("norm_before_fc", "norm_before_residual")


def llamacpp_kind_refusal(kind: DrafterKind) -> str | None:
    """Why llama.cpp cannot serve a drafter of this kind (None: it can): a DFlash or DSpark drafter its dflash
    GGUF holds (loopspec/engines/llamacpp.py `dflash_gguf_refusal`: draft-dflash, draft-dspark); a DFlash2
    drafter whose selector lattice its loader builds; an EAGLE-3 drafter whose switches its reader implements
    (both through llama.cpp's own converter)."""
    if kind.name == "eagle3":
        return eagle3_switch_refusal(kind, "llama.cpp", EAGLE3_SWITCHES_READ)
    if kind.name == "dflash2":
        selector = kind.selector
        if selector is not None and selector.width < selector.top_k * (selector.top_k + 1):
            return (
                f"llama.cpp's DFlash2 loader needs a hidden size of at least selector_top_k x (selector_top_k + 1) "
                f"= {selector.top_k * (selector.top_k + 1)} for its selector lattice, and this drafter's is "
                f"{selector.width}"
            )
        return None
    return dflash_gguf_refusal(kind)


def converted_by_llamacpp(kind) -> bool:
    """Whether llama.cpp's own converter writes the drafter's GGUF (EAGLE-3, DFlash2); loopspec writes the
    dflash GGUF of the other block drafters itself (loopspec/engines/llamacpp.py)."""
    return kind.chain or kind.selector is not None


def converter_source(kind) -> str:
    """The drafter checkpoint llama.cpp's converter reads, in the bundle."""
    return LLAMACPP_EAGLE3 if kind.chain else LLAMACPP_DFLASH2


def llamacpp_files(s: LaunchSettings) -> dict[str, str]:
    threads = str(s.threads) if s.threads else "$(nproc 2>/dev/null || echo 4)"
    settings = (
        "# LLAMA_SERVER: the llama-server binary (default: llama-server on PATH; "
        "scripts/build_llama_server.sh builds one)\n"
        'LLAMA_SERVER="${LLAMA_SERVER:-llama-server}"\n'
        f'THREADS="${{THREADS:-{threads}}}"\n'
        'HOST="${HOST:-127.0.0.1}"\n'
        'PORT="${PORT:-8080}"\n'
    )
    # llama.cpp drafts at most the drafter's drafts per block
    argv = llama_server_command(
        "$LLAMA_SERVER",
        f"./{LLAMACPP_TARGET}",
        drafter_gguf=f"./{LLAMACPP_DRAFTER}",
        draft_max=s.drafts,
        threads="$THREADS",
        context=s.max_context,
        host="$HOST",
        port="$PORT",
        spec=spec_type(s.drafter),
    )
    argv += ["--alias", s.name]
    if not converted_by_llamacpp(s.kind):
        return {"llamacpp/launch.sh": launch_script(TITLE, argv, settings)}
    settings += (
        f"[ -f ./{LLAMACPP_DRAFTER} ] || sh ./{LLAMACPP_CONVERT}  # the {_gguf_arch(s.kind)} GGUF, "
        "converted once by llama.cpp's own converter\n"
    )
    return {"llamacpp/launch.sh": launch_script(TITLE, argv, settings), LLAMACPP_CONVERT: convert_script(s.kind)}


def _gguf_arch(kind) -> str:
    return "eagle3" if kind.chain else "dflash"


def convert_script(kind) -> str:
    """The shell script running llama.cpp's convert_hf_to_gguf.py on the drafter's checkpoint."""
    return (
        "#!/bin/sh\n"
        f"# Convert the {kind.title} drafter to llama.cpp's {_gguf_arch(kind)} GGUF with llama.cpp's own converter. "
        "Use the\n"
        "# convert_hf_to_gguf.py of the llama.cpp that built llama-server (scripts/build_llama_server.sh keeps\n"
        "# it under PREFIX/src); it needs torch, numpy, transformers and sentencepiece. Extra flags are passed on.\n"
        "set -eu\n"
        'cd "$(dirname "$0")/.."  # paths below are relative to the bundle root\n'
        'LLAMACPP_CONVERT="${LLAMACPP_CONVERT:-convert_hf_to_gguf.py}"\n'
        'PYTHON="${PYTHON:-python3}"\n'
        f'exec "$PYTHON" "$LLAMACPP_CONVERT" ./{converter_source(kind)} \\\n'
        f"    --target-model-dir ./{LLAMACPP_TARGET_CONFIG} \\\n"
        "    --outtype f32 \\\n"
        f"    --outfile ./{LLAMACPP_DRAFTER} \\\n"
        '    "$@"\n'
    )


def _write_parts(parts: BundleParts, tmp: Path) -> None:
    """The target GGUF's copy and the drafter GGUF (with its reduced draft vocabulary when it has one)."""
    (tmp / "llamacpp").mkdir()
    shutil.copyfile(parts.source.gguf, tmp / LLAMACPP_TARGET)
    if converted_by_llamacpp(parts.drafter.cfg.kind):
        write_converter_sources(parts, tmp)
        return
    shutil.copyfile(cached_drafter_gguf(parts.drafter, parts.drafter_dir, parts.source.gguf), tmp / LLAMACPP_DRAFTER)


def write_converter_sources(parts: BundleParts, tmp: Path) -> None:
    """What llama.cpp's converter reads: the drafter's checkpoint in f32 (an EAGLE-3 drafter in SpecForge's
    layout with its `d2t`, its top-level `eagle_aux_hidden_state_layer_ids` the target layers whose inputs
    llama.cpp extracts; a DFlash2 drafter in z-lab's layout) and the target's config.json and tokenizer files."""
    parts.drafter.save(tmp / converter_source(parts.drafter.cfg.kind), dtype=torch.float32)
    config = tmp / LLAMACPP_TARGET_CONFIG
    config.mkdir(parents=True)
    for name in ("config.json", *TOKENIZER_FILES):
        if (parts.target_dir / name).is_file():
            shutil.copyfile(parts.target_dir / name, config / name)


def _readme_launch(s: LaunchSettings) -> list[str]:
    convert = (
        [
            f" Before its first launch it runs `{LLAMACPP_CONVERT}`: llama.cpp's own `convert_hf_to_gguf.py` "
            "(`$LLAMACPP_CONVERT`, the one of the llama.cpp that built llama-server; `$PYTHON` runs it) writes "
            f"`{LLAMACPP_DRAFTER}` from `{converter_source(s.kind)}/` with `--target-model-dir "
            f"{LLAMACPP_TARGET_CONFIG}`."
        ]
        if converted_by_llamacpp(s.kind)
        else [""]
    )
    return [
        "",
        f"`llamacpp/launch.sh` runs llama-server (`$LLAMA_SERVER`, else `llama-server` on PATH) on "
        f"`{LLAMACPP_TARGET}` (a copy of the target GGUF) with the drafter `{LLAMACPP_DRAFTER}` "
        f"(`--spec-type {spec_type(s.drafter)} --spec-draft-n-max {s.drafts}`); `THREADS`, `HOST` and `PORT` "
        "in the environment set `-t`, `--host` and `--port` (defaults: all cores, 127.0.0.1, 8080)." + convert[0],
    ]


def _readme_uses(s: LaunchSettings) -> list[str]:
    kind = s.kind
    if drafts_in_steps(kind):
        return [
            f"- `{LLAMACPP_EAGLE3}/`: the EAGLE-3 drafter in SpecForge's layout (f32), and "
            f"`{LLAMACPP_TARGET_CONFIG}/`: the target's `config.json` and tokenizer, what llama.cpp's converter "
            f"reads to write `{LLAMACPP_DRAFTER}` (its `eagle3` architecture: `extract_layers` "
            f"{[i + 1 for i in s.target_layer_ids]}, the inputs of those target layers) for `{LLAMACPP_TARGET}`."
        ]
    if kind.selector:
        return [
            f"- `{LLAMACPP_DFLASH2}/`: the DFlash2 drafter in z-lab's layout (f32), and `{LLAMACPP_TARGET_CONFIG}/`: "
            f"the target's `config.json` and tokenizer, what llama.cpp's converter reads to write `{LLAMACPP_DRAFTER}` "
            f"(its `dflash` architecture with the convolutions and the selector: `dflash.selector_top_k` "
            f"{kind.selector.top_k}, `target_layers` {[i + 1 for i in s.target_layer_ids]}) for `{LLAMACPP_TARGET}`; "
            f"it needs {LLAMACPP_DFLASH2_VERSION}."
        ]
    heads = (
        " with its Markov head (`markov_w1`, `markov_w2`)"
        + (" and confidence head (`conf_proj`)" if kind.confidence else "")
        if kind.markov
        else ""
    )
    return [
        f"- `{LLAMACPP_DRAFTER}`: the drafter as a llama.cpp `dflash` GGUF{heads} (f32, the target's "
        f"tokenizer), for `{LLAMACPP_TARGET}`."
    ]


def _reduced_vocab_line(vocab: int) -> str:
    return (
        f"  - llama.cpp: reduced, in `{LLAMACPP_DRAFTER}` (the `d2t` tensor of absolute target ids "
        "and the draft's own `output` head: the target's lm_head rows of the draft tokens)."
    )


def _manifest_entry(s: LaunchSettings) -> dict:
    entry = {
        "target": LLAMACPP_TARGET,
        "drafter": LLAMACPP_DRAFTER,
        "drafter_dtype": "f32",
        "spec_type": spec_type(s.drafter),
        "draft_max": s.drafts,
    }
    if converted_by_llamacpp(s.kind):  # converted at the first launch, by llama.cpp's own converter
        entry.update(
            drafter_source=converter_source(s.kind),
            converter_target_dir=LLAMACPP_TARGET_CONFIG,
            convert=LLAMACPP_CONVERT,
        )
    return entry


LLAMACPP = ServingFramework(
    name="llamacpp",
    title=TITLE,
    target=GGUF_TARGET,
    support=(
        "yes (`--spec-type draft-dflash`)",
        "vanilla Markov head (`draft-dspark`)",
        "chains (`draft-eagle3`, from llama.cpp's own converter)",
        "yes (`draft-dflash`, from llama.cpp's own converter; hidden size >= top-k x (top-k + 1))",
        "no",
        "yes (`d2t` + the draft's own `output` head)",
        "no (the target's own GGUF quantization)",
        "no",
        "no (one process)",
    ),
    launch_files=llamacpp_files,
    write_parts=_write_parts,
    readme_launch=_readme_launch,
    readme_uses=_readme_uses,
    kind_refusal=llamacpp_kind_refusal,
    reduced_vocab_line=_reduced_vocab_line,
    manifest_entry=_manifest_entry,
    reads_checkpoint=converted_by_llamacpp,
    tree_refusal="llama.cpp's draft-eagle3 drafts a chain of up to --spec-draft-n-max tokens: it has no draft tree",
)
