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
from loopspec.convert.bundle import build_bundle, parse_engines
from loopspec.errors import LoopspecError
from loopspec.model.drafter import Drafter
from loopspec.weights import file_sha256, load_target_dir, read_safetensors, write_safetensors

# Documented field names (TensorRT-LLM LLM API reference: DFlashDecodingConfig, CudaGraphConfig, LlmArgs;
# vLLM SpeculativeConfig). A bundle key outside these would be rejected or ignored by the engine.
TRTLLM_DFLASH_FIELDS = {"max_draft_len", "max_total_draft_tokens", "speculative_model", "max_concurrency",
                        "draft_len_schedule", "load_format", "acceptance_rate_window_size",
                        "acceptance_rate_threshold", "use_rejection_sampling", "allow_advanced_sampling",
                        "advanced_sampling_mode", "enable_penalty", "mask_token_id", "target_layer_ids",
                        "decoding_type", "attention_backend"}
TRTLLM_CUDA_GRAPH_FIELDS = {"batch_sizes", "max_batch_size", "enable_padding"}
TRTLLM_TOP_LEVEL = {"tensor_parallel_size", "cuda_graph_config", "speculative_config"}
VLLM_SPECULATIVE_FIELDS = {"method", "model", "num_speculative_tokens", "quantization", "max_model_len",
                           "draft_tensor_parallel_size", "revision", "attention_backend"}


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
    for rel in ("drafter/config.json", "drafter/model.safetensors", "target/config.json",
                "target/model.safetensors", "target/tokenizer.json", "target/tokenizer_config.json",
                "trtllm/extra_llm_api_options.yaml", "trtllm/launch.sh", "vllm/launch.sh", "sglang/launch.sh",
                "README.md", "manifest.json"):
        assert (out / rel).is_file(), rel
    assert not (out / "drafter" / "d2t.safetensors").exists()
    assert manifest["engines"] == ["trtllm", "vllm", "sglang"]
    assert manifest["tensor_parallel_size"] == 2 and manifest["draft_vocab"] == "full"
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


def test_launch_commands_carry_the_documented_flags(bundle):
    out, _ = bundle
    block = Drafter.load(out / "drafter").cfg.block_size

    trt = launch_argv(out / "trtllm" / "launch.sh")
    assert trt[:2] == ["trtllm-serve", "./target"]
    assert flag(trt, "--backend") == "pytorch" and flag(trt, "--tp_size") == "2"
    assert (out / flag(trt, "--extra_llm_api_options")).is_file()

    vllm = launch_argv(out / "vllm" / "launch.sh")
    assert vllm[:3] == ["vllm", "serve", "./target"]
    assert flag(vllm, "--tensor-parallel-size") == "2"
    spec = json.loads(flag(vllm, "--speculative-config"))
    assert set(spec) <= VLLM_SPECULATIVE_FIELDS
    assert spec == {"method": "dflash", "model": "./drafter", "num_speculative_tokens": block - 1}

    sgl = launch_argv(out / "sglang" / "launch.sh")
    assert sgl[:3] == ["python", "-m", "sglang.launch_server"]
    assert flag(sgl, "--model-path") == "./target" and flag(sgl, "--tp-size") == "2"
    assert flag(sgl, "--speculative-algorithm") == "DFLASH"
    assert flag(sgl, "--speculative-draft-model-path") == "./drafter"
    assert flag(sgl, "--speculative-num-draft-tokens") == str(block)  # SGLang counts the anchor
    assert "--speculative-draft-model-quantization" not in sgl  # unquantized target: nothing to undo

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


def test_reduced_vocab_drafter_exports_full_vocab(tiny_pair, tmp_path):
    target_dir, drafter_dir = tiny_pair
    src = tmp_path / "drafter_d2t"
    shutil.copytree(drafter_dir, src)
    draft_ids = torch.tensor([2, 5, 9, 40, 100])
    write_safetensors({"d2t": draft_ids - torch.arange(5)}, src / "d2t.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["loopspec"] = {"draft_vocab_size": 5}
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "b"
    build_bundle(str(target_dir), str(src), out, "sglang")
    assert not (out / "drafter" / "d2t.safetensors").exists()
    assert Drafter.load(out / "drafter").draft_ids is None
    assert "draft_vocab_size" not in json.loads((out / "drafter" / "config.json").read_text()).get("loopspec", {})
    readme = (out / "README.md").read_text()
    assert "reduced draft vocabulary of 5 tokens" in readme and "DLoop" in readme


def test_tp_sets_every_launch(tiny_pair, tmp_path):
    import yaml

    target_dir, drafter_dir = tiny_pair
    out = tmp_path / "tp4"
    build_bundle(str(target_dir), str(drafter_dir), out, "trtllm,vllm,sglang", tp=4)  # 4 heads, 2 K/V heads
    options = yaml.safe_load((out / "trtllm" / "extra_llm_api_options.yaml").read_text())
    assert options["tensor_parallel_size"] == 4
    assert flag(launch_argv(out / "trtllm" / "launch.sh"), "--tp_size") == "4"
    assert flag(launch_argv(out / "vllm" / "launch.sh"), "--tensor-parallel-size") == "4"
    assert flag(launch_argv(out / "sglang" / "launch.sh"), "--tp-size") == "4"


def test_bad_inputs(tiny_pair, tmp_path):
    target_dir, drafter_dir = tiny_pair
    with pytest.raises(LoopspecError, match="unknown engine"):
        parse_engines("trtllm,tgi")
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
        build_bundle(str(target_dir), str(drafter_dir), out, "trtllm", precision="fp8",
                     calib_prompts=str(tmp_path / "missing.jsonl"))
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # no temporary left beside it


def test_docs_carry_the_support_matrix():
    from pathlib import Path

    from loopspec.convert.bundle import support_matrix_markdown

    docs = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    assert support_matrix_markdown() in docs


def test_cli_convert_bundle(tiny_pair, tmp_path, capsys):
    from loopspec.cli import main

    target_dir, drafter_dir = tiny_pair
    out = tmp_path / "cli"
    assert main(["convert", "bundle", "--engine", "vllm,sglang", "--target", str(target_dir),
                 "--drafter", str(drafter_dir), "--tp", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"sh {out / 'vllm' / 'launch.sh'}" in printed and "tensor parallel 2" in printed
    assert main(["convert", "bundle", "--engine", "tgi", "--target", str(target_dir), "--drafter",
                 str(drafter_dir), "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "loopspec: error: unknown engine tgi (choose from trtllm, vllm, sglang or all)"


def test_serve_script_builds_then_launches(tiny_pair, tmp_path):
    """scripts/serve_vllm.sh builds the bundle with the real CLI, then execs its launch with the engine
    flags; vLLM is not installed here, so the launch itself fails with the shell's 'not found'."""
    from pathlib import Path

    import os
    import sys

    root = Path(__file__).resolve().parents[1]
    # the script runs .venv/bin/loopspec, else `loopspec` on PATH: the command installed beside this interpreter
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if shutil.which("vllm"):
        pytest.skip("vLLM is installed here: launching it is not this test's business")
    target_dir, drafter_dir = tiny_pair
    out = tmp_path / "served"
    run = subprocess.run([str(root / "scripts" / "serve_vllm.sh"), str(out), "--target", str(target_dir),
                          "--drafter", str(drafter_dir), "--", "--port", "8123"], capture_output=True, text=True,
                         env=env)
    assert (out / "vllm" / "launch.sh").is_file() and not (out / "trtllm").exists()
    assert run.returncode == 127 and "vllm" in run.stderr and "not found" in run.stderr
