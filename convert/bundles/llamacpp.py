"""llama.cpp: llama-server on the target GGUF (a copy in the bundle) with the drafter as a llama.cpp
`dflash` GGUF (a DSpark drafter with its heads, run as draft-dspark).

The GGUF format and the llama-server command line (the version vendored by llama-cpp-python 0.3.36)
are loopspec/engines/llamacpp.py's; which drafter kinds llama.cpp takes is stated in
loopspec/model/drafter_kinds.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from loopspec.convert.bundles.common import GGUF_TARGET, BundleParts, LaunchSettings, ServingFramework, launch_script
from loopspec.engines.llamacpp import cached_drafter_gguf, llama_server_command, spec_type

TITLE = "llama.cpp"
LLAMACPP_TARGET = "llamacpp/target.gguf"
LLAMACPP_DRAFTER = "llamacpp/drafter.gguf"  # f32, with the reduced draft vocabulary when it has one


def llamacpp_files(s: LaunchSettings) -> dict[str, str]:
    threads = str(s.threads) if s.threads else "$(nproc 2>/dev/null || echo 4)"
    settings = ("# LLAMA_SERVER: the llama-server binary (default: llama-server on PATH; "
                "scripts/build_llama_server.sh builds one)\n"
                'LLAMA_SERVER="${LLAMA_SERVER:-llama-server}"\n'
                f'THREADS="${{THREADS:-{threads}}}"\n'
                'HOST="${HOST:-127.0.0.1}"\n'
                'PORT="${PORT:-8080}"\n')
    # llama.cpp drafts at most the drafter's drafts per block
    argv = llama_server_command("$LLAMA_SERVER", f"./{LLAMACPP_TARGET}", drafter_gguf=f"./{LLAMACPP_DRAFTER}",
                                draft_max=s.drafts, threads="$THREADS", context=s.max_context,
                                host="$HOST", port="$PORT", spec=spec_type(s.drafter))
    argv += ["--alias", s.name]
    return {"llamacpp/launch.sh": launch_script(TITLE, argv, settings)}


def _write_parts(parts: BundleParts, tmp: Path) -> None:
    """The target GGUF's copy and the drafter GGUF (with its reduced draft vocabulary when it has one)."""
    (tmp / "llamacpp").mkdir()
    shutil.copyfile(parts.source.gguf, tmp / LLAMACPP_TARGET)
    shutil.copyfile(cached_drafter_gguf(parts.drafter, parts.drafter_dir, parts.source.gguf), tmp / LLAMACPP_DRAFTER)


def _readme_launch(s: LaunchSettings) -> list[str]:
    return ["", f"`llamacpp/launch.sh` runs llama-server (`$LLAMA_SERVER`, else `llama-server` on PATH) on "
            f"`{LLAMACPP_TARGET}` (a copy of the target GGUF) with the drafter `{LLAMACPP_DRAFTER}` "
            f"(`--spec-type {spec_type(s.drafter)} --spec-draft-n-max {s.drafts}`); `THREADS`, `HOST` and `PORT` "
            "in the environment set `-t`, `--host` and `--port` (defaults: all cores, 127.0.0.1, 8080)."]


def _readme_uses(s: LaunchSettings) -> list[str]:
    kind = s.kind
    heads = (" with its Markov head (`markov_w1`, `markov_w2`)" + (" and confidence head (`conf_proj`)"
                                                                    if kind.confidence else "")
             if kind.markov else "")
    return [f"- `{LLAMACPP_DRAFTER}`: the drafter as a llama.cpp `dflash` GGUF{heads} (f32, the target's "
            f"tokenizer), for `{LLAMACPP_TARGET}`."]


def _reduced_vocab_line(vocab: int) -> str:
    return (f"  - llama.cpp: reduced, in `{LLAMACPP_DRAFTER}` (the `d2t` tensor of absolute target ids "
            "and the draft's own `output` head: the target's lm_head rows of the draft tokens).")


def _manifest_entry(s: LaunchSettings) -> dict:
    return {"target": LLAMACPP_TARGET, "drafter": LLAMACPP_DRAFTER, "drafter_dtype": "f32",
            "spec_type": spec_type(s.drafter), "draft_max": s.drafts}


LLAMACPP = ServingFramework(
    name="llamacpp", title=TITLE, target=GGUF_TARGET,
    support=("yes (`--spec-type draft-dflash`)", "vanilla Markov head (`draft-dspark`)", "no",
             "yes (`d2t` + the draft's own `output` head)",
             "no (the target's own GGUF quantization)", "no", "no (one process)"),
    launch_files=llamacpp_files, write_parts=_write_parts, readme_launch=_readme_launch, readme_uses=_readme_uses,
    reduced_vocab_line=_reduced_vocab_line, manifest_entry=_manifest_entry)
