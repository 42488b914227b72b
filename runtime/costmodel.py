"""Cost model of speculative decoding on the current machine.

Measures the memory read bandwidth, the target's verification time per number of tokens and the
drafter's stage time, and derives the bounds: plain decoding cannot beat weight_bytes / bandwidth per
token, and a speculative method with acceptance length τ cannot beat
τ · t_verify(1) / (t_draft + t_verify(k)) over autoregressive decoding.
"""

from __future__ import annotations

import statistics
import time

import torch

from loopspec.engines.protocol import Engine


def memory_bandwidth_gbs(megabytes: int = 1024, repeats: int = 5) -> float:
    """Read bandwidth in GB/s: sum over a buffer much larger than the caches (median of repeats)."""
    x = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of distinct parameters (tied weights once)."""
    seen, total = set(), 0
    for p in module.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def verify_times(
    engine: Engine, lengths=(1, 2, 4, 8, 12, 16), context: int = 128, repeats: int = 5
) -> dict[int, float]:
    """Seconds of one target verification of `n` tokens after `context` committed ones (row 0).

    The lengths are interleaved within each repeat, so a transient slowdown of the machine spreads
    over all of them instead of skewing one length's median."""
    vocab = engine.target_cfg.vocab_size
    engine.prefill(0, [(10 + i) % vocab for i in range(context)], want_taps=False)
    times: dict[int, list[float]] = {n: [] for n in lengths}
    for repeat in range(repeats + 1):  # the first round warms up
        for n in lengths:
            t0 = time.perf_counter()
            engine.verify([[(20 + i) % vocab for i in range(n)]], want_taps=engine.has_drafter)
            engine.target_rollback([context])
            if repeat:
                times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def draft_time(engine: Engine, block_size: int, context: int = 128, repeats: int = 5) -> float:
    """Seconds of one drafter stage (block forward + draft head) plus the context append it needs (row 0)."""
    vocab = engine.target_cfg.vocab_size
    tokens = [(10 + i) % vocab for i in range(context)]
    engine.prefill(0, tokens[:-4], want_taps=True)
    _, taps = engine.verify([tokens[-4:]], want_taps=True)

    def stage():
        engine.draft([0], [5], [context - 4], block_size)
        engine.append_context(taps, [4])  # a typical accepted run of 4 positions
        engine.context_rollback([0], [context - 4])

    return _median_time(stage, repeats)


def speedup_bound(tau: float, t_verify_1: float, t_draft: float, t_verify_k: float) -> float:
    """τ · t(1) / (t_draft + t_verify(k))."""
    return tau * t_verify_1 / (t_draft + t_verify_k)
