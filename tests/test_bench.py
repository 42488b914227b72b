"""`loopspec bench`: the --out report (JSON, Markdown, PNG plots), repeats, several prompt sets,
prompt sets by file, acceptance statistics and the transformers peers, on a tiny random pair."""

import json
import math

import pytest

from loopspec.cli import main
from loopspec.decoding import SamplingParams
from loopspec.errors import LoopspecError
from loopspec.runtime.pipeline import EngineChoice
from loopspec.weights import TargetSource
from loopspec.runtime.bench import (
    BenchOutput,
    BenchPlan,
    Runs,
    acceptance_stats,
    load_prompt_sets,
    median_run,
    run_bench,
    verifications_saved,
)

PLOTS = (
    "speedup.png",
    "acceptance.png",
    "tau_histogram.png",
    "time_split.png",
    "dloop_stages.png",
    "tree_budget.png",
    "cost_model.png",
)
METHODS = ("ar", "dflash", "dloop", "dflash+chain", "dflash+tree8", "dflash+tree8+suffix", "suffix", "hf", "hf-lookup")


@pytest.fixture
def prompt_sets(tmp_path):
    a, b = tmp_path / "alpha.jsonl", tmp_path / "beta.jsonl"
    a.write_text('{"turns": ["abc def"]}\n{"turns": ["xyz"]}\n')
    b.write_text('{"turns": ["hello there"]}\n')
    return a, b


