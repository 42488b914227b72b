"""DFlash2 drafters in serving bundles: vLLM (method dflash) and SGLang (DFLASH) read z-lab's
`DFlash2DraftModel` layout from drafter/ and pick their DFlash2 model from it, llama.cpp gets the
checkpoint and its own converter, TensorRT-LLM refuses in one line; each framework's fields read back
from a tiny DFlash2 drafter's bundle, the drafter directories loading back into loopspec unchanged, each
refusal in one line at its boundary, and (where installed) the engines' own configuration code and
llama.cpp's converter run on the bundles."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import save_tiny_target, save_tiny_tokenizer
from loopspec.convert.bundles import FRAMEWORKS, build_bundle
from loopspec.errors import LoopspecError
from loopspec.model.dflash2 import DFlash2Config, DFlash2Drafter
from loopspec.model.drafters import load_drafter
from test_dflash2 import BLOCK, HIDDEN, LAYERS, MASK, TAPS, dflash2_checkpoint
from test_eagle3_bundles import flag, launch_argv, llamacpp_converter, one_line_error

DRAFT_FIELDS = (
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = save_tiny_target("qwen3", tmp_path_factory.mktemp("dflash2-bundles") / "target", seed=3, num_layers=LAYERS)
    save_tiny_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    """z-lab's DFlash2 layout: 2 sliding layers (window 6), bidirectional block, 6 candidates a slot."""
    return dflash2_checkpoint(tmp_path_factory.mktemp("dflash2-drafter") / "drafter")[0]


def test_vllm_and_sglang_read_the_dflash2_drafter_from_drafter_dir(target_dir, drafter_dir, tmp_path):
    out = tmp_path / "bundle"
    manifest = build_bundle(target_dir, str(drafter_dir), out, "vllm,sglang")
    drafts = BLOCK - 1
    argv = launch_argv(out / "vllm" / "launch.sh")
    assert json.loads(flag(argv, "--speculative-config")) == {
        "method": "dflash",
        "model": "./drafter",
        "num_speculative_tokens": drafts,
    }
    argv = launch_argv(out / "sglang" / "launch.sh")
    assert (
        flag(argv, "--speculative-algorithm"),
        flag(argv, "--speculative-draft-model-path"),
        flag(argv, "--speculative-num-draft-tokens"),
    ) == ("DFLASH", "./drafter", str(BLOCK))
    assert "--speculative-dspark-block-size" not in argv
    assert not (out / "vllm" / "drafter").exists()  # the full vocabulary: the selector's codebooks span it

    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    # vLLM's DFlash2 model reads these from dflash_config only, never the top level
    assert {k: config["dflash_config"][k] for k in DRAFT_FIELDS} == {
        "block_size": BLOCK,
        "mask_token_id": MASK,
        "target_layer_ids": TAPS,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 6,
    }
    assert (config["is_causal"], config["use_sliding_window"], config["sliding_window"], config["layer_types"]) == (
        False,
        True,
        6,
        ["sliding_attention"] * 2,
    )
    assert "draft_vocab_size" not in config

    assert (manifest["drafter_kind"], manifest["block_convention"], manifest["drafts_per_block"]) == (
        "DFlash2",
        "z-lab",
        drafts,
    )
    assert manifest["vllm"] == {"method": "dflash", "num_speculative_tokens": drafts}
    assert manifest["draft_vocab"] == {"vllm": "full", "sglang": "full"} and manifest["mask_token_id"] == MASK
    readme = (out / "README.md").read_text()
    for words in (
        "Drafting: DFlash2",
        "top 6 candidates",
        'architectures: ["DFlash2DraftModel"]',
        "vLLM (>= 0.28)",
        "SGLang (>= 0.5.19)",
        "V2 model runner",
        "| DFlash2 |",
    ):
        assert words in readme, words


def test_drafter_dir_loads_back_unchanged(target_dir, drafter_dir, tmp_path):
    """drafter/ (what vLLM and SGLang read) is the drafter loopspec loaded: every tensor and every config field."""
    out = tmp_path / "bundle"
    build_bundle(target_dir, str(drafter_dir), out, "sglang", dtype="float32")
    original, written = DFlash2Drafter.load(drafter_dir), load_drafter(out / "drafter")
    assert isinstance(written, DFlash2Drafter) and written.cfg == original.cfg
    assert original.state_dict().keys() == written.state_dict().keys()
    for name, tensor in original.state_dict().items():
        assert torch.equal(tensor, written.state_dict()[name]), name


def test_all_takes_the_engines_that_run_dflash2(target_dir, drafter_dir, tmp_path):
    manifest = build_bundle(target_dir, str(drafter_dir), tmp_path / "b", "all")
    assert manifest["engines"] == ["vllm", "sglang"]  # TensorRT-LLM has no DFlash2 model


