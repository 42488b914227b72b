"""Serving bundles for TensorRT-LLM, vLLM and SGLang: structure, keys against each engine's documented
schema, launch commands, drafter round trip, --tp, bad inputs. (The engines themselves need GPUs and
are not run here.)"""

import json
import shlex
import shutil
import subprocess

import pytest
import torch

from conftest import save_tiny_target, save_tiny_tokenizer
from loopspec.convert.bundles import build_bundle, parse_frameworks
from loopspec.errors import LoopspecError
from loopspec.model.dflash import Drafter
from loopspec.weights import file_sha256, load_target_dir, read_safetensors, write_safetensors

# Documented field names (TensorRT-LLM LLM API reference: DFlashDecodingConfig, CudaGraphConfig, LlmArgs;
# vLLM SpeculativeConfig). A bundle key outside these would be rejected or ignored by the engine.
TRTLLM_DFLASH_FIELDS = {
    "max_draft_len",
    "max_total_draft_tokens",
    "speculative_model",
    "max_concurrency",
    "draft_len_schedule",
    "load_format",
    "acceptance_rate_window_size",
    "acceptance_rate_threshold",
    "use_rejection_sampling",
    "allow_advanced_sampling",
    "advanced_sampling_mode",
    "enable_penalty",
    "mask_token_id",
    "target_layer_ids",
    "decoding_type",
    "attention_backend",
}
TRTLLM_CUDA_GRAPH_FIELDS = {"batch_sizes", "max_batch_size", "enable_padding"}
TRTLLM_TOP_LEVEL = {
    "tensor_parallel_size",
    "max_batch_size",
    "max_seq_len",
    "max_num_tokens",
    "cuda_graph_config",
    "speculative_config",
}
VLLM_SPECULATIVE_FIELDS = {
    "method",
    "model",
    "num_speculative_tokens",
    "quantization",
    "max_model_len",
    "draft_tensor_parallel_size",
    "revision",
    "attention_backend",
    "enable_adaptive_verification",
}
# TensorRT-LLM LLM API reference, DSparkDecodingConfig as of 1.3.0rc27 (the first release that has it)
TRTLLM_DSPARK_FIELDS = {
    "max_draft_len",
    "max_total_draft_tokens",
    "speculative_model",
    "max_concurrency",
    "draft_len_schedule",
    "load_format",
    "acceptance_rate_window_size",
    "acceptance_rate_threshold",
    "use_rejection_sampling",
    "allow_advanced_sampling",
    "advanced_sampling_mode",
    "enable_penalty",
    "mask_token_id",
    "target_layer_ids",
    "block_size",
    "markov_rank",
    "markov_head_type",
    "decoding_type",
    "attention_backend",
}
# ... and what 1.4.0rc4 adds for confidence scheduling: files a bundle cannot measure, so never written
TRTLLM_DSPARK_CONFIDENCE_FIELDS = {
    "enable_confidence_scheduling",
    "confidence_cost_table_path",
    "confidence_calibration_path",
    "confidence_min_predicted_gain",
    "enable_fused_confidence_scheduler",
}


def launch_argv(path):
    """The argv of the `exec` line of a launch script (continuation lines joined)."""
    text = path.read_text().replace("\\\n", " ")
    line = next(l for l in text.splitlines() if l.startswith("exec "))
    return shlex.split(line)[1:]


def flag(argv, name):
    return argv[argv.index(name) + 1]


@pytest.fixture(scope="module")
def bundle(tiny_pair, tmp_path_factory):
    target_dir, drafter_dir = tiny_pair
    out = tmp_path_factory.mktemp("bundle") / "all"
    manifest = build_bundle(str(target_dir), str(drafter_dir), out, "all", tp=2)
    return out, manifest


