"""Continuous batching: one thread owns the decoder (and so the engine and its caches).

Requests wait in a bounded queue (`submit` raises QueueFull when it is full). Between two decoding
steps the thread admits waiting requests into free batch rows, retires the finished ones, and ends
the ones whose client went away (`cancel`) or whose deadline passed. Each request receives its
output as Events through its own callback, called from this thread (the server turns them into an
asyncio queue). A failure stays with its request: a bad admission or a failed acceptance ends that
request with an error; a failed batched forward ends the requests in that batch, and the loop goes on.

Text: tokens are detokenized per request; text is released only when it can no longer turn out to be
part of a stop string or of an incomplete UTF-8 character, and it ends before a stop string. The server's
decode (Pipeline.decode, runtime/detokenize.py) ends at a whole character: the bytes of a character the
generation never finished (max_tokens cut it) are never sent, in a stream or in the whole reply.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable

from loopspec.decoding import SamplingParams
from loopspec.errors import LoopspecError
from loopspec.runtime.decoder import Decoder
from loopspec.runtime.metrics import Metrics

log = logging.getLogger("loopspec.server")
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length"}  # decoder → OpenAI


class QueueFull(Exception):
    """The request queue is full (HTTP 429)."""


@dataclass
class Event:
    kind: str  # "text" | "done" | "error"
    text: str = ""
    finish_reason: str | None = None  # done: "stop" | "length"
    usage: dict | None = None  # done: prompt_tokens, completion_tokens, total_tokens
    status: int = 0  # error: 400 bad request, 500 failure, 503 shutting down, 504 timeout
    message: str = ""


@dataclass(eq=False)  # identity: a request is the key of its batch row
class Request:
    prompt_ids: list[int]
    max_tokens: int
    on_event: Callable[[Event], None]
    params: SamplingParams = SamplingParams()
    seed: int | None = None  # None: a fresh random seed
    stop: tuple[str, ...] = ()
    timeout_s: float | None = None
    constraint: object | None = None  # its grammar state (runtime/constraint.py), None: unconstrained
    scope: Hashable = None  # the shared suffix library's scope (the server's tenant: API key and `user`)
    arrived: float = field(default_factory=time.monotonic)
    cancelled: bool = False  # set by the client side; the scheduler acts on it between steps
    finished: bool = False
    first_token_at: float | None = None
    completion_tokens: int = 0

    @property
    def deadline(self) -> float | None:
        return None if self.timeout_s is None else self.arrived + self.timeout_s


class TextTail:
    """Incremental detokenization of one request with stop strings. `decode` gives the text of all the
    tokens so far; one that ends at a whole character (Pipeline.decode) leaves an unfinished
    character out of every piece and of the end, while a plain decode's U+FFFD for it is held back
    until tokens follow and released by `flush` (no later token can finish it then)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]):
        self.decode, self.stop = decode, tuple(s for s in stop if s)
        self.tokens: list[int] = []
        self.sent = 0  # characters released so far

    def feed(self, tokens: list[int], final: bool = False) -> tuple[str, bool]:
        """Add tokens → (text now safe to release, whether a stop string ended the text). `final`:
        no tokens follow, so the whole text counts as decoded."""
        self.tokens += tokens
        text = self.decode(self.tokens)
        # A trailing U+FFFD may be the first bytes of a character whose other bytes come with the next
        # tokens: that text is not decoded yet, so it is neither released nor matched against stop
        # strings (a stop string "\ufffd" would otherwise end every reply at its first emoji).
        decoded = len(text)
        if not final:
            while decoded > self.sent and text[decoded - 1] == "\ufffd":
                decoded -= 1
        if self.stop:
            longest = max(len(s) for s in self.stop)
            start = max(0, self.sent - longest + 1)
            hits = [i for i in (text.find(s, start, decoded) for s in self.stop) if i >= 0]
            if hits:
                end = max(min(hits), self.sent)
                out, self.sent = text[self.sent : end], end
                return out, True
        end = decoded
        hold = 0  # the longest unreleased tail that may still grow into a stop string
        for s in self.stop if not final else ():
            for n in range(min(len(s) - 1, end - self.sent), hold, -1):
                if text[end - n : end] == s[:n]:
                    hold = n
                    break
        end -= hold
        out, self.sent = text[self.sent : end], max(self.sent, end)
        return out, False

    def flush(self) -> tuple[str, bool]:
        """The rest of the text at the end of a request, and whether a stop string ended it (one
        can end in text held back until now: a genuine U+FFFD at the very end)."""
        return self.feed([], final=True)


