"""Run vLLM's and SGLang's own configuration code on serving bundles (called by check_bundles.sh,
inside its scratch environment, which has the engines but not loopspec), and read back the eagle3 or
dflash GGUF llama.cpp's own converter wrote for an EAGLE-3 or DFlash2 bundle.

    python scripts/check_bundles_parsers.py BUNDLE_DIR [BUNDLE_DIR ...]

For each bundle and engine: parse the bundle's launch.sh exactly as the engine's own command line
would, build the engine's configuration from it, and compare what the engine resolved with what the
bundle's manifest.json says. One line per check, PASS or FAIL with the reason; exit 1 on a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import traceback
from pathlib import Path


def launch_argv(script: Path) -> list[str]:
    """The argv of a launch script's `exec` line (continuation lines joined, "$@" dropped)."""
    text = script.read_text().replace("\\\n", " ")
    line = next(l for l in text.splitlines() if l.startswith("exec "))
    return [a for a in shlex.split(line)[1:] if a != "$@"]


def expect(what: str, got, want) -> None:
    if got != want:
        raise AssertionError(f"{what} is {got!r}, the bundle says {want!r}")


def check_vllm(bundle: Path, manifest: dict) -> str:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm.config import SpeculativeConfig

    argv = launch_argv(bundle / "vllm" / "launch.sh")
    assert argv[:2] == ["vllm", "serve"], argv[:2]
    vllm = manifest.get("vllm", {"method": "dflash", "num_speculative_tokens": manifest["block_size"] - 1})
    adaptive = vllm.get("enable_adaptive_verification", False)
    cpu_note = ""
    if adaptive:
        # vLLM accepts adaptive verification with full CUDA graphs only, which its CPU platform never has:
        # the field is checked to be SpeculativeConfig's, then the rest of the line without it
        expect(
            "SpeculativeConfig has enable_adaptive_verification",
            "enable_adaptive_verification" in SpeculativeConfig.__dataclass_fields__,
            True,
        )
        i = argv.index("--speculative-config") + 1
        spec_json = json.loads(argv[i])
        expect("enable_adaptive_verification in the launch line", spec_json.pop("enable_adaptive_verification"), True)
        argv[i] = json.dumps(spec_json)
        cpu_note = (
            " (enable_adaptive_verification: a SpeculativeConfig field; it needs full CUDA graphs,"
            " checked without it here)"
        )
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[2:])
    args.model = args.model_tag  # what `vllm serve MODEL` does with its positional argument
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    spec = config.speculative_config
    # a DSpark drafter of DeepSpec's convention: method dspark, one draft per block position
    expect("speculative method", spec.method, vllm["method"])
    expect("num_speculative_tokens", spec.num_speculative_tokens, vllm["num_speculative_tokens"])
    draft_config = spec.draft_model_config.hf_config
    if vllm["method"] == "dspark":  # vLLM's own Qwen3 DSpark model, not its DeepSeek-V4 one
        expect("draft architectures", list(draft_config.architectures), ["Qwen3DSparkModel"])
    dflash2 = ""
    if manifest["drafter_kind"] == "DFlash2":  # method dflash, its DFlash2 model picked from the architecture
        expect("draft architectures", list(draft_config.architectures), ["DFlash2DraftModel"])
        expect("a DFlash candidate-head draft (vLLM's DFlash2 speculator)", config._is_dflash_candidate_draft(), True)
        expect("V2 model runner (the only one with the candidate head)", config.use_v2_model_runner, True)
        written = json.loads((bundle / "drafter" / "config.json").read_text())["dflash_config"]
        fields = (
            "conv_kernel_size",
            "conv_group_size",
            "selector_rank",
            "selector_top_k",
            "mask_token_id",
            "target_layer_ids",
        )
        for name in fields:  # vLLM's DFlash2 model reads these from dflash_config only
            expect(f"dflash_config.{name}", draft_config.dflash_config.get(name), written[name])
        dflash2 = (
            f", DFlash2DraftModel on the V2 runner, conv {draft_config.dflash_config['conv_kernel_size']} taps / "
            f"groups of {draft_config.dflash_config['conv_group_size']}, selector rank "
            f"{draft_config.dflash_config['selector_rank']} top-k {draft_config.dflash_config['selector_top_k']}"
        )
    if vllm["method"] == "eagle3":  # its LlamaForCausalLMEagle3 model, the taps as the stream entering layer j
        expect("draft architectures", list(draft_config.architectures), ["LlamaForCausalLMEagle3"])
        expect(
            "aux hidden state layers",
            list(draft_config.eagle_aux_hidden_state_layer_ids),
            [i + 1 for i in manifest["target_layer_ids"]],
        )
    expect("tensor_parallel_size", config.parallel_config.tensor_parallel_size, manifest["tensor_parallel_size"])
    target_type = json.loads((bundle / "target" / "config.json").read_text())["model_type"]
    expect("target model type", config.model_config.hf_config.model_type, target_type)
    expect("max_model_len", config.model_config.max_model_len, manifest["max_context"])
    expect("max_num_seqs", config.scheduler_config.max_num_seqs, manifest["max_batch_size"])
    expect("served model name", config.model_config.served_model_name, manifest["served_model_name"])
    draft_vocab = getattr(draft_config, "draft_vocab_size", None)
    if draft_vocab in (None, config.model_config.get_vocab_size()):  # EAGLE-3's config always names one
        draft_vocab = "full"
    expect("draft vocabulary", draft_vocab, manifest["draft_vocab"]["vllm"])
    quantization = config.model_config.quantization
    return (
        f"{target_type} target, {spec.method} k={spec.num_speculative_tokens}, "
        f"tp={config.parallel_config.tensor_parallel_size}, "
        f"max_model_len={config.model_config.max_model_len}, draft vocab {draft_vocab}, "
        f"quantization {quantization}{dflash2}{cpu_note}"
    )