def test_structure_and_manifest(bundle, tiny_pair):
    out, manifest = bundle
    for rel in (
        "drafter/config.json",
        "drafter/model.safetensors",
        "target/config.json",
        "target/model.safetensors",
        "target/tokenizer.json",
        "target/tokenizer_config.json",
        "trtllm/extra_llm_api_options.yaml",
        "trtllm/launch.sh",
        "vllm/launch.sh",
        "sglang/launch.sh",
        "README.md",
        "manifest.json",
    ):
        assert (out / rel).is_file(), rel
    assert not (out / "drafter" / "d2t.safetensors").exists() and not (out / "vllm" / "drafter").exists()
    assert manifest["engines"] == ["trtllm", "vllm", "sglang"]
    assert manifest["tensor_parallel_size"] == 2
    assert manifest["draft_vocab"] == {"trtllm": "full", "vllm": "full", "sglang": "full"}
    assert manifest["trained_draft_vocab_size"] is None and manifest["full_draft_vocab_reasons"] == {}
    assert manifest["served_model_name"] == "target"  # the target's folder name
    assert (manifest["max_batch_size"], manifest["max_context"]) == (8, 512)  # 4096 capped at the target's 512
    listed = set(manifest["files"])
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {"manifest.json"}
    assert listed == on_disk
    for rel, sha in manifest["files"].items():
        assert file_sha256(out / rel) == sha, rel
    assert manifest["sources"]["drafter_files"]["model.safetensors"] == file_sha256(tiny_pair[1] / "model.safetensors")
    assert {"loopspec", "torch", "transformers"} <= set(manifest["tools"])
    assert json.loads((out / "manifest.json").read_text()) == manifest


def test_trtllm_yaml_matches_the_documented_schema(bundle):
    import yaml

    out, _ = bundle
    drafter = Drafter.load(out / "drafter")
    options = yaml.safe_load((out / "trtllm" / "extra_llm_api_options.yaml").read_text())
    assert set(options) <= TRTLLM_TOP_LEVEL
    spec = options["speculative_config"]
    assert set(spec) <= TRTLLM_DFLASH_FIELDS
    assert spec["decoding_type"] == "DFlash"
    assert spec["max_draft_len"] == drafter.cfg.block_size - 1
    assert spec["mask_token_id"] == drafter.cfg.mask_token_id == 127
    assert spec["target_layer_ids"] == drafter.cfg.target_layer_ids
    assert (out / spec["speculative_model"]).resolve() == (out / "drafter").resolve()
    assert set(options["cuda_graph_config"]) <= TRTLLM_CUDA_GRAPH_FIELDS
    assert options["cuda_graph_config"]["enable_padding"] is True
    assert options["tensor_parallel_size"] == 2
    # sized by default for 8 requests of the target's whole 512 positions, not TensorRT-LLM's 2048 requests
    assert options["max_batch_size"] == options["cuda_graph_config"]["max_batch_size"] == 8
    assert options["max_seq_len"] == 512 and options["max_num_tokens"] == 512


def test_launch_commands_carry_the_documented_flags(bundle):
    out, _ = bundle
    block = Drafter.load(out / "drafter").cfg.block_size

    trt = launch_argv(out / "trtllm" / "launch.sh")
    assert trt[:2] == ["trtllm-serve", "./target"]
    assert flag(trt, "--backend") == "pytorch" and flag(trt, "--served-model-name") == "target"
    assert (out / flag(trt, "--extra_llm_api_options")).is_file()
    # tensor parallelism only in the YAML, which trtllm-serve applies over its own flags
    assert not {"--tp_size", "--tensor_parallel_size"} & set(trt)

    vllm = launch_argv(out / "vllm" / "launch.sh")
    assert vllm[:3] == ["vllm", "serve", "./target"]
    assert flag(vllm, "--tensor-parallel-size") == "2" and flag(vllm, "--served-model-name") == "target"
    assert flag(vllm, "--max-model-len") == "512" and flag(vllm, "--max-num-seqs") == "8"
    spec = json.loads(flag(vllm, "--speculative-config"))
    assert set(spec) <= VLLM_SPECULATIVE_FIELDS
    assert spec == {"method": "dflash", "model": "./drafter", "num_speculative_tokens": block - 1}

    sgl = launch_argv(out / "sglang" / "launch.sh")
    assert sgl[:3] == ["python", "-m", "sglang.launch_server"]
    assert flag(sgl, "--model-path") == "./target" and flag(sgl, "--tp-size") == "2"
    assert flag(sgl, "--served-model-name") == "target"
    assert flag(sgl, "--context-length") == "512" and flag(sgl, "--max-running-requests") == "8"
    assert flag(sgl, "--speculative-algorithm") == "DFLASH"
    assert flag(sgl, "--speculative-draft-model-path") == "./drafter"
    assert flag(sgl, "--speculative-num-draft-tokens") == str(block)  # SGLang counts the anchor
    assert "--speculative-draft-model-quantization" not in sgl  # unquantized target: nothing to undo
    assert "--speculative-dspark-block-size" not in sgl  # a z-lab DFlash drafter: DFLASH only

    for engine in ("trtllm", "vllm", "sglang"):
        script = out / engine / "launch.sh"
        assert script.stat().st_mode & 0o111
        assert subprocess.run(["sh", "-n", str(script)]).returncode == 0
        assert script.read_text().rstrip().endswith('"$@"')


