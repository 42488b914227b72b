"""OpenAI-compatible HTTP server over the continuous-batching scheduler (FastAPI + uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent
events ending with `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus text).
Errors have OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 bad request,
401 a missing or wrong API key (when the server has keys), 404 unknown model or path, 405 wrong
method (with `Allow`), 408 a request not whole within the read timeout, 413 body too large, 429
queue full, 500 failure (a generic message; the traceback goes to the server's log), 503 shutting
down or every connection busy, 504 timeout. Request bodies are parsed and checked by
runtime/openai_api.py, not by pydantic, so every bad input gets a clear message naming the
parameter; the OpenAPI document (/openapi.json) describes the same bodies and the streamed chunks
are runtime/openai_wire.py's. What a connection may hold (read timeout, connection limit) is
runtime/connections.py's.

API keys (ServeConfig.api_keys, `loopspec serve --api-key`): when any is configured, every /v1/ route
wants `Authorization: Bearer KEY` with one of them, else 401 (/health and /metrics stay open, as
vLLM's --api-key leaves them). Tenancy: each request decodes in a scope (`request_scope`) — the key
it came with and its `user` field — and the shared suffix library (DecodingSettings.shared_suffix)
proposes to a request only what earlier requests of its scope wrote (loopspec/tenancy.py).

The handlers are plain functions of the HTTP request; what they serve (pipeline, scheduler, config)
is the app's `ServerState` (`app.state.server`).
"""

# no `from __future__ import annotations` here: FastAPI reads the handlers' annotations (the lazily
# imported Request class) at definition time
import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass

from loopspec.precisions import describe_precision
from loopspec.errors import LoopspecError
from loopspec.tenancy import api_key_problem, request_scope
from loopspec.settings import DecodingSettings
from loopspec.suffix_library import check_library_size
from loopspec.runtime.constraint import GrammarBusy, GrammarError
from loopspec.runtime.decoder import Decoder
from loopspec.runtime.metrics import Metrics
from loopspec.runtime.openai_api import (
    APIError,
    RequestOptions,
    chat_prompt,
    completion_prompt,
    json_depth,
    parse_options,
    with_tools,
)
from loopspec.runtime.openai_wire import CHAT_BODY, COMPLETION_BODY, error_responses, post_route_doc, sse_stream
from loopspec.runtime.scheduler import Event, QueueFull, Request, Scheduler
from loopspec.runtime.tool_calls import chat_answer

try:  # the serve extra (fastapi brings starlette); FastAPI reads the handlers' parameter type
    from starlette.requests import ClientDisconnect, Request as HTTPRequest
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
except ImportError:  # create_app refuses with a clear message before any route exists
    ClientDisconnect = HTTPRequest = JSONResponse = PlainTextResponse = StreamingResponse = None

log = logging.getLogger("loopspec.server")


