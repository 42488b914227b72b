"""Tool calls on /v1/chat/completions: the request's `tools` / `tool_choice` / `parallel_tool_calls`
checked, the history's calls and results made ready for the chat template, the grammar of a call
under `tool_choice` "required" or a named function, and the calls parsed out of the reply's text.

How a model writes a call is its chat template's business, so the format is read from the template
(`call_format`): Qwen2.5 / Qwen3 (and Hermes) templates write
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one per call, calls separated by
"\\n"; Llama 3.1's writes the whole reply as one JSON object `{"name": ..., "parameters": {...}}`
(after an optional `<|python_tag|>`), one call per turn. A template whose source never mentions
tools cannot show them to the model; one whose call format is not one of these cannot be parsed;
both are refused (`tool_choice` "none" excepted, which renders the tools and parses nothing).

The forced grammar (`forced_grammar`) is an xgrammar structural tag: the call's text around the
function's `parameters` schema, written as structured output writes JSON (runtime/constraint.py:
the separators ", " and ": ", no other whitespace); one call, or with `parallel_tool_calls` (and a
format that has it) calls separated as the template separates them. Drafts are pruned and the target
masked with it as for any grammar, so speculation commits grammar-masked plain decoding's tokens.

Parsing (`ToolCallParser`) reads the committed text as it grows, in whatever pieces it comes (a
call may straddle any number of rounds or streamed chunks): the text is classified once, the same
way whole or in pieces, so a streamed reply is the non-streamed one cut into deltas. A call whose
JSON does not parse, names no given function, or whose arguments break the function's schema stays
text. This module raises ToolError (a request field and a message); runtime/openai_api.py turns it
into a 400 naming the field.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace

from loopspec.errors import LoopspecError
from loopspec.runtime.constraint import GrammarSpec, json_schema_ebnf

CHOICES = ("none", "auto", "required")
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what OpenAI takes as a function's name
MAX_TOOLS = 128  # as OpenAI's API


# The OpenAPI schemas of the fields (runtime/openai_api.py FIELDS): what the parsing below accepts
TEXT_PARTS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
    },
}
MESSAGE_SCHEMA = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [{"type": "string"}, TEXT_PARTS, {"type": "null"}]},
        "tool_calls": {
            "type": "array",
            "description": "an assistant's earlier calls",
            "items": {
                "type": "object",
                "required": ["function"],
                "properties": {
                    "id": {"type": "string"},
                    "type": {"enum": ["function"]},
                    "function": {
                        "type": "object",
                        "required": ["name", "arguments"],
                        "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
                    },
                },
            },
        },
        "tool_call_id": {"type": "string", "description": "a tool message: the call it answers"},
    },
}
TOOLS_SCHEMA = {
    "type": "array",
    "maxItems": MAX_TOOLS,
    "items": {
        "type": "object",
        "required": ["type", "function"],
        "additionalProperties": False,
        "properties": {
            "type": {"enum": ["function"]},
            "function": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                    "description": {"type": "string"},
                    "parameters": {"type": "object", "description": "a JSON schema of an object"},
                    "strict": {"type": ["boolean", "null"]},
                },
            },
        },
    },
}
TOOL_CHOICE_SCHEMA = {
    "oneOf": [
        {"enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"enum": ["function"]},
                "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
            },
        },
    ]
}


class ToolError(LoopspecError):
    """A tool field that cannot be used: `param` is the request field to name in the 400."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _jsonschema():
    try:
        import jsonschema
    except ImportError:
        raise ToolError("tool calls need jsonschema: pip install 'loopspec[serve]'", "tools") from None
    return jsonschema


# --------------------------------------------------------------------------------------------------
# The request


@dataclass(frozen=True)
class ToolRequest:
    """What a request's tool fields ask for. choice: "none" | "auto" | "required" | "named";
    format: the chat template's call format, known once the template is read (`for_template`)."""

    tools: tuple[dict, ...]  # as the chat template renders them ({"type": "function", "function": {...}})
    parameters: dict  # function name → its parameters schema (a JSON schema of an object)
    choice: str = "auto"
    named: str | None = None  # choice "named": the function every call must be
    parallel: bool = True  # more than one call per reply allowed
    format: "CallFormat | None" = None

    @property
    def parses(self) -> bool:
        """Whether calls are parsed out of the reply (tool_choice "none" leaves the text as it is)."""
        return self.choice != "none" and self.format is not None

    def allowed(self) -> tuple[str, ...]:
        """The functions a call may name."""
        return (self.named,) if self.choice == "named" else tuple(self.parameters)


def _shown(value) -> str:
    return json.dumps(value)[:80]


