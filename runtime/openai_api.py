"""The OpenAI API as this server speaks it, apart from HTTP: a request body's options and prompt,
parsed and checked (plain functions of the dict json.loads gives, so every bad input gets a clear
message naming the parameter), errors in OpenAI's shape, and the OpenAPI description of the same
bodies."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from loopspec.decoding import SamplingParams
from loopspec.errors import LoopspecError
from loopspec.runtime.constraint import GrammarError, GrammarSpec
from loopspec.runtime.tool_calls import (
    MESSAGE_SCHEMA,
    TOOL_CHOICE_SCHEMA,
    TOOLS_SCHEMA,
    ToolError,
    ToolRequest,
    for_template,
    history_message,
    template_source,
    tool_request,
)

SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes


class APIError(Exception):
    TYPES = {
        400: "invalid_request_error",
        401: "invalid_request_error",
        404: "invalid_request_error",
        405: "invalid_request_error",
        408: "timeout_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        500: "server_error",
        503: "server_error",
        504: "timeout_error",
    }

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, counted: bool = False
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.counted = counted  # already in the metrics (the scheduler counts what it ends)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


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
    grammar: GrammarSpec | None = None  # structured output (response_format or a guided_* field)
    user: str | None = None  # the end user's id: with the API key, the request's scope (runtime/server.py)
    tools: ToolRequest | None = None  # chat: the functions the reply may call (runtime/tool_calls.py)


# Every request field this server knows, one row each (a name whose handling differs between the two
# endpoints has one row per endpoint). Each is
#   HONOURED      parsed and obeyed (parse_options, completion_prompt, chat_prompt, read_body);
#   NEUTRAL_ONLY  not implemented: accepted only as null or its one neutral value, the value that leaves
#                 the output as it is; any other value would change the output, so it gets a 400;
#   IGNORED       accepted (of its JSON type) and unused, because no value of it can change the output.
# A field in no row gets a 400 naming it, as OpenAI's API answers: an unknown field may be one that
# changes the output, and silently ignoring it would answer a different question than was asked.

HONOURED, NEUTRAL_ONLY, IGNORED = "honoured", "neutral only", "ignored"
CHAT, COMPLETIONS = "chat", "completions"
BOTH = (CHAT, COMPLETIONS)
ENDPOINT_PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}


@dataclass(frozen=True)
class Field:
    name: str
    use: str  # HONOURED, NEUTRAL_ONLY or IGNORED
    schema: dict  # the OpenAPI schema of the values it takes
    endpoints: tuple[str, ...] = BOTH
    neutral: object = None  # NEUTRAL_ONLY: the value beside null that is accepted (None: null only)
    note: str = ""  # NEUTRAL_ONLY: what it would do; IGNORED: why it cannot change the output


def _honoured(name: str, schema: dict, endpoints=BOTH) -> Field:
    return Field(name, HONOURED, schema, endpoints)


def _neutral_only(name: str, neutral, note: str, endpoints=BOTH) -> Field:
    # The JSON type is part of the value: Python's == would let `true` pass for 1, `1.0` for 1 and `0`
    # for false. An int here takes an integer only; a float takes any number (0 or 0.0 for a penalty).
    schema = {"enum": [None] if neutral is None else [None, neutral], "description": f"not supported: {note}"}
    return Field(name, NEUTRAL_ONLY, schema, endpoints, neutral, note)


def _ignored(name: str, json_type: str, note: str, endpoints=BOTH) -> Field:
    schema = {"type": json_type, "description": f"accepted, unused: {note}"}
    return Field(name, IGNORED, schema, endpoints, note=note)


FIELDS = (
    _honoured("model", {"type": "string"}),
    _honoured(
        "prompt",
        {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
            ]
        },
        (COMPLETIONS,),
    ),
    _honoured("messages", {"type": "array", "minItems": 1, "items": MESSAGE_SCHEMA}, (CHAT,)),
    _honoured("max_tokens", {"type": "integer", "minimum": 1}),
    _honoured("max_completion_tokens", {"type": "integer", "minimum": 1}, (CHAT,)),
    _honoured("temperature", {"type": "number", "minimum": 0, "maximum": 2}),
    _honoured("top_p", {"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    _honoured("top_k", {"type": "integer", "minimum": 0}),
    _honoured("seed", {"type": "integer", "minimum": SEED_RANGE[0], "maximum": SEED_RANGE[1]}),
    _honoured(
        "stop",
        {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4},
            ]
        },
    ),
    _honoured("stream", {"type": "boolean"}),
    _honoured("user", {"type": "string"}),
    _honoured(
        "stream_options",
        {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "include_usage": {"type": "boolean"},
                "continuous_usage_stats": {"enum": [None, False]},
                "include_obfuscation": {"type": "boolean"},
            },
        },
    ),
    # OpenAI's own
    _neutral_only("n", 1, "more than one choice per request"),
    _neutral_only("best_of", 1, "the best of several completions"),
    _neutral_only("echo", False, "the prompt repeated in the reply"),
    _neutral_only("logprobs", False, "log-probabilities of the reply's tokens", (CHAT,)),
    _neutral_only("logprobs", None, "log-probabilities (even 0 returns the sampled token's)", (COMPLETIONS,)),
    _neutral_only("top_logprobs", 0, "the most likely alternatives of each token"),
    _neutral_only("suffix", "", "text after the completion (fill in the middle)"),
    _neutral_only("presence_penalty", 0.0, "a penalty on tokens already present"),
    _neutral_only("frequency_penalty", 0.0, "a penalty growing with a token's count"),
    _neutral_only("logit_bias", {}, "biases added to chosen tokens' logits"),
    _honoured("tools", TOOLS_SCHEMA, (CHAT,)),
    _neutral_only("tools", [], "tool calls (on /v1/chat/completions)", (COMPLETIONS,)),
    _neutral_only("functions", [], "function calls (send tools)"),
    _neutral_only("function_call", None, "a forced function call (send tool_choice)"),
    _honoured("tool_choice", TOOL_CHOICE_SCHEMA, (CHAT,)),
    _neutral_only("tool_choice", None, "a forced tool call (on /v1/chat/completions)", (COMPLETIONS,)),
    _honoured(
        "response_format",
        {
            "oneOf": [
                {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
                {
                    "type": "object",
                    "required": ["type", "json_schema"],
                    "properties": {
                        "type": {"enum": ["json_schema"]},
                        "json_schema": {
                            "type": "object",
                            "required": ["schema"],
                            "properties": {
                                "name": {"type": "string"},
                                "schema": {"type": "object"},
                                "strict": {"type": ["boolean", "null"]},
                                "description": {"type": "string"},
                            },
                        },
                    },
                },
            ]
        },
    ),
    _neutral_only("reasoning_effort", None, "a reasoning model's effort"),
    _neutral_only("verbosity", None, "a longer or shorter answer"),
    _neutral_only("modalities", ["text"], "output other than text"),
    _neutral_only("audio", None, "audio output"),
    _neutral_only("web_search_options", None, "web search"),
    # vLLM's and llama.cpp's extensions
    _honoured("guided_json", {"oneOf": [{"type": "object"}, {"type": "string"}]}),
    _honoured("guided_regex", {"type": "string", "minLength": 1}),
    _honoured("guided_choice", {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}),
    _neutral_only("guided_grammar", None, "output constrained to a grammar"),
    _neutral_only("guided_decoding_backend", None, "the engine of guided decoding"),
    _neutral_only("guided_whitespace_pattern", None, "whitespace allowed in guided JSON"),
    _neutral_only("structured_outputs", None, "constrained output"),
    _neutral_only("grammar", None, "output constrained to a grammar"),
    _neutral_only("json_schema", None, "output constrained to a JSON schema"),
    _neutral_only("repetition_penalty", 1.0, "a penalty on repeated tokens"),
    _neutral_only("repeat_penalty", 1.0, "a penalty on repeated tokens"),
    _neutral_only("min_p", 0.0, "min-p sampling"),
    _neutral_only("typical_p", 1.0, "locally typical sampling"),
    _neutral_only("top_a", 0.0, "top-a sampling"),
    _neutral_only("tfs_z", 1.0, "tail-free sampling"),
    _neutral_only("mirostat", 0, "mirostat sampling"),
    _neutral_only("use_beam_search", False, "beam search"),
    _neutral_only("length_penalty", 1.0, "beam search's length penalty"),
    _neutral_only("ignore_eos", False, "decoding past the end of sequence"),
    _neutral_only("min_tokens", 0, "a minimum length"),
    _neutral_only("max_new_tokens", None, "a token budget under another name (send max_tokens)"),
    _neutral_only("stop_token_ids", [], "more stop tokens"),
    _neutral_only("bad_words", [], "banned words"),
    _neutral_only("allowed_token_ids", None, "a restricted vocabulary"),
    _neutral_only("n_probs", 0, "the most likely alternatives of each token"),
    _neutral_only("prompt_logprobs", None, "log-probabilities of the prompt's tokens"),
    _neutral_only("include_stop_str_in_output", False, "the stop string kept in the text"),
    _neutral_only("skip_special_tokens", False, "special tokens left out of the text (they are kept here)"),
    _neutral_only("add_special_tokens", True, "the prompt without the tokenizer's special tokens", (COMPLETIONS,)),
    _neutral_only("add_special_tokens", False, "the tokenizer's special tokens added to the rendered chat", (CHAT,)),
    _neutral_only("add_generation_prompt", True, "the chat rendered without the assistant's turn opened", (CHAT,)),
    _neutral_only("continue_final_message", False, "the last message continued instead of answered", (CHAT,)),
    _neutral_only("chat_template", None, "another chat template", (CHAT,)),
    _neutral_only("chat_template_kwargs", {}, "arguments of the chat template", (CHAT,)),
    _neutral_only("truncate_prompt_tokens", None, "a truncated prompt"),
    # no value of these changes the output
    _ignored("safety_identifier", "string", "an end-user id for abuse monitoring"),
    _ignored("metadata", "object", "tags for stored completions; nothing is stored"),
    _ignored("store", "boolean", "whether the provider stores the completion; nothing is stored"),
    _ignored("service_tier", "string", "a provider's latency and price tier"),
    _ignored("prompt_cache_key", "string", "a hint for a provider's prompt cache"),
    _ignored("cache_prompt", "boolean", "a hint for a prompt cache (llama.cpp)"),
    _ignored("cache_salt", "string", "isolates a prompt cache (vLLM)"),
    _ignored("prediction", "object", "text the reply is expected to contain, a latency hint only"),
    _honoured("parallel_tool_calls", {"type": "boolean"}, (CHAT,)),
    _ignored("parallel_tool_calls", "boolean", "applies to tools, which this endpoint has none of", (COMPLETIONS,)),
)


def endpoint_fields(endpoint: str) -> dict[str, Field]:
    """The fields a body sent to this endpoint (CHAT or COMPLETIONS) may carry, by name."""
    return {f.name: f for f in FIELDS if endpoint in f.endpoints}


_JSON_TYPES = {"string": str, "boolean": bool, "object": dict, "array": list}


def _is_neutral(value, neutral) -> bool:
    """`value` is `neutral` in JSON terms: equal, and of its JSON type (see _neutral_only)."""
    if isinstance(neutral, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == neutral
    return type(value) is type(neutral) and value == neutral


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else json.dumps(value)


def check_fields(body: dict, endpoint: str) -> None:
    """Every field of `body` is one this endpoint knows; a NEUTRAL_ONLY one is null or neutral; an
    IGNORED one is of its JSON type. The first field that is not gets a 400 naming it."""
    known = endpoint_fields(endpoint)
    for name, value in body.items():
        field = known.get(name)
        if field is None:
            _text(name, "a field name")
            others = [e for e in BOTH if e != endpoint and name in endpoint_fields(e)]
            where = f"; it is a field of {ENDPOINT_PATHS[others[0]]}" if others else ""
            raise APIError(
                400,
                f"unrecognized request field {name!r} for {ENDPOINT_PATHS[endpoint]}{where} (fields "
                f"this server does not know are refused rather than ignored)",
                name,
            )
        if value is None or field.use == HONOURED:
            continue
        if field.use == NEUTRAL_ONLY and not (field.neutral is not None and _is_neutral(value, field.neutral)):
            supported = "null" if field.neutral is None else f"null or {_shown(field.neutral)}"
            raise APIError(
                400, f"{name}={json.dumps(value)[:80]} is not supported: {field.note} (supported: {supported})", name
            )
        if field.use == IGNORED and type(value) is not _JSON_TYPES[field.schema["type"]]:
            raise APIError(
                400, f"{name} must be of JSON type {field.schema['type']}, got {json.dumps(value)[:80]}", name
            )


def parse_options(body: dict, config, chat: bool) -> RequestOptions:
    """A request body's options, checked against the server's limits (`config`: a ServeConfig, of which
    max_tokens_limit and max_stop_strings are read)."""
    check_fields(body, CHAT if chat else COMPLETIONS)
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
    for key, value in options.items():  # include_usage honoured; the others are neutral here
        if key == "include_usage" or key == "include_obfuscation":  # obfuscation pads chunks; text unchanged
            if value is not None and not isinstance(value, bool):
                raise APIError(
                    400, f"stream_options.{key} must be a boolean, got {json.dumps(value)[:80]}", "stream_options"
                )
        elif key == "continuous_usage_stats":
            if not (value is None or value is False):
                raise APIError(
                    400,
                    "stream_options.continuous_usage_stats (usage in every chunk) is not supported "
                    "(supported: null or false)",
                    "stream_options",
                )
        else:
            _text(key, "stream_options")
            raise APIError(
                400,
                f"unrecognized field stream_options.{key} (supported: include_usage, "
                "include_obfuscation, continuous_usage_stats)",
                "stream_options",
            )
    include_usage = options.get("include_usage")
    user = body.get("user")  # whose scope the shared suffix library reads (runtime/server.py request_scope)
    if user is not None and not isinstance(user, str):
        raise APIError(400, f"user must be a string, got {json.dumps(user)[:80]}", "user")
    try:
        tools = tool_request(body) if chat else None
    except ToolError as e:
        raise APIError(400, str(e), e.param) from None
    grammar = grammar_of(body)
    if grammar is not None and tools is not None and tools.choice != "none":
        raise APIError(
            400, f'{grammar.param} and tools both shape the reply: send one (or tool_choice "none")', grammar.param
        )
    return RequestOptions(
        params=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
        seed=seed,
        max_tokens=max_tokens,
        stop=tuple(_text(s, "stop") for s in stop),
        stream=bool(stream),
        include_usage=bool(include_usage),
        grammar=grammar,
        user=_text(user, "user") if user else None,
        tools=tools,
    )


def with_tools(options: RequestOptions, pipeline) -> RequestOptions:
    """The request's tools read against the chat template: its call format, and under tool_choice
    "required" or a named function the grammar of the reply (runtime/tool_calls.py)."""
    if options.tools is None:
        return options
    try:
        tools, grammar = for_template(options.tools, pipeline.tokenizer)
    except (ToolError, GrammarError) as e:
        raise APIError(400, str(e), e.param) from None
    except LoopspecError as e:  # the grammar's library is missing
        raise APIError(400, f"tools: {e}", "tools") from None
    return replace(options, tools=tools, grammar=grammar or options.grammar)


GRAMMAR_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")


def grammar_of(body: dict) -> GrammarSpec | None:
    """Structured output: response_format (json_object, json_schema; text is none) or one of vLLM's
    guided_json (a schema, or its JSON text), guided_regex, guided_choice — at most one of them."""
    given = [
        name
        for name in GRAMMAR_FIELDS
        if body.get(name) is not None
        and not (name == "response_format" and isinstance(body[name], dict) and body[name].get("type") == "text")
    ]
    if len(given) > 1:
        raise APIError(400, f"{given[0]} and {given[1]} both constrain the output: send one", given[1])
    if not given:
        format_ = body.get("response_format")
        if format_ is not None and (not isinstance(format_, dict) or set(format_) != {"type"}):
            raise APIError(
                400, 'response_format must be {"type": "text" | "json_object" | "json_schema", ...}', "response_format"
            )
        return None
    name, value = given[0], body[given[0]]
    try:
        if name == "response_format":
            return _response_format(value)
        if name == "guided_json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise APIError(400, f"guided_json is not JSON: {e}", name) from None
            return GrammarSpec("json_schema", value, name)
        if name == "guided_regex":
            return GrammarSpec("regex", _text(value, name) if isinstance(value, str) else value, name)
        return GrammarSpec("choice", value, name)
    except GrammarError as e:
        raise APIError(400, str(e), e.param) from None
    except LoopspecError as e:  # structured output cannot apply here (its library is missing)
        raise APIError(400, f"{name}: {e}", name) from None


def _response_format(value) -> GrammarSpec:
    name = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object" and set(value) == {"type"}:
        return GrammarSpec("json_object", None, name)
    if kind == "json_schema" and set(value) <= {"type", "json_schema"}:
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise APIError(400, "response_format.json_schema must be an object with a schema object", name)
        if set(spec) - {"name", "schema", "strict", "description"}:
            raise APIError(
                400,
                f"unrecognized field response_format.json_schema."
                f"{sorted(set(spec) - {'name', 'schema', 'strict', 'description'})[0]}",
                name,
            )
        return GrammarSpec("json_schema", spec["schema"], name)
    raise APIError(
        400,
        'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
        '"json_schema", "json_schema": {"name": ..., "schema": {...}}}',
        name,
    )


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


def chat_prompt(body: dict, pipeline, tools: ToolRequest | None = None) -> list[int]:
    """`messages` (earlier calls and their results included) rendered by the chat template, with `tools`."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    clean, tool_history = [], False
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise APIError(
                400, f"messages[{i}] must be an object with role system, user, assistant or tool", "messages"
            )
        if m.get("function_call") is not None:
            raise APIError(400, f"messages[{i}].function_call is not supported (send tool_calls)", "messages")
        called = m.get("tool_calls") not in (None, [])
        content = m.get("content")
        if content is None and called:  # a reply that only called functions
            content = ""
        if isinstance(content, list):  # content parts: text only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        if role == "tool" or called:
            try:
                clean.append(history_message(i, m, _text(content, "messages")))
            except ToolError as e:
                raise APIError(400, str(e), e.param) from None
            tool_history = True
            continue
        clean.append({"role": role, "content": _text(content, "messages")})
    if not getattr(pipeline.tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    if tool_history and "tool" not in template_source(pipeline.tokenizer, None):
        raise APIError(400, "this model's chat template does not render tool calls or their results", "messages")
    try:
        return pipeline.encode_chat(clean, tools=list(tools.tools) if tools is not None else None)
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
