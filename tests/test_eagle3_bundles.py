"""EAGLE-3 drafters in serving bundles: each framework's fields from a tiny EAGLE-3 drafter (vLLM
method eagle3, SGLang EAGLE3, TensorRT-LLM Eagle3DecodingConfig, llama.cpp draft-eagle3 from its own
converter), the chain or tree taken from the decoding setting and kept inside what each engine's own
validation accepts, what an engine cannot take refused in one line, and the drafter directories the
engines read loading back into loopspec with identical weights and taps."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import save_tiny_target, save_tiny_tokenizer
from loopspec.cli import main
from loopspec.convert.bundles import build_bundle
from loopspec.errors import LoopspecError
from loopspec.model.draft_head import DRAFT_CANDIDATES
from loopspec.model.eagle3 import Eagle3Drafter
from test_eagle3 import DRAFT_VOCAB, LAYERS, eagle3_checkpoint

BLOCK = 5  # the drafter's block size: 4 drafter steps per verification
DEFAULT_TAPS = [1, 3, 4]  # vLLM's default aux layers of 8 layers (2, 4, 5), as layer outputs


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = save_tiny_target("qwen3", tmp_path_factory.mktemp("eagle3-bundles") / "target", seed=3, num_layers=LAYERS)
    save_tiny_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    """A SpecForge-layout drafter with a reduced draft vocabulary and its taps left unpinned."""
    directory, _ = eagle3_checkpoint(
        tmp_path_factory.mktemp("eagle3-drafter") / "drafter", loopspec={"block_size": BLOCK}
    )
    return directory


def launch_argv(path: Path) -> list[str]:
    text = path.read_text().replace("\\\n", " ")
    return shlex.split(next(line for line in text.splitlines() if line.startswith("exec ")))[1:]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def trtllm_spec(out: Path) -> dict:
    return yaml.safe_load((out / "trtllm" / "extra_llm_api_options.yaml").read_text())["speculative_config"]


def sglang_shape(out: Path) -> tuple:
    argv = launch_argv(out / "sglang" / "launch.sh")
    return (
        flag(argv, "--speculative-algorithm"),
        flag(argv, "--speculative-draft-model-path"),
        int(flag(argv, "--speculative-num-steps")),
        int(flag(argv, "--speculative-eagle-topk")),
        int(flag(argv, "--speculative-num-draft-tokens")),
    )


def test_chain_bundle_carries_each_frameworks_eagle3_fields(target_dir, drafter_dir, tmp_path):
    out = tmp_path / "bundle"
    manifest = build_bundle(target_dir, str(drafter_dir), out, "trtllm,vllm,sglang")
    drafts = BLOCK - 1
    argv = launch_argv(out / "vllm" / "launch.sh")
    assert json.loads(flag(argv, "--speculative-config")) == {
        "method": "eagle3",
        "model": "./drafter",
        "num_speculative_tokens": drafts,
    }
    assert not (out / "vllm" / "drafter").exists()  # drafter/ carries the reduced vocabulary itself
    assert sglang_shape(out) == ("EAGLE3", "./drafter", drafts, 1, drafts + 1)
    # the one-model path is TensorRT-LLM's default: eagle3_one_model is left out (gone from 1.3.0rc27's config)
    assert trtllm_spec(out) == {
        "decoding_type": "Eagle3",
        "speculative_model": "./drafter",
        "max_draft_len": drafts,
        "eagle3_layers_to_capture": DEFAULT_TAPS,
    }
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == DRAFT_VOCAB
    # vLLM / llama.cpp read the stream entering layer j; SGLang (eagle_config) and TensorRT-LLM the output of i
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in DEFAULT_TAPS]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == DEFAULT_TAPS
    assert (manifest["drafter_kind"], manifest["block_convention"], manifest["drafts_per_block"]) == (
        "EAGLE-3",
        "eagle3",
        drafts,
    )
    assert manifest["draft_tree_nodes"] == 0 and manifest["mask_token_id"] is None
    assert manifest["target_layer_ids"] == DEFAULT_TAPS
    assert manifest["draft_vocab"] == {"trtllm": DRAFT_VOCAB, "vllm": DRAFT_VOCAB, "sglang": DRAFT_VOCAB}
    assert manifest["full_draft_vocab_reasons"] == {}
    assert manifest["vllm"] == {"method": "eagle3", "num_speculative_tokens": drafts}
    readme = (out / "README.md").read_text()
    assert "EAGLE-3" in readme and "a chain of 4 drafts per verification" in readme and "mask token" not in readme


def test_the_drafter_directory_loads_back_with_identical_weights(target_dir, drafter_dir, tmp_path):
    """drafter/ (what TensorRT-LLM, vLLM and SGLang read) is the drafter loopspec loaded, its taps pinned."""
    out = tmp_path / "bundle"
    build_bundle(target_dir, str(drafter_dir), out, "vllm", dtype="float32")
    original, written = Eagle3Drafter.load(drafter_dir), Eagle3Drafter.load(out / "drafter")
    assert original.state_dict().keys() == written.state_dict().keys()
    for name, tensor in original.state_dict().items():
        assert torch.equal(tensor, written.state_dict()[name]), name
    assert torch.equal(original.draft_ids, written.draft_ids)
    assert original.cfg.target_layer_ids is None and written.cfg.target_layer_ids == DEFAULT_TAPS


def test_the_setting_sets_the_chain_or_the_tree(target_dir, drafter_dir, tmp_path):
    out = tmp_path / "k7"
    build_bundle(target_dir, str(drafter_dir), out, "vllm,sglang", setting={"block_size": 7})
    assert (
        json.loads(flag(launch_argv(out / "vllm" / "launch.sh"), "--speculative-config"))["num_speculative_tokens"] == 6
    )
    assert sglang_shape(out)[2:] == (6, 1, 7)

    out = tmp_path / "tree12"
    manifest = build_bundle(target_dir, str(drafter_dir), out, "trtllm,sglang", setting={"tree_budget": 12})
    assert sglang_shape(out) == ("EAGLE3", "./drafter", BLOCK - 1, DRAFT_CANDIDATES, 13)
    assert trtllm_spec(out) == {
        "decoding_type": "Eagle3",
        "speculative_model": "./drafter",
        "max_draft_len": BLOCK - 1,
        "eagle3_layers_to_capture": DEFAULT_TAPS,
        "use_dynamic_tree": True,
        "dynamic_tree_max_topK": DRAFT_CANDIDATES,
        "max_total_draft_tokens": 12,
    }
    assert manifest["draft_tree_nodes"] == 12 and "a draft tree of 12 nodes" in (out / "README.md").read_text()

    # the setting stored with the drafter applies when none is given (loopspec tune keeps it there)
    stored = tmp_path / "stored"
    stored.mkdir()
    for f in drafter_dir.iterdir():
        (stored / f.name).write_bytes(f.read_bytes())
    config = json.loads((stored / "config.json").read_text())
    config["loopspec"]["dloop"] = {"block_size": 3, "tree_budget": 2}  # resolve_settings: dflash takes the tree
    (stored / "config.json").write_text(json.dumps(config))
    build_bundle(target_dir, str(stored), tmp_path / "from-stored", "sglang")
    assert sglang_shape(tmp_path / "from-stored")[2:] == (2, 2, 3)  # the drafter's block 5, its stored tree of 2


def test_every_tree_fits_each_engines_own_validation(drafter_dir):
    """The tree's numbers kept within the engines' rules: TensorRT-LLM's validate_eagle_config
    (max_draft_len <= max_total_draft_tokens <= dynamic_tree_max_topK * max_draft_len) and SGLang's
    organize_draft_results (num_draft_tokens - 1 of topk + (steps - 1) * topk^2 candidates); the nodes
    are at most what loopspec's tree over those steps holds (DRAFT_CANDIDATES a depth)."""
    from loopspec.convert.bundles.common import LaunchSettings
    from loopspec.convert.bundles.sglang import speculative_argv
    from loopspec.convert.bundles.trtllm import eagle3_speculative_config

    cfg = Eagle3Drafter.load(drafter_dir).cfg
    for block_size in (2, 3, 5, 9):
        for budget in (1, 2, 3, 5, 8, 9, 12, 17, 40, 100):
            s = LaunchSettings(
                name="t",
                tp=1,
                block_size=block_size,
                drafts=block_size - 1,
                mask_token_id=None,
                target_layer_ids=DEFAULT_TAPS,
                precision=None,
                max_batch_size=4,
                max_context=64,
                drafter=cfg,
                tree_budget=budget,
            )
            spec, argv = eagle3_speculative_config(s), speculative_argv(s)
            steps, topk, tokens = (
                int(flag(argv, f"--speculative-{n}")) for n in ("num-steps", "eagle-topk", "num-draft-tokens")
            )
            nodes = min(budget, DRAFT_CANDIDATES * (block_size - 1))
            case = (block_size, budget, spec, argv)
            assert spec["max_total_draft_tokens"] == nodes == tokens - 1 == s.verified_tokens - 1, case
            assert spec["max_draft_len"] <= nodes <= spec["dynamic_tree_max_topK"] * spec["max_draft_len"], case
            assert spec["max_draft_len"] == steps <= block_size - 1, case
            assert spec["dynamic_tree_max_topK"] == topk <= DRAFT_CANDIDATES, case
            assert tokens - 1 <= topk + (steps - 1) * topk * topk, case