class Scheduler:
    def __init__(
        self,
        decoder: Decoder,
        decode_text: Callable[[list[int]], str],
        *,
        stop_token_ids: frozenset[int] = frozenset(),
        max_queue: int = 64,
        metrics: Metrics | None = None,
    ):
        if max_queue < 1:
            raise LoopspecError(f"max queue must be >= 1, got {max_queue}")
        self.decoder, self.decode_text, self.stop_token_ids = decoder, decode_text, frozenset(stop_token_ids)
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self._waiting: collections.deque[Request] = collections.deque()
        self._active: dict[Request, TextTail] = {}
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="loopspec-scheduler", daemon=True)

    # ---- client side (any thread) ------------------------------------------------------------------
    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closing

    def submit(self, request: Request) -> None:
        with self._cond:
            if self._closing:
                raise LoopspecError("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting); retry later")
            self._waiting.append(request)
            self.metrics.queue_depth = len(self._waiting)
            self._cond.notify()

    def cancel(self, request: Request) -> None:
        """The client is gone: the request ends at the next step boundary (no more events needed)."""
        request.cancelled = True
        with self._cond:
            self._cond.notify()

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the scheduler thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closing and not self._waiting and not self._active:
                    self._cond.wait()
                if self._closing:
                    break
                now = time.monotonic()
                for request in [r for r in self._waiting if r.cancelled or _expired(r, now)]:
                    self._waiting.remove(request)
                    self._end_early(request, now)
                incoming = [self._waiting.popleft() for _ in range(min(self.decoder.free_rows, len(self._waiting)))]
                self.metrics.queue_depth = len(self._waiting)
            for request in incoming:
                self._admit(request)
            now = time.monotonic()
            for request in [r for r in self._active if r.cancelled or _expired(r, now)]:
                self.decoder.cancel(request)
                self._end_early(request, now)
            if self.decoder.rows or self.decoder.prefilling:
                self._step()
            self.metrics.running = len(self._active)
        with self._cond:  # shutting down: nothing waiting or running gets an answer any more
            pending = list(self._waiting) + list(self._active)
            self._waiting.clear()
        for request in pending:
            self.decoder.cancel(request)
            self._fail(request, 503, "the server is shutting down")

    def _admit(self, request: Request) -> None:
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        try:
            row, first = self.decoder.admit(
                request,
                request.prompt_ids,
                max_new_tokens=request.max_tokens,
                params=request.params,
                seed=seed,
                stop_token_ids=self.stop_token_ids,
                constraint=request.constraint,
                scope=request.scope,
            )
        except LoopspecError as e:
            self._fail(request, 400, str(e))
            return
        except Exception:  # noqa: BLE001 — isolate: this request fails, the server goes on
            log.exception("prefill failed")
            self._fail(request, 500, "prefill failed (see the server log)")
            return
        with self.metrics.lock:
            self.metrics.prompt_tokens += len(request.prompt_ids)
        self._active[request] = TextTail(self.decode_text, request.stop)
        self._deliver(request, row, first)

    def _step(self) -> None:
        try:
            events = self.decoder.step()
        except Exception:  # noqa: BLE001 — a batched forward failed: its requests end, the loop goes on
            log.exception("a decoding step failed")
            for request in list(self._active):
                self.decoder.cancel(request)
                self._fail(request, 500, "decoding failed (see the server log)")
            return
        with self.metrics.lock:
            self.metrics.steps += 1
            for row, _ in events:
                committed = row.stats.last_counted_round() if row.finish != "error" else None
                if committed is not None:
                    self.metrics.tau.observe(committed)
                if row.finish and row.finish != "error":
                    self.metrics.count_verifications(row.stats)
        for row, new in events:
            self._deliver(row.key, row, new)

    def _deliver(self, request: Request, row, new: list[int]) -> None:
        tail = self._active.get(request)
        if tail is None:
            return
        if row.finish == "error":
            log.error("decoding failed for one request: %s", row.error)
            self._fail(request, 500, "decoding failed (see the server log)")
            return
        now = time.monotonic()
        if new:
            request.completion_tokens += len(new)
            self.metrics.add_tokens(len(new), now)
            if request.first_token_at is None:
                request.first_token_at = now
                with self.metrics.lock:
                    self.metrics.first_token.observe(now - request.arrived)
        text, stopped = tail.feed(new)
        if stopped and not row.finish:
            self.decoder.cancel(request)  # the stop string ended it mid-decode: free its row now
        finish = "stop" if stopped else FINISH_REASONS.get(row.finish)
        if finish and not stopped:
            rest, stopped = tail.flush()
            text += rest
            finish = "stop" if stopped else finish
        if text and not self._emit(request, Event("text", text=text)):
            return
        if finish:
            del self._active[request]
            request.finished = True
            usage = {
                "prompt_tokens": len(request.prompt_ids),
                "completion_tokens": request.completion_tokens,
                "total_tokens": len(request.prompt_ids) + request.completion_tokens,
            }
            with self.metrics.lock:
                self.metrics.requests["completed"] += 1
                self.metrics.latency.observe(now - request.arrived)
            self._emit(request, Event("done", finish_reason=finish, usage=usage))

    def _emit(self, request: Request, event: Event) -> bool:
        try:
            request.on_event(event)
            return True
        except Exception:  # noqa: BLE001 — the consumer is gone or broken: end this request only
            request.cancelled = True
            if request in self._active:
                self.decoder.cancel(request)
                del self._active[request]
                request.finished = True
                self.metrics.count_request("cancelled")
            return False

    def _end_early(self, request: Request, now: float) -> None:
        """A cancelled (client gone) or timed-out request, waiting or running."""
        self._active.pop(request, None)
        if request.cancelled:
            request.finished = True
            self.metrics.count_request("cancelled")
            return
        self._fail(request, 504, f"the request timed out after {request.timeout_s:g} s", outcome="timeout")

    def _fail(self, request: Request, status: int, message: str, outcome: str = "error") -> None:
        self._active.pop(request, None)
        request.finished = True
        self.metrics.count_request(outcome)
        try:
            request.on_event(Event("error", status=status, message=message))
        except Exception:  # noqa: BLE001 — nobody is listening any more
            pass


def _expired(request: Request, now: float) -> bool:
    return request.deadline is not None and now >= request.deadline