def _function(i: int, tool) -> tuple[dict, str, dict]:
    """tools[i] checked → (the tool as the template gets it, its name, its parameters schema)."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ToolError(f'{where} must be {{"type": "function", "function": {{"name": ...}}}}', "tools")
    if set(tool) - {"type", "function"}:
        raise ToolError(f"unrecognized field {where}.{sorted(set(tool) - {'type', 'function'})[0]}", "tools")
    function = tool["function"]
    extra = set(function) - {"name", "description", "parameters", "strict"}
    if extra:
        raise ToolError(f"unrecognized field {where}.function.{sorted(extra)[0]}", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolError(
            f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {_shown(name)}", "tools"
        )
    if not isinstance(function.get("description", ""), str):
        raise ToolError(f"{where}.function.description must be a string", "tools")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise ToolError(f"{where}.function.strict must be a boolean", "tools")
    parameters = function.get("parameters")
    if parameters is None:  # OpenAI: a function without parameters takes none
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ToolError(
            f'{where}.function.parameters must be a JSON schema of an object ({{"type": "object"}})', "tools"
        )
    jsonschema = _jsonschema()
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as e:
        raise ToolError(f"{where}.function.parameters is not a valid JSON schema: {e.message[:200]}", "tools") from None
    clean = {key: function[key] for key in ("name", "description") if key in function} | {"parameters": parameters}
    return {"type": "function", "function": clean}, name, parameters


def tool_request(body: dict) -> ToolRequest | None:
    """The body's `tools`, `tool_choice` and `parallel_tool_calls` checked → None without tools."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(f"parallel_tool_calls must be a boolean, got {_shown(parallel)}", "parallel_tool_calls")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ToolError(f"tools must be a list of functions, got {_shown(tools)}", "tools")
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    rendered, parameters = [], {}
    for i, tool in enumerate(tools):
        clean, name, schema = _function(i, tool)
        if name in parameters:
            first = next(j for j, t in enumerate(rendered) if t["function"]["name"] == name)
            raise ToolError(f"tools[{i}].function.name {name!r} is tools[{first}]'s name too", "tools")
        rendered.append(clean)
        parameters[name] = schema
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        function = choice.get("function")
        if (
            set(choice) != {"type", "function"}
            or choice["type"] != "function"
            or not isinstance(function, dict)
            or set(function) != {"name"}
            or not isinstance(function["name"], str)
        ):
            raise ToolError(
                f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
                f'{{"name": ...}}}}, got {_shown(choice)}',
                "tool_choice",
            )
        named, choice = function["name"], "named"
        if named not in parameters:
            raise ToolError(f"tool_choice names the function {named!r}, which is not among tools", "tool_choice")
    elif choice not in CHOICES:
        raise ToolError(
            f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
            f'{{"name": ...}}}}, got {_shown(choice)}',
            "tool_choice",
        )
    if not rendered:  # "none" asks for nothing that needs them
        if body.get("tool_choice") not in (None, "none"):
            raise ToolError(
                f"tool_choice {_shown(body.get('tool_choice'))} needs tools (none are given)", "tool_choice"
            )
        return None
    return ToolRequest(tuple(rendered), parameters, choice, named, parallel is not False)


# --------------------------------------------------------------------------------------------------
# The chat template's call format


@dataclass(frozen=True)
class CallFormat:
    """How a family's chat template writes one call (and so how its model was taught to)."""

    name: str
    arguments_key: str  # the key of the arguments object ("arguments", "parameters")
    begin: str  # the text a call opens with, as the template writes it
    end: str  # the text it closes with
    separator: str | None  # between two calls of one reply; None: one call per reply
    # what a parser looks for: the markers without the template's newlines, which models may leave
    # out ("": no markers, the reply itself is the call)
    opens: str = ""
    closes: str = ""

    def prefix(self, name: str) -> str:
        """A call's text up to its arguments object."""
        return f'{self.begin}{{"name": {json.dumps(name)}, "{self.arguments_key}": '

    def suffix(self) -> str:
        """A call's text after its arguments object."""
        return "}" + self.end

    def text(self, name: str, arguments: dict) -> str:
        """The text of a call, as the template renders it and the forced grammar writes it."""
        return self.prefix(name) + json.dumps(arguments, ensure_ascii=False) + self.suffix()


# Qwen2.5 / Qwen3 (Hermes): each call its own <tool_call> block, the arguments an object
HERMES = CallFormat("hermes", "arguments", "<tool_call>\n", "\n</tool_call>", "\n", "<tool_call>", "</tool_call>")
# Llama 3.1 / 3.2 / 3.3 ("JSON based tool calling"): the reply is one object; no parallel calls
LLAMA3_JSON = CallFormat("llama3_json", "parameters", "", "", None)
PYTHON_TAG = "<|python_tag|>"  # what Llama 3.1 may write before a call


