"""The README's figures are the committed bench report's, and every repository path the docs name
exists: a number or a path that drifts from its source fails here."""

import json
import re
from pathlib import Path

import pytest

from loopspec.runtime.bench.headline import headline_table, per_set_table, step_table

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
HEADLINE_REPORT = "docs/bench-fused/bench.json"
DOCS = [README] + sorted((ROOT / "docs").glob("*.md"))


def test_the_readme_table_is_the_committed_reports():
    """The README quotes `scripts/headline_table.py` of the report it names, verbatim."""
    readme = README.read_text(encoding="utf-8")
    assert f"python scripts/headline_table.py {HEADLINE_REPORT}" in readme
    table = headline_table(json.loads((ROOT / HEADLINE_REPORT).read_text(encoding="utf-8")))
    assert table in readme


def test_the_benchmarks_page_quotes_the_same_report_per_set():
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert f"python scripts/headline_table.py {HEADLINE_REPORT} --per-set" in page
    assert per_set_table(json.loads((ROOT / HEADLINE_REPORT).read_text(encoding="utf-8"))) in page


def _row(dataset, method, backend, tokens_per_s, tau=None, new_tokens=0, verifications=0, identical=True, **kw):
    return dict(
        dataset=dataset,
        method=method,
        backend=backend,
        tokens_per_s=tokens_per_s,
        tau=tau,
        prompts=2,
        new_tokens=new_tokens,
        verifications=verifications,
        identical_to_ar=identical,
        **kw,
    )


def test_the_headline_ranges_are_computed_per_set():
    """Two sets, two engines and llama.cpp, every figure worked out by hand: speeds against the same
    set's `ar`, tokens per verification from the field or, in older reports, from the counts."""
    plain = {"method": "ar", "block_size": 1}
    chain = {"method": "dflash", "block_size": 4}
    report = {
        "settings": {
            "engines": {"int8": {"decoding": {"ar": plain, "dflash": chain}}, "fp32": {"decoding": {"ar": plain}}}
        },
        "results": [
            _row("a", "ar", "int8", 10.0, 1.0),
            _row("b", "ar", "int8", 20.0, 1.0),
            _row("a", "dflash", "int8", 15.0, 2.5, tokens_per_verification=1.5),
            _row("b", "dflash", "int8", 22.0, 3.0, new_tokens=42, verifications=20, identical=False),
            _row("a", "ar", "fp32", 5.0, 1.0),
            _row("b", "ar", "fp32", 5.0, 1.0),
            _row("a", "llamacpp", "llama.cpp", 30.0, 1.0),
            _row("b", "llamacpp", "llama.cpp", 22.0, 1.0),
        ],
    }
    lines = headline_table(report).splitlines()
    assert (
        lines[3] == "| `int8`, `dflash`: k=4 | 15.0–22.0 | 1.10–1.50× its `ar` | 2.50–3.00 | 1.50–2.00 | 1 of 2 sets |"
    )
    assert lines[4] == "| `fp32`, `ar` | 5.0 | 0.25–0.50× `int8`'s `ar` | 1 | 1 | – |"
    assert "reaches 0.50–1.00× of it" in lines[5]  # dflash's 15 of 30 on a, its 22 of 22 on b
    cells = per_set_table(report).splitlines()
    assert cells[3] == "| `dflash`, int8 | 15.0 (2.50 / 1.50, 1.50×) | 22.0 (3.00 / 2.00, 1.10×) |"


STEP_RUNS = [
    "docs/runs/2026-12-05/steps-gguf-int8act.json",
    "docs/runs/2026-12-05/genai-int4-a.json",
    "docs/runs/2026-12-05/genai-int4-b.json",
]


def test_the_benchmarks_page_quotes_the_committed_step_runs():
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert "python scripts/step_table.py " + " ".join(STEP_RUNS) in " ".join(page.split())
    ours, *genai = [json.loads((ROOT / path).read_text(encoding="utf-8")) for path in STEP_RUNS]
    assert step_table(ours, genai) in page


