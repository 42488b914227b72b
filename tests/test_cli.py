"""The command line: output on good input; one clear stderr line and exit code 2 on bad input."""

import json
import shutil
import socket
import subprocess
import sys

import pytest
from loopspec.cli import main
from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.weights import load_target_dir


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_ar_and_dflash_print_same_text(capsys, tiny_pair):
    """Every method on both CPU backends prints the same text; the default backend is ONNX Runtime
    where the onnx extra is installed, and the stats line names it."""
    from loopspec.runtime.pipeline import resolve_backend

    target, drafter = tiny_pair
    default = resolve_backend("auto")
    texts = {}
    for method in ("ar", "dflash"):
        for backend in ("default", "torch"):
            extra = [] if backend == "default" else ["--backend", backend]
            code, out, err = run(
                capsys,
                "generate",
                "--prompt",
                "hello world",
                "--target",
                str(target),
                "--drafter",
                str(drafter),
                "--method",
                method,
                "--max-new-tokens",
                "20",
                *extra,
            )
            assert code == 0
            assert "tokens in" in err and "tau" in err
            stats = [line for line in err.splitlines() if line.startswith(f"[{method}, k=")]
            assert len(stats) == 1 and f", {default if backend == 'default' else backend}" in stats[0]
            texts[method, backend] = out
    assert len(set(texts.values())) == 1 and len(texts["ar", "torch"].strip()) > 0
    for extra in (["--method", "dloop", "--tree-budget", "8", "--suffix"], ["--method", "suffix", "--drafter", "none"]):
        code, out, err = run(
            capsys,
            "generate",
            "--prompt",
            "hello world",
            "--target",
            str(target),
            "--drafter",
            str(drafter),
            "--max-new-tokens",
            "20",
            *extra,
        )
        stats = [line for line in err.splitlines() if line.startswith(("[dloop", "[suffix"))]  # not "[loopspec] ..."
        assert code == 0 and out == texts["ar", "torch"] and "nodes/verification" in stats[0]
        assert ("tree 8, + suffix" in stats[0]) == ("dloop" in extra)


def test_auto_backend_follows_design_default():
    import importlib.util

    from loopspec.runtime.pipeline import resolve_backend

    installed = all(importlib.util.find_spec(m) for m in ("onnxruntime", "onnx", "onnxscript"))
    assert resolve_backend("auto") == ("onnxruntime" if installed else "torch")
    assert resolve_backend("auto", device="cuda") == "torch"
    assert resolve_backend("auto", cuda_graphs=True) == "torch"
    assert resolve_backend("auto", onnx_dir="x") == "onnxruntime"
    assert resolve_backend("auto", trt_dir="x") == "tensorrt"
    assert resolve_backend("torch", onnx_dir="x") == "torch"  # explicit choices are kept (and checked later)


def test_bench_json(capsys, tiny_pair, tmp_path):
    target, drafter = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["abc def"]}\n{"turns": ["xyz", "second turn"]}\n')
    out_json = tmp_path / "r.json"
    code, out, err = run(
        capsys,
        "bench",
        "--prompts",
        str(prompts),
        "--target",
        str(target),
        "--drafter",
        str(drafter),
        "--max-new-tokens",
        "12",
        "--json",
        str(out_json),
        "--all-turns",
        "--methods",
        "ar,dflash,dloop",
        "--cost-model",
        "--gate-threshold=-3",
    )
    assert code == 0
    report = json.loads(out_json.read_text())
    # one set of flags: each method takes the knobs that apply to it (the gate is dloop's alone)
    (engine,) = report["settings"]["engines"].values()
    assert (
        engine["decoding"]["dloop"]["gate_threshold"] == -3 and engine["decoding"]["dflash"]["gate_threshold"] == -0.5
    )
    results = report["results"]
    assert [r["method"] for r in results] == ["ar", "dflash", "dloop"]
    cm = report["cost_model"]
    assert cm["bandwidth_gbs"] > 0 and cm["ar_bound_tokens_per_s"] > 0 and cm["draft_stage_s"] > 0
    assert all(r["speedup_bound"] > 0 for r in results)
    assert results[2]["stages_per_verification"] >= 1
    for r in results:
        assert set(r) >= {
            "method",
            "dataset",
            "prompts",
            "new_tokens",
            "tau",
            "tokens_per_s",
            "speedup_vs_ar",
            "identical_to_ar",
        }
        assert r["dataset"] == "p" and r["prompts"] == 3 and r["identical_to_ar"] is True
    assert "dflash" in out and "speedup" in out