def template_source(tokenizer, tools: list[dict] | None) -> str:
    """The Jinja source the tokenizer renders these messages with ("" without a chat template)."""
    if not getattr(tokenizer, "chat_template", None):
        return ""
    try:
        return tokenizer.get_chat_template(tools=tools)
    except ValueError:  # several templates, none the default
        return ""


def call_format(source: str) -> CallFormat | None:
    """The call format a chat template's source writes; None when it is not one this module knows."""
    if "<function=" in source:  # Qwen3-Coder / Qwen3.5's XML parameters inside <tool_call>
        return None
    if "<tool_call>" in source:
        return HERMES
    if '"parameters"' in source:
        return LLAMA3_JSON
    return None


def for_template(request: ToolRequest, tokenizer) -> tuple[ToolRequest, GrammarSpec | None]:
    """The request with its chat template's call format, and the grammar every reply must match
    (None unless tool_choice is "required" or a named function)."""
    source = template_source(tokenizer, list(request.tools))
    if "tools" not in source:
        if request.choice == "none":  # the template cannot show them, and nothing is parsed
            return request, None
        raise ToolError("this model's chat template does not render tools, so its model cannot call them", "tools")
    found = call_format(source)
    if found is None:
        if request.choice == "none":
            return request, None
        raise ToolError(
            "this model's chat template writes tool calls in a format this server does not parse (it parses "
            'Qwen\'s <tool_call>{"name", "arguments"}</tool_call> and Llama 3.1\'s {"name", "parameters"})',
            "tools",
        )
    request = replace(request, format=found)
    return request, forced_grammar(request)


def forced_grammar(request: ToolRequest) -> GrammarSpec | None:
    """Under tool_choice "required" or a named function: the grammar of a reply made of calls only
    (one, or with parallel calls one or more separated as the format separates them)."""
    if request.choice not in ("required", "named"):
        return None
    form = request.format
    tags = [
        {
            "type": "tag",
            "begin": form.prefix(name),
            "content": {"type": "grammar", "grammar": json_schema_ebnf(request.parameters[name], "tools")},
            "end": form.suffix(),
        }
        for name in request.allowed()
    ]
    several = request.parallel and form.separator is not None
    calls = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": form.separator or "",
        "at_least_one": True,
        "stop_after_first": not several,
    }
    return GrammarSpec("structural_tag", {"type": "structural_tag", "format": calls}, "tools")


# --------------------------------------------------------------------------------------------------
# The history: assistant messages with tool_calls, tool messages


def history_message(i: int, message: dict, content: str) -> dict:
    """messages[i], an assistant message carrying `tool_calls` or a `tool` message (its text
    `content` already read), as chat templates take it: a call's arguments as an object (Qwen's and
    Llama's templates write them with `tojson`; OpenAI sends their JSON text)."""
    where = f"messages[{i}]"
    if message["role"] == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ToolError(f"{where}.tool_call_id must be the id of the call it answers (a string)", "messages")
        return {"role": "tool", "tool_call_id": call_id, "content": content}
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        raise ToolError(f"{where}.tool_calls must be a list", "messages")
    clean = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or call.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise ToolError(
                f'{at} must be {{"id": ..., "type": "function", "function": {{"name": ..., "arguments": '
                '"<JSON text>"}}',
                "messages",
            )
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise ToolError(f"{at}.function.arguments must be the JSON text of an object", "messages")
        entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        clean.append(entry)
    out = {"role": "assistant", "content": content}
    if clean:  # Llama 3.1's template asks `'tool_calls' in message`: an empty list would be a call
        out["tool_calls"] = clean
    return out


