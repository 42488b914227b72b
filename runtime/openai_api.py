"""The OpenAI API as this server speaks it, apart from HTTP: a request body's options and prompt,
parsed and checked (plain functions of the dict json.loads gives, so every bad input gets a clear
message naming the parameter), errors in OpenAI's shape, and the OpenAPI description of the same
bodies."""

from __future__ import annotations

import json
from dataclasses import dataclass

from loopspec.decoding import SamplingParams
from loopspec.errors import LoopspecError

SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes


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
# Request parsing


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
class RequestOptions:
    """How one request asks to be answered (its sampling, seed, budget, stop strings, streaming);
    how every request decodes is the server's DecodingSettings."""

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


def parse_options(body: dict, config, chat: bool) -> RequestOptions:
    """A request body's options, checked against the server's limits (`config`: a ServeConfig, of which
    max_tokens_limit and max_stop_strings are read)."""
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
    return RequestOptions(params=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), seed=seed,
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
# OpenAPI: the request bodies parse_options / completion_prompt / chat_prompt accept, and the errors

ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
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
REPLY_SCHEMA = {"type": "object", "required": ["id", "object", "choices"],
            "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                           "choices": {"type": "array"}, "usage": {"type": ["object", "null"]}}}


def error_responses(*statuses: int) -> dict:
    """OpenAPI `responses` for these error statuses, each in OpenAI's error shape."""
    return {s: {"description": APIError.TYPES[s], "content": {"application/json": {"schema": ERROR_SCHEMA}}} for s in statuses}


def post_route_doc(body: dict) -> dict:
    """The OpenAPI description of a POST route taking `body` (FastAPI's add_api_route keywords)."""
    return dict(openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}},
                responses={200: {"description": "the completion (JSON), or server-sent events with stream: true",
                                 "content": {"application/json": {"schema": REPLY_SCHEMA}, "text/event-stream": {}}},
                           **error_responses(400, 404, 413, 429, 500, 503, 504)})