def _one_error_line(err: str) -> str:
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def bad_cases(tiny_pair, tmp_path, tiny_targets):
    target, drafter = tiny_pair
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for f in target.iterdir():
        (corrupt / f.name).write_bytes(f.read_bytes())
    st = next(corrupt.glob("*.safetensors"))
    st.write_bytes(st.read_bytes()[:200])
    other = load_target_dir(tiny_targets["qwen3"])  # head_dim 32 but same hidden size: mismatch via layers
    cfg = DrafterConfig.for_target(other.cfg, num_layers=1, block_size=4, mask_token_id=127)
    cfg.num_target_layers = 9
    Drafter(cfg).save(tmp_path / "wrong_drafter")
    wider = tmp_path / "wider"  # config.json says hidden size 96, the weights are 64 wide
    wider.mkdir()
    for f in target.iterdir():
        (wider / f.name).write_bytes(f.read_bytes())
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "hidden_size": 96}))
    empty = tmp_path / "empty"
    empty.mkdir()
    # the PyTorch engine: these checks need the model, not a (first-time) ONNX export
    base = [
        "generate",
        "--target",
        str(target),
        "--drafter",
        str(drafter),
        "--max-new-tokens",
        "4",
        "--backend",
        "torch",
    ]
    # The cases below name a target that does not exist: their own check must come first, before
    # the model would load, or the line would say "does not exist" instead.
    never = str(tmp_path / "never-loaded")
    latin1 = tmp_path / "latin1.jsonl"  # "café" in Latin-1: byte 0xE9 is no UTF-8
    latin1.write_bytes(b'{"turns": ["ok"]}\n{"turns": ["caf\xe9"]}\n')
    good = tmp_path / "good.jsonl"
    good.write_text('{"turns": ["hello"]}\n')
    gen = ["generate", "--prompt", "x", "--target", never]
    costs = tmp_path / "costs.json"  # a well-formed table of another engine
    costs.write_text(
        json.dumps(
            {
                "engine": "onnxruntime gguf-int8act",
                "context": 64,
                "rows": [1],
                "widths": [1, 2],
                "verify_s": [[0.01, 0.012]],
                "draft_s": [0.002],
            }
        )
    )
    train = ["train", "--data", str(tmp_path / "data"), "--target", never, "--out", str(tmp_path / "drafter-out")]
    serve = ["serve", "--target", never]
    not_utf8 = "latin1.jsonl:2: prompt file is not UTF-8"
    deep = tmp_path / "deep.jsonl"  # a prompt line nested 100,000 deep: the JSON decoder's recursion
    deep.write_text('{"turns": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    huge_rank = tmp_path / "huge-rank"  # a Markov head of rank 2^40 would allocate 2^57 bytes
    shutil.copytree(drafter, huge_rank)
    config = json.loads((huge_rank / "config.json").read_text())
    config["dflash_config"]["markov_rank"] = 2**40
    (huge_rank / "config.json").write_text(json.dumps(config))
    huge_layer = tmp_path / "huge-layer"  # a config size its weights do not have: refused before allocating
    shutil.copytree(drafter, huge_layer)
    config = json.loads((huge_layer / "config.json").read_text())
    (huge_layer / "config.json").write_text(json.dumps({**config, "intermediate_size": 2**40}))
    pair = ["--target", str(target), "--mask-token-id", "127"]  # a tiny target whose vocabulary has no unused row
    real_train = ["train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "drafter-out"), *pair]
    listening = socket.socket()  # holds a port, as another server would
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    taken = str(listening.getsockname()[1])
    yield {
        "weights wider than config": (
            ["generate", "--prompt", "x", "--target", str(wider), "--drafter", "none", "--method", "ar"],
            "does not match its config.json",
        ),
        "empty target dir": (["generate", "--prompt", "x", "--target", str(empty)], "config.json"),
        "unknown path": (["generate", "--prompt", "x", "--target", str(tmp_path / "nope")], "does not exist"),
        "corrupt safetensors": (
            ["generate", "--prompt", "x", "--target", str(corrupt), "--drafter", "none", "--method", "ar"],
            "corrupt",
        ),
        "mismatched drafter": (
            [
                "generate",
                "--prompt",
                "x",
                "--target",
                str(target),
                "--drafter",
                str(tmp_path / "wrong_drafter"),
                "--backend",
                "torch",
            ],
            "does not fit",
        ),
        "empty prompt": (base + ["--prompt", "  "], "empty prompt"),
        "prompt over context": (base + ["--prompt", "a" * 40, "--max-context", "16"], "does not fit the context"),
        "negative temperature": (base + ["--prompt", "x", "--temperature", "-1"], "temperature"),
        "infinite temperature": (base + ["--prompt", "x", "--temperature", "inf"], "finite"),
        "block size 0": (base + ["--prompt", "x", "--block-size", "0"], "block-size"),
        "unknown method": (base + ["--prompt", "x", "--method", "magic"], "unknown method"),
        "bad top-p": (base + ["--prompt", "x", "--top-p", "0"], "top_p"),
        "negative tree budget": (base + ["--prompt", "x", "--tree-budget", "-1"], "--tree-budget"),
        "tree on suffix": (base + ["--prompt", "x", "--method", "suffix", "--tree-budget", "4"], "tree"),
        # fail before the model loads
        "bench prompts not UTF-8": (["bench", "--prompts", str(latin1), "--target", never], not_utf8),
        "tune prompts not UTF-8": (["tune", "--prompts", str(latin1), "--target", never], not_utf8),
        "data prompts not UTF-8": (
            ["data", "--prompts", str(latin1), "--target", never, "--out", str(tmp_path / "data-out")],
            not_utf8,
        ),
        "calibration prompts not UTF-8": (
            [
                "convert",
                "quantize",
                "--precision",
                "fp8",
                "--target",
                never,
                "--calib-prompts",
                str(latin1),
                "--out",
                str(tmp_path / "q-out"),
            ],
            "latin1.jsonl:2: calibration prompt file is not UTF-8",
        ),
        "tune --json into a missing folder": (
            ["tune", "--prompts", str(good), "--target", never, "--json", str(tmp_path / "no-such-folder" / "t.json")],
            "no-such-folder does not exist",
        ),
        "bench --json names a folder": (
            ["bench", "--prompts", str(good), "--target", never, "--json", str(tmp_path)],
            "is a directory",
        ),
        "bench --json into a missing folder": (
            ["bench", "--prompts", str(good), "--target", never, "--json", str(tmp_path / "no-such-folder" / "b.json")],
            "no-such-folder does not exist",
        ),
        "tune without a drafter": (
            ["tune", "--prompts", str(good), "--target", never, "--drafter", "none"],
            "tune needs a drafter",
        ),
        "tune storing into an exported engine": (["tune", "--prompts", str(good), "--onnx-dir", never], "--no-store"),
        "tune thresholds not numbers": (
            ["tune", "--prompts", str(good), "--target", never, "--thresholds=a,b"],
            "--thresholds must be comma-separated numbers",
        ),
        "seed 2**64": (gen + ["--seed", str(2**64)], "argument --seed: --seed must be in [0, 18446744073709551615]"),
        "negative seed": (gen + ["--seed", "-1"], "argument --seed: --seed must be in [0,"),
        "train seed 2**70": (train + ["--seed", str(2**70)], "train: argument --seed"),
        "data negative seed": (
            ["data", "--prompts", str(good), "--out", str(tmp_path / "d"), "--seed", "-5"],
            "data: argument --seed",
        ),
        "serve port 70000": (serve + ["--port", "70000"], "argument --port: --port must be in [1, 65535], got 70000"),
        "serve port 0": (serve + ["--port", "0"], "argument --port"),
        "serve port not a number": (serve + ["--port", "http"], "argument --port: --port must be an integer"),
        "serve log level bogus": (serve + ["--log-level", "bogus"], "argument --log-level: invalid choice: 'bogus'"),
        "train epochs inf": (train + ["--epochs", "inf"], "argument --epochs: --epochs must be a finite number > 0"),
        "train epochs nan": (train + ["--epochs", "nan"], "argument --epochs: --epochs must be a finite number > 0"),
        "train epochs 0": (train + ["--epochs", "0"], "argument --epochs: --epochs must be a finite number > 0"),
        "train epochs negative": (
            train + ["--epochs", "-2"],
            "argument --epochs: --epochs must be a finite number > 0",
        ),
        "train gamma 0": (train + ["--gamma", "0"], "argument --gamma: --gamma must be a finite number > 0"),
        "train gamma negative": (train + ["--gamma", "-7"], "argument --gamma: --gamma must be a finite number > 0"),
        "train lr nan": (train + ["--lr", "nan"], "argument --lr"),
        "train max minutes inf": (train + ["--max-minutes", "inf"], "argument --max-minutes"),
        "train kl weight negative": (
            train + ["--kl-weight", "-1"],
            "argument --kl-weight: --kl-weight must be a finite number >= 0",
        ),
        "generate without --prompt": (
            ["generate", "--target", never],
            "generate: the following arguments are required: --prompt",
        ),
        "generate unknown flag": (gen + ["--beam-width", "4"], "unrecognized arguments: --beam-width"),
        "max new tokens 0": (
            gen + ["--max-new-tokens", "0"],
            "argument --max-new-tokens: --max-new-tokens must be >= 1",
        ),
        "unknown command": (["translate"], "argument command: invalid choice: 'translate'"),
        "convert onnx unknown precision": (
            ["convert", "onnx", "--out", str(tmp_path / "o"), "--precision", "int3"],
            "convert onnx: argument --precision: invalid choice",
        ),
        "prompts count 0": (["prompts", "--out", str(tmp_path / "p.jsonl"), "--count", "0"], "argument --count"),
        # settings that cannot apply: refused, never ignored
        "gate threshold with dflash": (
            base + ["--prompt", "x", "--method", "dflash", "--gate-threshold", "-1"],
            "--gate-threshold does not apply to method dflash: it needs dloop",
        ),
        "gate threshold with suffix": (
            base + ["--prompt", "x", "--method", "suffix", "--drafter", "none", "--gate-threshold", "-1"],
            "--gate-threshold does not apply to method suffix",
        ),
        "max stages with dflash": (
            base + ["--prompt", "x", "--method", "dflash", "--max-stages", "3"],
            "--max-stages does not apply to method dflash",
        ),
        "block size with ar": (
            base + ["--prompt", "x", "--method", "ar", "--block-size", "4"],
            "--block-size does not apply to method ar",
        ),
        "draft sampling drafter with ar": (
            base + ["--prompt", "x", "--method", "ar", "--draft-sampling", "drafter"],
            "--draft-sampling does not apply to method ar",
        ),
        "draft sampling drafter greedy": (
            base + ["--prompt", "x", "--method", "dflash", "--draft-sampling", "drafter"],
            "--draft-sampling drafter samples drafts at temperature > 0",
        ),
        "gate threshold inf": (
            base + ["--prompt", "x", "--method", "dloop", "--gate-threshold", "inf"],
            "(--gate-threshold) must be a finite number, got inf",
        ),
        "gate threshold nan": (
            base + ["--prompt", "x", "--method", "dloop", "--gate-threshold", "nan"],
            "(--gate-threshold) must be a finite number, got nan",
        ),
        "bench knob for none of its methods": (
            ["bench", "--prompts", str(good), "--target", never, "--methods", "ar,dflash", "--gate-threshold", "-1"],
            "--gate-threshold does not apply to methods ar, dflash",
        ),
        "tune thresholds inf": (
            ["tune", "--prompts", str(good), "--target", never, "--thresholds=-1,inf"],
            "--thresholds inf: the gate threshold (--gate-threshold) must be a finite number",
        ),
        "tune suffix first 7": (
            ["tune", "--prompts", str(good), "--target", never, "--suffix-firsts", "0,7"],
            "--suffix-firsts 7: suffix-first match length must be 2..6",
        ),
        "tune block size 1": (
            ["tune", "--prompts", str(good), "--target", never, "--block-sizes", "1"],
            "--block-sizes 1: dloop needs a block size >= 2",
        ),
        "mask token id -1": (gen + ["--mask-token-id", "-1"], "argument --mask-token-id: --mask-token-id must be >= 0"),
        "mask token id with --drafter none": (
            base + ["--prompt", "x", "--method", "ar", "--drafter", "none", "--mask-token-id", "5"],
            "--mask-token-id 5 is a drafter's mask",
        ),
        "mask token id over the drafter's own": (base + ["--prompt", "x", "--mask-token-id", "5"], "has its own (127)"),
        "serve request timeout inf": (serve + ["--request-timeout", "inf"], "argument --request-timeout"),
        "serve request timeout nan": (serve + ["--request-timeout", "nan"], "argument --request-timeout"),
        "serve request timeout 0": (serve + ["--request-timeout", "0"], "argument --request-timeout"),
        "serve request timeout negative": (serve + ["--request-timeout", "-5"], "argument --request-timeout"),
        "serve on a port in use": (serve + ["--port", taken], f"--port {taken}: cannot listen on 127.0.0.1:{taken}"),
        "train heads only without init": (train + ["--heads-only", "--confidence-head"], "--heads-only"),
        "train gated Markov head without a rank": (
            train + ["--markov-head", "gated"],
            "a gated Markov head (--markov-head) needs its rank",
        ),
        "train confidence weight without the head": (
            real_train + ["--confidence-weight", "2"],
            "--confidence-weight weighs a confidence head's loss",
        ),
        "train loop stages -2": (train + ["--loop-stages", "-2"], "(--loop-stages) must be an integer >= 0"),
        "train draft vocabulary over the target's": (
            real_train + ["--draft-vocab-size", str(10**8)],
            "(--draft-vocab-size) is larger than the target's vocabulary",
        ),
        # tracebacks that became one line
        "prompt not UTF-8 in argv": (
            ["generate", "--prompt", "hi \udcff", "--target", never],
            "the value of --prompt is not valid UTF-8 (byte 0xff)",
        ),
        "bench --json under /proc": (
            ["bench", "--prompts", str(good), "--target", never, "--json", "/proc/x.json"],
            "--json /proc/x.json: cannot write there",
        ),
        "tune --json under /proc": (
            ["tune", "--prompts", str(good), "--target", never, "--json", "/proc/x.json"],
            "--json /proc/x.json: cannot write there",
        ),
        "bench --out under /proc": (
            ["bench", "--prompts", str(good), "--target", never, "--out", "/proc/x"],
            "--out /proc/x: cannot write there",
        ),
        "prompts --out under /proc": (
            ["prompts", "--out", "/proc/x.jsonl", "--count", "1", "--target", never],
            "--out /proc: cannot write there",
        ),  # (its folder, made where missing)
        "prompts --out in a new folder left out when the run fails": (
            ["prompts", "--out", str(tmp_path / "new" / "p.jsonl"), "--count", "1", "--target", never],
            "does not exist",
        ),
        "train --out under /proc": (
            ["train", "--data", str(tmp_path), "--target", never, "--out", "/proc/x"],
            "--out /proc/x: cannot write there",
        ),
        "convert --out under /proc": (
            ["convert", "onnx", "--target", never, "--out", "/proc/x"],
            "--out /proc/x: cannot write there",
        ),
        "bench --json left out when the run fails": (
            ["bench", "--prompts", str(good), "--target", never, "--json", str(tmp_path / "b.json")],
            "does not exist",
        ),
        "bench --out left out when the run fails": (
            ["bench", "--prompts", str(good), "--target", never, "--out", str(tmp_path / "report" / "deeper")],
            "does not exist",
        ),
        "prompt line nested 100,000 deep": (
            ["bench", "--prompts", str(deep), "--target", never],
            "deep.jsonl:1: JSON nested too deeply",
        ),
        "drafter markov rank 2^40": (
            base + ["--prompt", "x", "--drafter", str(huge_rank)],
            "markov_rank 1099511627776 is larger than the vocabulary of",
        ),
        "drafter config size beyond its weights": (
            base + ["--prompt", "x", "--drafter", str(huge_layer)],
            "the config makes it",
        ),
        "abbreviated flag": (gen + ["--max-new", "4"], "unrecognized arguments: --max-new 4"),
        "abbreviated prompt flag": (
            ["generate", "--target", never, "--prompt", "x", "--prom", "y"],
            "unrecognized arguments: --prom y",
        ),
        "costs widths not from 1": (["costs", "--target", never, "--widths", "2,4"], "--widths must start at 1"),
        "costs rows not increasing": (["costs", "--target", never, "--rows", "4,2"], "--rows must be increasing"),
        "costs reading a table": (["costs", "--target", never, "--step-costs", str(good)], "--step-costs reads one"),
        "step costs file missing": (gen + ["--step-costs", str(tmp_path / "nope.json")], "No such file"),
        "step costs not a table": (gen + ["--step-costs", str(good)], "missing engine, context, rows, widths"),
        "step costs with ar": (
            base + ["--prompt", "x", "--method", "ar", "--step-costs", str(costs)],
            "--step-costs feeds the verification budget of --adaptive, which method ar does not run",
        ),
        "step costs of another engine": (
            base + ["--prompt", "x", "--method", "dflash", "--step-costs", str(costs)],
            "measured on the onnxruntime gguf-int8act engine, not torch fp32",
        ),
    }
    listening.close()


CASES = [
    "weights wider than config",
    "empty target dir",
    "unknown path",
    "corrupt safetensors",
    "mismatched drafter",
    "empty prompt",
    "prompt over context",
    "negative temperature",
    "infinite temperature",
    "block size 0",
    "unknown method",
    "bad top-p",
    "negative tree budget",
    "tree on suffix",
    "bench prompts not UTF-8",
    "tune prompts not UTF-8",
    "data prompts not UTF-8",
    "calibration prompts not UTF-8",
    "tune --json into a missing folder",
    "bench --json names a folder",
    "bench --json into a missing folder",
    "tune without a drafter",
    "tune storing into an exported engine",
    "tune thresholds not numbers",
    "seed 2**64",
    "negative seed",
    "train seed 2**70",
    "data negative seed",
    "serve port 70000",
    "serve port 0",
    "serve port not a number",
    "serve log level bogus",
    "train epochs inf",
    "train epochs nan",
    "train epochs 0",
    "train epochs negative",
    "train gamma 0",
    "train gamma negative",
    "train lr nan",
    "train max minutes inf",
    "train kl weight negative",
    "generate without --prompt",
    "generate unknown flag",
    "max new tokens 0",
    "unknown command",
    "convert onnx unknown precision",
    "prompts count 0",
    "gate threshold with dflash",
    "gate threshold with suffix",
    "max stages with dflash",
    "block size with ar",
    "draft sampling drafter with ar",
    "draft sampling drafter greedy",
    "gate threshold inf",
    "gate threshold nan",
    "bench knob for none of its methods",
    "tune thresholds inf",
    "tune suffix first 7",
    "tune block size 1",
    "mask token id -1",
    "mask token id with --drafter none",
    "mask token id over the drafter's own",
    "serve request timeout inf",
    "serve request timeout nan",
    "serve request timeout 0",
    "serve request timeout negative",
    "serve on a port in use",
    "train heads only without init",
    "train gated Markov head without a rank",
    "train confidence weight without the head",
    "train loop stages -2",
    "train draft vocabulary over the target's",
    "prompt not UTF-8 in argv",
    "bench --json under /proc",
    "tune --json under /proc",
    "bench --out under /proc",
    "prompts --out under /proc",
    "prompts --out in a new folder left out when the run fails",
    "train --out under /proc",
    "convert --out under /proc",
    "bench --json left out when the run fails",
    "bench --out left out when the run fails",
    "prompt line nested 100,000 deep",
    "drafter markov rank 2^40",
    "drafter config size beyond its weights",
    "abbreviated flag",
    "abbreviated prompt flag",
    "costs widths not from 1",
    "costs rows not increasing",
    "costs reading a table",
    "step costs file missing",
    "step costs not a table",
    "step costs with ar",
    "step costs of another engine",
]


def _files_under(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_2_with_one_line(case, bad_cases, capsys, tmp_path):
    """One line `loopspec: error: ...` naming the cause, exit code 2, and nothing written."""
    argv, needle = bad_cases[case]
    before = _files_under(tmp_path)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse-level errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    line = _one_error_line(err)
    assert line.startswith("loopspec: error: ") and needle in line, line
    assert _files_under(tmp_path) == before


def test_bench_bad_prompt_file(capsys, tiny_pair, tmp_path):
    target, drafter = tiny_pair
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\nnot json\n')
    for path, needle in ((bad, "bad.jsonl:2"), (tmp_path / "missing.jsonl", "does not exist")):
        code = main(["bench", "--prompts", str(path), "--target", str(target), "--drafter", str(drafter)])
        assert code == 2 and needle in _one_error_line(capsys.readouterr().err)


def test_console_script_entry_point(tiny_pair):
    target, _ = tiny_pair
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loopspec.cli",
            "generate",
            "--prompt",
            "hi",
            "--target",
            str(target),
            "--drafter",
            "none",
            "--method",
            "ar",
            "--max-new-tokens",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "loopspec.cli", "generate", "--prompt", "hi", "--target", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_tune_stores_fastest_lossless_setting(capsys, tiny_pair, tmp_path):
    import shutil

    target, drafter = tiny_pair
    mine = tmp_path / "drafter"
    shutil.copytree(drafter, mine)
    prompts = tmp_path / "calib.jsonl"
    prompts.write_text('{"turns": ["tune me"]}\n{"turns": ["and me too"]}\n')
    out_json = tmp_path / "tune.json"
    code = main(
        [
            "tune",
            "--prompts",
            str(prompts),
            "--target",
            str(target),
            "--drafter",
            str(mine),
            "--max-new-tokens",
            "16",
            "--thresholds=-0.5,-2",
            "--stages",
            "1,3",
            "--block-sizes",
            "3,6",
            "--tree-budgets",
            "0,8",
            "--suffix-firsts",
            "0,3",
            "--json",
            str(out_json),
        ]
    )
    assert code == 0
    report = json.loads(out_json.read_text())
    rows = report["rows"]
    # k x (one-stage + two thresholds for 3 stages), then on the best: chain + suffix, tree 8 ± suffix,
    # then the chain policy (match of 3) on the best chain and, when it differs, the best tree setting
    chains, trees, firsts = rows[:6], rows[6:9], rows[9:]
    assert len(chains) == 2 * (1 + 2) and not any(r["tree_budget"] or r["suffix"] or r["suffix_first"] for r in chains)
    assert {(r["tree_budget"], r["suffix"]) for r in trees} == {(0, True), (8, False), (8, True)}
    from loopspec.runtime.tune import choose

    best_chain = choose(chains)
    assert firsts[0]["suffix_first"] == 3 and all(
        firsts[0][k] == best_chain[k] for k in ("block_size", "max_stages", "gate_threshold")
    )
    assert len(firsts) in (2, 4) and all(r["suffix_first"] == 3 for r in firsts)  # both variants
    assert sorted(r["suffix_then_draft"] for r in firsts[:2]) == [False, True]
    assert all(r["lossless"] for r in rows)
    extra = json.loads((mine / "config.json").read_text())["loopspec"]
    stored = extra["dloop"]  # the first tuned setting is the drafter's default for every backend
    assert stored == {
        k: report["best"][k]
        for k in (
            "gate_threshold",
            "max_stages",
            "block_size",
            "tree_budget",
            "suffix",
            "suffix_first",
            "suffix_then_draft",
        )
    }
    assert list(extra["tuned"].values()) == [stored] and list(extra["tuned"]) in (["onnxruntime"], ["torch"])
    from loopspec.runtime.pipeline import load_pipeline

    pipe = load_pipeline(str(target), str(mine))
    assert pipe.settings("dloop").max_stages == stored["max_stages"]
    assert pipe.settings("dloop").block_size == stored["block_size"]
    assert pipe.settings("dloop").suffix_first == stored["suffix_first"]
    assert pipe.settings("dloop").suffix_then_draft == stored["suffix_then_draft"]
    assert (
        main(["tune", "--prompts", str(prompts), "--target", str(target), "--drafter", str(mine), "--stages", "0"]) == 2
    )


@pytest.mark.parametrize(
    "kwargs", [{"max_context": 0}, {"max_context": -8}, {"max_context": 2.5}, {"max_context": True}, {"num_threads": 0}]
)
def test_load_pipeline_refuses_a_bad_size_before_loading(kwargs):
    """The Python API: a ValueError naming the parameter, raised before the (default) model loads."""
    from loopspec.runtime.pipeline import load_pipeline

    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
        load_pipeline("/nonexistent-target", "none", **kwargs)


def _subcommands(parser):
    import argparse

    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_decoding_knob_is_one_flag_and_every_decoding_flag_a_knob():
    """The decoding knobs are declared once, in DecodingSettings' fields: every command that decodes
    takes one flag per knob, as its Knob declares it, and parses into the knob dict resolve_settings
    takes; a flag whose destination is a settings field is a knob's."""
    import dataclasses

    from loopspec.cli import build_parser
    from loopspec.cli.flags import decoding_knobs
    from loopspec.settings import KNOBS, DecodingSettings, knobs_of, resolve_settings

    fields = {f.name for f in dataclasses.fields(DecodingSettings)}
    assert set(KNOBS) == fields - {"method"}
    commands = _subcommands(build_parser())
    for name in ("generate", "bench", "serve"):
        actions = {a.dest: a for a in commands[name]._actions}
        assert {dest for dest in actions if dest in fields} == set(KNOBS) | ({"method"} & set(actions)), name
        for knob_name, knob in KNOBS.items():
            assert actions[knob_name].option_strings[0] == knob.flag and actions[knob_name].help == knob.help
    args = commands["generate"].parse_args(
        ["--prompt", "x", "--tree-budget", "3", "--no-adaptive", "--gate", "confidence", "--draft-sampling", "walk"]
    )
    knobs = decoding_knobs(args)
    assert knobs == {name: knob.unset for name, knob in KNOBS.items()} | {
        "tree_budget": 3,
        "adaptive": False,
        "gate": "confidence",
        "draft_sampling": "walk",
    }
    assert resolve_settings("suffix", None, **(knobs | {"tree_budget": 0, "gate": None})).adaptive is False
    # a knob added to the settings without its Knob (so without a flag) is refused where KNOBS is made
    planted = dataclasses.make_dataclass(
        "Planted", [("beam_width", int, dataclasses.field(default=1))], bases=(DecodingSettings,), frozen=True
    )
    with pytest.raises(TypeError, match="Planted.beam_width is declared without a Knob"):
        knobs_of(planted)
    with pytest.raises(TypeError, match="unexpected keyword argument 'beam_width'"):
        resolve_settings("ar", None, beam_width=2)


def test_bundle_framework_flag_and_its_deprecated_spelling(capsys):
    """`convert bundle --framework`; `--engine` still parses into it, with one line on stderr."""
    from loopspec.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["convert", "bundle", "--framework", "vllm,sglang", "--out", "o"])
    assert args.framework == "vllm,sglang" and capsys.readouterr().err == ""
    args = parser.parse_args(["convert", "bundle", "--engine", "all", "--out", "o"])
    assert args.framework == "all"
    assert capsys.readouterr().err == "loopspec: warning: --engine is deprecated; use --framework\n"
    for argv, needle in (
        (["--out", "o"], "one of the arguments --framework is required"),
        (["--framework", "vllm", "--engine", "vllm", "--out", "o"], "not allowed with"),
    ):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["convert", "bundle", *argv])
        line = _one_error_line(
            capsys.readouterr().err.replace("loopspec: warning: --engine is deprecated; use --framework\n", "")
        )
        assert e.value.code == 2 and line.startswith("loopspec: error: convert bundle: ") and needle in line


def test_costs_measures_a_table_that_generate_and_bench_read(capsys, tiny_pair, tmp_path):
    """`loopspec costs --out` writes the engine's table; `--step-costs` hands it to the verification
    budget, and the output stays plain decoding's."""
    target, drafter = tiny_pair
    pair = ["--target", str(target), "--drafter", str(drafter), "--backend", "torch"]
    out = tmp_path / "costs.json"
    code, printed, _ = run(
        capsys,
        "costs",
        *pair,
        "--rows",
        "1,2",
        "--widths",
        "1,2,4",
        "--context",
        "16",
        "--repeats",
        "1",
        "--out",
        str(out),
    )
    assert code == 0 and f"stored: {out}" in printed and "drafter stage" in printed
    table = json.loads(out.read_text())
    assert table["engine"] == "torch fp32" and table["rows"] == [1, 2] and table["widths"] == [1, 2, 4]
    texts = {}
    for extra in ([], ["--step-costs", str(out)]):
        code, printed, err = run(
            capsys, "generate", "--prompt", "hello world", *pair, "--method", "dflash", "--max-new-tokens", "12", *extra
        )
        assert code == 0
        texts[bool(extra)] = printed
        assert "adaptive: " in err and (not extra or "adaptive: verification budget" in err)
    assert texts[True] == texts[False]
