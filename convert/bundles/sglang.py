"""SGLang: sglang.launch_server on the HF checkpoint with the z-lab drafter.

Facts this module relies on (docs.sglang.io speculative decoding; z-lab model cards; re-check on
upgrades): `python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH
--speculative-draft-model-path DRAFTER --speculative-num-draft-tokens k` (the block size, anchor
included; newer releases also spell it `--speculative-dflash-block-size` and require both to agree
when both are set), `--tp-size N`, `--context-length`, `--max-running-requests`,
`--served-model-name`; `--speculative-draft-model-quantization unquant` keeps the drafter unquantized
when the target is.
"""

from __future__ import annotations

from loopspec.convert.bundles.common import HF_TARGET, LaunchSettings, ServingFramework, launch_script

TITLE = "SGLang"


def sglang_files(s: LaunchSettings) -> dict[str, str]:
    argv = ["python", "-m", "sglang.launch_server", "--model-path", "./target", "--served-model-name", s.name,
            "--tp-size", str(s.tp), "--context-length", str(s.max_context),
            "--max-running-requests", str(s.max_batch_size), "--speculative-algorithm", "DFLASH",
            "--speculative-draft-model-path", "./drafter", "--speculative-num-draft-tokens", str(s.block_size)]
    if s.precision is not None:  # SGLang quantizes the drafter like the target unless told otherwise
        argv += ["--speculative-draft-model-quantization", "unquant"]
    return {"sglang/launch.sh": launch_script(TITLE, argv)}


SGLANG = ServingFramework(
    name="sglang", title=TITLE, target=HF_TARGET,
    support=("yes (`DFLASH`)", "no", "no (full vocab)", "yes (modelopt checkpoint)", "Blackwell only",
             "yes (`--tp-size`)"),
    launch_files=sglang_files,
    full_vocab_reason=("SGLang's DFLASH drafter has no lm_head of its own: it drafts with the target's lm_head over "
                       "the full vocabulary and ignores a d2t tensor."))