def sglang_server_args(bundle: Path):
    from sglang.srt.server_args import prepare_server_args

    argv = launch_argv(bundle / "sglang" / "launch.sh")
    assert argv[:3] == ["python", "-m", "sglang.launch_server"], argv[:3]
    return prepare_server_args(argv[3:])


def check_sglang_server_args(bundle: Path, manifest: dict) -> str:
    server_args = sglang_server_args(bundle)
    convention = manifest["block_convention"]
    if convention == "eagle3":  # EAGLE3: the chain's steps with topk 1, or the tree's nodes beside the root
        nodes, drafts = manifest["draft_tree_nodes"], manifest["drafts_per_block"]
        expect("speculative algorithm", server_args.speculative_algorithm, "EAGLE3")
        expect("speculative_num_draft_tokens", server_args.speculative_num_draft_tokens, (nodes or drafts) + 1)
        expect("speculative_num_steps", server_args.speculative_num_steps, min(drafts, nodes) if nodes else drafts)
        if not nodes:
            expect("speculative_eagle_topk", server_args.speculative_eagle_topk, 1)
        topk, steps = server_args.speculative_eagle_topk, server_args.speculative_num_steps
        # organize_draft_results picks the nodes from topk + (steps - 1) * topk^2 candidates
        assert nodes <= topk + (steps - 1) * topk * topk, (nodes, topk, steps)
    else:
        # a DSpark drafter of DeepSpec's convention: DSPARK, gamma = its drafts per block, verify window gamma + 1
        dspark = convention == "deepspec"
        expect("speculative algorithm", server_args.speculative_algorithm, "DSPARK" if dspark else "DFLASH")
        expect(
            "speculative_num_draft_tokens",
            server_args.speculative_num_draft_tokens,
            manifest["drafts_per_block"] + 1 if dspark else manifest["block_size"],
        )
    expect("tp_size", server_args.tp_size, manifest["tensor_parallel_size"])
    expect("context_length", server_args.context_length, manifest["max_context"])
    expect("max_running_requests", server_args.max_running_requests, manifest["max_batch_size"])
    expect("served model name", server_args.served_model_name, manifest["served_model_name"])
    tree = (
        f"{server_args.speculative_num_steps} steps, topk {server_args.speculative_eagle_topk}, "
        if convention == "eagle3"
        else ""
    )
    return (
        f"{server_args.speculative_algorithm} {server_args.speculative_num_draft_tokens} tokens, {tree}"
        f"tp={server_args.tp_size}, "
        f"context {server_args.context_length}, drafter quantization "
        f"{server_args.speculative_draft_model_quantization}"
    )