def dflash2_kind(directory: Path, **draft_changes):
    """The kind of the drafter in `directory` with some dflash_config fields changed."""
    raw = json.loads((directory / "config.json").read_text())
    return DFlash2Config.from_checkpoint({**raw, "dflash_config": {**raw["dflash_config"], **draft_changes}}).kind


def test_each_frameworks_rule_at_its_boundary(drafter_dir):
    """llama.cpp's selector lattice needs hidden >= top_k (top_k + 1) (64 here: top-k 7 fits, 8 does not);
    SGLang does not read input_embedding_scale; vLLM serves them all; TensorRT-LLM none."""
    assert HIDDEN == 64
    refuses = {name: framework.refuses for name, framework in FRAMEWORKS.items()}
    fits, too_wide = dflash2_kind(drafter_dir, selector_top_k=7), dflash2_kind(drafter_dir, selector_top_k=8)
    scaled = dflash2_kind(drafter_dir, input_embedding_scale=8.0)
    assert refuses["llamacpp"](fits) is None
    assert "at least selector_top_k x (selector_top_k + 1) = 72" in refuses["llamacpp"](too_wide)
    assert refuses["sglang"](fits) is None and refuses["sglang"](too_wide) is None
    assert "input_embedding_scale (8 in this drafter)" in refuses["sglang"](scaled)
    assert all(refuses["vllm"](kind) is None for kind in (fits, too_wide, scaled))
    assert all("DFlashDecodingConfig" in refuses["trtllm"](kind) for kind in (fits, too_wide, scaled))


def test_each_refusal_is_one_line(target_dir, drafter_dir, tmp_path, capsys):
    base = ["convert", "bundle", "--target", str(target_dir), "--drafter", str(drafter_dir)]
    line = one_line_error(capsys, base + ["--framework", "trtllm", "--out", str(tmp_path / "t")])
    for words in (
        "TensorRT-LLM >= 1.3 cannot serve this DFlash2 drafter",
        "DFlashDecodingConfig",
        "engines that can: vLLM, SGLang, llama.cpp",
    ):
        assert words in line, line
    scaled = dflash2_checkpoint(tmp_path / "scaled", draft_changes={"input_embedding_scale": 2.0})[0]
    line = one_line_error(
        capsys,
        [
            "convert",
            "bundle",
            "--target",
            str(target_dir),
            "--drafter",
            str(scaled),
            "--framework",
            "vllm,sglang",
            "--out",
            str(tmp_path / "s"),
        ],
    )
    assert "SGLang cannot serve this DFlash2 drafter" in line and "input_embedding_scale (2 in this drafter)" in line
    assert not (tmp_path / "t").exists() and not (tmp_path / "s").exists()
    with pytest.raises(LoopspecError, match="EAGLE-3 drafter's chain or tree.*trained block of 5") as e:
        build_bundle(target_dir, str(drafter_dir), tmp_path / "k", "vllm", setting={"block_size": 3})
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------------
# llama.cpp: the converter's inputs, and (with its converter) the dflash GGUF it writes


def default_target_dflash2(directory: Path, top_k: int = 16) -> DFlash2Drafter:
    """A random DFlash2 drafter shaped for the default target (hidden 576), one sliding layer."""
    from loopspec.defaults import DEFAULT_TARGET_MASK_TOKEN_ID
    from loopspec.model.dflash import DrafterConfig
    from loopspec.model.families import target_config
    from loopspec.weights import TargetSource, read_json

    target = target_config(read_json(TargetSource.of("default").checkpoint_dir() / "config.json", "target config"))
    base = DrafterConfig.for_target(target, num_layers=1, block_size=6, mask_token_id=DEFAULT_TARGET_MASK_TOKEN_ID)
    cfg = DFlash2Config.over(
        base,
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=4,
        selector_top_k=top_k,
        sliding_window=64,
        layer_types=("sliding_attention",),
        is_causal=False,
    )
    torch.manual_seed(0)
    model = DFlash2Drafter(cfg)
    model.save(directory, dtype=torch.float32)
    return model