@pytest.fixture(scope="module")
def report_dir(tiny_pair, tmp_path_factory):
    """One bench --out run: two prompt sets, every method, two repeats, cost model, DLoop forced to chain."""
    target, drafter = tiny_pair
    root = tmp_path_factory.mktemp("bench")
    (root / "alpha.jsonl").write_text('{"turns": ["abc def"]}\n{"turns": ["xyz"]}\n')
    (root / "beta.jsonl").write_text('{"turns": ["hello there"]}\n')
    out = root / "report"
    code = main(
        [
            "bench",
            "--prompts",
            str(root / "alpha.jsonl"),
            str(root / "beta.jsonl"),
            "--target",
            str(target),
            "--drafter",
            str(drafter),
            "--methods",
            ",".join(METHODS),
            "--max-new-tokens",
            "14",
            "--repeats",
            "2",
            "--gate-threshold=-1000",
            "--max-stages",
            "3",
            "--no-adaptive",
            "--cost-model",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    return out


def test_out_writes_json_markdown_and_plots(report_dir):
    from matplotlib.image import imread

    report = json.loads((report_dir / "bench.json").read_text())
    assert report["settings"]["command"].startswith("loopspec bench --prompts")
    assert report["settings"]["repeats"] == 2
    results = report["results"]
    assert [(r["dataset"], r["method"]) for r in results] == [(d, m) for d in ("alpha", "beta") for m in METHODS]
    for name in PLOTS:
        image = imread(report_dir / name)
        assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0  # drawn, not blank
    md = (report_dir / "bench.md").read_text()
    assert "## alpha (2 prompts)" in md and "## beta (1 prompt)" in md
    for r in results:  # one table row per (dataset, method), in its dataset's section
        section = md.split(f"## {r['dataset']} (")[1].split("\n## ")[0]
        assert f"| {r['method']} | {r['backend']} | " in section
    for name in PLOTS:
        assert f"]({name})" in md
    backend = results[0]["backend"]  # the default: onnxruntime where installed, else torch
    assert (
        backend in ("onnxruntime fp32", "torch fp32")
        and f"| dflash ({backend}) |" in md.split("## Speedup over `ar`")[1]
    )


def test_rows_are_lossless_and_consistent(report_dir):
    results = json.loads((report_dir / "bench.json").read_text())["results"]
    for r in results:  # (the timing columns: test_timing_columns_from_known_run_times)
        assert r["identical_to_ar"] is True and r["same_across_repeats"] is True and r["repeats"] == 2
    ar = [r for r in results if r["method"] == "ar"]
    assert all(r["tau"] == 1.0 and r["acceptance_curve"] == [] for r in ar)
    peers = [r for r in results if r["method"] in ("hf", "hf-lookup")]
    assert len(peers) == 4 and all(r["backend"] == "transformers" for r in peers)
    for r in results:
        if r["method"] not in ("dflash", "dloop"):
            continue
        curve, hist = r["acceptance_curve"], r["accepted_histogram"]
        assert len(curve) == (3 if r["method"] == "dloop" else 1) * 5  # stages × (k − 1), k = 6
        assert all(a >= b for a, b in zip(curve, curve[1:]))  # non-increasing
        assert sum(hist) == r["drafting_verifications"] > 0
        assert sum(curve) == pytest.approx(r["tau"] - 1)  # Σ P(accepted ≥ i) = mean accepted = τ − 1
    dloop = [r for r in results if r["method"] == "dloop"]
    for r in dloop:  # the gate always opens: chains of more than one stage happened
        assert len(r["stages_histogram"]) > 2 and sum(r["stages_histogram"][2:]) > 0
        assert r["stages_per_verification"] > 1
        k = len(r["acceptance_curve"]) // 3 + 1  # the block size: a verification of a accepted drafts stands for
        saved = [math.ceil((a + 1) / k) - 1 for a in range(len(r["accepted_histogram"]))]  # ceil((a+1)/k) DFlash ones
        assert r["verifications_saved"] == sum(n * s for n, s in zip(r["accepted_histogram"], saved))
        assert r["speedup_bound"] > 0 and r["speedup_bound_as_run"] > 0
    for r in results:
        if "tree8" in r["method"]:  # trees verify more nodes than the chain's 5
            assert 5 < r["nodes_per_verification"] <= 8 + 5 * ("suffix" in r["method"])
            assert r["speedup_bound"] > 0
        if "suffix" in r["method"]:
            assert 0 <= r["suffix_share"] <= 1
        if r["method"] == "dflash":
            assert 3 <= r["nodes_per_verification"] <= 5  # the chain of k - 1 = 5 (the last rounds are shorter)
    for r in results:  # as run mixes drafting rounds (at the drafting bound) with plain rounds (at 1×)
        if r["method"] in ("dflash", "dloop"):
            low, high = sorted((r["speedup_bound"], 1.0))
            assert low - 1e-9 <= r["speedup_bound_as_run"] <= high + 1e-9


def test_timing_columns_from_known_run_times():
    """The bench's measuring loop fed runs of known wall times and time splits (a stub in place of
    decoding, passed as its run_once): each prompt's median repeat counts, the warm-up does not,
    and every timing column equals its value worked out by hand below."""
    from types import SimpleNamespace

    from loopspec.runtime.bench import measure_sets
    from loopspec.settings import DecodingSettings
    from loopspec.stats import GenerationStats

    engine = "torch fp32"
    # wall seconds per call: the warm-up first (prompt 0 only), then three repeats
    wall = {
        ("ar", 0): [100.0, 4.0, 1.0, 2.0],
        ("ar", 1): [2.0, 9.0, 1.0],  # medians 2.0, 2.0
        ("dflash", 0): [100.0, 0.9, 1.0, 3.0],
        ("dflash", 1): [0.6, 0.2, 0.7],
    }  # medians 1.0, 0.6
    calls = {key: iter(times) for key, times in wall.items()}
    tokens = list(range(10, 18))  # 8 tokens, the same for both methods

    def run_once(run, ids, i, new_tokens):
        method, _ = run
        seconds = next(calls[method, i])
        if method == "ar":  # 8 plain rounds; a tenth of the time prefilling, half verifying
            stats = GenerationStats(
                accepted_per_round=[0] * 8, stages_per_round=[0] * 8, prefill_s=0.1 * seconds, verify_s=0.5 * seconds
            )
        else:  # drafting rounds accepting 3, 1 and 0 drafts and one plain round commit 4 + 2 + 1 + 1 = 8 tokens;
            # drafting a fifth of the time
            stats = GenerationStats(
                drafting=True,
                accepted_per_round=[3, 1, 0, 0],
                stages_per_round=[1, 1, 1, 0],
                nodes_per_round=[5, 5, 5, 0],
                prefill_s=0.1 * seconds,
                draft_s=0.2 * seconds,
                verify_s=0.5 * seconds,
            )
        return list(tokens), seconds, stats

    order = [("ar", engine), ("dflash", engine)]
    runs = Runs(
        order=order,
        decoding={order[0]: DecodingSettings(), order[1]: DecodingSettings("dflash", 6)},
        reported=set(order),
        reference=order[0],
        plain={order[0]: order[0], order[1]: order[0]},
    )
    ar, dflash = measure_sets(
        {"set": [[1, 2], [3, 4]]},
        runs,
        run_once,
        BenchPlan(prompt_sets=("set",), methods=("ar", "dflash"), max_new_tokens=8, repeats=3),
        progress=SimpleNamespace(set_description=lambda text: None, update=lambda: None),
    )
    assert all(next(it, None) is None for it in calls.values())  # one warm-up, three repeats each, no more
    # ar: 2.0 + 2.0 = 4 s for 16 tokens; prefill 0.2 + 0.2, verify 1.0 + 1.0, the rest 1.6
    assert (ar.seconds, ar.new_tokens, ar.tokens_per_s) == pytest.approx((4.0, 16, 4.0))
    assert (ar.prefill_s, ar.draft_s, ar.verify_s, ar.other_s) == pytest.approx((0.4, 0.0, 2.0, 1.6))
    # dflash: 1.0 + 0.6 = 1.6 s for 16 tokens = 10 tok/s, 2.5x ar's 4; τ = 14 tokens / 6 drafting verifications,
    # 16 tokens / 8 verifications over all rounds
    assert (dflash.seconds, dflash.tokens_per_s, dflash.speedup_vs_ar) == pytest.approx((1.6, 10.0, 2.5))
    assert (dflash.prefill_s, dflash.draft_s, dflash.verify_s, dflash.other_s) == pytest.approx((0.16, 0.32, 0.8, 0.32))
    assert dflash.tau == pytest.approx(14 / 6) and dflash.nodes_per_verification == 5
    assert dflash.tokens_per_verification == pytest.approx(2.0) and ar.tokens_per_verification == 1.0
    assert (dflash.verifications, dflash.drafting_verifications) == (8, 6)
    assert dflash.identical_to_ar is True and dflash.same_across_repeats is True


def test_the_stats_line_counts_plain_rounds_beside_tau():
    """τ is over the rounds that drafted; the line also gives tokens per verification over every round
    and how many were plain, so a fallback-heavy request cannot pass for a fast one."""
    from loopspec.stats import GenerationStats

    drafting = GenerationStats(
        new_tokens=10, drafting=True, accepted_per_round=[3, 0, 2, 0, 0], stages_per_round=[1, 0, 1, 1, 0]
    )
    assert drafting.acceptance_length == pytest.approx(8 / 3) and drafting.tokens_per_verification == pytest.approx(
        10 / 5
    )
    assert "tau 2.67 over 3 drafting verifications, 2.00 tokens/verification over all 5 (2 plain)" in drafting.summary()
    plain = GenerationStats(new_tokens=4, accepted_per_round=[0, 0, 0], stages_per_round=[0, 0, 0])
    assert plain.plain_rounds == 0 and "tau 1.00 over 3 verifications |" in plain.summary()


def test_acceptance_stats_curve_and_histogram():
    hist, curve = acceptance_stats([0, 3, 5, 1, 3], max_drafts=7)
    assert hist == [1, 1, 0, 2, 0, 1, 0, 0]
    assert curve == pytest.approx([4 / 5, 3 / 5, 3 / 5, 1 / 5, 1 / 5, 0, 0])
    assert sum(curve) == pytest.approx((0 + 3 + 5 + 1 + 3) / 5)
    assert acceptance_stats([], max_drafts=3) == ([0, 0, 0, 0], [0.0, 0.0, 0.0])


def test_verifications_saved_counts_dflash_rounds_for_the_same_commits():
    # k = 8: one DFlash round commits ≤ 8 tokens (7 drafts + bonus)
    assert verifications_saved([0, 6, 7], block_size=8) == 0
    assert verifications_saved([8], block_size=8) == 1  # 9 tokens: 2 DFlash rounds
    assert verifications_saved([15, 16, 28], block_size=8) == 1 + 2 + 3


def test_median_run_picks_the_median_wall_time():
    runs = [([1], 3.0, None), ([1], 1.0, None), ([1], 2.0, None)]
    assert median_run(runs) == 2
    assert median_run(runs + [([1], 0.5, None)]) == 1  # even count: the lower median (1.0 of 0.5/1/2/3)


def test_repeats_and_several_prompt_sets_through_the_api(tiny_pair, prompt_sets):
    target, drafter = tiny_pair
    results = run_bench(
        BenchPlan([str(p) for p in prompt_sets], ["ar", "dflash"], max_new_tokens=8, repeats=3),
        EngineChoice(str(target), str(drafter), backend="torch"),
    )
    assert [(r.dataset, r.method) for r in results] == [
        ("alpha", "ar"),
        ("alpha", "dflash"),
        ("beta", "ar"),
        ("beta", "dflash"),
    ]
    assert all(r.repeats == 3 and r.same_across_repeats and r.identical_to_ar for r in results)
    assert [r.prompts for r in results] == [2, 2, 1, 1]


def test_prompt_set_bad_input(prompt_sets, tmp_path):
    a, _ = prompt_sets
    with pytest.raises(LoopspecError, match="built-in sets: humaneval, mbpp, math500, mt-bench, alpaca"):
        load_prompt_sets(["nosuchset"])
    (tmp_path / "sub").mkdir()
    twin = tmp_path / "sub" / "alpha.jsonl"
    twin.write_text(a.read_text())
    with pytest.raises(LoopspecError, match="two prompt sets are named 'alpha'"):
        load_prompt_sets([str(a), str(twin)])


def test_bench_bad_out_and_methods(capsys, tiny_pair, prompt_sets, tmp_path):
    target, drafter = tiny_pair
    a, _ = prompt_sets
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    cases = (
        (["--out", str(a_file)], "--out is not a directory"),
        (["--methods", "ar,dflash,ar"], "named twice"),
        (["--methods", "ar,hf", "--temperature", "1"], "greedy only"),
        (["--methods", "ar,dflash+treeX"], "unknown part"),
        (["--methods", "ar,suffix+tree8"], "only dflash and dloop"),
        (["--methods", "ar,magic"], "unknown method"),
    )
    for extra, needle in cases:
        code = main(["bench", "--prompts", str(a), "--target", str(target), "--drafter", str(drafter), *extra])
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert code == 2 and len(err) == 1 and needle in err[0], err


def test_backends_side_by_side_in_one_run(tiny_pair, prompt_sets, tmp_path):
    """--backend torch,onnxruntime: every method on both backends in one process, same prompts;
    ar on the first backend is the reference for speedup and identity."""
    pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'loopspec[onnx]'")
    target, drafter = tiny_pair
    results = run_bench(
        BenchPlan([str(prompt_sets[0])], ["ar", "dflash", "dloop"], max_new_tokens=12),
        [EngineChoice(str(target), str(drafter), backend=b) for b in ("torch", "onnxruntime")],
        {"adaptive": False, "gate_threshold": -1000, "max_stages": 2},
        BenchOutput(out_dir=str(tmp_path / "out")),
    )
    assert [(r.method, r.backend) for r in results] == [
        (m, b) for b in ("torch fp32", "onnxruntime fp32") for m in ("ar", "dflash", "dloop")
    ]
    assert all(r.identical_to_ar for r in results)
    assert results[0].speedup_vs_ar == 1.0
    by = {(r.method, r.backend): r for r in results}
    assert by["dflash", "torch fp32"].tau == by["dflash", "onnxruntime fp32"].tau  # same drafts accepted on both
    assert all(r.agreement_with_fp32 == 1.0 for r in results)
    md = (tmp_path / "out" / "bench.md").read_text()
    assert "| ar (onnxruntime fp32) |" in md
    with pytest.raises(LoopspecError, match="name the engine torch fp32 twice"):
        run_bench(BenchPlan([str(prompt_sets[0])], ["ar"]), [EngineChoice(str(target), "none", backend="torch")] * 2)
    # on the command line the comma list itself is refused: one line, exit 2
    assert main(["bench", "--prompts", str(prompt_sets[0]), "--target", str(target), "--backend", "torch,torch"]) == 2


def test_llamacpp_rows_are_skipped_with_a_reason_without_a_binary(tiny_pair, prompt_sets, tmp_path, monkeypatch):
    """No llama-server on PATH: the llama.cpp rows are left out with one line saying why, the rest runs;
    a --llama-server that does not exist is a clear error before anything runs."""
    target, drafter = tiny_pair
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no llama-server to find
    report = tmp_path / "b.json"
    results = run_bench(
        BenchPlan([str(prompt_sets[1])], ["ar", "dflash", "llamacpp", "llamacpp-dflash"], max_new_tokens=8),
        EngineChoice(str(target), str(drafter), backend="torch"),
        output=BenchOutput(json_out=str(report)),
    )
    assert [r.method for r in results] == ["ar", "dflash"]
    skipped = json.loads(report.read_text())["settings"]["skipped"]
    assert set(skipped) == {"llamacpp", "llamacpp-dflash"} and "no llama-server on PATH" in skipped["llamacpp"]
    with pytest.raises(LoopspecError, match="does not exist or is not executable"):
        run_bench(
            BenchPlan([str(prompt_sets[1])], ["ar", "llamacpp"], llama_server=str(tmp_path / "llama-server")),
            EngineChoice(str(target), "none", backend="torch"),
        )
    with pytest.raises(LoopspecError, match="greedy only"):
        BenchPlan([str(prompt_sets[1])], ["ar", "llamacpp"], params=SamplingParams(temperature=0.7))


def test_a_llama_server_that_dies_at_load_is_a_skipped_row(tiny_pair, prompt_sets, tmp_path):
    """A llama-server that crashes while loading the model (as llama.cpp's AMX weight repacking did):
    it is tried again without repacking, and when that dies too its rows are skipped with the exit code
    and last log line; the bench itself runs to the end."""
    import stat

    target, drafter = tiny_pair
    gguf = tmp_path / "target.gguf"
    gguf.write_bytes(b"GGUF")  # never read: the server dies first
    calls = tmp_path / "calls.txt"
    binary = tmp_path / "llama-server"
    binary.write_text(
        f"#!/bin/sh\necho \"$@\" >> {calls}\necho 'load_tensors: repacking'\necho 'Segmentation fault'\nexit 139\n"
    )
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    # the tiny checkpoint directory for loopspec's engines, with a GGUF file beside it for llama.cpp
    source = TargetSource(name=str(target), is_default=False, gguf=gguf, directory=target)
    report = tmp_path / "b.json"
    results = run_bench(
        BenchPlan([str(prompt_sets[1])], ["ar", "dflash", "llamacpp"], max_new_tokens=8, llama_server=str(binary)),
        EngineChoice(source, str(drafter), backend="torch"),
        output=BenchOutput(json_out=str(report)),
    )
    assert [r.method for r in results] == ["ar", "dflash"]
    why = json.loads(report.read_text())["settings"]["skipped"]["llamacpp"]
    assert "exited with code 139 at load (load_tensors: repacking | Segmentation fault)" in why and "--no-repack" in why
    tried = calls.read_text().splitlines()
    assert len(tried) == 2 and "--no-repack" not in tried[0] and tried[1].endswith("--no-repack")


FAKE_SERVER_DYING_ON_ITS_FIRST_BATCH = """#!{python}
import http.server, os, sys
with open({calls!r}, "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
port = int(sys.argv[sys.argv.index("--port") + 1])


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # /health: loaded
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{{}}")

    def do_POST(self):  # the first batch: the crash llama.cpp's AMX repacking had on one Xeon
        print("ggml_amx: batch", flush=True)
        os._exit(139)

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_a_llama_server_that_dies_on_its_first_batch_is_a_skipped_row(tiny_pair, prompt_sets, tmp_path):
    """A llama-server that loads and answers /health but crashes on its first prompt of several tokens
    (as llama.cpp's AMX repacking did on an Intel Xeon): the bench probes a batch before it times
    anything, tries again without repacking, and skips the rows with the reason; the bench runs on."""
    import stat
    import sys

    target, drafter = tiny_pair
    gguf = tmp_path / "target.gguf"
    gguf.write_bytes(b"GGUF")
    calls = tmp_path / "calls.txt"
    binary = tmp_path / "llama-server"
    binary.write_text(FAKE_SERVER_DYING_ON_ITS_FIRST_BATCH.format(python=sys.executable, calls=str(calls)))
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    source = TargetSource(name=str(target), is_default=False, gguf=gguf, directory=target)
    report = tmp_path / "b.json"
    results = run_bench(
        BenchPlan([str(prompt_sets[1])], ["ar", "llamacpp"], max_new_tokens=8, llama_server=str(binary)),
        EngineChoice(source, str(drafter), backend="torch"),
        output=BenchOutput(json_out=str(report)),
    )
    assert [r.method for r in results] == ["ar"]
    why = json.loads(report.read_text())["settings"]["skipped"]["llamacpp"]
    assert "exited with code 139 on its first batch of 8 tokens (ggml_amx: batch)" in why and "--no-repack" in why
    tried = calls.read_text().splitlines()
    assert len(tried) == 2 and "--no-repack" not in tried[0] and tried[1].endswith("--no-repack")


@pytest.mark.e2e
def test_llamacpp_peers_beside_the_default_engines(tmp_path):
    """llama-server on the default GGUF, plain and with the shipped drafter, in one bench run with
    loopspec's engines: both rows complete, repeat their own output, and report τ from llama.cpp's
    counters. Whether its DFlash output equals its plain output is reported, not asserted: llama.cpp
    does not promise it (docs/benchmarks.md)."""
    from loopspec.engines.llamacpp import find_llama_server

    if find_llama_server() is None:
        pytest.skip(reason="no llama-server on PATH (scripts/build_llama_server.sh builds one)")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["Write a Python function that returns the n-th Fibonacci number."]}\n')
    report = tmp_path / "b.json"
    results = run_bench(
        BenchPlan([str(prompts)], ["ar", "llamacpp", "llamacpp-dflash"], max_new_tokens=32, repeats=2),
        EngineChoice(backend="torch", threads=2),
        output=BenchOutput(json_out=str(report)),
    )
    by = {r.method: r for r in results}
    assert by["llamacpp"].backend == by["llamacpp-dflash"].backend == "llama.cpp"
    assert by["llamacpp"].new_tokens == by["llamacpp-dflash"].new_tokens == 32
    assert by["llamacpp"].same_across_repeats and by["llamacpp-dflash"].same_across_repeats
    assert by["llamacpp"].tau == 1.0 and by["llamacpp-dflash"].tau > 1.0  # drafts were accepted
    assert by["llamacpp-dflash"].identical_to_ar in (True, False)  # compared with llamacpp's own output
    print(
        f"llamacpp-dflash: tau {by['llamacpp-dflash'].tau:.2f}, output identical to llamacpp's plain output: "
        f"{by['llamacpp-dflash'].identical_to_ar}"
    )
    assert 0.0 <= by["llamacpp"].fp32_matching_prefix <= 32
    command = json.loads(report.read_text())["settings"]["llamacpp"]["llamacpp-dflash"]
    assert "--spec-type" in command and "draft-dflash" in command
