"""`loopspec bench`: every method on the same prompts in one process, compared against `ar`."""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from loopspec.decoding import SamplingParams
from loopspec.errors import LoopspecError


@dataclass
class BenchResult:
    method: str
    dataset: str
    prompts: int
    new_tokens: int
    tau: float | None
    tokens_per_s: float
    speedup_vs_ar: float | None
    identical_to_ar: bool | None
    seconds: float
    verifications: int
    draft_s: float
    verify_s: float
    stages_per_verification: float | None = None
    later_stage_share: float | None = None  # share of committed tokens drafted by stages > 1
    speedup_bound: float | None = None  # τ·t(1) / (stages·t_draft + t_verify(len)) from the cost model
    fallback_rounds: int = 0  # plain rounds chosen by the adaptive fallback


def load_prompts(path: str | Path, limit: int | None = None, all_turns: bool = False) -> list[str]:
    """Prompts from a `{"turns": [...]}` JSONL file (first turn of each line unless all_turns)."""
    path = Path(path)
    if not path.is_file():
        raise LoopspecError(f"prompt file does not exist: {path}")
    prompts: list[str] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                turns = json.loads(line)["turns"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise LoopspecError(f"{path}:{number}: expected a JSON object with a 'turns' list") from None
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise LoopspecError(f"{path}:{number}: 'turns' must be a non-empty list of strings")
            prompts.extend(turns if all_turns else turns[:1])
            if limit is not None and len(prompts) >= limit:
                return prompts[:limit]
    if not prompts:
        raise LoopspecError(f"no prompts in {path}")
    return prompts


def _table(results: list[BenchResult]) -> str:
    head = f"{'dataset':<14}{'method':<10}{'prompts':>8}{'tokens':>8}{'tau':>7}{'tok/s':>8}{'speedup':>9}{'same as ar':>12}"
    lines = [head, "-" * len(head)]
    for r in results:
        speed = "-" if r.speedup_vs_ar is None else f"{r.speedup_vs_ar:.2f}x"
        same = "-" if r.identical_to_ar is None else ("yes" if r.identical_to_ar else "NO")
        tau = "-" if r.tau is None else f"{r.tau:.2f}"
        lines.append(f"{r.dataset:<14}{r.method:<10}{r.prompts:>8}{r.new_tokens:>8}{tau:>7}"
                     f"{r.tokens_per_s:>8.1f}{speed:>9}{same:>12}")
    return "\n".join(lines)


def run_bench(*, prompt_files: list[str], methods: list[str], target: str = "default", drafter: str = "default",
              limit: int | None = None, max_new_tokens: int = 128, all_turns: bool = False,
              params: SamplingParams = SamplingParams(), block_size: int | None = None, seed: int = 0,
              repeats: int = 1, json_out: str | None = None, chat: bool = True, max_context: int | None = None,
              mask_token_id: int | None = None, num_threads: int | None = None,
              gate_threshold: float | None = None, max_stages: int | None = None,
              cost_model: bool = False, adaptive: bool = True) -> list[BenchResult]:
    from tqdm import tqdm

    from loopspec.runtime.peers import PEER_METHODS, HFPeer
    from loopspec.runtime.pipeline import METHODS, load_pipeline

    unknown = [m for m in methods if m not in METHODS + PEER_METHODS]
    if unknown or not methods:
        raise LoopspecError(f"unknown method(s) {unknown or methods} (choose from {', '.join(METHODS + PEER_METHODS)})")
    if any(m in PEER_METHODS for m in methods) and not params.greedy:
        raise LoopspecError("the transformers peers are measured greedy only (use --temperature 0)")
    datasets = {Path(f).stem: load_prompts(f, limit, all_turns) for f in prompt_files}  # validate all first
    if json_out is not None and not Path(json_out).resolve().parent.is_dir():
        raise LoopspecError(f"directory for --json does not exist: {Path(json_out).parent}")
    needs_drafter = any(m not in ("ar",) + PEER_METHODS for m in methods)
    pipe = load_pipeline(target, drafter if needs_drafter else "none",
                         max_context=max_context, mask_token_id=mask_token_id, num_threads=num_threads)
    sizes = {m: pipe.block_size_for(m, block_size) for m in methods if m in METHODS}
    peer = HFPeer(pipe.target_dir, pipe.stop_token_ids, num_threads) if any(m in PEER_METHODS for m in methods) else None
    order = ["ar"] + [m for m in methods if m != "ar"]  # ar always runs: it is the reference

    encoded_sets = {name: [pipe.encode(p, chat=chat) for p in prompts] for name, prompts in datasets.items()}
    for name, encoded in encoded_sets.items():
        too_long = [len(ids) for ids in encoded if len(ids) >= pipe.engine.max_context]
        if too_long:
            raise LoopspecError(f"{name}: a prompt of {too_long[0]} tokens does not fit the context of {pipe.engine.max_context}")
    if needs_drafter:
        print(f"[loopspec] drafter: {pipe.drafter_description}", file=sys.stderr)
    results: list[BenchResult] = []
    for dataset, prompts in datasets.items():
        encoded = encoded_sets[dataset]
        for method in order:  # warm-up: first calls allocate and pack
            if method in PEER_METHODS:
                peer.run(encoded[0], method, 8)
            else:
                pipe.run(encoded[0], method=method, max_new_tokens=8, params=params, block_size=sizes[method],
                         gate_threshold=gate_threshold, max_stages=max_stages)
        outputs: dict[str, list[list[int]]] = {}
        per_method: dict[str, BenchResult] = {}
        for method in order:
            k = sizes.get(method, 1)
            times, runs = [], None
            for rep in range(repeats):
                runs = []
                t0 = time.perf_counter()
                for i, ids in enumerate(tqdm(encoded, desc=f"{dataset}/{method}", leave=False, file=sys.stderr)):
                    if method in PEER_METHODS:
                        runs.append(peer.run(ids, method, max_new_tokens))
                    else:
                        runs.append(pipe.run(ids, method=method, max_new_tokens=max_new_tokens, params=params,
                                             block_size=k, seed=seed + i, gate_threshold=gate_threshold,
                                             max_stages=max_stages, adaptive=adaptive))
                times.append(time.perf_counter() - t0)
            seconds = statistics.median(times)
            outputs[method] = [r.tokens for r in runs]
            new_tokens = sum(len(r.tokens) for r in runs)
            if method in PEER_METHODS:  # transformers does not report its acceptance
                tau, verifications, draft_s, verify_s = (1.0 if method == "hf" else None), 0, 0.0, 0.0
            else:
                verifications = sum(r.stats.verifications for r in runs)
                # τ over the verifications that checked drafts (plain rounds of the adaptive fallback and
                # the last single-token rounds commit 1 by construction and would dilute it)
                drafted = [n + 1 for r in runs for n, s in zip(r.stats.accepted_per_round, r.stats.stages_per_round)
                           if s > 0 or method == "ar"]
                tau = sum(drafted) / max(len(drafted), 1)
                draft_s, verify_s = sum(r.stats.draft_s for r in runs), sum(r.stats.verify_s for r in runs)
            per_method[method] = BenchResult(
                method=method, dataset=dataset, prompts=len(prompts), new_tokens=new_tokens, tau=tau,
                tokens_per_s=new_tokens / seconds, speedup_vs_ar=None, identical_to_ar=None, seconds=seconds,
                verifications=verifications, draft_s=draft_s, verify_s=verify_s)
            if method not in PEER_METHODS:
                per_method[method].fallback_rounds = sum(r.stats.fallback_rounds for r in runs)
            if method == "dloop":
                stages = [n for r in runs for n in r.stats.stages_per_round if n > 0]  # rounds that drafted
                per_method[method].stages_per_verification = sum(stages) / max(len(stages), 1)
                per_method[method].later_stage_share = sum(r.stats.later_stage_tokens for r in runs) / max(new_tokens, 1)
        base = per_method["ar"]
        for method in order:
            if method not in methods:
                continue
            r = per_method[method]
            r.speedup_vs_ar = r.tokens_per_s / base.tokens_per_s
            r.identical_to_ar = outputs[method] == outputs["ar"] if params.greedy else None
            results.append(r)

    cm = measure_cost_model(pipe, sizes, results, gate_threshold, max_stages) if cost_model else None
    report = {"results": [asdict(r) for r in results]}
    if cm is not None:
        report["cost_model"] = cm
    print(_table(results))
    if cost_model:
        cm = report["cost_model"]
        print(f"memory bandwidth {cm['bandwidth_gbs']:.1f} GB/s, target weights {cm['target_weight_mb']:.0f} MB "
              f"→ plain decoding bound {cm['ar_bound_tokens_per_s']:.1f} tok/s; "
              f"t_verify(n) ms: {', '.join(f'{n}: {t * 1e3:.1f}' for n, t in cm['verify_s'].items())}; "
              f"draft stage {cm['draft_stage_s'] * 1e3:.1f} ms" if cm.get("draft_stage_s") else "")
        for r in results:
            if r.speedup_bound is not None:
                print(f"  {r.dataset}/{r.method}: speedup {r.speedup_vs_ar:.2f}x of a {r.speedup_bound:.2f}x bound")
    if json_out is not None:
        Path(json_out).write_text(json.dumps(report, indent=2) + "\n")
    return results


def measure_cost_model(pipe, sizes: dict, results: list[BenchResult], gate_threshold, max_stages) -> dict:
    """Bandwidth bound of plain decoding, t_verify(n), drafter stage time, and each result's bound."""
    from loopspec.runtime.costmodel import draft_time, memory_bandwidth_gbs, speedup_bound, verify_times, weight_bytes

    bandwidth = memory_bandwidth_gbs()
    weights = weight_bytes(pipe.target)
    lengths = sorted({1, 2, 4, 8} | {k for k in sizes.values()}
                     | ({min(64, (pipe.dloop_settings(gate_threshold, max_stages)["max_stages"]) * (sizes["dloop"] - 1) + 1)}
                        if "dloop" in sizes else set()))
    t_verify = verify_times(pipe.engine, lengths)
    t_draft = draft_time(pipe.engine, max(sizes.values())) if pipe.drafter is not None and max(sizes.values()) > 1 else None
    for r in results:
        if r.method == "ar":
            r.speedup_bound = 1.0
        elif r.method in ("dflash", "dloop") and t_draft is not None and r.tau is not None:
            stages = r.stages_per_verification or 1.0
            n = min(max(t_verify), int(round(stages * (sizes[r.method] - 1))) + 1)
            nearest = min(t_verify, key=lambda m: abs(m - n))
            r.speedup_bound = speedup_bound(r.tau, t_verify[1], stages * t_draft, t_verify[nearest])
    return {"bandwidth_gbs": bandwidth, "target_weight_mb": weights / 1e6,
            "ar_bound_tokens_per_s": bandwidth * 1e9 / weights, "verify_s": t_verify, "draft_stage_s": t_draft}