def one_line_error(capsys, argv) -> str:
    code = main(argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("loopspec: error: "), lines
    return lines[0]


def test_what_an_engine_cannot_take_is_refused_in_one_line(target_dir, drafter_dir, tmp_path, capsys):
    argv = [
        "convert",
        "bundle",
        "--framework",
        "vllm",
        "--target",
        str(target_dir),
        "--drafter",
        str(drafter_dir),
        "--out",
        str(tmp_path / "b"),
        "--tree-budget",
        "6",
    ]
    line = one_line_error(capsys, argv)
    for words in (
        "vLLM cannot serve this EAGLE-3 drafter with a draft tree (6 nodes)",
        "chain",
        "engines that can: TensorRT-LLM >= 1.3, SGLang",
    ):
        assert words in line, line
    assert not (tmp_path / "b").exists()
    with pytest.raises(LoopspecError, match="block size must be >= 2, got 1") as e:  # no drafts at all
        build_bundle(target_dir, str(drafter_dir), tmp_path / "b", "sglang", setting={"block_size": 1})
    assert "\n" not in str(e.value)
    with pytest.raises(LoopspecError, match="not max_stages"):  # a knob the engines do not take
        build_bundle(target_dir, str(drafter_dir), tmp_path / "b", "sglang", setting={"max_stages": 2})


def test_llamacpp_tree_and_a_block_drafters_setting_are_refused(target_dir, drafter_dir, tiny_pair, tmp_path):
    with pytest.raises(LoopspecError, match="llama.cpp cannot serve this EAGLE-3 drafter with a draft tree") as e:
        build_bundle("default", str(drafter_dir), tmp_path / "b", "llamacpp", setting={"tree_budget": 4})
    assert "\n" not in str(e.value)
    with pytest.raises(LoopspecError, match="EAGLE-3 drafter's chain or tree.*trained block of 6") as e:
        build_bundle(tiny_pair[0], str(tiny_pair[1]), tmp_path / "c", "vllm", setting={"block_size": 4})
    assert "\n" not in str(e.value)


def test_eagle3_1_goes_where_its_switches_are_read_and_is_refused_elsewhere(target_dir, tmp_path):
    """An EAGLE 3.1 drafter (fc_norm + norm_output): vLLM and SGLang read both switches, so their bundles
    carry it with the switches and tap norms in drafter/; llama.cpp's converter and TensorRT-LLM would
    drop them, so those refuse in one line naming the switches; a norm_before_residual drafter goes to
    vLLM and llama.cpp, not SGLang."""
    from test_eagle3 import switch_tensors

    directory, _ = eagle3_checkpoint(
        tmp_path / "e31",
        loopspec={"block_size": BLOCK},
        fc_norm=True,
        norm_output=True,
        tensors=switch_tensors(("fc_norm",)),
    )
    manifest = build_bundle(target_dir, str(directory), tmp_path / "ok", "vllm,sglang")
    assert manifest["drafter_kind"] == "EAGLE-3 (fc_norm, norm_output)"
    config = json.loads((tmp_path / "ok" / "drafter" / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    written = Eagle3Drafter.load(tmp_path / "ok" / "drafter")
    assert written.cfg.variant.switched_on == ("fc_norm", "norm_output") and written.fc_norm is not None
    for framework, title, target in (("llamacpp", "llama.cpp", "default"), ("trtllm", "TensorRT-LLM", target_dir)):
        with pytest.raises(
            LoopspecError, match=f"{title}'s EAGLE-3 reader does not implement fc_norm, norm_output"
        ) as e:
            build_bundle(target, str(directory), tmp_path / framework, framework)
        assert "\n" not in str(e.value) and not (tmp_path / framework).exists()
    directory, _ = eagle3_checkpoint(tmp_path / "nbr", loopspec={"block_size": BLOCK}, norm_before_residual=True)
    assert build_bundle(target_dir, str(directory), tmp_path / "nbr-ok", "vllm")["engines"] == ["vllm"]
    with pytest.raises(LoopspecError, match="SGLang's EAGLE-3 reader does not implement norm_before_residual"):
        build_bundle(target_dir, str(directory), tmp_path / "nbr-sglang", "sglang")


def test_all_takes_the_engines_that_verify_the_tree(target_dir, drafter_dir, tmp_path):
    manifest = build_bundle(target_dir, str(drafter_dir), tmp_path / "b", "all", setting={"tree_budget": 6})
    assert manifest["engines"] == ["trtllm", "sglang"]


# --------------------------------------------------------------------------------------------------
# llama.cpp: the converter's inputs, and (with its converter) the eagle3 GGUF it writes

VENDORED_CONVERTER = "llamacpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py"


def llamacpp_converter() -> tuple[str, str] | None:
    """(python, convert_hf_to_gguf.py) as the bundle's convert.sh takes them (LLAMACPP_CONVERT, PYTHON;
    else the converter scripts/build_llama_server.sh keeps), or None."""
    script = os.environ.get("LLAMACPP_CONVERT") or str(Path(__file__).resolve().parents[1] / VENDORED_CONVERTER)
    return (os.environ.get("PYTHON", sys.executable), script) if Path(script).is_file() else None


@pytest.mark.e2e
def test_llamacpp_bundle_is_what_llamacpps_converter_reads(tmp_path):
    """The default target with a random EAGLE-3 drafter shaped for it: the launch runs draft-eagle3 after
    convert.sh; llamacpp/eagle3 loads back with identical weights and carries the taps as the stream
    entering layer j (llama.cpp's extract_layers); and, where llama.cpp's converter is at hand, its GGUF."""
    from loopspec.model.eagle3 import fresh_eagle3
    from loopspec.model.families import target_config
    from loopspec.weights import TargetSource, read_json

    target = target_config(read_json(TargetSource.of("default").checkpoint_dir() / "config.json", "target config"))
    torch.manual_seed(0)
    draft_ids = torch.randperm(target.vocab_size)[:512].sort().values
    model = fresh_eagle3(target, block_size=4, draft_ids=draft_ids, intermediate_size=64)
    model.save(tmp_path / "drafter", dtype=torch.float32)
    out = tmp_path / "bundle"
    manifest = build_bundle("default", str(tmp_path / "drafter"), out, "llamacpp")
    argv = launch_argv(out / "llamacpp" / "launch.sh")
    assert (flag(argv, "-md"), flag(argv, "--spec-type"), flag(argv, "--spec-draft-n-max")) == (
        "./llamacpp/drafter.gguf",
        "draft-eagle3",
        "3",
    )
    assert "|| sh ./llamacpp/convert.sh" in (out / "llamacpp" / "launch.sh").read_text()
    convert = (out / "llamacpp" / "convert.sh").read_text()
    assert "./llamacpp/eagle3" in convert and "--target-model-dir ./llamacpp/target-config" in convert
    assert {"config.json", "tokenizer.json"} <= {p.name for p in (out / "llamacpp" / "target-config").iterdir()}
    assert manifest["llamacpp"]["spec_type"] == "draft-eagle3" and manifest["draft_vocab"] == {"llamacpp": 512}
    written = Eagle3Drafter.load(out / "llamacpp" / "eagle3")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, written.state_dict()[name]), name
    assert torch.equal(written.draft_ids, draft_ids)
    config = json.loads((out / "llamacpp" / "eagle3" / "config.json").read_text())
    taps = model.cfg.target_layer_ids
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in taps] == [2, 15, 27]

    converter = llamacpp_converter()
    if converter is None:
        pytest.skip(
            f"no llama.cpp converter: set LLAMACPP_CONVERT (scripts/build_llama_server.sh keeps it at "
            f"{VENDORED_CONVERTER})"
        )
    python, script = converter
    env = {**os.environ, "LLAMACPP_CONVERT": script, "PYTHON": python}
    run = subprocess.run(["sh", str(out / "llamacpp" / "convert.sh")], env=env, capture_output=True, text=True)
    if run.returncode and "No module named" in run.stderr:
        pytest.skip(f"the converter's Python lacks a requirement: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-2000:]
    gguf = pytest.importorskip(
        "gguf", reason="needs the gguf package (a loopspec dependency) to read the converted drafter"
    )
    reader = gguf.GGUFReader(str(out / "llamacpp" / "drafter.gguf"))
    assert reader.fields["general.architecture"].contents() == "eagle3"
    assert list(reader.fields["eagle3.target_layers"].contents()) == [i + 1 for i in taps]
    d2t = next(t for t in reader.tensors if t.name == "d2t")
    assert d2t.data.tolist() == draft_ids.tolist()  # absolute target ids
