"""What keeps the HTTP server answering whatever its connections do: a time limit on the arrival of
each request, a limit on open connections, the open-file limit, and logging that a flood of one
error cannot drown.

uvicorn times out only idle keep-alive connections, after a response: a connection that sends half a
header, or nothing, is held forever, and its `limit_concurrency` counts such connections and then
answers every new request, /health included, with 503. Here a connection is *waiting* while the
request it is sending is not yet whole (from its first byte, or from the end of the previous
response) and *busy* while that request is answered. A waiting connection is closed after the read
timeout (with a 408 when part of a request had arrived); at the connection limit the connection
waiting longest makes room for the new one, so idle connections cannot lock anyone out. Only when
every open connection is busy is a new one answered 503 at once and closed.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections import OrderedDict

from loopspec.errors import LoopspecError
from loopspec.runtime.openai_api import APIError

log = logging.getLogger("loopspec.server")

DEFAULT_MAX_CONNECTIONS = 4096
FILES_RESERVED = 128  # open files the process needs beside its connections: weights, libraries, logs, listeners


def raise_open_file_limit() -> int | None:
    """Raise this process's soft limit on open files to its hard limit (no privilege needed); the soft
    limit now, or None where the platform has none."""
    try:
        import resource
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:  # e.g. an unlimited hard limit the kernel caps lower
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, e)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def connection_limit(requested: int | None, open_files: int | None) -> int:
    """The most connections to hold open: `requested`, refused when the open-file limit cannot hold
    it; by default as many as the limit allows, up to DEFAULT_MAX_CONNECTIONS."""
    room = None if open_files is None else open_files - FILES_RESERVED
    if requested is None:
        return DEFAULT_MAX_CONNECTIONS if room is None else max(1, min(DEFAULT_MAX_CONNECTIONS, room))
    if room is not None and requested > room:
        raise LoopspecError(
            f"--max-connections {requested} needs {requested + FILES_RESERVED} open files; this "
            f"process may open {open_files} (raise `ulimit -Hn`, or ask for fewer connections)"
        )
    return requested


class RepeatedLogFilter(logging.Filter):
    """Lets one record of each kind (logger and message) through per interval; the next one let
    through says how many were held back. Records below WARNING pass untouched."""

    MAX_KINDS = 1024  # distinct kinds remembered (messages that embed a varying value are each a kind)

    def __init__(self, interval_s: float = 10.0):
        super().__init__()
        self.interval_s = interval_s
        self.kinds: dict[tuple[str, str], list] = {}  # kind -> [when one was let through, held back since]
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        kind, now = (record.name, str(record.msg)[:200]), time.monotonic()
        with self.lock:
            seen = self.kinds.get(kind)
            if seen is not None and now - seen[0] < self.interval_s:
                seen[1] += 1
                return False
            if len(self.kinds) >= self.MAX_KINDS:
                self.kinds.clear()
            self.kinds[kind] = [now, 0]
        if seen is not None and seen[1]:
            record.msg = f"{record.msg} [{seen[1]} more like this in the last {now - seen[0]:.0f} s, not shown]"
        return True


LOGGERS = ("loopspec.server", "uvicorn.error", "asyncio")  # asyncio logs accept() failures such as EMFILE


def install_log_filter(interval_s: float = 10.0) -> RepeatedLogFilter:
    """One RepeatedLogFilter on each of LOGGERS (installed once per process)."""
    for name in LOGGERS:
        for existing in logging.getLogger(name).filters:
            if isinstance(existing, RepeatedLogFilter):
                return existing
    shared = RepeatedLogFilter(interval_s)
    for name in LOGGERS:
        logging.getLogger(name).addFilter(shared)
    return shared


def _response(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP response in OpenAI's error shape, written straight to a connection that closes."""
    body = json.dumps(APIError(status, message, code=code).body()).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


LINGER_S = 1.0  # how long a connection answered and closed still reads (and drops) what its client sends


