"""What speculative decoding costs at 8B scale on a GPU, without trained weights.

    PYTHONPATH=. python scripts/gpu_cost.py [--out gpu_cost.json]      # on the GPU machine
    PYTHONPATH=. python scripts/gpu_cost.py --dry-run                  # tiny shapes on the CPU, seconds

Built on the device, nothing carried: random bf16 weights with Qwen3-8B's shapes (36 layers, hidden
4096, 32 query / 8 KV heads, head dim 128, intermediate 12288, vocab 151936) in loopspec's own
target class, and a 5-layer DFlash drafter at block 16. Random weights accept no drafts, so an
oracle sets the acceptance: `OracleEngine` (a TorchEngine used only here) drafts the true greedy
continuation (plain decoding's output, decoded first) for 5 tokens, then 6, alternately, each
followed by a wrong one — τ = 6.5 with the bonus token, whatever the weights. Verification is
untouched, so the output still equals plain decoding's (reported: `identical`).

Measured, CUDA graphs on and off: tokens/s of ar, dflash and dloop at batch 1 and 8; t_verify(k) /
t_verify(1) for k = 1..32; draft ms per stage; and the runtime's overhead against the bound
τ · t_verify(1) / (t_draft + t_verify(k)) (the speedup a zero-overhead runtime would reach with
that τ, one stage of k = 16 tokens verified per round). On the CPU (--dry-run) "graphs on" runs
the graphs' static-buffer path without capture (engines/cuda_graphs.py StaticRunner).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.model.draft_head import StageDrafts
from loopspec.model.families import new_target
from loopspec.model.target import TargetConfig
from loopspec.engines.cuda_graphs import StaticRunner
from loopspec.runtime.decoder import Decoder, decode_all
from loopspec.engines.torch_engine import TorchEngine
from loopspec.settings import DLOOP_DEFAULTS, DecodingSettings

QWEN3_8B = dict(
    family="qwen3",
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1000000.0,
    qk_norm=True,
    max_position_embeddings=40960,
)
TINY = dict(
    family="qwen3",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qk_norm=True,
    max_position_embeddings=1024,
)
FULL = dict(block=16, drafter_layers=5, prompt=128, new_tokens=64, accepts=(5, 6), batches=(1, 8), max_k=32, repeats=10)
DRY = dict(block=8, drafter_layers=1, prompt=12, new_tokens=10, accepts=(2, 3), batches=(1, 2), max_k=8, repeats=1)


class OracleEngine(TorchEngine):
    """Drafts the known greedy continuation for `accepts[i % 2]` tokens of round i, then a wrong token:
    a fixed acceptance without trained weights. `truth` {key: plain decoding's tokens} and `decoder`
    are set before decoding; only rank 0 (the chain) is replaced, verification is the engine's own."""

    def __init__(self, *args, accepts: tuple[int, int], static_on_cpu: bool = False, **kwargs):
        self.accepts, self.static_on_cpu = accepts, static_on_cpu
        self.truth: dict = {}
        self.decoder: Decoder | None = None
        self.rounds: dict = {}
        super().__init__(*args, **kwargs)

    def static_runner(self):
        return StaticRunner(self) if self.static_on_cpu else super().static_runner()

    def with_rows(self, max_rows: int) -> "OracleEngine":
        twin = super().with_rows(max_rows)
        twin.rounds, twin.decoder = {}, None
        return twin

    def draft(self, rows, anchors, positions, block_size):
        stage = super().draft(rows, anchors, positions, block_size)
        if self.decoder is None:  # timing one stage outside decoding: the drafter's own drafts
            return stage
        drafts, logprobs, hidden = stage
        drafts = drafts.clone()
        for i, b in enumerate(rows):
            row = self.decoder.rows[b]
            start = positions[i] - row.prompt_len + 1  # index in the truth of the token after the anchor
            chain_index = start - len(row.tokens)  # which draft of this round's chain this stage starts at
            if chain_index == 0:
                self.rounds[row.key] = self.rounds.get(row.key, -1) + 1
            accept = self.accepts[self.rounds.get(row.key, 0) % 2]
            truth = (self.truth[row.key] + [0] * (block_size + 64))[start : start + block_size - 1]
            guess = [
                t if chain_index + j < accept else (t + 1) % self.target_cfg.vocab_size for j, t in enumerate(truth)
            ]
            drafts[i, :, 0] = torch.tensor(guess)
        return StageDrafts(drafts, logprobs, hidden)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build(dry_run: bool, device: torch.device, dtype: torch.dtype, block: int, drafter_layers: int):
    cfg = TargetConfig(**(TINY if dry_run else QWEN3_8B))
    torch.manual_seed(0)
    with torch.device(device):
        target = new_target(cfg).to(dtype).eval()
        drafter_cfg = DrafterConfig.for_target(
            cfg, num_layers=drafter_layers, block_size=block, mask_token_id=cfg.vocab_size - 1
        )
        drafter = Drafter(drafter_cfg).to(dtype).eval()
    return target, drafter


def timed(fn, device, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs, after one warm-up (capture, autotune)."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def step_costs(engine, prompt: list[int], block: int, max_k: int, repeats: int, device) -> dict:
    """t_verify(k) for k = 1..max_k after the prompt (rolled back after each call) and one drafter stage."""
    engine.prefill(0, prompt, want_taps=True)
    length = len(prompt)

    def verify(k):
        engine.verify([[7] * k], want_taps=True)
        engine.target_rollback([length])

    verify_s = {k: timed(lambda: verify(k), device, repeats) for k in range(1, max_k + 1)}
    draft_s = timed(lambda: engine.draft([0], [prompt[-1]], [length], block), device, repeats)
    return {
        "t_verify_ms": {k: round(s * 1e3, 3) for k, s in verify_s.items()},
        "t_verify_ratio": {k: round(s / verify_s[1], 3) for k, s in verify_s.items()},
        "t_draft_ms": round(draft_s * 1e3, 3),
    }


@torch.inference_mode()
def throughput(
    engine: OracleEngine, settings: DecodingSettings, prompts: list[list[int]], new_tokens: int, device
) -> dict:
    twin = engine.with_rows(len(prompts))
    twin.truth = engine.truth
    requests = [dict(key=i, prompt_ids=p, max_new_tokens=new_tokens) for i, p in enumerate(prompts)]

    def run():
        twin.decoder = Decoder(twin, settings)
        twin.rounds = {}
        return decode_all(twin.decoder, requests)

    run()  # warm-up: captures, allocator
    sync(device)
    t0 = time.perf_counter()
    done = run()
    sync(device)
    seconds = time.perf_counter() - t0
    tokens = sum(len(done[i].tokens) for i in range(len(prompts)))
    taus = [done[i].stats.acceptance_length for i in range(len(prompts)) if done[i].stats.acceptance_length]
    return {
        "tokens_per_s": round(tokens / seconds, 2),
        "tau": round(sum(taus) / len(taus), 3) if taus else 1.0,
        "identical": all(done[i].tokens == engine.truth[i] for i in range(len(prompts))),
    }


def measure(dry_run: bool) -> dict:
    shape = DRY if dry_run else FULL
    device = torch.device("cpu" if dry_run else "cuda")
    dtype = torch.float32 if dry_run else torch.bfloat16
    t0 = time.perf_counter()
    target, drafter = build(dry_run, device, dtype, shape["block"], shape["drafter_layers"])
    built_s = time.perf_counter() - t0
    vocab = target.cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, vocab - 1, (shape["prompt"],), generator=g).tolist() for _ in range(max(shape["batches"]))
    ]
    max_context = shape["prompt"] + shape["new_tokens"] + 4 * shape["block"] + 64
    methods = {
        "ar": DecodingSettings(),
        "dflash": DecodingSettings("dflash", shape["block"]),
        "dloop": DecodingSettings("dloop", shape["block"], **DLOOP_DEFAULTS),
    }
    report = {
        "dry_run": dry_run,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype).replace("torch.", ""),
        "target": TINY if dry_run else QWEN3_8B,
        "drafter": {"layers": shape["drafter_layers"], "block": shape["block"]},
        "oracle_accepts": list(shape["accepts"]),
        "build_s": round(built_s, 1),
        "graphs": {},
    }
    for graphs in (False, True):
        engine = OracleEngine(
            target, drafter, max_context, cuda_graphs=graphs, static_on_cpu=graphs and dry_run, accepts=shape["accepts"]
        )
        # the truth: plain decoding of every prompt (the oracle drafts it; every method must reproduce it)
        truth_engine = engine.with_rows(len(prompts))
        truth_engine.decoder = Decoder(truth_engine, methods["ar"])
        done = decode_all(
            truth_engine.decoder,
            [dict(key=i, prompt_ids=p, max_new_tokens=shape["new_tokens"]) for i, p in enumerate(prompts)],
        )
        engine.truth = {i: done[i].tokens for i in range(len(prompts))}
        costs = step_costs(engine.with_rows(1), prompts[0], shape["block"], shape["max_k"], shape["repeats"], device)
        runs = {}
        for batch in shape["batches"]:
            for name, settings in methods.items():
                runs[f"{name}@{batch}"] = throughput(engine, settings, prompts[:batch], shape["new_tokens"], device)
        k = shape["block"]
        for batch in shape["batches"]:
            ar = runs[f"ar@{batch}"]["tokens_per_s"]
            for name in ("dflash", "dloop"):
                r = runs[f"{name}@{batch}"]
                r["speedup"] = round(r["tokens_per_s"] / ar, 3)
                if batch == 1:  # the bound: τ tokens per (one stage + one verification of k tokens)
                    bound = r["tau"] * costs["t_verify_ms"][1] / (costs["t_draft_ms"] + costs["t_verify_ms"][k])
                    r["bound"] = round(bound, 3)
                    r["overhead"] = round(1 - r["speedup"] / bound, 3)
        report["graphs"]["on" if graphs else "off"] = {**costs, "runs": runs}
    return report