def require_torchvision() -> None:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "SGLang's config package imports torchvision (sglang/srt/configs/__init__.py -> "
            "nano_nemotron_vl -> multimodal/internvl_utils.py) and no CPU torchvision "
            "0.28 is installed"
        ) from None


def check_sglang_model_config(bundle: Path, manifest: dict) -> str:
    require_torchvision()
    from sglang.srt.configs.model_config import ModelConfig

    server_args = sglang_server_args(bundle)
    target = ModelConfig.from_server_args(server_args)
    draft = ModelConfig.from_server_args(
        server_args, model_path=server_args.speculative_draft_model_path, is_draft_model=True
    )
    expect("target context length", target.context_len, manifest["max_context"])
    target_type = json.loads((bundle / "target" / "config.json").read_text())["model_type"]
    expect("target model type", target.hf_config.model_type, target_type)
    expect("drafter vocabulary", draft.vocab_size, target.vocab_size)
    return (
        f"{target_type} target, context {target.context_len}, quantization {target.quantization}; "
        f"drafter vocab {draft.vocab_size}"
    )


def check_sglang_dflash2_config(bundle: Path, manifest: dict) -> str:
    """SGLang's own DFLASH draft-config parser on drafter/ (what its DFlash2DraftModel is built from) and its
    per-layer attention (layer types, window)."""
    require_torchvision()  # sglang.srt.speculative imports sglang.srt.configs
    from sglang.srt.speculative.dflash_utils import (
        get_dflash_attention_sliding_window_size,
        get_dflash_layer_types,
        parse_dflash_draft_config,
    )
    from transformers import AutoConfig

    draft_config = AutoConfig.from_pretrained(str(bundle / "drafter"))
    parsed = parse_dflash_draft_config(draft_hf_config=draft_config)
    written = json.loads((bundle / "drafter" / "config.json").read_text())
    draft = written["dflash_config"]
    expect("draft architectures", list(draft_config.architectures), ["DFlash2DraftModel"])
    for name in (
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
        "mask_token_id",
        "block_size",
    ):
        expect(name, getattr(parsed, name), draft[name])
    expect("target_layer_ids", parsed.target_layer_ids, manifest["target_layer_ids"])
    window = get_dflash_attention_sliding_window_size(draft_config)
    expect(
        "window (SGLang's window_left: the HF window less the query)",
        window,
        written["sliding_window"] - 1 if "sliding_attention" in written.get("layer_types", []) else None,
    )
    return (
        f"DFlash2DraftModel: block {parsed.block_size}, conv {parsed.conv_kernel_size} taps / groups of "
        f"{parsed.conv_group_size}, selector rank {parsed.selector_rank} top-k {parsed.selector_top_k}, "
        f"layers {list(get_dflash_layer_types(draft_config))}, window_left {window}"
    )


def check_llamacpp_dflash2(bundle: Path, manifest: dict) -> str:
    """The dflash GGUF llama.cpp's converter wrote from a DFlash2 bundle (check_bundles.sh ran convert.sh): its
    architecture, the convolution and selector keys, the taps (+1) and the selector's tensors."""
    from gguf import GGUFReader

    entry = manifest["llamacpp"]
    reader = GGUFReader(str(bundle / entry["drafter"]))
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    draft = json.loads((bundle / entry["drafter_source"] / "config.json").read_text())["dflash_config"]
    expect("architecture", field("general.architecture"), "dflash")
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "block_size"):
        expect(f"dflash.{name}", field(f"dflash.{name}"), draft[name])
    expect(
        "target layers (inputs of)", list(field("dflash.target_layers")), [i + 1 for i in manifest["target_layer_ids"]]
    )
    names = {t.name for t in reader.tensors}
    expect(
        "selector tensors",
        {"selector_hidden.weight", "selector_predecessor.weight", "selector_successor.weight"} <= names,
        True,
    )
    expect("spec type", entry["spec_type"], "draft-dflash")
    return (
        f"dflash GGUF with the selector (top-k {field('dflash.selector_top_k')}, "
        f"rank {field('dflash.selector_rank')}), "
        f"conv {field('dflash.conv_kernel_size')} taps, target layers {list(field('dflash.target_layers'))}, "
        f"{len(reader.tensors)} tensors"
    )


