"""OpenAI-compatible HTTP server over the continuous-batching scheduler (FastAPI + uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent
events ending with `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus text).
Errors have OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 bad request,
404 unknown model or path, 405 wrong method (with `Allow`), 413 body too large, 429 queue full,
500 failure (a generic message; the traceback goes to the server's log), 503 shutting down, 504
timeout. Request bodies are parsed and checked here, not by pydantic, so every bad input gets a clear
message naming the parameter; the OpenAPI document (/openapi.json) describes the same bodies.

The handlers are plain functions of the HTTP request; what they serve (pipeline, scheduler, config)
is the app's `ServerState` (`app.state.server`).
"""

# no `from __future__ import annotations` here: FastAPI reads the handlers' annotations (the lazily
# imported Request class) at definition time
import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass

from loopspec.decoding import SamplingParams
from loopspec.precisions import describe_precision
from loopspec.errors import LoopspecError
from loopspec.settings import DecodingSettings
from loopspec.runtime.decoder import Decoder
from loopspec.runtime.metrics import Metrics
from loopspec.runtime.scheduler import Event, QueueFull, Request, Scheduler

try:  # the serve extra (fastapi brings starlette); FastAPI reads the handlers' parameter type
    from starlette.requests import ClientDisconnect, Request as HTTPRequest
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
except ImportError:  # create_app refuses with a clear message before any route exists
    ClientDisconnect = HTTPRequest = JSONResponse = PlainTextResponse = StreamingResponse = None

log = logging.getLogger("loopspec.server")
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class ServeConfig:
    settings: DecodingSettings  # how every request decodes (resolved once, e.g. Pipeline.settings)
    model_name: str | None = None  # the id clients send as `model` (default: the target's folder name)
    max_batch_size: int = 8  # batch rows decoding at once
    max_queue: int = 64  # requests waiting for a row; one more gets 429
    prefill_chunk: int | None = 64  # prompt tokens prefilled per step beside the running rows (None: whole prompts)
    request_timeout_s: float = 600.0  # from arrival, queueing included
    max_body_bytes: int = 1 << 20
    max_json_depth: int = 64  # nesting of the request body; deeper gets 400
    max_tokens_limit: int = 4096  # the most `max_tokens` one request may ask for
    default_max_tokens: int = 256  # when a request sets none (bounded by the context)
    max_stop_strings: int = 4


class ClientGone(Exception):
    """The client closed the connection before its request body was complete: nobody to answer."""


class APIError(Exception):
    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error",
             504: "timeout_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 counted: bool = False):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.counted = counted  # already in the metrics (the scheduler counts what it ends)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


# --------------------------------------------------------------------------------------------------
# Request parsing (plain functions: the body is a dict from json.loads)


