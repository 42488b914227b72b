"""`loopspec bench`: every method on the same prompts in one process, compared against `ar`.

Per (dataset, method): τ, tokens/s (sum over prompts of each prompt's median wall time over the
repeats), speedup over `ar` of the same dataset, identity with `ar`, the per-position acceptance
curve, the τ histogram, the DLoop breakdown and the prefill/draft/verify/other time split.
The plan it runs is plan.py's, the peers peers.py's; `--out DIR` writes bench.json, bench.md and PNG
plots (report.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from loopspec.errors import LoopspecError
from loopspec.precisions import describe_precision
from loopspec.runtime.bench.peers import (
    HF_METHODS,
    LLAMACPP_METHODS,
    PEER_BACKENDS,
    PEER_METHODS,
    PLAIN_PEER,
    HFPeer,
    llamacpp_peer,
)
from loopspec.runtime.bench.plan import BenchOutput, BenchPlan
from loopspec.runtime.bench.report import results_table
from loopspec.settings import DRAFTER_METHODS, DecodingSettings, check_knobs_apply, knobs_for
from loopspec.stats import acceptance_length, tokens_per_verification


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
    seconds: float  # sum over prompts of the median over repeats of each prompt's wall time
    verifications: int
    draft_s: float
    verify_s: float
    stages_per_verification: float | None = None
    later_stage_share: float | None = None  # share of committed tokens drafted by stages > 1
    speedup_bound: float | None = None  # τ·t(1) / (stages·t_draft + t_verify(len)) from the cost model
    speedup_bound_as_run: float | None = None  # the same bound over the mix of drafting and plain rounds run
    fallback_rounds: int = 0  # plain rounds chosen by the adaptive fallback
    backend: str = "torch"  # the engine: backend and precision ("onnxruntime gguf-int8act"); a peer's library
    repeats: int = 1
    same_across_repeats: bool = True  # every repeat produced the same tokens
    prefill_s: float = 0.0
    other_s: float = 0.0  # wall time outside prefill, draft and verify (all of it for the peers)
    drafting_verifications: int = 0  # verifications that checked drafts: τ, histogram and curve are over these
    tokens_per_verification: float | None = None  # committed tokens per verification over all rounds, plain included
    accepted_histogram: list[int] = field(default_factory=list)  # [i]: drafting verifications that accepted i drafts
    acceptance_curve: list[float] = field(default_factory=list)  # [i-1]: P(the draft at position i is accepted)
    stages_histogram: list[int] = field(default_factory=list)  # [s]: verifications after s draft stages (0: plain)
    verifications_saved: int | None = None  # DLoop: one-stage DFlash verifications its chains replaced
    nodes_per_verification: float | None = None  # draft nodes (tree or chain) per verification that drafted
    suffix_share: float | None = None  # share of committed tokens that only the suffix index proposed
    # share of prompts whose greedy output equals the fp32 reference engine's `ar` (None: no fp32
    # engine in the run); identical_to_ar compares with the same engine's own plain decoding
    agreement_with_fp32: float | None = None
    fp32_matching_prefix: float | None = None  # mean tokens before the output first leaves fp32's `ar`


def acceptance_stats(accepted: list[int], max_drafts: int) -> tuple[list[int], list[float]]:
    """Histogram of accepted drafts per verification, and the per-position acceptance curve.

    The draft at position i of a verification is accepted iff at least i drafts were accepted, so
    curve[i-1] = P(accepted >= i): non-increasing, and its sum is the mean accepted count = τ − 1."""
    histogram = [0] * (max(accepted + [max_drafts]) + 1)
    for n in accepted:
        histogram[n] += 1
    total = max(len(accepted), 1)
    curve = [sum(histogram[i:]) / total for i in range(1, max_drafts + 1)]
    return histogram, curve


def verifications_saved(accepted: list[int], block_size: int) -> int:
    """Verifications a one-stage DFlash drafter would have needed beyond DLoop's, for the same commits.

    A DFlash round commits at most k tokens (k−1 accepted drafts + the target's bonus, which is the
    next token of the chain). So a DLoop verification that accepted `a` drafts and committed a+1
    tokens stands for ceil((a+1)/k) DFlash verifications: it saved ceil((a+1)/k) − 1. This assumes
    DFlash would have drafted the same tokens (an estimate: its later blocks see real context)."""
    return sum(max(0, math.ceil((a + 1) / block_size) - 1) for a in accepted)


def plain_decoding(
    run: tuple[str, str], reference: tuple[str, str], fp32_reference: tuple[str, str] | None, pipes: dict
) -> tuple[str, str] | None:
    """The run whose greedy output `run` must equal token for token: a method, its engine's own `ar`
    (lossless is relative to the engine's weights and arithmetic); `ar`, the reference's `ar` where
    both engines compute in the same precision (torch and ONNX Runtime fp32); transformers, the fp32
    `ar` (the same fp32 model), its prompt lookup transformers' own plain run; llama.cpp's DFlash its
    plain llama.cpp (llama.cpp's own arithmetic equals nothing of ours: `agreement_with_fp32` says how close)."""
    method, on = run
    if method in PLAIN_PEER:
        return PLAIN_PEER[method], PEER_BACKENDS[method]
    if method == "hf":
        return fp32_reference
    if method == "llamacpp":
        return None
    if method != "ar":
        return "ar", on
    same_precision = pipes[on].engine.precision == pipes[reference[1]].engine.precision
    return reference if same_precision else None


def matching_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two outputs share before they first differ."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def median_run(runs: list) -> int:
    """Index of the run with the median wall time (the lower median for an even count)."""
    order = sorted(range(len(runs)), key=lambda i: runs[i][1])
    return order[(len(runs) - 1) // 2]


def _prepare_out_dir(out_dir: str | None) -> Path | None:
    if out_dir is None:
        return None
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise LoopspecError(f"--out is not a directory: {path}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LoopspecError(f"cannot create --out directory {path}: {e.strerror}") from None
    return path


@dataclass
class Runs:
    """The (method, engine) runs of a bench in order, and what each is compared with."""

    order: list[tuple[str, str]]
    decoding: dict[tuple[str, str], DecodingSettings | None]  # per run (None: a peer)
    reported: set[tuple[str, str]]  # the runs asked for (`ar` always runs: it is the reference)
    reference: tuple[str, str]  # the first engine's `ar`: every speedup is against it
    plain: dict[tuple[str, str], tuple[str, str] | None]  # the run whose output each must equal (`plain_decoding`)
    fp32_reference: tuple[str, str] | None = None  # the fp32 engine's `ar`, where one runs


def run_bench(
    plan: BenchPlan, choices, knobs: dict | None = None, output: BenchOutput = BenchOutput()
) -> list[BenchResult]:
    """Every method of `plan` on every engine `choices` names (an EngineChoice, or several: the same
    pair side by side in this process, the first engine's `ar` the reference of every speedup), with
    the decoding `knobs` of loopspec.settings.resolve_settings (loopspec.settings.KNOBS)."""
    from tqdm import tqdm

    from loopspec.runtime.pipeline import EngineChoice, open_pipeline

    choices = [choices] if isinstance(choices, EngineChoice) else list(choices)
    if not choices:
        raise LoopspecError("no engine to bench")
    methods, variants, knobs = plan.methods, plan.variants, dict(knobs or {})
    # one set of flags for every method: each takes the knobs that apply to it, and a knob that
    # applies to none of them is refused
    check_knobs_apply([method for method, _ in variants.values()], knobs)
    datasets = plan.datasets  # everything checked before the long run
    if output.json_out is not None and not Path(output.json_out).resolve().parent.is_dir():
        raise LoopspecError(f"directory for --json does not exist: {Path(output.json_out).parent}")
    out_path = _prepare_out_dir(output.out_dir)
    needs_drafter = any(method in DRAFTER_METHODS for method, _ in variants.values()) or "llamacpp-dflash" in methods
    first = choices[0]
    pipe = open_pipeline(first if needs_drafter else dataclasses.replace(first, drafter="none"))
    # every engine runs the same pair in this process; `ar` on the first is the reference
    pipes = {pipe.engine_name: pipe}
    for choice in choices[1:]:
        other = pipe.on_backend(choice.backend, choice.max_context, choice.threads, choice.precision)
        if other.engine_name in pipes:
            raise LoopspecError(f"--backend/--precision name the engine {other.engine_name} twice")
        pipes[other.engine_name] = other
    if pipe.target is None and (plan.cost_model or any(m in PEER_METHODS for m in methods)):
        raise LoopspecError(
            "the transformers and llama.cpp peers and --cost-model need the target's weights: run without --onnx-dir"
        )
    # each engine's decoding settings per method, resolved once (tuned settings are per engine);
    # `ar` always runs: each engine's own plain decoding is what its methods must reproduce
    decoding = {
        name: {"ar": p.settings("ar")}
        | {m: p.settings(method, **knobs_for(method, knobs | overrides)) for m, (method, overrides) in variants.items()}
        for name, p in pipes.items()
    }
    for settings in decoding[pipe.engine_name].values():
        settings.check_sampling(plan.params.greedy)
    encoded_sets = {name: [pipe.encode(p, chat=plan.chat) for p in prompts] for name, prompts in datasets.items()}
    for name, encoded in encoded_sets.items():
        too_long = [len(ids) for ids in encoded if len(ids) >= pipe.engine.max_context]
        if too_long:
            raise LoopspecError(
                f"{name}: a prompt of {too_long[0]} tokens does not fit the context of {pipe.engine.max_context}"
            )
    if needs_drafter:
        print(f"[loopspec] drafter: {pipe.drafter_description}", file=sys.stderr)

    peers, skipped = {}, {}  # peer library → its runner; peer method → why it did not run
    if any(m in HF_METHODS for m in methods):
        peers["transformers"] = HFPeer(
            pipe.target_dir, pipe.stop_token_ids, first.threads, getattr(pipe.engine, "device", "cpu")
        )
    wanted = [m for m in methods if m in LLAMACPP_METHODS]
    if wanted:
        longest = max(len(ids) for encoded in encoded_sets.values() for ids in encoded)
        # llama.cpp drafts the block of the drafter's tuned setting on this machine (loopspec's dloop
        # block): the block whose verification pays on a CPU
        dflash_block = (
            pipe.settings("dloop", block_size=knobs.get("block_size")).block_size
            if "llamacpp-dflash" in wanted
            else None
        )
        llama, reason = llamacpp_peer(
            pipe,
            first.target,
            plan.llama_server,
            dflash_block,
            first.threads,
            context=longest + plan.max_new_tokens + 16,
        )
        skipped = {m: reason for m in wanted} if llama is None else dict(llama.failed)
        for m, why in skipped.items():
            print(f"[loopspec] skipping {m}: {why}", file=sys.stderr)
        if llama is not None:
            peers["llama.cpp"] = llama
    runs = plan_runs(plan, pipes, decoding, [m for m in methods if m in PEER_METHODS and m not in skipped])

    def run_once(run: tuple[str, str], ids: list[int], i: int, new_tokens: int):
        """(tokens, wall seconds, stats: GenerationStats, a peer's PeerRun, or None)."""
        method, on = run
        t0 = time.perf_counter()
        if method in PEER_METHODS:
            out = peers[on].run(ids, method, new_tokens)
            return out.tokens, time.perf_counter() - t0, out if method in LLAMACPP_METHODS else None
        out = pipes[on].run(
            ids, decoding[on][method], max_new_tokens=new_tokens, params=plan.params, seed=plan.seed + i
        )
        return out.tokens, time.perf_counter() - t0, out.stats

    total_runs = sum(len(e) for e in encoded_sets.values()) * len(runs.order) * plan.repeats
    progress = tqdm(total=total_runs, unit="run", file=sys.stderr, leave=False)
    try:
        results = measure_sets(encoded_sets, runs, run_once, plan, progress)
    finally:
        for peer in peers.values():
            getattr(peer, "close", lambda: None)()
    progress.close()

    cm = measure_cost_model(pipe, decoding[pipe.engine_name], results) if plan.cost_model else None
    report = {
        "settings": run_description(plan, output.command, pipe, ",".join(pipes), datasets, decoding[pipe.engine_name]),
        "results": [asdict(r) for r in results],
    }
    report["settings"]["engines"] = {
        name: {
            "precision": p.engine.precision,
            "computes_with": describe_precision(p.engine.precision, p.engine.block_types),
            "decoding": {m: d.to_dict() for m, d in decoding[name].items() if m in methods},
        }
        for name, p in pipes.items()
    }
    if "llama.cpp" in peers:
        report["settings"]["llamacpp"] = peers["llama.cpp"].settings
    if skipped:
        report["settings"]["skipped"] = skipped
    if cm is not None:
        report["cost_model"] = cm
    print(results_table(report["results"]))
    if cm is not None:
        print(
            f"memory bandwidth {cm['bandwidth_gbs']:.1f} GB/s, target weights {cm['target_weight_mb']:.0f} MB "
            f"→ plain decoding bound {cm['ar_bound_tokens_per_s']:.1f} tok/s; "
            f"t_verify(n) ms: {', '.join(f'{n}: {t * 1e3:.1f}' for n, t in cm['verify_s'].items())}"
            + (f"; draft stage {cm['draft_stage_s'] * 1e3:.1f} ms" if cm.get("draft_stage_s") else "")
        )
        for r in results:
            if r.speedup_bound is not None:
                print(
                    f"  {r.dataset}/{r.method}: speedup {r.speedup_vs_ar:.2f}x of a {r.speedup_bound:.2f}x bound "
                    f"({r.speedup_bound_as_run:.2f}x over the rounds as run)"
                )
    text = json.dumps(report, indent=2) + "\n"
    if output.json_out is not None:
        Path(output.json_out).write_text(text)
    if out_path is not None:
        from loopspec.runtime.bench.report import write_report

        (out_path / "bench.json").write_text(text)  # first: the measurements survive a plotting failure
        written = write_report(json.loads(text), out_path)
        print(f"[loopspec] wrote {', '.join(str(p) for p in [out_path / 'bench.json'] + written)}", file=sys.stderr)
    return results


def plan_runs(plan: BenchPlan, pipes: dict, decoding: dict, peer_methods: list[str]) -> Runs:
    """The runs in order — every loopspec method on every engine (`ar` first on each), then the peers
    that can run — and what each is compared with."""
    own = ["ar"] + [m for m in plan.methods if m != "ar" and m not in PEER_METHODS]
    order = [(m, e) for e in pipes for m in own] + [(m, PEER_BACKENDS[m]) for m in peer_methods]
    reference = order[0]
    fp32_reference = next((("ar", e) for e, p in pipes.items() if p.engine.precision == "fp32"), None)
    return Runs(
        order=order,
        decoding={(m, on): None if m in PEER_METHODS else decoding[on][m] for m, on in order},
        reported={run for run in order if run[0] in plan.methods},
        reference=reference,
        plain={run: plain_decoding(run, reference, fp32_reference, pipes) for run in order},
        fp32_reference=fp32_reference,
    )


def summarize(
    method: str, dataset: str, runs: list[tuple], repeats: int, backend: str, decoding: DecodingSettings | None
) -> BenchResult:
    """One row from each prompt's median run: (tokens, wall seconds, GenerationStats or None);
    `decoding` None: a peer (transformers), which reports neither its acceptance nor its time split."""
    seconds = sum(s for _, s, _ in runs)
    new_tokens = sum(len(tokens) for tokens, _, _ in runs)
    row = BenchResult(
        method=method,
        dataset=dataset,
        prompts=len(runs),
        new_tokens=new_tokens,
        tau=None,
        tokens_per_s=new_tokens / seconds,
        speedup_vs_ar=None,
        identical_to_ar=None,
        seconds=seconds,
        verifications=0,
        draft_s=0.0,
        verify_s=0.0,
        repeats=repeats,
        other_s=seconds,
        backend=backend,
    )
    if decoding is None:
        row.tau = 1.0 if method in ("hf", "llamacpp") else None
        counted = [s for _, _, s in runs if s is not None]  # llama.cpp's own counters
        if method == "llamacpp-dflash" and counted:
            # every token after the first (sampled at prefill) came from a verification that accepted
            # `accepted` drafts in all: verifications = tokens - 1 - accepted
            after_prefill = sum(max(len(tokens) - 1, 0) for tokens, _, _ in runs)
            accepted = sum(s.accepted for s in counted)
            row.verifications = after_prefill - accepted
            row.tau = after_prefill / row.verifications if row.verifications > 0 else None
        row.tokens_per_verification = row.tau  # a peer's every verification is counted in its τ
        return row
    stats = [s for _, _, s in runs]
    accepted = [n - 1 for s in stats for n in s.counted_rounds()]  # the verifications τ counts
    row.drafting_verifications = len(accepted)
    row.tau = acceptance_length(stats)  # None: nothing was ever drafted
    row.tokens_per_verification = tokens_per_verification(stats)
    row.accepted_histogram, row.acceptance_curve = acceptance_stats(accepted, decoding.max_drafts)
    row.verifications = sum(s.verifications for s in stats)
    row.prefill_s = sum(s.prefill_s for s in stats)
    row.draft_s = sum(s.draft_s for s in stats)
    row.verify_s = sum(s.verify_s for s in stats)
    row.other_s = max(0.0, seconds - row.prefill_s - row.draft_s - row.verify_s)
    row.fallback_rounds = sum(s.fallback_rounds for s in stats)
    all_stages = [n for s in stats for n in s.stages_per_round]
    row.stages_histogram = [all_stages.count(n) for n in range(max(all_stages, default=0) + 1)]
    nodes = [n for s in stats for n, st in zip(s.nodes_per_round, s.stages_per_round) if st > 0]
    row.nodes_per_verification = sum(nodes) / len(nodes) if nodes else None
    row.suffix_share = sum(s.suffix_tokens for s in stats) / max(new_tokens, 1) if decoding.uses_suffix else None
    if decoding.method == "dloop":
        stages = [n for n in all_stages if n > 0]  # rounds that drafted
        row.stages_per_verification = sum(stages) / max(len(stages), 1)
        row.later_stage_share = sum(s.later_stage_tokens for s in stats) / max(new_tokens, 1)
        row.verifications_saved = verifications_saved(accepted, decoding.block_size)
    return row


def cpu_description() -> str:
    """The CPU's model name, the wide-vector features the figures depend on, and the core count
    ("AMD EPYC (avx2, avx512f, avx512_vnni, avx512_bf16, 2 cores)")."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
        platform.processor() or platform.machine(),
    )
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    field_of = {
        k.strip(): v.strip() for k, _, v in (line.partition(":") for line in info.split("\n\n")[0].splitlines())
    }
    if "cpu family" in field_of:  # a model name such as "AMD EPYC" names no generation: family and model do
        model += f", family {field_of['cpu family']} model {field_of.get('model', '?')}"
    features = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8") if f in flags]
    return f"{model} ({', '.join(features + [f'{os.cpu_count()} cores'])})"


def run_description(
    plan: BenchPlan, command: str | None, pipe, backend: str, datasets: dict, decoding: dict[str, DecodingSettings]
) -> dict:
    """What produced the numbers (the report's "settings"): the command, the pair, the prompts, each
    method's decoding settings and the machine."""
    import torch
    import transformers

    return {
        "command": command,
        "target": str(pipe.target_dir),
        "drafter": pipe.drafter_description if pipe.engine.has_drafter else "none",
        "backend": backend,
        "device": str(getattr(pipe.engine, "device", "cpu")),
        "methods": list(plan.methods),
        "datasets": {
            name: {"source": src, "prompts": len(p)} for (name, p), src in zip(datasets.items(), plan.prompt_sets)
        },
        "limit": plan.limit,
        "max_new_tokens": plan.max_new_tokens,
        "repeats": plan.repeats,
        "all_turns": plan.all_turns,
        "chat": plan.chat,
        "sampling": {"temperature": plan.params.temperature, "top_k": plan.params.top_k, "top_p": plan.params.top_p},
        "decoding": {m: d.to_dict() for m, d in decoding.items() if m in plan.methods},
        "block_size": {m: d.block_size for m, d in decoding.items() if m in plan.methods},
        "dloop": (
            {"gate_threshold": decoding["dloop"].gate_threshold, "max_stages": decoding["dloop"].max_stages}
            if "dloop" in decoding
            else None
        ),
        "adaptive": any(d.adaptive for d in decoding.values()),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {
            "cpu": cpu_description(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
    }


def measure_cost_model(pipe, decoding: dict[str, DecodingSettings], results: list[BenchResult]) -> dict:
    """Bandwidth bound of plain decoding, t_verify(n), drafter stage time, and each result's bound:
    τ · t(1) / (stages · t_draft + t_verify(N + 1)) with N the draft nodes it verified per round
    (a tree costs what a chain of as many tokens costs: the mask changes no arithmetic)."""
    from loopspec.runtime.costmodel import draft_time, memory_bandwidth_gbs, speedup_bound, verify_times, weight_bytes

    bandwidth = memory_bandwidth_gbs()
    weights = weight_bytes(pipe.target)
    sizes = [d.block_size for d in decoding.values() if d.uses_drafter]
    trees = [round(r.nodes_per_verification) + 1 for r in results if r.nodes_per_verification is not None]
    lengths = sorted(
        {1, 2, 4, 8, 16, 24, 32}
        | set(sizes)
        | {min(64, d.max_drafts + 1) for d in decoding.values()}
        | {min(64, n) for n in trees}
    )
    t_verify = verify_times(pipe.engine, lengths)
    t_draft = draft_time(pipe.engine, max(sizes)) if pipe.engine.has_drafter and sizes else None
    for r in results:
        d = decoding.get(r.method)
        if d is None:  # a peer
            continue
        if not d.drafting:
            r.speedup_bound = r.speedup_bound_as_run = 1.0
        elif r.tau is not None and (t_draft is not None or not d.uses_drafter):
            # one round: its drafter stages, then one verification of its nodes + the anchor, t_verify(N+1)
            stages = (r.stages_per_verification or 1.0) if d.uses_drafter else 0.0
            nodes = r.nodes_per_verification if r.nodes_per_verification is not None else d.max_drafts
            nearest = min(t_verify, key=lambda m: abs(m - (round(nodes) + 1)))
            r.speedup_bound = speedup_bound(r.tau, t_verify[1], stages * (t_draft or 0.0), t_verify[nearest])
            # the adaptive fallback and the last rounds of a request verify the anchor alone: 1 token at t(1)
            plain, drafting = r.verifications - r.drafting_verifications, r.drafting_verifications
            committed = plain + drafting * r.tau
            r.speedup_bound_as_run = (
                committed
                * t_verify[1]
                / (plain * t_verify[1] + drafting * (stages * (t_draft or 0.0) + t_verify[nearest]))
            )
    return {
        "bandwidth_gbs": bandwidth,
        "target_weight_mb": weights / 1e6,
        "ar_bound_tokens_per_s": bandwidth * 1e9 / weights,
        "verify_s": t_verify,
        "draft_stage_s": t_draft,
    }


def measure_sets(
    encoded_sets: dict[str, list[list[int]]], runs: Runs, run_once, plan: BenchPlan, progress
) -> list[BenchResult]:
    """Every run on every dataset (after one short warm-up each): `run_once(run, ids, prompt index,
    new tokens)` → (tokens, wall seconds, stats or None), `plan.repeats` times per prompt; per run and
    dataset a row from each prompt's median repeat, with its speedup against `runs.reference`, its
    identity with `runs.plain[run]` (greedy), and its agreement with the fp32 engine's `ar`."""
    results = []
    engines = {on for _, on in runs.order}
    for dataset, encoded in encoded_sets.items():
        for run in runs.order:  # warm-up: first calls allocate and pack
            run_once(run, encoded[0], 0, 8)
        outputs: dict[tuple, list[list[int]]] = {}
        per_run: dict[tuple, BenchResult] = {}
        for run in runs.order:
            method, on = run
            progress.set_description(f"{dataset}/{method}" + (f"/{on}" if len(engines) > 1 else ""))
            repeats: list[list[tuple]] = [[] for _ in encoded]  # per prompt: one (tokens, seconds, stats) per repeat
            for _ in range(plan.repeats):
                for i, ids in enumerate(encoded):
                    repeats[i].append(run_once(run, ids, i, plan.max_new_tokens))
                    progress.update()
            median = [prompt_runs[median_run(prompt_runs)] for prompt_runs in repeats]
            outputs[run] = [tokens for tokens, _, _ in median]
            per_run[run] = summarize(method, dataset, median, plan.repeats, on, runs.decoding[run])
            per_run[run].same_across_repeats = all(
                r[0] == prompt_runs[0][0] for prompt_runs in repeats for r in prompt_runs
            )
        base = per_run[runs.reference]
        for run in runs.order:
            if run not in runs.reported:
                continue
            r = per_run[run]
            r.speedup_vs_ar = r.tokens_per_s / base.tokens_per_s
            plain = runs.plain[run]
            if plan.params.greedy and plain in outputs:
                r.identical_to_ar = outputs[run] == outputs[plain]
            if plan.params.greedy and runs.fp32_reference is not None:
                pairs = list(zip(outputs[run], outputs[runs.fp32_reference]))
                r.agreement_with_fp32 = sum(a == b for a, b in pairs) / max(len(pairs), 1)
                r.fp32_matching_prefix = sum(matching_prefix(a, b) for a, b in pairs) / max(len(pairs), 1)
            results.append(r)
    return results