@dataclass(frozen=True)
class ServeConfig:
    settings: DecodingSettings  # how every request decodes (resolved once, e.g. Pipeline.settings)
    model_name: str | None = None  # the id clients send as `model` (default: the target's folder name)
    max_batch_size: int = 8  # batch rows decoding at once
    max_queue: int = 64  # requests waiting for a row; one more gets 429
    prefill_chunk: int | None = 64  # prompt tokens prefilled per step beside the running rows (None: whole prompts)
    request_timeout_s: float = 600.0  # from arrival, queueing included
    grammar_timeout_s: float = 10.0  # a grammar not compiled by then gets 429; its compile goes on and is kept
    max_body_bytes: int = 1 << 20
    max_json_depth: int = 64  # nesting of the request body; deeper gets 400
    max_tokens_limit: int = 4096  # the most `max_tokens` one request may ask for
    default_max_tokens: int = 256  # when a request sets none (bounded by the context)
    max_stop_strings: int = 4
    read_timeout_s: float = 30.0  # a request (header and body) must arrive whole within this, else 408 and closed
    max_connections: int | None = None  # open connections (None: as many as the open-file limit allows, <= 4096)
    api_keys: tuple[str, ...] = ()  # bearer keys a /v1/ request must carry one of (none: open to all)

    def __post_init__(self):
        # the CLI's flags refuse the same values; a Python caller gets the same one line
        for name in ("request_timeout_s", "read_timeout_s", "grammar_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise LoopspecError(f"ServeConfig.{name} must be a finite number of seconds > 0, got {value!r}")
        for name in (
            "max_batch_size",
            "max_queue",
            "max_body_bytes",
            "max_json_depth",
            "max_tokens_limit",
            "default_max_tokens",
            "max_stop_strings",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= (0 if name == "max_stop_strings" else 1)):
                raise LoopspecError(
                    f"ServeConfig.{name} must be an integer >= {0 if name == 'max_stop_strings' else 1}, got {value!r}"
                )
        if self.prefill_chunk is not None and not (isinstance(self.prefill_chunk, int) and self.prefill_chunk >= 1):
            raise LoopspecError(
                f"ServeConfig.prefill_chunk must be an integer >= 1 or None, got {self.prefill_chunk!r}"
            )
        if not isinstance(self.api_keys, tuple):
            raise LoopspecError(f"ServeConfig.api_keys must be a tuple of strings, got {type(self.api_keys).__name__}")
        check_library_size(self.settings.shared_suffix, self.max_tokens_limit)  # its memory, bounded
        for i, key in enumerate(self.api_keys):
            problem = api_key_problem(key)
            if problem:  # (the key itself is not repeated: it is a secret)
                raise LoopspecError(f"ServeConfig.api_keys[{i}]: {problem}")


def authorize(http: "HTTPRequest", keys: tuple[str, ...]) -> int | None:
    """Which configured key the request carries (its index) → None when the server has no keys;
    401 when it has and the request carries none of them. Every key is compared in constant time."""
    if not keys:
        return None
    scheme, _, token = http.headers.get("authorization", "").partition(" ")
    token = token.strip().encode() if scheme.lower() == "bearer" else b""
    found = None
    for i, key in enumerate(keys):
        if hmac.compare_digest(token, key.encode()) and found is None:
            found = i
    if found is None:
        raise APIError(
            401, "a valid API key is required: send the header 'Authorization: Bearer KEY'", code="invalid_api_key"
        )
    return found


class ClientGone(Exception):
    """The client closed the connection before its request body was complete: nobody to answer."""


# --------------------------------------------------------------------------------------------------
# The app state and the handlers


@dataclass
class ServerState:
    pipeline: object  # runtime.pipeline.Pipeline, its engine with config.max_batch_size rows
    config: ServeConfig
    scheduler: Scheduler
    model_name: str
    created: int

    @property
    def metrics(self) -> Metrics:
        return self.scheduler.metrics

    @property
    def max_context(self) -> int:
        return self.pipeline.engine.max_context


def _state(http: HTTPRequest) -> ServerState:
    return http.app.state.server


class _EventQueue:
    """The scheduler thread's Events, handed to the asyncio loop that serves the request."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def __call__(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


async def read_body(http: HTTPRequest, state: ServerState) -> dict:
    """The request's JSON object, within the size and depth limits, naming a model we serve."""
    config = state.config
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
        raise APIError(
            413,
            f"request body of {declared} bytes exceeds the limit of {config.max_body_bytes}",
            code="request_too_large",
        )
    chunks, size = [], 0
    try:
        async for chunk in http.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                raise APIError(
                    413, f"request body exceeds the limit of {config.max_body_bytes} bytes", code="request_too_large"
                )
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    raw = b"".join(chunks)
    if b"\x00" in raw:  # JSON escapes every control character: a NUL byte is UTF-16 or UTF-32 text
        raise APIError(400, "the body is not UTF-8 JSON (it holds NUL bytes: UTF-16 or UTF-32?)", code="invalid_json")
    try:
        # UTF-8 only, as JSON over HTTP is (RFC 8259): json.loads(bytes) would also take UTF-16/32
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not UTF-8 JSON (byte {e.start} is not UTF-8)", code="invalid_json") from None
    except RecursionError:
        raise APIError(
            400, f"the JSON body nests deeper than {config.max_json_depth} levels", code="invalid_json"
        ) from None
    except ValueError as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the JSON body must be an object", code="invalid_json")
    if json_depth(body, config.max_json_depth) > config.max_json_depth:
        raise APIError(400, f"the JSON body nests deeper than {config.max_json_depth} levels", code="invalid_json")
    model = body.get("model")
    if model is not None and model != state.model_name:
        raise APIError(
            404,
            f"the model {model!r} does not exist (this server serves {state.model_name!r})",
            "model",
            code="model_not_found",
        )
    return body


def token_budget(state: ServerState, prompt_ids: list[int], options: RequestOptions) -> int:
    max_context = state.max_context
    if len(prompt_ids) >= max_context:
        raise APIError(
            400,
            f"the prompt has {len(prompt_ids)} tokens; this model's context is {max_context} "
            f"tokens and the prompt must leave room for one",
            "messages/prompt",
            code="context_length_exceeded",
        )
    room = max_context - len(prompt_ids)
    if options.max_tokens is not None and options.max_tokens > room:
        raise APIError(
            400,
            f"this model's context is {max_context} tokens; {len(prompt_ids)} in the prompt "
            f"+ max_tokens {options.max_tokens} exceed it",
            "max_tokens",
            code="context_length_exceeded",
        )
    return options.max_tokens or min(state.config.default_max_tokens, room)


async def request_constraint(state: ServerState, options: RequestOptions, prompt_ids: list[int]):
    """The request's grammar state (None without structured output), compiled off the event loop; one
    that cannot apply is a 400, one not compiled within grammar_timeout_s a 429 (its compile goes on).
    It starts after the reply's reasoning where the model reasons first (Pipeline.after_reasoning)."""
    grammar = options.grammar
    if grammar is None:
        return None
    if state.config.settings.draft_sampling == "drafter" and not options.params.greedy:
        raise APIError(
            400,
            f"{grammar.param} needs drafts verified by the walk; this server samples drafts from "
            "the drafter (serve with --draft-sampling walk, or send temperature 0)",
            grammar.param,
        )
    try:
        grammars = await asyncio.to_thread(lambda: state.pipeline.grammars)  # built on first use: the vocabulary
        constraint = await grammars.constraint_within(grammar, state.config.grammar_timeout_s)
        state.pipeline.after_reasoning(constraint, prompt_ids)
        return constraint
    except GrammarBusy as e:  # not the request's fault: the same request succeeds once the compile is kept
        raise APIError(429, str(e), e.param, code="grammar_compiling") from None
    except GrammarError as e:
        raise APIError(400, str(e), e.param) from None
    except LoopspecError as e:
        raise APIError(400, f"{grammar.param}: {e}", grammar.param) from None


async def _collect(queue: asyncio.Queue) -> tuple[str, Event]:
    """A request's text and its last event (done or error)."""
    parts = []
    while True:
        event = await queue.get()
        if event.kind == "text":
            parts.append(event.text)
        else:
            return "".join(parts), event


async def _disconnected(http: HTTPRequest) -> None:
    """Returns when the client goes away (the body is read: the next ASGI message is the disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def respond(
    http: HTTPRequest,
    state: ServerState,
    prompt_ids: list[int],
    options: RequestOptions,
    chat: bool,
    scope: tuple = (None, None),
):
    scheduler = state.scheduler
    events = _EventQueue(asyncio.get_running_loop())
    request = Request(
        prompt_ids=prompt_ids,
        max_tokens=token_budget(state, prompt_ids, options),
        on_event=events,
        params=options.params,
        seed=options.seed,
        stop=options.stop,
        timeout_s=state.config.request_timeout_s,
        constraint=await request_constraint(state, options, prompt_ids),
        scope=scope,
    )
    try:
        scheduler.submit(request)
    except QueueFull as e:
        state.metrics.count_request("rejected")
        raise APIError(429, str(e), code="queue_full", counted=True) from None
    except LoopspecError as e:
        raise APIError(503, str(e)) from None
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    kind = "chat.completion" if chat else "text_completion"
    if options.stream:
        return _SSE(
            sse_stream(events.queue, rid, kind, chat, options.include_usage, state.model_name, options.tools),
            on_close=lambda: request.finished or scheduler.cancel(request),
        )
    result, gone = asyncio.ensure_future(_collect(events.queue)), asyncio.ensure_future(_disconnected(http))
    await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not result.done():  # the client gave up: stop decoding for it
        result.cancel()
        scheduler.cancel(request)
        return PlainTextResponse("", status_code=499)
    gone.cancel()
    text, event = result.result()
    if event.kind == "error":
        raise APIError(event.status, event.message, counted=True)
    if chat:  # the reply's tool calls parsed out of its text, if it was given tools
        message, finish = chat_answer(text, event.finish_reason, options.tools)
        choice = {"index": 0, "message": message, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": event.finish_reason}
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": state.model_name,
        "choices": [choice],
        "usage": event.usage,
    }


async def completions(http: HTTPRequest):
    state = _state(http)
    key = authorize(http, state.config.api_keys)
    body = await read_body(http, state)
    options = parse_options(body, state.config, chat=False)
    return await respond(
        http,
        state,
        completion_prompt(body, state.pipeline),
        options,
        chat=False,
        scope=request_scope(key, options.user),
    )


async def chat_completions(http: HTTPRequest):
    state = _state(http)
    key = authorize(http, state.config.api_keys)
    body = await read_body(http, state)
    options = with_tools(parse_options(body, state.config, chat=True), state.pipeline)
    prompt_ids = chat_prompt(body, state.pipeline, options.tools)
    return await respond(http, state, prompt_ids, options, chat=True, scope=request_scope(key, options.user))


async def models(http: HTTPRequest):
    state = _state(http)
    authorize(http, state.config.api_keys)
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": state.created,
                "owned_by": "loopspec",
                "max_model_len": state.max_context,
                "engine": engine_info(state.pipeline),
            }
        ],
    }


def engine_info(pipeline) -> dict:
    """What the served model computes with: backend, precision and its weights and arithmetic in words."""
    engine = pipeline.engine
    return {
        "backend": engine.backend,
        "precision": engine.precision,
        "computes_with": describe_precision(engine.precision, engine.block_types),
    }


async def health(http: HTTPRequest):
    state = _state(http)
    if not state.scheduler.alive:
        return JSONResponse(APIError(503, "the scheduler is not running").body(), status_code=503)
    return {
        "status": "ok",
        "model": state.model_name,
        "method": state.config.settings.method,
        "decoding": state.config.settings.to_dict(),
        "engine": engine_info(state.pipeline),
        "max_batch_size": state.pipeline.engine.max_rows,
    }


async def prometheus(http: HTTPRequest):
    return PlainTextResponse(_state(http).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def api_error(http, e: APIError):
    if not e.counted:
        _state(http).metrics.count_request("invalid" if e.status < 500 else "error")
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def http_error(http, e):
    """Routing's own errors (404 unknown path, 405 wrong method, ...) in OpenAI's shape, headers kept."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return JSONResponse(
        APIError(e.status_code, str(e.detail), code=code).body(),
        status_code=e.status_code,
        headers=getattr(e, "headers", None),
    )