def check_llamacpp_eagle3(bundle: Path, manifest: dict) -> str:
    """The eagle3 GGUF llama.cpp's converter wrote from the bundle (check_bundles.sh ran llamacpp/convert.sh):
    its architecture, the target layers whose inputs llama-server extracts, and d2t as absolute target ids."""
    import numpy as np
    from gguf import GGUFReader
    from safetensors.numpy import load_file

    entry = manifest["llamacpp"]
    reader = GGUFReader(str(bundle / entry["drafter"]))
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    expect("architecture", field("general.architecture"), "eagle3")
    expect(
        "target layers (inputs of)", list(field("eagle3.target_layers")), [i + 1 for i in manifest["target_layer_ids"]]
    )
    d2t = next(t for t in reader.tensors if t.name == "d2t")
    offsets = load_file(str(bundle / entry["drafter_source"] / "model.safetensors"))["d2t"]
    expect("d2t (absolute target ids)", np.asarray(d2t.data).tolist(), (offsets + np.arange(offsets.size)).tolist())
    expect("spec type", entry["spec_type"], "draft-eagle3")
    return (
        f"eagle3 GGUF, target layers {list(field('eagle3.target_layers'))}, draft vocab {d2t.data.size}, "
        f"{len(reader.tensors)} tensors"
    )


# (engine, what runs, check)
CHECKS = [
    ("vllm", "make_arg_parser -> AsyncEngineArgs.create_engine_config", check_vllm),
    ("sglang", "prepare_server_args", check_sglang_server_args),
    ("sglang", "ModelConfig (target and drafter)", check_sglang_model_config),
    ("sglang", "parse_dflash_draft_config (drafter)", check_sglang_dflash2_config),
    ("llamacpp", "convert_hf_to_gguf.py's eagle3 GGUF", check_llamacpp_eagle3),
    ("llamacpp", "convert_hf_to_gguf.py's dflash GGUF", check_llamacpp_dflash2),
]


def applies(check, manifest: dict) -> bool:
    """Whether a check is for this bundle: its engine is in it, and the drafter-specific checks for their kind."""
    engine, _, function = check
    if engine not in manifest["engines"]:
        return False
    if function in (check_sglang_dflash2_config, check_llamacpp_dflash2):
        return manifest["drafter_kind"] == "DFlash2"
    if function is check_llamacpp_eagle3:
        return manifest["block_convention"] == "eagle3"
    return engine != "llamacpp"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundles", nargs="+", type=Path, help="serving bundles (`loopspec convert bundle --out DIR`)")
    args = parser.parse_args(argv)
    failures = 0
    for bundle in args.bundles:
        manifest = json.loads((bundle / "manifest.json").read_text())
        label = f"{bundle.name} ({manifest['precision']}, tp={manifest['tensor_parallel_size']})"
        for engine, what, check in [c for c in CHECKS if applies(c, manifest)]:
            cwd = Path.cwd()
            os.chdir(bundle)  # the launch lines use paths relative to the bundle root
            try:
                print(f"PASS {engine} {label}: {what}: {check(bundle.resolve(), manifest)}", flush=True)
            except BaseException as e:  # an engine's own parser may also exit (SystemExit)
                failures += 1
                where = traceback.extract_tb(e.__traceback__)[-1]
                print(
                    f"FAIL {engine} {label}: {what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                    f"({Path(where.filename).name}:{where.lineno})",
                    flush=True,
                )
            finally:
                os.chdir(cwd)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
