"""The speculative loop: prefill → draft → verify → accept → commit/rollback → repeat.

Autoregressive decoding is the same loop with block size 1 (nothing drafted, the verification of the
anchor alone yields the next token), so every speedup is measured by identical code.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from loopspec.decoding import SamplingParams, greedy_accept, next_token, probabilities, speculative_accept
from loopspec.errors import LoopspecError


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    accepted_per_round: list[int] = field(default_factory=list)  # drafts accepted per verification
    stages_per_round: list[int] = field(default_factory=list)  # draft stages per verification (DLoop)
    later_stage_tokens: int = 0  # committed drafts that came from stages > 1
    fallback_rounds: int = 0  # plain rounds the adaptive fallback chose while drafting did not pay
    fallback_switches: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = ""

    @property
    def verifications(self) -> int:
        return len(self.accepted_per_round)

    @property
    def acceptance_length(self) -> float:
        """τ: tokens committed per target verification (accepted drafts + 1 bonus), over the
        verifications that checked drafts (all of them for plain decoding)."""
        drafted = [n + 1 for n, s in zip(self.accepted_per_round, self.stages_per_round) if s > 0]
        rounds = drafted or [n + 1 for n in self.accepted_per_round]
        return sum(rounds) / len(rounds) if rounds else 0.0

    @property
    def accepted_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.accepted_per_round).items()))

    @property
    def stages_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.stages_per_round).items()))

    @property
    def other_s(self) -> float:
        return max(0.0, self.total_s - self.prefill_s - self.draft_s - self.verify_s)

    @property
    def decode_tokens_per_s(self) -> float:
        decode_s = self.total_s - self.prefill_s
        return (self.new_tokens - 1) / decode_s if decode_s > 0 and self.new_tokens > 1 else 0.0

    def summary(self) -> str:
        return (f"{self.new_tokens} tokens in {self.total_s:.2f}s ({self.new_tokens / max(self.total_s, 1e-9):.1f} tok/s)"
                f" | tau {self.acceptance_length:.2f} over {self.verifications} verifications"
                f" | prefill {self.prefill_s * 1e3:.0f} ms, draft {self.draft_s * 1e3:.0f} ms,"
                f" verify {self.verify_s * 1e3:.0f} ms, other {self.other_s * 1e3:.0f} ms"
                f"{f' | fallback: {self.fallback_rounds} plain rounds' if self.fallback_switches else ''}"
                f" | finish: {self.finish_reason}")


class AdaptiveFallback:
    """Per request: decode autoregressively while drafting does not pay, and probe again later.

    Drafting pays when the rolling τ per second of a drafting round beats one token per second of a
    plain round: τ / t_round(draft) > 1 / t_round(ar). Both round costs and τ are measured on this
    request (exponential moving averages). When drafting loses, `backoff` plain rounds follow (8,
    doubling on each consecutive loss up to 64), then drafting is probed again. Only the number of
    drafted tokens changes, never the output."""

    def __init__(self, alpha: float = 0.3, min_rounds: int = 3, backoff: int = 8, max_backoff: int = 64):
        self.alpha, self.min_rounds, self.initial_backoff, self.max_backoff = alpha, min_rounds, backoff, max_backoff
        self.backoff = backoff
        self.tau = self.t_draft_round = self.t_ar_round = None
        self.plain_left = 1  # one plain round first: it measures t_round(ar)
        self.draft_rounds = 0
        self.rounds_since_probe = 0
        self.fallback_rounds = 0
        self.switches = 0

    def _ema(self, old, new):
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def want_draft(self) -> bool:
        return self.plain_left <= 0

    def record(self, drafted: bool, committed: int, seconds: float) -> None:
        if not drafted:
            self.t_ar_round = self._ema(self.t_ar_round, seconds)
            self.plain_left -= 1
            if self.draft_rounds:  # a backoff round (the first calibration round is not a fallback)
                self.fallback_rounds += 1
            return
        self.draft_rounds += 1
        self.tau = self._ema(self.tau, committed)
        self.t_draft_round = self._ema(self.t_draft_round, seconds)
        self.rounds_since_probe += 1
        if self.rounds_since_probe < self.min_rounds or self.t_ar_round is None:
            return
        if self.tau / self.t_draft_round < 1.0 / self.t_ar_round:
            self.plain_left = self.backoff
            self.backoff = min(self.max_backoff, self.backoff * 2)
            self.switches += 1
            self.rounds_since_probe = 0
            self.tau = None  # the next probe judges on fresh evidence
        else:
            self.backoff = self.initial_backoff


@dataclass
class GenerationResult:
    tokens: list[int]
    stats: GenerationStats


def draft_chain(engine, anchor: int, position: int, block_size: int, max_drafts: int, max_stages: int,
                gate_threshold: float) -> tuple[torch.Tensor, int]:
    """Draft stages for one verification (design §4) → (drafts [≤ max_drafts], stages run).

    Stage 1 drafts [anchor, MASK…] on the target context. While the gate score of the newest stage
    (sum of its drafts' log-probs) is >= gate_threshold and fewer than max_stages ran, the next stage
    drafts from the previous stage's last draft, its context extended — temporarily — with the
    previous stage's own final-norm hidden states as pseudo-features (feature(p) = z(p+1)). The gate
    only decides whether to ADD a stage: a drafted block is never dropped or cut for its own score."""
    context_length = engine.context_length
    chain, stages = [], 0
    while True:
        stage_size = min(block_size, engine.max_context - position)
        drafts, logprobs, hidden = engine.drafter_block(anchor, position, stage_size)
        chain.append(drafts)
        stages += 1
        drafted = sum(d.numel() for d in chain)
        next_position = position + stage_size - 1
        if (stages >= max_stages or drafted >= max_drafts or engine.max_context - next_position < block_size
                or float(logprobs.sum()) < gate_threshold):
            break
        engine.drafter_context_hidden(hidden[1:])  # positions position .. position+k-2
        anchor, position = int(drafts[-1]), next_position
    if stages > 1:
        engine.context_rollback(context_length)  # the pseudo-context never outlives the round
    return torch.cat(chain)[:max_drafts], stages


def generate(engine, prompt_ids: list[int], *, max_new_tokens: int, params: SamplingParams = SamplingParams(),
             block_size: int = 1, stop_token_ids: frozenset[int] | set[int] = frozenset(),
             generator: torch.Generator | None = None, max_stages: int = 1, gate_threshold: float = -0.5,
             fallback: AdaptiveFallback | None = None,
             on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """Decode up to `max_new_tokens` after `prompt_ids`; block_size 1 = autoregressive,
    max_stages 1 = DFlash, max_stages > 1 = DLoop."""
    if not prompt_ids:
        raise LoopspecError("empty prompt")
    if max_new_tokens < 1:
        raise LoopspecError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if block_size < 1:
        raise LoopspecError(f"block size must be >= 1, got {block_size}")
    if len(prompt_ids) >= engine.max_context:
        raise LoopspecError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {engine.max_context}")
    drafting = block_size > 1
    if drafting and not engine.has_drafter:
        raise LoopspecError("a drafter is needed for block size > 1")
    if max_stages < 1:
        raise LoopspecError(f"max_stages must be >= 1, got {max_stages}")
    stats = GenerationStats(prompt_tokens=len(prompt_ids))
    t_start = time.perf_counter()
    engine.reset()

    logits, taps = engine.target_verify(prompt_ids, all_logits=False, want_taps=drafting)
    if drafting:
        engine.drafter_context(taps)  # the context holds features for every prompt position
    anchor = next_token(logits[-1], params, generator)
    stats.prefill_s = time.perf_counter() - t_start
    out = [anchor]
    finish = "stop" if anchor in stop_token_ids else ""
    if on_tokens:
        on_tokens([anchor])

    while not finish:
        position = len(prompt_ids) + len(out) - 1  # the anchor's position (not yet in the KV cache)
        remaining = max_new_tokens - len(out)
        room = engine.max_context - position - 1  # how many drafts still fit after the anchor
        if remaining <= 0:
            finish = "length"
            break
        if room < 0:
            finish = "context"
            break
        possible = min(max_stages * (block_size - 1), remaining - 1, room)
        num_drafts = possible
        if fallback is not None and possible > 0 and not fallback.want_draft():
            num_drafts = 0  # a plain round; its taps still enter the drafter context below

        t0 = time.perf_counter()
        drafts, stages = torch.empty(0, dtype=torch.long), 0
        if num_drafts > 0:
            drafts, stages = draft_chain(engine, anchor, position, block_size, num_drafts, max_stages, gate_threshold)
        t1 = time.perf_counter()
        logits, taps = engine.target_verify([anchor] + drafts.tolist(), want_taps=drafting)
        if params.greedy:
            accepted, bonus = greedy_accept(drafts, logits)
        else:
            accepted, bonus = speculative_accept(drafts, None, probabilities(logits, params), generator)
        t2 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.accepted_per_round.append(accepted)
        stats.stages_per_round.append(stages)
        stats.later_stage_tokens += max(0, accepted - (block_size - 1))
        if fallback is not None and drafting and possible > 0:
            fallback.record(drafted=num_drafts > 0, committed=accepted + 1, seconds=t2 - t0)

        # Commit the anchor and the accepted drafts; the rejected ones leave the KV cache.
        engine.target_rollback(position + accepted + 1)
        if drafting:
            engine.drafter_context(taps[:accepted + 1])  # only accepted taps enter the context
        new = drafts[:accepted].tolist() + [bonus]
        for i, token in enumerate(new):
            if token in stop_token_ids:
                new, finish = new[:i + 1], "stop"
                break
        out += new
        if on_tokens:
            on_tokens(new)
        anchor = bonus

    if fallback is not None:
        stats.fallback_rounds, stats.fallback_switches = fallback.fallback_rounds, fallback.switches
    stats.new_tokens = len(out)
    stats.total_s = time.perf_counter() - t_start
    stats.finish_reason = finish
    return GenerationResult(tokens=out, stats=stats)