def _number(body: dict, name: str, default, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise APIError(400, f"{name} must be a number, got {value!r}", name)
    if value < low or value > high or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise APIError(400, f"{name} must be in {bound}, got {value}", name)
    return float(value)


def _integer(body: dict, name: str, low: int | None = None, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"{name} must be an integer, got {value!r}", name)
    if low is not None and value < low:
        raise APIError(400, f"{name} must be >= {low}, got {value}", name)
    if high is not None and value > high:
        raise APIError(400, f"{name} must be <= {high}, got {value}", name)
    return value


def _text(value: str, name: str) -> str:
    """A string that can be encoded: JSON escapes can carry lone UTF-16 surrogates ("\\ud800")."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{name} is not valid Unicode (it holds a lone surrogate)", name) from None
    return value


@dataclass
class Settings:
    params: SamplingParams
    seed: int | None
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


# Options this server does not implement, each with the one value (beside null) that leaves the
# output as it is: any other value would change the output, so it is refused rather than ignored.
# The JSON type is part of the value: Python's == would let `true` pass for 1, `1.0` for 1 and `0`
# for false. An int here takes an integer only; a float takes any number (0 or 0.0 for a penalty).
UNSUPPORTED = {
    "n": 1, "best_of": 1, "echo": False, "top_logprobs": 0, "suffix": "",
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
    "ignore_eos": False, "min_tokens": 0, "stop_token_ids": [], "logit_bias": {},
    "tools": [], "functions": [], "function_call": None, "tool_choice": None,
    "response_format": {"type": "text"},
}


def _is_neutral(value, neutral) -> bool:
    """`value` is `neutral` in JSON terms: equal, and of its JSON type (see UNSUPPORTED)."""
    if isinstance(neutral, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == neutral
    return type(value) is type(neutral) and value == neutral


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else json.dumps(value)


def _check_unsupported(body: dict, chat: bool) -> None:
    for name, neutral in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not _is_neutral(value, neutral):
            supported = "null" if neutral is None else f"null or {_shown(neutral)}"
            raise APIError(400, f"{name}={json.dumps(value)[:80]} is not supported (supported: {supported})", name)
    # logprobs: a boolean in chat, a count in completions, where even 0 returns the sampled
    # token's log-probability; neither is produced here
    logprobs = body.get("logprobs")
    if logprobs is not None and not (chat and logprobs is False):
        supported = "null or false" if chat else "null"
        raise APIError(400, f"logprobs={json.dumps(logprobs)[:80]} is not supported (supported: {supported})",
                       "logprobs")
    user = body.get("user")  # an end-user id for abuse monitoring: accepted, unused, but a string
    if user is not None and not isinstance(user, str):
        raise APIError(400, f"user must be a string, got {json.dumps(user)[:80]}", "user")


def parse_settings(body: dict, config: ServeConfig, chat: bool) -> Settings:
    _check_unsupported(body, chat)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = _integer(body, "top_k", low=0) or 0  # an extension (vLLM has it too)
    seed = _integer(body, "seed", *SEED_RANGE)
    # chat: max_completion_tokens wins over max_tokens, but both are checked (a bad one is refused
    # even beside a good one)
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    limits = [_integer(body, name, low=1, high=config.max_tokens_limit) for name in names]
    max_tokens = next((value for value in limits if value is not None), None)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "stop must be a non-empty string or a list of them", "stop")
    if len(stop) > config.max_stop_strings:
        raise APIError(400, f"at most {config.max_stop_strings} stop strings, got {len(stop)}", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise APIError(400, f"stream must be a boolean, got {stream!r}", "stream")
    options = body.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise APIError(400, f"stream_options must be an object, got {json.dumps(options)[:80]}", "stream_options")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise APIError(400, f"stream_options.include_usage must be a boolean, got {json.dumps(include_usage)[:80]}",
                       "stream_options")
    return Settings(params=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), seed=seed,
                    max_tokens=max_tokens, stop=tuple(_text(s, "stop") for s in stop), stream=bool(stream),
                    include_usage=bool(include_usage))


def completion_prompt(body: dict, pipeline) -> list[int]:
    """`prompt`: a string, or token ids, or a list holding one of those (n = 1, one prompt)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt is empty", "prompt")
        return pipeline.encode_text(_text(prompt, "prompt"))
    vocab_size = pipeline.engine.target_cfg.vocab_size
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", "prompt")
        return list(prompt)
    raise APIError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request)", "prompt")