# --------------------------------------------------------------------------------------------------
# The reply


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # the arguments object's JSON text


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """The calls in a reply's text, fed in the pieces it is committed in → content text and Calls.

    `feed` and `finish` return what is classified so far, in order: str (content) and Call. Text that
    may still become (or is inside) a call is held back until it is decided. Whitespace next to a call
    is no content (templates put newlines around calls); a call that does not check out is content, as
    written. Whole or in pieces, the same text gives the same content and calls."""

    def __init__(self, request: ToolRequest):
        self.request, self.form = request, request.format
        self.pending = ""  # text not yet classified
        self.space = ""  # trailing whitespace of the content so far: dropped if a call follows
        self.in_call = False  # `pending` starts with an opened call (Hermes) / is the call (Llama)
        self.after_call = False  # the last piece was a call: the whitespace after it is dropped
        self.reply_is_text = False  # Llama: the reply did not open as a call
        self.calls = 0
        self.validators = {}

    def feed(self, text: str) -> list:
        self.pending += text
        out: list = []
        self._classify(out, final=False)
        return out

    def finish(self) -> list:
        out: list = []
        self._classify(out, final=True)
        if self.in_call:  # a call never closed (cut by max_tokens or a stop string): text, as written
            self._content(self.space + self.pending, out)
        else:
            self._text(self.pending, out)
            self._content(self.space, out)
        self.pending, self.space, self.in_call = "", "", False
        return out

    def _classify(self, out: list, final: bool) -> None:
        if self.form.opens:
            self._blocks(out)
        else:
            self._whole_reply(out, final)

    def _blocks(self, out: list) -> None:
        """Calls opened and closed by markers anywhere in the text (Hermes)."""
        opens, closes = self.form.opens, self.form.closes
        while True:
            if self.in_call:
                stop = self.pending.find(closes, len(opens))
                if stop < 0:
                    return
                raw, self.pending = self.pending[: stop + len(closes)], self.pending[stop + len(closes) :]
                call = self._call(raw[len(opens) : stop])
                if call is None:
                    self._content(self.space + raw, out)
                else:
                    out.append(call)
                self.in_call, self.after_call, self.space = False, call is not None, ""
                continue
            may_call = self.request.parallel or self.calls == 0
            start = self.pending.find(opens) if may_call else -1
            if start >= 0:
                self._text(self.pending[:start], out)
                self.pending, self.in_call = self.pending[start:], True
                continue
            keep = 0  # a tail that may grow into the marker is held back
            if may_call:
                longest = min(len(opens) - 1, len(self.pending))
                keep = next((n for n in range(longest, 0, -1) if self.pending.endswith(opens[:n])), 0)
            self._text(self.pending[: len(self.pending) - keep], out)
            self.pending = self.pending[len(self.pending) - keep :]
            return

    def _whole_reply(self, out: list, final: bool) -> None:
        """One call that is the whole reply, after optional whitespace and <|python_tag|> (Llama 3.1):
        decided at the reply's first visible characters; a call is held whole to the end."""
        if not (self.in_call or self.reply_is_text):
            head = self.pending.lstrip()
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self.in_call = True
            elif final or (head and not PYTHON_TAG.startswith(head)):
                self.reply_is_text = True
        if self.reply_is_text:
            self._content(self.pending, out)
            self.pending = ""
        elif self.in_call and final:
            call = self._call(self.pending.strip().removeprefix(PYTHON_TAG))
            if call is not None:
                out.append(call)
                self.pending, self.in_call = "", False

    def _text(self, text: str, out: list) -> None:
        """Content between calls: the whitespace after a call dropped, trailing whitespace held."""
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        text = self.space + text
        body = text.rstrip()
        self.space = text[len(body) :]
        self._content(body, out)

    @staticmethod
    def _content(text: str, out: list) -> None:
        if text:
            out.append(text)

    def _call(self, body: str) -> Call | None:
        """A call's JSON text checked → the Call, or None when it is not one (it stays text)."""
        try:
            value = json.loads(body, parse_constant=_not_json)
        except ValueError:
            return None
        key = self.form.arguments_key
        if not isinstance(value, dict) or set(value) != {"name", key}:
            return None
        name, arguments = value["name"], value[key]
        if name not in self.request.allowed() or not isinstance(arguments, dict):
            return None
        if not self._valid_arguments(name, arguments):
            return None
        self.calls += 1
        return Call(name, json.dumps(arguments, ensure_ascii=False))

    def _valid_arguments(self, name: str, arguments: dict) -> bool:
        if name not in self.validators:
            schema = self.request.parameters[name]
            self.validators[name] = _jsonschema().validators.validator_for(schema)(schema)
        return self.validators[name].is_valid(arguments)


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")  # Python's json takes NaN and Infinity


def message_entry(call: Call, call_id: str) -> dict:
    """A call as a non-streamed message's `tool_calls` holds it."""
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def finish_reason(reason: str, calls: int) -> str:
    """OpenAI's finish reason: "tool_calls" when the reply ended by itself after making calls."""
    return "tool_calls" if calls and reason == "stop" else reason


def chat_answer(text: str, reason: str, request: ToolRequest | None) -> tuple[dict, str]:
    """A finished reply's message (content, tool_calls) and finish reason."""
    if request is None or not request.parses:
        return {"role": "assistant", "content": text}, reason
    parser = ToolCallParser(request)
    pieces = parser.feed(text) + parser.finish()
    calls = [message_entry(p, new_call_id()) for p in pieces if isinstance(p, Call)]
    content = "".join(p for p in pieces if isinstance(p, str))
    if not calls:
        return {"role": "assistant", "content": content}, reason
    return {"role": "assistant", "content": content or None, "tool_calls": calls}, finish_reason(reason, len(calls))