def test_drafter_and_target_round_trip(tiny_pair, tmp_path):
    target_dir, drafter_dir = tiny_pair
    out = tmp_path / "fp32"
    build_bundle(str(target_dir), str(drafter_dir), out, "vllm", dtype="float32")
    source, loaded = Drafter.load(drafter_dir), Drafter.load(out / "drafter")
    assert loaded.cfg.to_zlab() == source.cfg.to_zlab()
    for (name, a), (_, b) in zip(source.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    original, copied = load_target_dir(target_dir), load_target_dir(out / "target")
    for (name, a), (_, b) in zip(original.state_dict().items(), copied.state_dict().items()):
        assert torch.equal(a, b), name
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "drafter", "manifest.json", "target", "vllm"]


def test_default_dtype_is_bfloat16(bundle, tiny_pair):
    out, _ = bundle
    assert json.loads((out / "target" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert json.loads((out / "drafter" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    weights = read_safetensors(out / "target" / "model.safetensors")
    source = read_safetensors(tiny_pair[0] / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert all(torch.equal(weights[k], source[k].to(torch.bfloat16)) for k in source)


def reduced_vocab_drafter(drafter_dir, directory, draft_ids):
    """A copy of `drafter_dir` trained (as loopspec records it) on the draft vocabulary `draft_ids`."""
    shutil.copytree(drafter_dir, directory)
    write_safetensors({"d2t": draft_ids - torch.arange(draft_ids.numel())}, directory / "d2t.safetensors")
    cfg = json.loads((directory / "config.json").read_text())
    cfg["loopspec"] = {"draft_vocab_size": draft_ids.numel()}
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def test_reduced_vocab_drafter_is_kept_for_vllm_and_stripped_for_the_others(tiny_pair, tmp_path):
    target_dir, drafter_dir = tiny_pair
    draft_ids = torch.tensor([2, 5, 9, 40, 100])
    src = reduced_vocab_drafter(drafter_dir, tmp_path / "drafter_d2t", draft_ids)
    out = tmp_path / "b"
    manifest = build_bundle(str(target_dir), str(src), out, "all")

    # drafter/ (TensorRT-LLM, SGLang): the full vocabulary, no trace of the reduced one
    assert sorted(p.name for p in (out / "drafter").iterdir()) == ["config.json", "model.safetensors"]
    full_cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert "draft_vocab_size" not in full_cfg and "draft_vocab_size" not in full_cfg.get("loopspec", {})
    assert Drafter.load(out / "drafter").draft_ids is None

    # vllm/drafter/: what vLLM's DFlash model reads for a reduced vocabulary
    vllm_dir = out / "vllm" / "drafter"
    vllm_cfg = json.loads((vllm_dir / "config.json").read_text())
    assert vllm_cfg["draft_vocab_size"] == 5 and vllm_cfg["vocab_size"] == 128  # the target's vocabulary
    d2t = read_safetensors(vllm_dir / "d2t.safetensors")["d2t"]
    assert d2t.dtype == torch.int64 and torch.equal(torch.arange(5) + d2t, draft_ids)  # target id = draft id + d2t
    head = read_safetensors(vllm_dir / "lm_head.safetensors")["lm_head.weight"]
    tied_embedding = read_safetensors(target_dir / "model.safetensors")["model.embed_tokens.weight"]  # tiny llama ties
    assert head.dtype == torch.bfloat16 and torch.equal(head, tied_embedding[draft_ids].to(torch.bfloat16))
    assert (vllm_dir / "model.safetensors").read_bytes() == (out / "drafter" / "model.safetensors").read_bytes()
    assert torch.equal(Drafter.load(vllm_dir).draft_ids, draft_ids)  # loopspec reads it back too

    # each launch points at the drafter it can use
    assert (
        json.loads(flag(launch_argv(out / "vllm" / "launch.sh"), "--speculative-config"))["model"] == "./vllm/drafter"
    )
    assert flag(launch_argv(out / "sglang" / "launch.sh"), "--speculative-draft-model-path") == "./drafter"
    import yaml

    options = yaml.safe_load((out / "trtllm" / "extra_llm_api_options.yaml").read_text())
    assert options["speculative_config"]["speculative_model"] == "./drafter"

    assert manifest["trained_draft_vocab_size"] == 5
    assert manifest["draft_vocab"] == {"trtllm": "full", "vllm": 5, "sglang": "full"}
    reasons = manifest["full_draft_vocab_reasons"]
    assert set(reasons) == {"trtllm", "sglang"}
    assert "lm_head" in reasons["trtllm"] and "draft_vocab_size" in reasons["trtllm"] and "lm_head" in reasons["sglang"]
    readme = (out / "README.md").read_text()
    assert "reduced draft vocabulary of 5 tokens" in readme and "`vllm/drafter/`" in readme
    assert reasons["trtllm"] in readme and reasons["sglang"] in readme and "DLoop" in readme


def test_reduced_vocab_without_vllm_is_stripped_with_its_reason(tiny_pair, tmp_path):
    target_dir, drafter_dir = tiny_pair
    src = reduced_vocab_drafter(drafter_dir, tmp_path / "drafter_d2t", torch.tensor([2, 5, 9]))
    out = tmp_path / "b"
    manifest = build_bundle(str(target_dir), str(src), out, "sglang")
    assert not (out / "vllm").exists() and not (out / "drafter" / "d2t.safetensors").exists()
    assert manifest["draft_vocab"] == {"sglang": "full"}
    assert list(manifest["full_draft_vocab_reasons"]) == ["sglang"]
    assert manifest["full_draft_vocab_reasons"]["sglang"] in (out / "README.md").read_text()


def test_untied_target_lm_head_rows(tiny_targets):
    from loopspec.convert.bundles.vllm import target_lm_head

    qwen3 = tiny_targets["qwen3"]  # untied: its own lm_head.weight
    assert torch.equal(
        target_lm_head(qwen3, tied=False), read_safetensors(qwen3 / "model.safetensors")["lm_head.weight"]
    )


def test_target_config_carries_rope_theta_beside_rope_parameters(tmp_path):
    from loopspec.model.dflash import DrafterConfig
    from loopspec.weights import load_target_dir

    target_dir = save_tiny_target(
        "llama", tmp_path / "target", rope_scaling={"rope_type": "default", "rope_theta": 123456.0}
    )
    save_tiny_tokenizer(target_dir)
    source = json.loads((target_dir / "config.json").read_text())
    assert source.get("rope_theta") is None and source["rope_parameters"]["rope_theta"] == 123456.0
    cfg = DrafterConfig.for_target(load_target_dir(target_dir).cfg, num_layers=1, block_size=4, mask_token_id=127)
    Drafter(cfg).save(tmp_path / "drafter")
    out = tmp_path / "b"
    build_bundle(str(target_dir), str(tmp_path / "drafter"), out, "vllm")
    exported = json.loads((out / "target" / "config.json").read_text())
    # a transformers-4 reader takes θ from rope_theta (and would assume 10000 without it)
    assert exported["rope_theta"] == 123456.0
    assert exported["rope_parameters"] == source["rope_parameters"]


def test_max_batch_size_and_max_context_size_every_engine(tiny_pair, tmp_path):
    import yaml

    target_dir, drafter_dir = tiny_pair  # block size 6
    for batch, context, tokens in ((4, 256, 256), (64, 128, 64 * 6)):  # tokens: a whole prompt, or every block
        out = tmp_path / f"b{batch}"
        manifest = build_bundle(
            str(target_dir), str(drafter_dir), out, "all", max_batch_size=batch, max_context=context
        )
        assert (manifest["max_batch_size"], manifest["max_context"]) == (batch, context)
        options = yaml.safe_load((out / "trtllm" / "extra_llm_api_options.yaml").read_text())
        assert (options["max_batch_size"], options["max_seq_len"], options["max_num_tokens"]) == (
            batch,
            context,
            tokens,
        )
        assert options["cuda_graph_config"]["max_batch_size"] == batch
        vllm = launch_argv(out / "vllm" / "launch.sh")
        assert (flag(vllm, "--max-num-seqs"), flag(vllm, "--max-model-len")) == (str(batch), str(context))
        sgl = launch_argv(out / "sglang" / "launch.sh")
        assert (flag(sgl, "--max-running-requests"), flag(sgl, "--context-length")) == (str(batch), str(context))
    for context in (0, 513):
        with pytest.raises(LoopspecError, match="max context must be between 1 and the target's 512 positions"):
            build_bundle(str(target_dir), str(drafter_dir), tmp_path / "x", "vllm", max_context=context)


def test_tp_sets_every_launch(tiny_pair, tmp_path):
    import yaml

    target_dir, drafter_dir = tiny_pair
    out = tmp_path / "tp4"
    build_bundle(str(target_dir), str(drafter_dir), out, "trtllm,vllm,sglang", tp=4)  # 4 heads, 2 K/V heads
    options = yaml.safe_load((out / "trtllm" / "extra_llm_api_options.yaml").read_text())
    assert options["tensor_parallel_size"] == 4
    assert "--tp_size" not in launch_argv(out / "trtllm" / "launch.sh")  # one place: the YAML
    assert flag(launch_argv(out / "vllm" / "launch.sh"), "--tensor-parallel-size") == "4"
    assert flag(launch_argv(out / "sglang" / "launch.sh"), "--tp-size") == "4"


def test_bad_inputs(tiny_pair, tmp_path):
    target_dir, drafter_dir = tiny_pair
    with pytest.raises(LoopspecError, match="unknown engine"):
        parse_frameworks("trtllm,tgi")
    with pytest.raises(LoopspecError, match="unknown engine"):
        build_bundle(str(target_dir), str(drafter_dir), tmp_path / "x", "")
    for tp in (0, 3):
        with pytest.raises(LoopspecError, match="tp|tensor parallel"):
            build_bundle(str(target_dir), str(drafter_dir), tmp_path / "x", "vllm", tp=tp)
    with pytest.raises(LoopspecError, match="unknown precision"):
        build_bundle(str(target_dir), str(drafter_dir), tmp_path / "x", "vllm", precision="int4")
    with pytest.raises(LoopspecError, match="unknown dtype"):
        build_bundle(str(target_dir), str(drafter_dir), tmp_path / "x", "vllm", dtype="float8")
    other = save_tiny_target("llama", tmp_path / "other", vocab_size=256)
    save_tiny_tokenizer(other)
    with pytest.raises(LoopspecError, match="does not fit"):
        build_bundle(str(other), str(drafter_dir), tmp_path / "x", "vllm")
    with pytest.raises(LoopspecError, match="drafter path does not exist"):
        build_bundle(str(target_dir), str(tmp_path / "nope"), tmp_path / "x", "vllm")
    with pytest.raises(LoopspecError, match="trained drafter"):
        build_bundle(str(target_dir), "default", tmp_path / "x", "vllm")
    notok = tmp_path / "notok"
    shutil.copytree(target_dir, notok, ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(LoopspecError, match="tokenizer"):
        build_bundle(str(notok), str(drafter_dir), tmp_path / "x", "vllm")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "precious.txt").write_text("keep me")
    with pytest.raises(LoopspecError, match="not a bundle"):
        build_bundle(str(target_dir), str(drafter_dir), busy, "vllm")
    assert (busy / "precious.txt").read_text() == "keep me"
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob("*.tmp"))  # nothing half-written


def test_fp8_bundle_has_a_modelopt_target(tiny_pair, tmp_path):
    pytest.importorskip("modelopt", reason="needs nvidia-modelopt (the quant extra)")
    target_dir, drafter_dir = tiny_pair
    out = tmp_path / "fp8"
    manifest = build_bundle(str(target_dir), str(drafter_dir), out, "all", precision="fp8", calib_size=2)
    assert manifest["precision"] == "fp8"
    config = json.loads((out / "target" / "config.json").read_text())
    assert "quantization_config" in config and (out / "target" / "hf_quant_config.json").is_file()
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 10000.0  # kept through modelopt
    weights = read_safetensors(out / "target" / "model.safetensors")
    assert any(t.dtype == torch.float8_e4m3fn for t in weights.values())
    assert flag(launch_argv(out / "sglang" / "launch.sh"), "--speculative-draft-model-quantization") == "unquant"
    drafter = read_safetensors(out / "drafter" / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in drafter.values())  # the drafter stays unquantized
    assert "FP8" in (out / "README.md").read_text()


def test_rebuild_replaces_a_previous_bundle(tiny_pair, tmp_path):
    target_dir, drafter_dir = tiny_pair
    out = tmp_path / "b"
    build_bundle(str(target_dir), str(drafter_dir), out, "trtllm")
    build_bundle(str(target_dir), str(drafter_dir), out, "vllm")
    assert (out / "vllm" / "launch.sh").is_file() and not (out / "trtllm").exists()


def test_a_failed_rebuild_keeps_the_previous_bundle(tiny_pair, tmp_path):
    target_dir, drafter_dir = tiny_pair
    out = tmp_path / "b"
    build_bundle(str(target_dir), str(drafter_dir), out, "vllm")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    # fails inside the build: the drafter is already written when the target's calibration file is read
    with pytest.raises(LoopspecError, match="calibration prompt file does not exist"):
        build_bundle(
            str(target_dir),
            str(drafter_dir),
            out,
            "trtllm",
            precision="fp8",
            calib_prompts=str(tmp_path / "missing.jsonl"),
        )
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # no temporary left beside it


def test_docs_carry_the_support_matrix():
    from pathlib import Path

    from loopspec.convert.bundles import support_matrix_markdown

    docs = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    assert support_matrix_markdown() in docs


def test_each_serving_framework_is_one_module_and_one_registry_row():
    """Every module of convert/bundles but the shared ones holds one framework's record, and the
    registry lists each under its name; each says why it drafts over the full vocabulary unless it
    takes a reduced one."""
    import importlib
    from pathlib import Path

    from loopspec.convert.bundles import FRAMEWORKS
    from loopspec.convert.bundles.common import GGUF_TARGET, HF_TARGET, SUPPORT_COLUMNS, ServingFramework

    folder = Path(__file__).resolve().parents[1] / "convert" / "bundles"
    shared = {"__init__", "common", "hf_checkpoint"}
    records = {}
    for path in sorted(folder.glob("*.py")):
        if path.stem not in shared:
            module = importlib.import_module(f"loopspec.convert.bundles.{path.stem}")
            found = [v for v in vars(module).values() if isinstance(v, ServingFramework)]
            assert len(found) == 1, (path.name, found)
            records[path.stem] = found[0]
    assert records == FRAMEWORKS
    for name, framework in FRAMEWORKS.items():
        assert framework.target in (HF_TARGET, GGUF_TARGET) and len(framework.support) == len(SUPPORT_COLUMNS)
        assert (framework.reduced_vocab_line is None) != (framework.full_vocab_reason is None), name


def test_which_kinds_a_framework_takes_is_its_own_record():
    """The core kind module names no serving framework; each framework's record answers, for every kind
    in the registry (and the DFlash2 kind with a selector), whether it takes it: None or a one-line reason."""
    import re
    from pathlib import Path

    from loopspec.convert.bundles import FRAMEWORKS
    from loopspec.model import drafter_kinds
    from loopspec.model.drafter_kinds import DRAFTER_KINDS, SelectorKind, dflash2_kind

    text = (Path(__file__).resolve().parents[1] / "loopspec" / "model" / "drafter_kinds.py").read_text()
    named = re.findall(r"vllm|sglang|tensorrt-llm|trtllm|llama\.cpp|llamacpp", text, flags=re.IGNORECASE)
    assert not named, f"loopspec/model/drafter_kinds.py names serving frameworks: {sorted(set(named))}"
    assert not hasattr(drafter_kinds.DrafterKind, "unsupported_in") and not hasattr(drafter_kinds, "SERVING_RULES")
    kinds = [*DRAFTER_KINDS.values(), dflash2_kind(SelectorKind(4, 8, 16, 4, 64))]
    for name, framework in FRAMEWORKS.items():
        assert callable(framework.kind_refusal), name
        for kind in kinds:
            why = framework.refuses(kind)
            assert why is None or (isinstance(why, str) and why and "\n" not in why), (name, kind.name, why)
        assert framework.refuses(DRAFTER_KINDS["dflash"]) is None, name  # z-lab DFlash: every framework
    refusing = {name for name, f in FRAMEWORKS.items() if f.refuses(kinds[-1])}
    assert refusing == {"trtllm"}, refusing  # DFlash2: all but TensorRT-LLM


def test_cli_convert_bundle(tiny_pair, tmp_path, capsys):
    from loopspec.cli import main

    target_dir, drafter_dir = tiny_pair
    out = tmp_path / "cli"
    assert (
        main(
            [
                "convert",
                "bundle",
                "--framework",
                "vllm,sglang",
                "--target",
                str(target_dir),
                "--drafter",
                str(drafter_dir),
                "--tp",
                "2",
                "--max-batch-size",
                "3",
                "--max-context",
                "200",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert f"sh {out / 'vllm' / 'launch.sh'}" in printed and "tensor parallel 2" in printed
    vllm = launch_argv(out / "vllm" / "launch.sh")
    assert (flag(vllm, "--max-num-seqs"), flag(vllm, "--max-model-len")) == ("3", "200")
    assert (
        main(
            [
                "convert",
                "bundle",
                "--framework",
                "vllm",
                "--target",
                str(target_dir),
                "--drafter",
                str(drafter_dir),
                "--max-context",
                "100000",
                "--out",
                str(tmp_path / "long"),
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == (
        "loopspec: error: max context must be between 1 and the target's 512 positions, got 100000"
    )
    assert (
        main(
            [
                "convert",
                "bundle",
                "--framework",
                "tgi",
                "--target",
                str(target_dir),
                "--drafter",
                str(drafter_dir),
                "--out",
                str(tmp_path / "bad"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err == "loopspec: error: unknown engine tgi (choose from trtllm, vllm, sglang, llamacpp or all)"


def test_serve_script_builds_then_launches(tiny_pair, tmp_path):
    """scripts/serve_vllm.sh builds the bundle with the real CLI, then execs its launch with the engine
    flags; vLLM is not installed here, so the launch itself fails with the shell's 'not found'."""
    from pathlib import Path

    import os
    import sys

    root = Path(__file__).resolve().parents[1]
    # the script runs .venv/bin/loopspec, else `loopspec` on PATH: only the command installed beside this
    # interpreter and the system's tools are on PATH, so a vLLM installed in this environment stays out
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "loopspec").symlink_to(Path(sys.executable).parent / "loopspec")
    env = {**os.environ, "PATH": os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"])}
    target_dir, drafter_dir = tiny_pair
    out = tmp_path / "served"
    run = subprocess.run(
        [
            str(root / "scripts" / "serve_vllm.sh"),
            str(out),
            "--target",
            str(target_dir),
            "--drafter",
            str(drafter_dir),
            "--",
            "--port",
            "8123",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert (out / "vllm" / "launch.sh").is_file() and not (out / "trtllm").exists()
    assert run.returncode == 127 and "vllm" in run.stderr and "not found" in run.stderr


# --------------------------------------------------------------------------------------------------
# DSpark drafters (DeepSpec's block convention) for TensorRT-LLM, vLLM and SGLang


def dspark_bundle(target_dir, tmp_path, frameworks, **kw):
    from dataclasses import replace

    from test_dspark import dspark_config

    torch.manual_seed(0)
    cfg = dspark_config(load_target_dir(target_dir).cfg, **kw)
    src = tmp_path / "src"
    Drafter(cfg).save(src, dtype=torch.float32)
    out = tmp_path / "bundle"
    return out, build_bundle(str(target_dir), str(src), out, frameworks, dtype="float32"), replace(cfg)


@pytest.mark.parametrize("confidence", [True, False])
def test_dspark_drafter_in_trtllm_vllm_and_sglang(confidence, target_dir, tmp_path):
    import yaml

    from test_dspark import BLOCK, MASK, RANK

    out, manifest, cfg = dspark_bundle(target_dir, tmp_path, "all", confidence=confidence)
    assert manifest["engines"] == ["trtllm", "vllm", "sglang"] and manifest["drafts_per_block"] == BLOCK

    options = yaml.safe_load((out / "trtllm" / "extra_llm_api_options.yaml").read_text())
    assert set(options) <= TRTLLM_TOP_LEVEL
    spec = options["speculative_config"]
    assert set(spec) <= TRTLLM_DSPARK_FIELDS and not set(spec) & TRTLLM_DSPARK_CONFIDENCE_FIELDS
    assert spec == {
        "decoding_type": "DSpark",
        "speculative_model": "./drafter",
        "max_draft_len": BLOCK,
        "block_size": BLOCK,
        "mask_token_id": MASK,
        "target_layer_ids": cfg.target_layer_ids,
        "markov_rank": RANK,
        "markov_head_type": "vanilla",
    }  # every block position drafts

    vllm = json.loads(flag(launch_argv(out / "vllm" / "launch.sh"), "--speculative-config"))
    assert set(vllm) <= VLLM_SPECULATIVE_FIELDS
    assert vllm == {
        "method": "dspark",
        "model": "./drafter",
        "num_speculative_tokens": BLOCK,
        **({"enable_adaptive_verification": True} if confidence else {}),
    }

    sgl = launch_argv(out / "sglang" / "launch.sh")
    assert flag(sgl, "--speculative-algorithm") == "DSPARK"
    assert flag(sgl, "--speculative-draft-model-path") == "./drafter"
    assert flag(sgl, "--speculative-dspark-block-size") == str(BLOCK)  # gamma: the drafts per block
    assert flag(sgl, "--speculative-num-draft-tokens") == str(BLOCK + 1)  # gamma + 1, as SGLang requires
    for engine in ("trtllm", "vllm", "sglang"):
        assert subprocess.run(["sh", "-n", str(out / engine / "launch.sh")]).returncode == 0

    readme = (out / "README.md").read_text()
    assert "TensorRT-LLM >= 1.3.0rc27" in readme and "--speculative-algorithm DSPARK" in readme
    assert "read by TensorRT-LLM >= 1.3, vLLM and SGLang as a DSpark drafter" in readme
    # confidence scheduling: named with its version and fields, left out, and why
    assert ("confidence_cost_table_path" in readme and "1.4.0rc4" in readme) == confidence
    assert ("`--speculative-config` sets `enable_adaptive_verification`" in readme) == confidence


def test_deepspec_dflash_drafter_goes_to_trtllm_as_dspark_and_sglang_refuses_it(target_dir, tmp_path):
    import yaml

    from test_dspark import BLOCK

    out, manifest, _ = dspark_bundle(target_dir, tmp_path, "all", rank=0, confidence=False)
    assert manifest["engines"] == ["trtllm"]  # vLLM's and SGLang's DSpark need a Markov head
    spec = yaml.safe_load((out / "trtllm" / "extra_llm_api_options.yaml").read_text())["speculative_config"]
    assert set(spec) <= TRTLLM_DSPARK_FIELDS
    # DSpark's config, not DFlash's: TensorRT-LLM's DFlash would read block positions 1.. (z-lab's convention)
    assert (spec["decoding_type"], spec["max_draft_len"], spec["markov_rank"]) == ("DSpark", BLOCK, 0)
    assert "markov_head_type" not in spec
    with pytest.raises(LoopspecError) as e:
        dspark_bundle(target_dir, tmp_path / "sgl", "sglang", rank=0, confidence=False)
    assert "\n" not in str(e.value) and "requires a Markov head" in str(e.value)


@pytest.mark.parametrize(
    "engine,kw,words",
    [
        ("trtllm", {"head_type": "gated"}, "vanilla Markov head only"),
        ("trtllm", {"anchor_predicts": False}, "one position off"),
        ("sglang", {"anchor_predicts": False}, "one position off"),
        ("vllm", {"anchor_predicts": False}, "one position off"),
    ],
)
def test_dspark_drafters_an_engine_cannot_run_are_refused_in_one_line(engine, kw, words, target_dir, tmp_path):
    with pytest.raises(LoopspecError) as e:
        dspark_bundle(target_dir, tmp_path, engine, **kw)
    assert "\n" not in str(e.value) and words in str(e.value), str(e.value)
    assert not (tmp_path / "bundle").exists()