@pytest.mark.parametrize(
    "path",
    [
        "docs/runs/2026-12-06/steps-with-peers.json",
        "docs/runs/2026-12-06/step/steps-with-peers.json",
        "docs/runs/2026-12-07/step-times-fused.json",
    ],
)  # before / after the in-place past; the fused step graph
def test_the_benchmarks_page_quotes_the_step_run_with_its_peers(path):
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert "python scripts/step_table.py " + path in page
    run = json.loads((ROOT / path).read_text(encoding="utf-8"))
    assert set(run["peers"]) == {"llama.cpp", "onnxruntime-genai"}
    assert step_table(run, []) in page


def test_the_step_table_reads_each_point_once():
    """Two contexts, chains of 1 and 4, two rows; GenAI's two runs side by side, one context missing."""
    ours = {
        "steps": [
            {"k": 1, "rows": 1, "context": 256, "ms": 10.04},
            {"k": 4, "rows": 1, "context": 256, "ms": 12.0},
            {"k": 1, "rows": 1, "context": 1024, "ms": 11.0},
            {"k": 4, "rows": 1, "context": 1024, "ms": 14.5},
            {"k": 1, "rows": 2, "context": 250, "ms": 17.0},
            {"k": 1, "rows": 2, "context": 1000, "ms": 19.0},
        ]
    }
    genai = [
        {"steps": [{"k": 1, "rows": 1, "context": 256, "ms": 7.0}, {"k": 4, "rows": 1, "context": 256, "ms": 9.0}]},
        {"steps": [{"k": 1, "rows": 1, "context": 256, "ms": 7.5}]},
    ]
    assert step_table(ours, genai).splitlines() == [
        "| k new tokens, one row (ms) | ours, 256 | ours, 1024 | GenAI int4, 256 |",
        "|---|---|---|---|",
        "| 1 | 10.0 | 11.0 | 7.0 / 7.5 |",
        "| 4 | 12.0 | 14.5 | 9.0 / – |",
        "",
        "| rows of one token (ms) | ours, 256 | ours, 1024 |",
        "|---|---|---|",
        "| 1 | 10.0 | 11.0 |",
        "| 2 | 17.0 | 19.0 |",
    ]


def test_the_step_table_shows_the_session_alone_where_the_run_timed_it():
    """A step-graph engine's run carries its session's own time on one row ("bare_ms"): one column per
    context beside ours; a point without it shows a dash."""
    ours = {
        "steps": [
            {"k": 1, "rows": 1, "context": 256, "ms": 14.07, "bare_ms": 11.93},
            {"k": 4, "rows": 1, "context": 256, "ms": 19.73},
            {"k": 1, "rows": 4, "context": 250, "ms": 29.0},
        ]
    }
    lines = step_table(ours, []).splitlines()
    assert lines[0] == "| k new tokens, one row (ms) | ours, 256 | ours' session alone, 256 |"
    assert lines[2:4] == ["| 1 | 14.1 | 11.9 |", "| 4 | 19.7 | – |"]


PATH = re.compile(r"(?<![\w./~-])((?:loopspec|engines|runtime|convert|cli|scripts|tests|docs|data)/[\w./*-]*[\w*])")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_repository_path_in_the_docs_exists(doc):
    """Module paths, scripts, committed outputs and relative links (a glob matches at least one file)."""
    text = doc.read_text(encoding="utf-8")
    missing = []
    for path in [m.group(1) for m in PATH.finditer(text)] + [
        m.group(1) for m in LINK.finditer(text) if not m.group(1).startswith(("http:", "https:", "mailto:"))
    ]:
        bases = (ROOT, doc.parent)
        found = any(any(base.glob(path)) if "*" in path else (base / path).exists() for base in bases)
        if not found:
            missing.append(path)
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"