@pytest.mark.e2e
def test_llamacpp_bundle_is_what_llamacpps_converter_reads(tmp_path):
    """The default target with a DFlash2 drafter: the launch runs draft-dflash after convert.sh; llamacpp/dflash2
    loads back unchanged; and, where llama.cpp's converter is at hand, its dflash GGUF carries the selector."""
    model = default_target_dflash2(tmp_path / "drafter")
    out = tmp_path / "bundle"
    manifest = build_bundle("default", str(tmp_path / "drafter"), out, "llamacpp")
    argv = launch_argv(out / "llamacpp" / "launch.sh")
    assert (flag(argv, "-md"), flag(argv, "--spec-type"), flag(argv, "--spec-draft-n-max")) == (
        "./llamacpp/drafter.gguf",
        "draft-dflash",
        "5",
    )
    assert "|| sh ./llamacpp/convert.sh" in (out / "llamacpp" / "launch.sh").read_text()
    convert = (out / "llamacpp" / "convert.sh").read_text()
    assert "./llamacpp/dflash2" in convert and "--target-model-dir ./llamacpp/target-config" in convert
    assert {"config.json", "tokenizer.json"} <= {p.name for p in (out / "llamacpp" / "target-config").iterdir()}
    assert manifest["llamacpp"] == {
        "target": "llamacpp/target.gguf",
        "drafter": "llamacpp/drafter.gguf",
        "drafter_dtype": "f32",
        "spec_type": "draft-dflash",
        "draft_max": 5,
        "drafter_source": "llamacpp/dflash2",
        "converter_target_dir": "llamacpp/target-config",
        "convert": "llamacpp/convert.sh",
    }
    written = DFlash2Drafter.load(out / "llamacpp" / "dflash2")
    assert written.cfg == model.cfg
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, written.state_dict()[name]), name
    assert "selector_top_k` 16" in (out / "README.md").read_text()

    converter = llamacpp_converter()
    if converter is None:
        pytest.skip(
            "no llama.cpp converter: set LLAMACPP_CONVERT to llama.cpp's convert_hf_to_gguf.py "
            "(scripts/build_llama_server.sh keeps it) and PYTHON to a Python with its requirements"
        )
    python, script = converter
    run = subprocess.run(
        ["sh", str(out / "llamacpp" / "convert.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "LLAMACPP_CONVERT": script, "PYTHON": python},
    )
    if run.returncode and "No module named" in run.stderr:
        pytest.skip(f"the converter's Python lacks a requirement: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-2000:]
    gguf = pytest.importorskip(
        "gguf", reason="needs the gguf package (a loopspec dependency) to read the converted drafter"
    )
    reader = gguf.GGUFReader(str(out / "llamacpp" / "drafter.gguf"))
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("general.architecture") == "dflash"
    assert [
        field(f"dflash.{k}")
        for k in ("block_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    ] == [6, 2, 16, 4, 16]
    assert list(field("dflash.target_layers")) == [i + 1 for i in model.cfg.target_layer_ids]
    assert field("dflash.attention.sliding_window") == 64 and field("dflash.attention.causal") is False
    tensors = {t.name: t for t in reader.tensors}
    predecessor = torch.from_numpy(tensors["selector_predecessor.weight"].data.copy())
    assert torch.equal(predecessor, model.candidate_selector.predecessor_codebook.detach())  # [V, rank], f32
    assert {"blk.0.attn_conv_base", "blk.0.ffn_conv_proj.weight", "selector_hidden.weight"} <= set(tensors)


def test_llamacpp_refuses_a_selector_wider_than_its_lattice(tmp_path):
    default_target_dflash2(tmp_path / "drafter", top_k=24)  # 24 x 25 = 600 > 576
    with pytest.raises(LoopspecError, match="llama.cpp cannot serve this DFlash2 drafter.*= 600.*is 576") as e:
        build_bundle("default", str(tmp_path / "drafter"), tmp_path / "b", "llamacpp")
    assert "\n" not in str(e.value) and not (tmp_path / "b").exists()


# --------------------------------------------------------------------------------------------------
# the engines' own configuration code (scripts/check_bundles_parsers.py), where a Python has them


def engines_python() -> str | None:
    """A Python with vLLM and SGLang installed (LOOPSPEC_ENGINES_PYTHON: check_bundles.sh's scratch venv)."""
    python = os.environ.get("LOOPSPEC_ENGINES_PYTHON")
    return python if python and Path(python).is_file() else None


def test_the_engines_own_configuration_code_takes_the_bundle(target_dir, drafter_dir, tmp_path):
    python = engines_python()
    if python is None:
        pytest.skip(
            "needs a Python with vLLM 0.33 and SGLang 0.5.23 (set LOOPSPEC_ENGINES_PYTHON to the "
            "venv scripts/check_bundles.sh builds)"
        )
    out = tmp_path / "dflash2"
    build_bundle(target_dir, str(drafter_dir), out, "vllm,sglang")
    env = {
        **os.environ,
        "VLLM_USE_V2_MODEL_RUNNER": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    run = subprocess.run(
        [python, str(ROOT / "scripts" / "check_bundles_parsers.py"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    vllm = [line for line in lines if line.startswith(("PASS vllm", "FAIL vllm"))]
    assert len(vllm) == 1 and vllm[0].startswith("PASS") and "DFlash2DraftModel on the V2 runner" in vllm[0], lines
    assert "dflash k=4" in vllm[0] and "selector rank 8 top-k 6" in vllm[0], vllm
    assert any(line.startswith("PASS sglang") and "prepare_server_args: DFLASH 5 tokens" in line for line in lines), (
        lines
    )
    for line in lines:  # SGLang's config package needs a CPU torchvision; anything else failing is a finding
        assert line.startswith("PASS") or "torchvision" in line, line