def summary(report: dict) -> str:
    lines = [
        f"gpu_cost on {report['device']} ({report['dtype']}{', dry run' if report['dry_run'] else ''}); "
        f"oracle accepts {report['oracle_accepts']}, weights built in {report['build_s']} s"
    ]
    for mode, r in report["graphs"].items():
        ratios = r["t_verify_ratio"]
        picks = ", ".join(
            f"k={k}: {ratios[k]}" for k in sorted(ratios) if k in (1, 2, 4, 8, 16, 32) or k == max(ratios)
        )
        lines.append(
            f"graphs {mode}: t_verify(1) {r['t_verify_ms'][1]} ms, t_verify(k)/t_verify(1) {picks}; "
            f"draft {r['t_draft_ms']} ms/stage"
        )
        for name, run in r["runs"].items():
            extra = "".join(f", {key} {run[key]}" for key in ("speedup", "bound", "overhead") if key in run)
            lines.append(
                f"  {name:<10} {run['tokens_per_s']:>9.1f} tok/s  tau {run['tau']:.2f}  "
                f"identical {run['identical']}{extra}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (seconds)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_cost: needs a CUDA GPU (or --dry-run for tiny shapes on the CPU)", file=sys.stderr)
        return 2
    if args.dry_run:
        torch.set_num_threads(1)  # tiny shapes: threads only add their synchronization (and it shares the CPU)
    report = measure(args.dry_run)
    print(summary(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    broken = [
        f"{mode}/{name}"
        for mode, r in report["graphs"].items()
        for name, run in r["runs"].items()
        if not run["identical"]
    ]
    if broken:
        print(f"gpu_cost: output differs from plain decoding: {', '.join(broken)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
