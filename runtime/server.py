"""OpenAI-compatible HTTP server over the continuous-batching scheduler (FastAPI + uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent
events ending with `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus text).
Errors have OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 bad request,
404 unknown model or path, 413 body too large, 429 queue full, 500 failure, 503 shutting down,
504 timeout. Request bodies are parsed and checked here, not by pydantic, so every bad input gets a
clear message naming the parameter.
"""

# no `from __future__ import annotations` here: FastAPI reads the handlers' annotations (the lazily
# imported Request class) at definition time
import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from loopspec.decoding import SamplingParams
from loopspec.errors import LoopspecError
from loopspec.runtime.batch import BatchedDecoder, method_for, open_batch
from loopspec.runtime.metrics import Metrics
from loopspec.runtime.scheduler import Event, QueueFull, Request, Scheduler


@dataclass(frozen=True)
class ServeConfig:
    method: str = "dflash"  # ar | dflash | dloop
    model_name: str | None = None  # the id clients send as `model` (default: the target's folder name)
    max_batch_size: int = 8  # batch rows decoding at once
    max_queue: int = 64  # requests waiting for a row; one more gets 429
    request_timeout_s: float = 600.0  # from arrival, queueing included
    max_body_bytes: int = 1 << 20
    max_tokens_limit: int = 4096  # the most `max_tokens` one request may ask for
    default_max_tokens: int = 256  # when a request sets none (bounded by the context)
    max_stop_strings: int = 4
    block_size: int | None = None
    gate_threshold: float | None = None
    max_stages: int | None = None
    adaptive: bool = True  # batch-level fallback to plain rounds while drafting does not pay


class APIError(Exception):
    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
             429: "rate_limit_error", 500: "server_error", 503: "server_error", 504: "timeout_error"}

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


@dataclass
class Settings:
    params: SamplingParams
    seed: int | None
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def parse_settings(body: dict, config: ServeConfig, chat: bool) -> Settings:
    for name, allowed in (("n", (None, 1)), ("best_of", (None, 1)), ("echo", (None, False)),
                          ("logprobs", (None, False)), ("top_logprobs", (None, 0)), ("suffix", (None, "")),
                          ("presence_penalty", (None, 0)), ("frequency_penalty", (None, 0)),
                          ("logit_bias", (None, {})), ("tools", (None, [])), ("response_format", (None, {"type": "text"}))):
        if body.get(name) not in allowed:
            raise APIError(400, f"{name}={body[name]!r} is not supported (supported: {allowed[1]!r})", name)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = _integer(body, "top_k", low=0) or 0  # an extension (vLLM has it too)
    seed = _integer(body, "seed")
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    max_tokens = None
    for name in names:
        value = _integer(body, name, low=1, high=config.max_tokens_limit)
        if value is not None:
            max_tokens = value
            break
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
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", "stream_options")
    return Settings(params=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), seed=seed,
                    max_tokens=max_tokens, stop=tuple(stop), stream=bool(stream),
                    include_usage=bool(options.get("include_usage")))


def completion_prompt(body: dict, tokenizer, vocab_size: int) -> list[int]:
    """`prompt`: a string, or token ids, or a list holding one of those (n = 1, one prompt)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt is empty", "prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", "prompt")
        return list(prompt)
    raise APIError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request)", "prompt")


def chat_prompt(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise APIError(400, f"messages[{i}] must be an object with role system, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", "messages")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 — templates raise on role orders they do not accept
        raise APIError(400, f"messages do not fit the chat template: {e}", "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


# --------------------------------------------------------------------------------------------------
# The app


def _require_fastapi():
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise LoopspecError("the server needs fastapi and uvicorn: pip install 'loopspec[serve]'") from None


class _EventQueue:
    """The scheduler thread's Events, handed to the asyncio loop that serves the request."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def __call__(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


