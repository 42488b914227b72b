"""What exact rollback costs on a hybrid (Qwen3.5) target: ms per verification of k tokens against a
plain one-token step on the PyTorch engine, and the share of a verification spent keeping the
linear-attention states after each token (the snapshots a rollback restores).

A random hybrid target (hidden 256, 8 layers: 6 Gated DeltaNet + 2 full attention, vocab 1000) in
fp32, one row, prefilled with 128 tokens. Three timings, each the median over --reps calls:
  plain       verify 1 token, keep it (what `ar` decoding runs per token);
  rollback k  verify k tokens, keep the first (all drafts rejected): the next call restores the
              states at the kept length from the snapshots;
  keep-all k  verify k tokens and keep them all, on two engines taking turns: one with snapshots,
              one whose cache's snapshot window is 0 (no state kept inside a forward): the same
              lengths, tokens and arithmetic; the difference is what taking the snapshots costs.

    python scripts/hybrid_rollback_cost.py --json docs/runs/2026-12-06/hybrid-rollback-cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from loopspec.engines.backends import torch_engine
from loopspec.model.families import new_target, target_config

PROMPT_TOKENS = 128


def hybrid_config(hidden: int, layers: int, full_every: int, vocab: int) -> dict:
    """An HF-style Qwen3.5 text config.json dict: every `full_every`-th layer full attention."""
    types = ["full_attention" if (i + 1) % full_every == 0 else "linear_attention" for i in range(layers)]
    return dict(
        model_type="qwen3_5_text",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=types,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        eos_token_id=None,
        tie_word_embeddings=False,
    )


def random_target(hf: dict, seed: int):
    torch.manual_seed(seed)
    target = new_target(target_config(hf))
    with torch.no_grad():
        for name, p in target.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.randn_like(p) * 0.5 - 1.5)
            elif p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return target.eval()


def timed_rounds(
    engines: list, width: int, keep: int, reps: int, warmup: int, rng: torch.Generator
) -> list[list[float]]:
    """ms of `reps` verifications of `width` tokens on row 0 of each engine (after `warmup` untimed
    ones), each followed by a commit of its first `keep` tokens; every engine starts from the same
    fresh prefill and verifies the same tokens, the engines taking turns (so that a drift of the
    machine's speed meets them all alike)."""
    vocab = engines[0].target_cfg.vocab_size
    prompt = torch.randint(0, vocab, (PROMPT_TOKENS,), generator=rng).tolist()
    for engine in engines:
        engine.prefill(0, prompt, want_taps=False)
    times = [[] for _ in engines]
    for i in range(warmup + reps):
        tokens = torch.randint(0, vocab, (width,), generator=rng).tolist()
        for engine, timed in zip(engines, times):
            start = int(engine.cache.lengths[0])
            t0 = time.perf_counter()
            engine.verify([tokens], want_taps=False)
            elapsed = time.perf_counter() - t0
            engine.target_commit([start], [list(range(keep))])
            if i >= warmup:
                timed.append(elapsed * 1e3)
    return times


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--widths", type=int, nargs="+", default=[4, 8], help="verified tokens k")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    hf = hybrid_config(hidden=256, layers=8, full_every=4, vocab=1000)
    engine = torch_engine(
        random_target(hf, seed=0), None, PROMPT_TOKENS + (args.warmup + args.reps) * max(args.widths) + 8
    )
    without = engine.with_rows(1)  # the same modules, caches of its own
    without.cache.snapshot_window = 0  # keeps no state inside a forward (and so never rolls back)
    rng = torch.Generator().manual_seed(1)
    median = {"plain": statistics.median(timed_rounds([engine], 1, 1, args.reps, args.warmup, rng)[0])}
    for k in args.widths:
        median[f"rollback k={k}"] = statistics.median(timed_rounds([engine], k, 1, args.reps, args.warmup, rng)[0])
        kept, unkept = timed_rounds([engine, without], k, k, args.reps, args.warmup, rng)
        median[f"keep-all k={k}, snapshots"] = statistics.median(kept)
        median[f"keep-all k={k}, no snapshots"] = statistics.median(unkept)
    shares = {
        f"k={k}": (median[f"keep-all k={k}, snapshots"] - median[f"keep-all k={k}, no snapshots"])
        / median[f"keep-all k={k}, snapshots"]
        for k in args.widths
    }
    for name, ms in median.items():
        print(f"{name:32s} {ms:8.3f} ms  ({ms / median['plain']:.2f}× a plain step)")
    for k, share in shares.items():
        print(f"snapshot share of a verification, {k}: {100 * share:.1f} %")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = dict(
            cpu=cpu_model(),
            cores=os.cpu_count(),
            load_average=list(os.getloadavg()),
            torch=torch.__version__,
            threads=args.threads,
            dtype="fp32",
            rows=1,
            prompt_tokens=PROMPT_TOKENS,
            config=hf,
            repetitions=args.reps,
            warmup=args.warmup,
            median_ms=median,
            ratio_to_plain={k: v / median["plain"] for k, v in median.items()},
            snapshot_share=shares,
        )
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
