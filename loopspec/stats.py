"""What one request's decoding did, and τ (the acceptance length) over it.

τ is the number of tokens committed per target verification that checked drafts (accepted drafts +
the target's bonus token); for plain decoding every verification counts (τ = 1). Rounds that drafted
nothing (the adaptive fallback's plain rounds, the last rounds of a request with no room left) commit
one token by construction and would dilute it. Tokens per verification over all rounds, plain ones
included, is what the speed sees: every report gives it beside τ.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    drafting: bool = False  # the method drafts (τ counts only the rounds that drafted)
    accepted_per_round: list[int] = field(default_factory=list)  # drafts accepted per verification
    stages_per_round: list[int] = field(default_factory=list)  # draft stages per verification (0: plain)
    nodes_per_round: list[int] = field(default_factory=list)  # draft nodes verified per verification
    later_stage_tokens: int = 0  # committed drafts that came from stages > 1
    suffix_tokens: int = 0  # committed drafts that only the suffix index proposed
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
    def plain_rounds(self) -> int:
        """Verifications of a drafting method that checked no draft (fallback, no room left)."""
        return sum(1 for s in self.stages_per_round if s == 0) if self.drafting else 0

    @property
    def tokens_per_verification(self) -> float | None:
        """Tokens committed per verification over all rounds, plain ones included (None: none ran)."""
        return tokens_per_verification([self])

    def counted_rounds(self) -> list[int]:
        """Tokens committed by each verification that τ counts."""
        return [n + 1 for n, s in zip(self.accepted_per_round, self.stages_per_round) if s > 0 or not self.drafting]

    def last_counted_round(self) -> int | None:
        """Tokens committed by the latest verification, if τ counts it."""
        if not self.accepted_per_round or (self.drafting and self.stages_per_round[-1] == 0):
            return None
        return self.accepted_per_round[-1] + 1

    @property
    def acceptance_length(self) -> float | None:
        """τ of this request (None when it never drafted)."""
        return acceptance_length([self])

    @property
    def accepted_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.accepted_per_round).items()))

    @property
    def stages_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.stages_per_round).items()))

    @property
    def other_s(self) -> float:
        return max(0.0, self.total_s - self.prefill_s - self.draft_s - self.verify_s)

    def summary(self) -> str:
        tau, per_verification = self.acceptance_length, self.tokens_per_verification
        acceptance = f"tau {'-' if tau is None else f'{tau:.2f}'} over {self.verifications} verifications"
        if self.drafting:  # τ counts the drafting rounds only; the speed sees every round
            acceptance = (
                f"tau {'-' if tau is None else f'{tau:.2f}'} over "
                f"{self.verifications - self.plain_rounds} drafting verifications, "
                f"{'-' if per_verification is None else f'{per_verification:.2f}'} tokens/verification "
                f"over all {self.verifications} ({self.plain_rounds} plain)"
            )
        return (
            f"{self.new_tokens} tokens in {self.total_s:.2f}s ({self.new_tokens / max(self.total_s, 1e-9):.1f} tok/s)"
            f" | {acceptance}"
            f" | prefill {self.prefill_s * 1e3:.0f} ms, draft {self.draft_s * 1e3:.0f} ms,"
            f" verify {self.verify_s * 1e3:.0f} ms, other {self.other_s * 1e3:.0f} ms"
            f"{f' | fallback: {self.fallback_rounds} plain rounds' if self.fallback_switches else ''}"
            f" | finish: {self.finish_reason}"
        )


def acceptance_length(stats: Iterable[GenerationStats]) -> float | None:
    """τ pooled over requests: committed tokens over the verifications τ counts (None: none drafted)."""
    rounds = [n for s in stats for n in s.counted_rounds()]
    return sum(rounds) / len(rounds) if rounds else None


def tokens_per_verification(stats: Iterable[GenerationStats]) -> float | None:
    """Committed tokens per verification pooled over requests and over every round, plain ones included
    (None: no verification ran). The token sampled at prefill is no verification's."""
    rounds = [n for s in stats for n in s.accepted_per_round]
    return (sum(rounds) + len(rounds)) / len(rounds) if rounds else None
