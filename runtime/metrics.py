"""Server metrics in the Prometheus text exposition format (version 0.0.4), without a client library.

Counters and histograms are updated by the scheduler thread and read by the HTTP thread: one lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque

# committed tokens per verification of one row (accepted drafts + 1)
TAU_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
OUTCOMES = ("completed", "cancelled", "timeout", "error", "rejected", "invalid")
# why the server closed a connection itself: its request did not arrive whole in time, it waited longest
# when the connection limit was reached, or it came when every connection was busy (503)
CONNECTION_CLOSES = ("read_timeout", "evicted", "refused")


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # per bucket (not cumulative; summed when rendered)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1
                break
        self.total += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for edge, n in zip(self.buckets, self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{edge:g}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.total}', f"{name}_sum {self.sum:g}", f"{name}_count {self.total}"]
        return out


class Metrics:
    def __init__(self, window_s: float = 10.0):
        self.lock = threading.Lock()
        self.requests = dict.fromkeys(OUTCOMES, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0
        self.tau = Histogram(TAU_BUCKETS)
        # every verification of the finished requests, plain ones included, and the tokens they committed:
        # tokens per verification over all rounds, beside tau over the drafting rounds
        self.verifications = {"drafting": 0, "plain": 0}
        self.verified_tokens = 0
        self.latency = Histogram(LATENCY_BUCKETS)
        self.first_token = Histogram(LATENCY_BUCKETS)
        self.queue_depth = 0
        self.running = 0
        self.window_s = window_s
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens) within the window
        self.open_connections = 0  # set by the server's connection guard
        self.connections_closed = dict.fromkeys(CONNECTION_CLOSES, 0)

    def count_verifications(self, stats) -> None:
        """A finished request's verifications (loopspec.stats.GenerationStats), under the lock."""
        self.verifications["plain"] += stats.plain_rounds
        self.verifications["drafting"] += stats.verifications - stats.plain_rounds
        self.verified_tokens += sum(stats.accepted_per_round) + stats.verifications

    def count_request(self, outcome: str) -> None:
        with self.lock:
            self.requests[outcome] += 1

    def count_connection_closed(self, reason: str) -> None:
        with self.lock:
            self.connections_closed[reason] += 1

    def add_tokens(self, n: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self.lock:
            self.generation_tokens += n
            self.recent.append((now, n))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self.recent and self.recent[0][0] < now - self.window_s:
            self.recent.popleft()

    def tokens_per_s(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self.lock:
            self._trim(now)
            return sum(n for _, n in self.recent) / self.window_s

    def render(self) -> str:
        tps = self.tokens_per_s()
        with self.lock:
            lines = ["# HELP loopspec_requests_total Requests by outcome.", "# TYPE loopspec_requests_total counter"]
            lines += [f'loopspec_requests_total{{outcome="{k}"}} {v}' for k, v in self.requests.items()]
            lines += [
                "# HELP loopspec_prompt_tokens_total Prompt tokens of admitted requests.",
                "# TYPE loopspec_prompt_tokens_total counter",
                f"loopspec_prompt_tokens_total {self.prompt_tokens}",
                "# HELP loopspec_generation_tokens_total Generated tokens.",
                "# TYPE loopspec_generation_tokens_total counter",
                f"loopspec_generation_tokens_total {self.generation_tokens}",
                f"# HELP loopspec_tokens_per_second Generated tokens per second over the last {self.window_s:g} s.",
                "# TYPE loopspec_tokens_per_second gauge",
                f"loopspec_tokens_per_second {tps:.3f}",
                "# HELP loopspec_queue_depth Requests waiting for a batch row.",
                "# TYPE loopspec_queue_depth gauge",
                f"loopspec_queue_depth {self.queue_depth}",
                "# HELP loopspec_running_requests Requests decoding in the batch.",
                "# TYPE loopspec_running_requests gauge",
                f"loopspec_running_requests {self.running}",
                "# HELP loopspec_batch_steps_total Batched draft-verify rounds.",
                "# TYPE loopspec_batch_steps_total counter",
                f"loopspec_batch_steps_total {self.steps}",
                "# HELP loopspec_acceptance_length Tokens committed per verification of a request "
                "(tau: accepted drafts + 1).",
                "# TYPE loopspec_acceptance_length histogram",
            ]
            lines += self.tau.lines("loopspec_acceptance_length")
            lines += [
                "# HELP loopspec_verifications_total Verifications of finished requests, by whether they "
                "checked drafts (plain: the anchor alone).",
                "# TYPE loopspec_verifications_total counter",
            ]
            lines += [f'loopspec_verifications_total{{kind="{k}"}} {v}' for k, v in self.verifications.items()]
            lines += [
                "# HELP loopspec_verified_tokens_total Tokens those verifications committed (over every "
                "round: divided by all verifications, what the speed sees).",
                "# TYPE loopspec_verified_tokens_total counter",
                f"loopspec_verified_tokens_total {self.verified_tokens}",
            ]
            lines += [
                "# HELP loopspec_time_to_first_token_seconds From arrival to the first token.",
                "# TYPE loopspec_time_to_first_token_seconds histogram",
            ]
            lines += self.first_token.lines("loopspec_time_to_first_token_seconds")
            lines += [
                "# HELP loopspec_request_duration_seconds From arrival to the end of a completed request.",
                "# TYPE loopspec_request_duration_seconds histogram",
            ]
            lines += self.latency.lines("loopspec_request_duration_seconds")
            lines += [
                "# HELP loopspec_open_connections HTTP connections open.",
                "# TYPE loopspec_open_connections gauge",
                f"loopspec_open_connections {self.open_connections}",
                "# HELP loopspec_connections_closed_total Connections the server closed itself, by reason.",
                "# TYPE loopspec_connections_closed_total counter",
            ]
            lines += [
                f'loopspec_connections_closed_total{{reason="{k}"}} {v}' for k, v in self.connections_closed.items()
            ]
        return "\n".join(lines) + "\n"