def create_app(pipeline, config: ServeConfig = ServeConfig()):
    """The FastAPI app serving `pipeline` (a runtime.pipeline.Pipeline); its scheduler thread runs
    while the app's lifespan does."""
    _require_fastapi()
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.requests import Request as HTTPRequest
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    method = method_for(pipeline, config.method, config.block_size, config.gate_threshold, config.max_stages,
                        adaptive=config.adaptive)
    batch = open_batch(pipeline.engine, config.max_batch_size)
    scheduler = Scheduler(BatchedDecoder(batch, method), pipeline.decode, stop_token_ids=pipeline.stop_token_ids,
                          max_queue=config.max_queue, metrics=Metrics())
    metrics = scheduler.metrics
    model_name = config.model_name or pipeline.target_dir.name
    max_context = pipeline.engine.max_context
    vocab_size = pipeline.engine.vocab_size
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        scheduler.close()

    app = FastAPI(title="loopspec", lifespan=lifespan)
    app.state.scheduler, app.state.config, app.state.method = scheduler, config, method

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        if not e.counted:
            metrics.count_request("invalid" if e.status < 500 else "error")
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None).body(),
                            status_code=e.status_code)

    @app.exception_handler(Exception)
    async def server_error(request, e: Exception):
        metrics.count_request("error")
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)

    async def read_json(request: HTTPRequest) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {config.max_body_bytes}",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                raise APIError(413, f"request body exceeds the limit of {config.max_body_bytes} bytes",
                               code="request_too_large")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the JSON body must be an object", code="invalid_json")
        model = body.get("model")
        if model is not None and model != model_name:
            raise APIError(404, f"the model {model!r} does not exist (this server serves {model_name!r})",
                           "model", code="model_not_found")
        return body

    def budget(prompt_ids: list[int], settings: Settings) -> int:
        if len(prompt_ids) >= max_context:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; this model's context is {max_context} "
                                f"tokens and the prompt must leave room for one", "messages/prompt",
                           code="context_length_exceeded")
        room = max_context - len(prompt_ids)
        if settings.max_tokens is not None and settings.max_tokens > room:
            raise APIError(400, f"this model's context is {max_context} tokens; {len(prompt_ids)} in the prompt "
                                f"+ max_tokens {settings.max_tokens} exceed it", "max_tokens",
                           code="context_length_exceeded")
        return settings.max_tokens or min(config.default_max_tokens, room)

    async def respond(http: HTTPRequest, prompt_ids: list[int], settings: Settings, chat: bool):
        events = _EventQueue(asyncio.get_running_loop())
        request = Request(prompt_ids=prompt_ids, max_tokens=budget(prompt_ids, settings), on_event=events,
                          params=settings.params, seed=settings.seed, stop=settings.stop,
                          timeout_s=config.request_timeout_s)
        try:
            scheduler.submit(request)
        except QueueFull as e:
            metrics.count_request("rejected")
            raise APIError(429, str(e), code="queue_full", counted=True) from None
        except LoopspecError as e:
            raise APIError(503, str(e)) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        kind = "chat.completion" if chat else "text_completion"
        if settings.stream:
            return _SSE(_stream(events.queue, rid, kind, chat, settings.include_usage, model_name),
                        on_close=lambda: request.finished or scheduler.cancel(request))
        parts, checked = [], time.monotonic()
        while True:
            try:
                event = await asyncio.wait_for(events.queue.get(), 0.25)
            except asyncio.TimeoutError:
                event = None
            if time.monotonic() - checked >= 0.25:  # a client that gave up: stop decoding for it
                checked = time.monotonic()
                if await http.is_disconnected():
                    scheduler.cancel(request)
                    return PlainTextResponse("", status_code=499)
            if event is None:
                continue
            if event.kind == "text":
                parts.append(event.text)
            elif event.kind == "error":
                raise APIError(event.status, event.message, counted=True)
            else:
                text = "".join(parts)
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                          else {"index": 0, "text": text, "logprobs": None})
                choice["finish_reason"] = event.finish_reason
                return {"id": rid, "object": kind, "created": int(time.time()), "model": model_name,
                        "choices": [choice], "usage": event.usage}

    class _SSE(StreamingResponse):
        """Server-sent events; when the response ends for any reason (the client left included) an
        unfinished request is cancelled."""

        def __init__(self, content, on_close):
            super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            self.on_close = on_close

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.on_close()

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        body = await read_json(http)
        settings = parse_settings(body, config, chat=False)
        return await respond(http, completion_prompt(body, pipeline.tokenizer, vocab_size), settings, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        body = await read_json(http)
        settings = parse_settings(body, config, chat=True)
        return await respond(http, chat_prompt(body, pipeline.tokenizer), settings, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "loopspec", "max_model_len": max_context}]}

    @app.get("/health")
    async def health():
        if not scheduler.alive:
            return JSONResponse(APIError(503, "the scheduler is not running").body(), status_code=503)
        return {"status": "ok", "model": model_name, "method": config.method, "max_batch_size": batch.max_rows}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


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


def serve(pipeline, host: str = "127.0.0.1", port: int = 8000, config: ServeConfig = ServeConfig(),
          log_level: str = "info") -> None:
    """Serve until interrupted."""
    _require_fastapi()
    import uvicorn

    uvicorn.run(create_app(pipeline, config), host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=5)