def _answer_and_close(protocol, response: bytes) -> None:
    """Write `response`, end our side, and close when the client ends its own, LINGER_S at most: closing
    at once while the client's request is still arriving resets the connection, and a reset can
    destroy the answer before the client reads it."""
    protocol.answered_and_closing = True
    transport = protocol.transport
    transport.write(response)
    if transport.can_write_eof():
        transport.write_eof()
    protocol.loop.call_later(LINGER_S, transport.close)


class ConnectionGuard:
    """The open connections of one server, and which of them wait for their request (oldest first)."""

    def __init__(self, max_connections: int, read_timeout_s: float, metrics=None):
        self.max_connections, self.read_timeout_s, self.metrics = max_connections, read_timeout_s, metrics
        self.open: set = set()
        self.waiting: OrderedDict = OrderedDict()  # protocol -> its read-timeout timer, oldest first

    def _count(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.count_connection_closed(reason)

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.open_connections = len(self.open)

    def opened(self, protocol) -> bool:
        """A new connection: held (True), or answered 503 and closed (False)."""
        if len(self.open) >= self.max_connections:
            if not self.waiting:
                _answer_and_close(
                    protocol,
                    _response(
                        503,
                        "Service Unavailable",
                        f"the server holds its limit of {self.max_connections} connections, all busy; retry later",
                        "too_many_connections",
                    ),
                )
                log.warning(
                    "connection limit of %d reached with every connection busy: a new one was refused",
                    self.max_connections,
                )
                self._count("refused")
                return False
            oldest = next(iter(self.waiting))
            self.closed(oldest)
            oldest.transport.close()
            log.warning(
                "connection limit of %d reached: closed the connection that waited longest for its request",
                self.max_connections,
            )
            self._count("evicted")
        self.open.add(protocol)
        self._gauge()
        self.track(protocol)
        return True

    def track(self, protocol) -> None:
        """After the connection's state changed: busy while a whole request is being answered, else waiting."""
        cycle = protocol.cycle
        if cycle is not None and not cycle.more_body and not cycle.response_complete:
            self.stop_waiting(protocol)
        elif protocol not in self.waiting and protocol in self.open:
            protocol.request_bytes_arrived = False
            self.waiting[protocol] = protocol.loop.call_later(self.read_timeout_s, self.expired, protocol)

    def stop_waiting(self, protocol) -> None:
        timer = self.waiting.pop(protocol, None)
        if timer is not None:
            timer.cancel()

    def closed(self, protocol) -> None:
        self.stop_waiting(protocol)
        self.open.discard(protocol)
        self._gauge()

    def expired(self, protocol) -> None:
        """The request did not arrive whole in time: a 408 when part of it came (and nothing has been
        answered to it), then the connection closes."""
        import h11

        self.waiting.pop(protocol, None)
        if protocol.transport.is_closing():
            return
        if protocol.request_bytes_arrived and protocol.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            if protocol.cycle is not None and not protocol.cycle.response_complete:  # the app awaits its body
                protocol.cycle.scope["loopspec.read_timed_out"] = True
            _answer_and_close(
                protocol,
                _response(
                    408,
                    "Request Timeout",
                    f"the request did not arrive whole within {self.read_timeout_s:g} s",
                    "request_timeout",
                ),
            )
        else:
            protocol.transport.close()
        log.warning("closed a connection whose request did not arrive whole within %g s", self.read_timeout_s)
        self._count("read_timeout")


def guarded_protocol(guard: ConnectionGuard) -> type:
    """uvicorn's h11 protocol, its connections kept by `guard` (a class per server: uvicorn makes
    one instance per connection, from the class alone)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            self.request_bytes_arrived, self.answered_and_closing = False, False
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                # uvicorn writes a response's head and body (and each streamed event) separately: with
                # Nagle's algorithm on, each write after the first waits for the client's delayed ACK (~40 ms)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().connection_made(transport)
            if not guard.opened(self):
                self.connections.discard(self)

        def data_received(self, data: bytes) -> None:
            if self.answered_and_closing:  # answered 408 or 503 already: what still comes is dropped
                return
            self.request_bytes_arrived = True
            super().data_received(data)
            guard.track(self)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            guard.track(self)

        def connection_lost(self, exc) -> None:
            guard.closed(self)
            super().connection_lost(exc)

    return GuardedH11Protocol