def chat_prompt(body: dict, pipeline) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise APIError(400, f"messages[{i}] must be an object with role system, user or assistant", "messages")
        for name in ("tool_calls", "function_call"):  # earlier tool use: no tools here to render it with
            if m.get(name) not in (None, []):
                raise APIError(400, f"messages[{i}].{name} is not supported (this server has no tools)", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        clean.append({"role": role, "content": _text(content, "messages")})
    if not getattr(pipeline.tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    try:
        return pipeline.encode_chat(clean)
    except LoopspecError as e:
        raise APIError(400, str(e), "messages") from None


def json_depth(value, limit: int) -> int:
    """Nesting depth of a parsed JSON value, counted up to `limit` + 1 (iteratively: no recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            todo.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


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
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {config.max_body_bytes}",
                       code="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in http.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                raise APIError(413, f"request body exceeds the limit of {config.max_body_bytes} bytes",
                               code="request_too_large")
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
        raise APIError(400, f"the JSON body nests deeper than {config.max_json_depth} levels",
                       code="invalid_json") from None
    except ValueError as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the JSON body must be an object", code="invalid_json")
    if json_depth(body, config.max_json_depth) > config.max_json_depth:
        raise APIError(400, f"the JSON body nests deeper than {config.max_json_depth} levels", code="invalid_json")
    model = body.get("model")
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist (this server serves {state.model_name!r})",
                       "model", code="model_not_found")
    return body


def token_budget(state: ServerState, prompt_ids: list[int], settings: Settings) -> int:
    max_context = state.max_context
    if len(prompt_ids) >= max_context:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; this model's context is {max_context} "
                            f"tokens and the prompt must leave room for one", "messages/prompt",
                       code="context_length_exceeded")
    room = max_context - len(prompt_ids)
    if settings.max_tokens is not None and settings.max_tokens > room:
        raise APIError(400, f"this model's context is {max_context} tokens; {len(prompt_ids)} in the prompt "
                            f"+ max_tokens {settings.max_tokens} exceed it", "max_tokens",
                       code="context_length_exceeded")
    return settings.max_tokens or min(state.config.default_max_tokens, room)


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


async def respond(http: HTTPRequest, state: ServerState, prompt_ids: list[int], settings: Settings, chat: bool):
    scheduler = state.scheduler
    events = _EventQueue(asyncio.get_running_loop())
    request = Request(prompt_ids=prompt_ids, max_tokens=token_budget(state, prompt_ids, settings), on_event=events,
                      params=settings.params, seed=settings.seed, stop=settings.stop,
                      timeout_s=state.config.request_timeout_s)
    try:
        scheduler.submit(request)
    except QueueFull as e:
        state.metrics.count_request("rejected")
        raise APIError(429, str(e), code="queue_full", counted=True) from None
    except LoopspecError as e:
        raise APIError(503, str(e)) from None
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    kind = "chat.completion" if chat else "text_completion"
    if settings.stream:
        return _SSE(_stream(events.queue, rid, kind, chat, settings.include_usage, state.model_name),
                    on_close=lambda: request.finished or scheduler.cancel(request))
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
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
              else {"index": 0, "text": text, "logprobs": None})
    choice["finish_reason"] = event.finish_reason
    return {"id": rid, "object": kind, "created": int(time.time()), "model": state.model_name,
            "choices": [choice], "usage": event.usage}


async def completions(http: HTTPRequest):
    state = _state(http)
    body = await read_body(http, state)
    settings = parse_settings(body, state.config, chat=False)
    return await respond(http, state, completion_prompt(body, state.pipeline), settings, chat=False)


async def chat_completions(http: HTTPRequest):
    state = _state(http)
    body = await read_body(http, state)
    settings = parse_settings(body, state.config, chat=True)
    return await respond(http, state, chat_prompt(body, state.pipeline), settings, chat=True)


async def models(http: HTTPRequest):
    state = _state(http)
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                        "owned_by": "loopspec", "max_model_len": state.max_context,
                                        "engine": engine_info(state.pipeline)}]}


def engine_info(pipeline) -> dict:
    """What the served model computes with: backend, precision and its weights and arithmetic in words."""
    engine = pipeline.engine
    return {"backend": engine.backend, "precision": engine.precision,
            "computes_with": describe_precision(engine.precision)}


async def health(http: HTTPRequest):
    state = _state(http)
    if not state.scheduler.alive:
        return JSONResponse(APIError(503, "the scheduler is not running").body(), status_code=503)
    return {"status": "ok", "model": state.model_name, "method": state.config.settings.method,
            "decoding": state.config.settings.to_dict(), "engine": engine_info(state.pipeline),
            "max_batch_size": state.pipeline.engine.max_rows}


async def prometheus(http: HTTPRequest):
    return PlainTextResponse(_state(http).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def api_error(http, e: APIError):
    if not e.counted:
        _state(http).metrics.count_request("invalid" if e.status < 500 else "error")
    return JSONResponse(e.body(), status_code=e.status)


async def http_error(http, e):
    """Routing's own errors (404 unknown path, 405 wrong method, ...) in OpenAI's shape, headers kept."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return JSONResponse(APIError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code,
                        headers=getattr(e, "headers", None))


async def client_gone(http, e: ClientGone):
    """A client that left mid-body cancelled its own request: no failure of ours, no traceback."""
    log.info("client left before sending all of its request body: %s %s", http.method, http.url.path)
    _state(http).metrics.count_request("cancelled")
    return PlainTextResponse("", status_code=499)  # what nginx logs for it; nobody reads it


async def server_error(http, e: Exception):
    """An internal failure: the traceback to the log, a generic message to the client."""
    log.exception("internal error serving %s %s", http.method, http.url.path, exc_info=e)
    _state(http).metrics.count_request("error")
    return JSONResponse(APIError(500, "internal server error (see the server log)").body(), status_code=500)


# --------------------------------------------------------------------------------------------------
# OpenAPI: the request bodies parse_settings / completion_prompt / chat_prompt accept, and the errors

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_SAMPLING = {
    "model": {"type": "string"},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0},
    "seed": {"type": "integer", "minimum": SEED_RANGE[0], "maximum": SEED_RANGE[1]},
    "max_tokens": {"type": "integer", "minimum": 1},
    "stop": {"oneOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4}]},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "user": {"type": "string"},
}
COMPLETION_BODY = {"type": "object", "required": ["prompt"], "properties": {
    **_SAMPLING,
    "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                         {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}]}}}
CHAT_BODY = {"type": "object", "required": ["messages"], "properties": {
    **_SAMPLING,
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "messages": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"enum": ["system", "developer", "user", "assistant"]},
                       "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
                           "type": "object", "required": ["type", "text"],
                           "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}}]}}}}}}
_CHOICES = {"type": "object", "required": ["id", "object", "choices"],
            "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                           "choices": {"type": "array"}, "usage": {"type": ["object", "null"]}}}


def _errors(*statuses: int) -> dict:
    return {s: {"description": APIError.TYPES[s], "content": {"application/json": {"schema": _ERROR}}} for s in statuses}


def _post_doc(body: dict) -> dict:
    return dict(openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}},
                responses={200: {"description": "the completion (JSON), or server-sent events with stream: true",
                                 "content": {"application/json": {"schema": _CHOICES}, "text/event-stream": {}}},
                           **_errors(400, 404, 413, 429, 500, 503, 504)})


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
    scheduler = Scheduler(Decoder(pipeline.engine, config.settings, prefill_chunk=config.prefill_chunk), pipeline.decode,
                          stop_token_ids=pipeline.stop_token_ids, max_queue=config.max_queue, metrics=Metrics())
    state = ServerState(pipeline=pipeline, config=config, scheduler=scheduler,
                        model_name=config.model_name or pipeline.target_dir.name, created=int(time.time()))

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
    app.add_api_route("/v1/completions", completions, methods=["POST"], **_post_doc(COMPLETION_BODY))
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], **_post_doc(CHAT_BODY))
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"], responses=_errors(503))
    app.add_api_route("/metrics", prometheus, methods=["GET"], response_class=PlainTextResponse,
                      responses={200: {"description": "Prometheus text exposition",
                                       "content": {"text/plain": {"schema": {"type": "string"}}}}})
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


async def _stream(queue: asyncio.Queue, rid: str, kind: str, chat: bool, include_usage: bool, model: str):
    """SSE chunks from the scheduler's Events, then `data: [DONE]`."""
    created = int(time.time())
    kind = kind + ".chunk" if chat else kind

    def chunk(choice: dict | None, usage: dict | None = None) -> str:
        out = {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice] if choice else []}
        if include_usage:
            out["usage"] = usage
        return f"data: {json.dumps(out)}\n\n"

    def piece(text: str | None = None, finish: str | None = None, role: bool = False) -> dict:
        if chat:
            delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    if chat:
        yield chunk(piece(role=True))
    while True:
        event = await queue.get()
        if event.kind == "text":
            yield chunk(piece(event.text))
        elif event.kind == "error":
            yield f"data: {json.dumps(APIError(event.status, event.message).body())}\n\n"
            break
        else:
            yield chunk(piece(finish=event.finish_reason))
            if include_usage:
                yield chunk(None, event.usage)
            break
    yield "data: [DONE]\n\n"


def serve(pipeline, host: str = "127.0.0.1", port: int = 8000, config: ServeConfig | None = None,
          log_level: str = "info") -> None:
    """Serve until interrupted."""
    _require_fastapi()
    import uvicorn

    uvicorn.run(create_app(pipeline, config), host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=5)