async def client_gone(http, e: ClientGone):
    """A client that left mid-body cancelled its own request: no failure of ours, no traceback. A body
    cut off by the read timeout was already answered 408 by the connection guard (runtime/connections.py)."""
    if http.scope.get("loopspec.read_timed_out"):
        _state(http).metrics.count_request("invalid")
    else:
        log.info("client left before sending all of its request body: %s %s", http.method, http.url.path)
        _state(http).metrics.count_request("cancelled")
    return PlainTextResponse("", status_code=499)  # what nginx logs for it; nobody reads it


async def server_error(http, e: Exception):
    """An internal failure: the traceback to the log, a generic message to the client."""
    log.exception("internal error serving %s %s", http.method, http.url.path, exc_info=e)
    _state(http).metrics.count_request("error")
    return JSONResponse(APIError(500, "internal server error (see the server log)").body(), status_code=500)


# --------------------------------------------------------------------------------------------------
# The app


def _require_fastapi():
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise LoopspecError("the server needs fastapi and uvicorn: pip install 'loopspec[serve]'") from None


def create_app(pipeline, config: ServeConfig):
    """The FastAPI app serving `pipeline` (a runtime.pipeline.Pipeline) with `config`; its scheduler
    thread runs while the app's lifespan does."""
    _require_fastapi()
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from starlette.exceptions import HTTPException

    pipeline = pipeline.with_rows(config.max_batch_size)
    scheduler = Scheduler(
        Decoder(pipeline.engine, config.settings, pipeline.pacing(config.settings), prefill_chunk=config.prefill_chunk),
        pipeline.decode,
        stop_token_ids=pipeline.stop_token_ids,
        max_queue=config.max_queue,
        metrics=Metrics(),
    )
    state = ServerState(
        pipeline=pipeline,
        config=config,
        scheduler=scheduler,
        model_name=config.model_name or pipeline.target_dir.name,
        created=int(time.time()),
    )

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        scheduler.close()

    app = FastAPI(title="loopspec", lifespan=lifespan)
    app.state.server = state
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(ClientGone, client_gone)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
    app.add_api_route("/v1/completions", completions, methods=["POST"], **post_route_doc(COMPLETION_BODY))
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], **post_route_doc(CHAT_BODY))
    app.add_api_route("/v1/models", models, methods=["GET"], responses=error_responses(401))
    app.add_api_route("/health", health, methods=["GET"], responses=error_responses(503))
    app.add_api_route(
        "/metrics",
        prometheus,
        methods=["GET"],
        response_class=PlainTextResponse,
        responses={
            200: {
                "description": "Prometheus text exposition",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    )
    return app


if StreamingResponse is not None:

    class _SSE(StreamingResponse):
        """Server-sent events; when the response ends for any reason (the client left included), an
        unfinished request is cancelled."""

        def __init__(self, content, on_close):
            super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            self.on_close = on_close

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.on_close()


def http_server(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
    """The uvicorn server for `app` (from create_app), its connections kept by a ConnectionGuard
    (runtime/connections.py): the app's read timeout and connection limit, the open-file limit raised
    to the hard limit first, repeated warnings logged once per 10 s with a count. Refuses a connection
    limit the open-file limit cannot hold."""
    _require_fastapi()
    import uvicorn

    from loopspec.runtime.connections import (
        ConnectionGuard,
        connection_limit,
        guarded_protocol,
        install_log_filter,
        raise_open_file_limit,
    )

    state: ServerState = app.state.server
    limit = connection_limit(state.config.max_connections, raise_open_file_limit())
    guard = ConnectionGuard(limit, state.config.read_timeout_s, state.metrics)
    # ws="none": no WebSocket routes here, and an upgraded connection would leave the guard's keeping
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=guarded_protocol(guard),
        ws="none",
        timeout_graceful_shutdown=5,
    )
    install_log_filter()  # after uvicorn.Config, which configures logging
    return uvicorn.Server(config)


def serve(
    pipeline, host: str = "127.0.0.1", port: int = 8000, config: ServeConfig | None = None, log_level: str = "info"
) -> None:
    """Serve until interrupted."""
    http_server(create_app(pipeline, config), host=host, port=port, log_level=log_level).run()
