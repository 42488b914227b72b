"""`loopspec bench`: plan.py (what a run measures: BenchPlan, its prompts, BenchOutput), run.py
(run_bench: every method on every engine, measured and compared with `ar`), peers.py (transformers
and llama.cpp measured beside them), report.py (the printed table, bench.md and the plots)."""

from loopspec.runtime.bench.plan import BenchOutput, BenchPlan, load_prompt_sets, load_prompts  # noqa: F401
from loopspec.runtime.bench.run import (  # noqa: F401
    BenchResult,
    Runs,
    acceptance_stats,
    measure_sets,
    median_run,
    run_bench,
    verifications_saved,
)
