"""Structured output's JSON schemas: every keyword is enforced or refused (runtime/schema_check.py).

Enforced: the schema is accepted, and xgrammar's matcher (over a byte tokenizer) takes a value that
jsonschema finds valid and rejects one it finds invalid. Refused: a GrammarError naming the keyword and
its JSON pointer, wherever the keyword stands (under properties, items, anyOf, a $ref, ...), and
xgrammar on its own would have let an invalid value through (so the refusal is needed). Limits refuse
what would compile too long. Over real HTTP: a refusal is a 400 naming the field, compiling is off the
event loop (/health and a plain request answer while a large grammar compiles), a grammar not compiled
in time is a 429, and a compiled grammar is kept (the same schema is not compiled twice). The CLI
refuses in one line."""

import json
import threading
import time

import pytest

xgrammar = pytest.importorskip("xgrammar", reason="needs xgrammar: pip install 'loopspec[grammar]'")
jsonschema = pytest.importorskip("jsonschema", reason="needs jsonschema (the dev extra): pip install 'loopspec[dev]'")

from loopspec.runtime import schema_check  # noqa: E402
from loopspec.runtime.constraint import GrammarError, GrammarSpec  # noqa: E402

BYTES = [bytes([b]) for b in range(256)] + [b"</s>"]  # one token per byte, then a stop token


@pytest.fixture(scope="module")
def compiler():
    info = xgrammar.TokenizerInfo(BYTES, vocab_size=len(BYTES), stop_token_ids=[256])
    return xgrammar.GrammarCompiler(info, max_threads=1)


def takes(compiler, grammar, text: str) -> bool:
    """Whether the grammar's matcher takes `text` whole and may end there."""
    matcher = xgrammar.GrammarMatcher(compiler.compile_grammar(grammar))
    return all(matcher.accept_token(b) for b in text.encode()) and matcher.accept_token(256)


def raw(schema: dict):
    """xgrammar's own grammar of the schema (no refusal in between), as GrammarSpec converts it."""
    return xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


def valid(schema: dict, text: str) -> bool:
    """The independent judge: jsonschema (draft 2020-12, formats checked where it can)."""
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    return validator.is_valid(json.loads(text))


INT = {"type": "integer"}
OBJ_AB = {"a": INT, "b": INT}

# (id, schema, a valid value, a value the keyword forbids) as xgrammar writes JSON: ", " and ": "
ENFORCED = [
    ("type", {"type": "integer"}, "3", '"a"'),
    ("type-list", {"type": ["integer", "null"]}, "null", '"a"'),
    ("const", {"const": 42}, "42", "43"),
    ("enum", {"enum": [1, "a"]}, '"a"', "2"),
    ("enum-beside-its-type", {"type": "string", "enum": ["a", "b"]}, '"b"', '"c"'),
    ("anyOf", {"anyOf": [INT, {"type": "null"}]}, "null", '"a"'),
    ("oneOf-by-type", {"oneOf": [INT, {"type": "string"}]}, '"a"', "null"),
    (
        "oneOf-by-required-const",
        {
            "oneOf": [
                {"type": "object", "properties": {"k": {"const": "cat"}, "v": INT}, "required": ["k", "v"]},
                {"type": "object", "properties": {"k": {"const": "dog"}}, "required": ["k"]},
            ]
        },
        '{"k": "cat", "v": 1}',
        '{"k": "cat"}',
    ),
    ("allOf-one-member", {"allOf": [INT]}, "3", '"a"'),
    ("$ref-$defs", {"$defs": {"i": INT}, "$ref": "#/$defs/i", "description": "d"}, "1", '"a"'),
    ("$ref-definitions", {"definitions": {"i": INT}, "$ref": "#/definitions/i"}, "1", '"a"'),
    ("$ref-root", {"type": "object", "properties": {"n": {"$ref": "#"}}}, '{"n": {}}', '{"n": 1}'),
    ("minimum-integer", {"type": "integer", "minimum": 5}, "5", "4"),
    ("maximum-integer", {"type": "integer", "maximum": 5}, "5", "6"),
    ("exclusiveMinimum-integer", {"type": "integer", "exclusiveMinimum": 5}, "6", "5"),
    ("exclusiveMaximum-integer", {"type": "integer", "exclusiveMaximum": 5}, "4", "5"),
    ("minimum-number", {"type": "number", "minimum": 0.5}, "0.5", "4e-1"),
    ("maximum-number", {"type": "number", "maximum": 1.5}, "1.5", "2e0"),
    ("exclusiveMinimum-number", {"type": "number", "exclusiveMinimum": 0.5}, "0.6", "0.5"),
    ("exclusiveMaximum-number", {"type": "number", "exclusiveMaximum": 0.5}, "0.4", "0.5"),
    ("multipleOf-integer", {"type": "integer", "multipleOf": 3}, "6", "7"),
    ("multipleOf-integer-range", {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 9999}, "6", "7"),
    ("minLength", {"type": "string", "minLength": 2}, '"ab"', '"a"'),
    ("maxLength", {"type": "string", "maxLength": 2}, '"ab"', '"abc"'),
    ("pattern", {"type": "string", "pattern": "^a+$"}, '"aa"', '"b"'),
    ("pattern-alternatives-anchored", {"type": "string", "pattern": "^a$|^b$"}, '"b"', '"c"'),
    ("items", {"type": "array", "items": INT}, "[1, 2]", '["a"]'),
    ("prefixItems", {"type": "array", "prefixItems": [INT], "items": False}, "[1]", "[1, 2]"),
    (
        "unevaluatedItems",
        {"type": "array", "prefixItems": [INT], "unevaluatedItems": {"type": "string"}},
        '[1, "a"]',
        "[1, 2]",
    ),
    ("minItems", {"type": "array", "items": INT, "minItems": 2}, "[1, 2]", "[1]"),
    ("maxItems", {"type": "array", "items": INT, "maxItems": 1}, "[1]", "[1, 2]"),
    ("properties", {"type": "object", "properties": {"a": INT}}, '{"a": 1}', '{"a": "x"}'),
    ("required", {"type": "object", "properties": {"a": INT}, "required": ["a"]}, '{"a": 1}', "{}"),
    (
        "additionalProperties-false",
        {"type": "object", "properties": {"a": INT}, "additionalProperties": False},
        '{"a": 1}',
        '{"b": 1}',
    ),
    ("additionalProperties-schema", {"type": "object", "additionalProperties": INT}, '{"b": 1}', '{"b": "x"}'),
    ("unevaluatedProperties", {"type": "object", "unevaluatedProperties": INT}, '{"b": 1}', '{"b": "x"}'),
    (
        "patternProperties",
        {"type": "object", "patternProperties": {"^x": INT}, "additionalProperties": False},
        '{"x": 1}',
        '{"x": "s"}',
    ),
    (
        "propertyNames",
        {"type": "object", "propertyNames": {"pattern": "^[a-c]+$"}, "additionalProperties": INT},
        '{"ab": 1}',
        '{"xy": 1}',
    ),
    ("minProperties", {"type": "object", "properties": OBJ_AB, "minProperties": 1}, '{"a": 1}', "{}"),
    ("maxProperties", {"type": "object", "properties": OBJ_AB, "maxProperties": 1}, '{"a": 1}', '{"a": 1, "b": 2}'),
    ("object-without-type", {"properties": {"a": INT}}, '{"a": 1}', '{"a": "x"}'),
    ("array-without-type", {"items": INT}, "[1]", '["x"]'),
] + [
    (f"format-{name}", {"type": "string", "format": name}, good, bad)
    for name, good, bad in [
        ("email", '"a@b"', '"ab"'),
        ("date", '"2024-01-02"', '"2024-13-02"'),
        ("time", '"10:00:00Z"', '"25:00:00Z"'),
        ("date-time", '"2024-01-02T10:00:00Z"', '"2024-01-02"'),
        ("duration", '"P1D"', '"1D"'),
        ("ipv4", '"1.2.3.4"', '"1.2.3"'),
        ("ipv6", '"::1"', '"1.2.3.4"'),
        ("hostname", '"a.b"', '"a b"'),
        ("uuid", '"12345678-1234-1234-1234-123456789012"', '"1234"'),
        ("uri", '"http://a.b/c"', '"ab"'),
        ("uri-reference", '"/a"', '"a b"'),
        ("uri-template", '"/a{b}"', '"{"'),
        ("json-pointer", '"/a"', '"a"'),
        ("relative-json-pointer", '"0/a"', '"a"'),
    ]
]
ANNOTATED = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://example.com/pet",
    "title": "pet",
    "description": "d",
    "$comment": "c",
    "type": "object",
    "properties": {
        "name": {
            "type": "string",
            "examples": ["x"],
            "default": "x",
            "deprecated": True,
            "readOnly": True,
            "writeOnly": False,
            "contentMediaType": "text/plain",
            "x-vendor": 1,
        }
    },
    "required": ["name"],
}


@pytest.mark.parametrize("name, schema, good, bad", ENFORCED, ids=[c[0] for c in ENFORCED])
def test_enforced_keywords_are_accepted_and_enforced(compiler, name, schema, good, bad):
    spec = GrammarSpec("json_schema", schema, "response_format")
    assert valid(schema, good), "the example should be valid"
    if not name.startswith("format-") or schema["format"] in jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers:
        assert not valid(schema, bad), "the counterexample should be invalid"
    assert takes(compiler, spec.converted, good), good
    assert not takes(compiler, spec.converted, bad), f"{name}: xgrammar let {bad} through"


def test_annotations_are_accepted(compiler):
    spec = GrammarSpec("json_schema", ANNOTATED, "guided_json")
    assert takes(compiler, spec.converted, '{"name": "x"}') and not takes(compiler, spec.converted, "{}")


# (id, schema, the keyword the refusal names, a value xgrammar alone lets through that breaks the schema
# (None where jsonschema cannot judge it: a remote $ref, a keyword it does not know))
REFUSED = [
    ("not", {"type": "integer", "not": {"const": 3}}, "not", "3"),
    ("if-then", {"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 5}}, "if", "7"),
    ("else", {"type": "integer", "else": {"const": 0}, "if": {"minimum": 0}}, "else", "-5"),
    (
        "dependentRequired",
        {"type": "object", "properties": OBJ_AB, "dependentRequired": {"a": ["b"]}},
        "dependentRequired",
        '{"a": 1}',
    ),
    (
        "dependentSchemas",
        {"type": "object", "properties": OBJ_AB, "dependentSchemas": {"a": {"required": ["b"]}}},
        "dependentSchemas",
        '{"a": 1}',
    ),
    ("dependencies", {"type": "object", "properties": OBJ_AB, "dependencies": {"a": ["b"]}}, "dependencies", None),
    ("contains", {"type": "array", "items": INT, "contains": {"const": 42}}, "contains", "[1, 2, 3, 4]"),
    (
        "minContains",
        {"minContains": 2, "type": "array", "items": INT, "contains": {"const": 42}},
        "minContains",
        "[42, 1]",
    ),
    (
        "maxContains",
        {"maxContains": 1, "type": "array", "items": INT, "contains": {"const": 42}},
        "maxContains",
        "[42, 42]",
    ),
    ("uniqueItems", {"type": "array", "items": INT, "uniqueItems": True}, "uniqueItems", "[1, 1]"),
    ("additionalItems", {"type": "array", "prefixItems": [INT], "additionalItems": INT}, "additionalItems", None),
    ("multipleOf-number", {"type": "number", "multipleOf": 0.5}, "multipleOf", "1.2"),
    ("multipleOf-fraction", {"type": "integer", "multipleOf": 1.5}, "multipleOf", "4"),
    ("multipleOf-over-1024", {"type": "integer", "multipleOf": 2000}, "multipleOf", "7"),
    ("multipleOf-one-bound", {"type": "integer", "multipleOf": 3, "minimum": 0}, "multipleOf", "7"),
    ("multipleOf-wide-range", {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 10000}, "multipleOf", "7"),
    ("allOf-two", {"allOf": [INT, {"minimum": 2}]}, "allOf", '"a"'),
    ("allOf-unsatisfiable", {"allOf": [{"type": "string"}, INT]}, "allOf", "{}"),
    ("$ref-remote", {"$ref": "https://example.com/s.json"}, "$ref", None),
    ("$ref-anchor", {"$defs": {"i": {"$anchor": "i", "type": "integer"}}, "$ref": "#i"}, "$ref", '"a"'),
    ("$ref-beside", {"$defs": {"i": INT}, "$ref": "#/$defs/i", "minimum": 5}, "minimum", "1"),
    ("anyOf-beside", {"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": 0}]}, "type", '"a"'),
    ("const-wrong-type", {"type": "string", "const": 1}, "const", "1"),
    ("enum-wrong-type", {"type": "string", "enum": ["a", 1]}, "enum", "1"),
    ("enum-beside-minLength", {"enum": ["a", "bbb"], "minLength": 2}, "minLength", '"a"'),
    (
        "oneOf-overlapping",
        {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]},
        "oneOf",
        "5",
    ),
    ("oneOf-integer-number", {"oneOf": [INT, {"type": "number"}]}, "oneOf", "1"),
    ("format-unknown", {"type": "string", "format": "regex"}, "format", '"("'),
    ("format-beside-pattern", {"type": "string", "format": "date", "pattern": "^2024"}, "pattern", '"2023-01-02"'),
    ("format-beside-maxLength", {"type": "string", "format": "date", "maxLength": 5}, "maxLength", '"2024-01-02"'),
    ("pattern-beside-maxLength", {"type": "string", "pattern": "^a+$", "maxLength": 2}, "maxLength", '"aaa"'),
    ("pattern-beside-minLength", {"type": "string", "pattern": "^a+$", "minLength": 2}, "minLength", '"a"'),
    ("pattern-lookahead", {"type": "string", "pattern": "^(?!b)[a-z]+$"}, "pattern", '"bc"'),
    ("pattern-inner-anchor", {"type": "string", "pattern": "a$b"}, "pattern", '"ab"'),
    ("required-not-listed", {"type": "object", "required": ["a"]}, "required", "{}"),
    ("required-not-listed-open", {"type": "object", "required": ["a"], "additionalProperties": True}, "required", "{}"),
    (
        "patternProperties-beside-properties",
        {"type": "object", "properties": {"xa": {"type": "string"}}, "patternProperties": {"xa": INT}},
        "patternProperties",
        '{"xa": "s"}',
    ),
    (
        "propertyNames-beside-properties",
        {"type": "object", "properties": {"XY": INT}, "propertyNames": {"pattern": "^[a-c]+$"}},
        "propertyNames",
        '{"XY": 1}',
    ),
    ("minimum-without-type", {"minimum": 3}, "minimum", "2"),
    ("required-without-type", {"required": ["a"]}, "required", "{}"),
    ("minLength-without-type", {"minLength": 3}, "minLength", '"a"'),
    ("unknown-keyword", {"type": "string", "nullable": True}, "nullable", None),
    ("$id-inside", {"type": "object", "properties": {"a": {"$id": "a", "type": "integer"}}}, "$id", None),
    ("$dynamicRef", {"$dynamicRef": "#x"}, "$dynamicRef", None),
]
# where a refused schema may stand, and the JSON pointer the refusal names there
NESTINGS = {
    "root": (lambda s: s, "#"),
    "property": (lambda s: {"type": "object", "properties": {"x": s}, "required": ["x"]}, "#/properties/x"),
    "items": (lambda s: {"type": "array", "items": s}, "#/items"),
    "prefixItems": (lambda s: {"type": "array", "prefixItems": [INT, s]}, "#/prefixItems/1"),
    "anyOf": (lambda s: {"anyOf": [{"type": "null"}, s]}, "#/anyOf/1"),
    "additionalProperties": (lambda s: {"type": "object", "additionalProperties": s}, "#/additionalProperties"),
    "allOf": (lambda s: {"allOf": [s]}, "#/allOf/0"),
    "$defs": (lambda s: {"$defs": {"T": s}, "type": "array", "items": {"$ref": "#/$defs/T"}}, "#/$defs/T"),
    "deep": (
        lambda s: {"type": "object", "properties": {"a": {"type": "array", "items": {"anyOf": [s]}}}},
        "#/properties/a/items/anyOf/0",
    ),
}


def refusal_misses(cases=REFUSED, nestings=NESTINGS) -> list[str]:
    """The (case, nesting) pairs not refused as they should be: a GrammarError naming the keyword and
    a pointer under the nesting's."""
    misses = []
    for name, schema, keyword, _ in cases:
        for where, (wrap, pointer) in nestings.items():
            if where == "$defs" and "$defs" in schema:
                continue  # its own $refs point from the root
            try:
                GrammarSpec("json_schema", wrap(schema), "guided_json")
                misses.append(f"{name} under {where}: accepted")
            except GrammarError as e:
                message = str(e)
                if not (
                    message.startswith("guided_json: ")
                    and f"'{keyword}'" in message
                    and f"at {pointer}" in message
                    and "\n" not in message
                ):
                    misses.append(f"{name} under {where}: {message}")
    return misses


def test_refused_keywords_are_refused_wherever_they_stand():
    assert refusal_misses() == []


JUDGED = [case for case in REFUSED if case[3] is not None]


@pytest.mark.parametrize("name, schema, keyword, breaking", JUDGED, ids=[c[0] for c in JUDGED])
def test_refusals_are_needed(compiler, name, schema, keyword, breaking):
    """xgrammar alone takes a value that breaks the schema: the refusal is what keeps the output valid."""
    assert not valid(schema, breaking), "the counterexample should be invalid"
    assert takes(compiler, raw(schema), breaking), f"xgrammar now enforces {keyword}: move it to ENFORCED"


def test_a_walker_that_skips_nested_items_is_caught(monkeypatch):
    """The planted bug: arrays' `items` not walked. The refusal check reports the misses."""
    real = schema_check._Walk._array

    def skips_items(self, node, path, depth):
        real(self, {k: v for k, v in node.items() if k != "items"}, path, depth)

    monkeypatch.setattr(schema_check._Walk, "_array", skips_items)
    misses = refusal_misses()
    assert misses and all(" under items:" in m or " under deep:" in m or " under $defs:" in m for m in misses), misses


# --------------------------------------------------------------------------------------------------
# Limits: what would take too long to convert or compile is refused before either starts


def properties(n: int, required: int = 0) -> dict:
    names = [f"p{i}" for i in range(n)]
    return {"type": "object", "properties": {k: INT for k in names}, "required": names[:required]}


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"type": "string", "description": "x" * schema_check.MAX_SCHEMA_BYTES}, "bytes of JSON"),
        (
            {
                "type": "object",
                "properties": {f"p{i}": True for i in range(5001)},
                "required": [f"p{i}" for i in range(5001)],
            },
            "subschemas",
        ),
        (properties(schema_check.MAX_OPTIONAL_PROPERTIES + 1), "optional properties"),
        (
            {"type": "object", "properties": {f"o{j}": properties(250) for j in range(5)}},
            "optional properties together",
        ),
        ({"type": "string", "pattern": "^[a-z]{1,2000}$"}, "repetitions cost"),
        (
            {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^.{1,300}$"} for i in range(5)}},
            "repetitions cost",
        ),
        (json.loads('{"type": "array", "items": ' * 70 + "{}" + "}" * 70), "nest deeper"),
    ],
    ids=["bytes", "subschemas", "optional-one-object", "optional-together", "pattern", "patterns-together", "depth"],
)
def test_limits_refuse_naming_the_limit(schema, words):
    with pytest.raises(GrammarError, match=words) as e:
        GrammarSpec("json_schema", schema, "response_format")
    assert e.value.param == "response_format" and "\n" not in str(e.value)


def test_schemas_at_the_limits_are_accepted(compiler):
    at = properties(schema_check.MAX_OPTIONAL_PROPERTIES, required=0)
    assert takes(compiler, GrammarSpec("json_schema", at).converted, '{"p0": 1}')
    GrammarSpec("json_schema", {"type": "string", "pattern": "^[a-z]{1,1000}$"})
    GrammarSpec("json_schema", properties(3000, required=3000))  # required properties are cheap


@pytest.mark.parametrize(
    "regex, words",
    [
        ("(?=a)[a-z]+", "lookarounds"),
        ("a$b", "'\\$' inside"),
        ("a^b", "'\\^' inside"),
        ("[a-z]{1,5000}", "repetitions"),
    ],
)
def test_regexes_xgrammar_would_not_enforce_are_refused(regex, words):
    with pytest.raises(GrammarError, match=words) as e:
        GrammarSpec("regex", regex, "guided_regex")
    assert str(e.value).startswith("guided_regex: ")


# --------------------------------------------------------------------------------------------------
# The server: refusals are 400s naming the field; compiling is off the event loop, bounded and kept

BIG = 1400  # optional properties: seconds to compile with the tiny tokenizer (0.6 s at 600, 3 s at 1200)


@pytest.fixture(scope="module")
def served(tiny_pair):
    pytest.importorskip("fastapi", reason="needs fastapi: pip install 'loopspec[serve]'")
    from test_server import CONTEXT, ServerThread, make_app

    from loopspec.runtime.pipeline import load_pipeline

    target_dir, drafter_dir = tiny_pair
    pipe = load_pipeline(str(target_dir), str(drafter_dir), max_context=CONTEXT, backend="torch")
    app = make_app(pipe, max_body_bytes=1 << 20, grammar_timeout_s=1.0)
    with ServerThread(app) as s:
        yield s, app.state.server.pipeline  # the server's own (its rows), whose grammars it compiles


def post(server, path, body, timeout=120):
    import httpx

    return httpx.post(server.url + path, json=body, timeout=timeout)


CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 8, "temperature": 0})
PLAIN = ("/v1/completions", {"prompt": "abc", "max_tokens": 8, "temperature": 0})


def schema_field(field: str, schema: dict) -> dict:
    if field == "guided_json":
        return {"guided_json": schema}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize("path, base", [CHAT, PLAIN], ids=["chat", "completions"])
@pytest.mark.parametrize("field", ["response_format", "guided_json"])
def test_server_refuses_unenforced_keywords_naming_the_field(served, path, base, field):
    server, _ = served
    tags = {"type": "object", "properties": {"tags": {"type": "array", "contains": {"const": 42}}}}
    response = post(server, path, {**base, **schema_field(field, tags)})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert "'contains' at #/properties/tags" in error["message"] and "\n" not in error["message"]


def compiles_for_one_schema(server, pipe, name: str) -> int:
    """Three requests with one schema (through both fields) → how many grammars the server compiled."""
    schema = {"type": "object", "properties": {name: {"type": "boolean"}}, "required": [name]}
    before = pipe.grammars.compiles
    for field in ("response_format", "guided_json", "response_format"):
        response = post(server, PLAIN[0], {**PLAIN[1], **schema_field(field, schema)})
        assert response.status_code == 200, response.text
    return pipe.grammars.compiles - before


def test_a_compiled_grammar_is_kept(served):
    assert compiles_for_one_schema(*served, "kept") == 1


def test_a_cache_keyed_by_the_request_is_caught(served, monkeypatch):
    """The planted bug: grammars kept under each request's spec object, not its schema."""
    monkeypatch.setattr(GrammarSpec, "key", lambda self: (self.kind, str(id(self))))
    assert compiles_for_one_schema(*served, "planted") == 3


class TimedCompiler:
    """xgrammar's compiler, with when each compile started and ended (test instrumentation)."""

    def __init__(self, compiler):
        self.compiler, self.started, self.ended = compiler, [], []

    def compile_grammar(self, grammar):
        self.started.append(time.monotonic())
        try:
            return self.compiler.compile_grammar(grammar)
        finally:
            self.ended.append(time.monotonic())


def while_compiling(server, pipe, monkeypatch, n: int) -> dict:
    """Send a schema of `n` optional properties (the limits raised for it) and, while it compiles, /health,
    a plain request and another schema: when each answered, and when the compile ended."""
    import httpx

    monkeypatch.setattr(schema_check, "MAX_OPTIONAL_PROPERTIES", n)
    monkeypatch.setattr(schema_check, "MAX_OPTIONAL_TOTAL", n)
    monkeypatch.setattr("loopspec.runtime.constraint.MAX_PENDING_COMPILES", 1)
    timed = TimedCompiler(pipe.grammars.compiler)
    monkeypatch.setattr(pipe.grammars, "compiler", timed)
    big = {"type": "object", "properties": {f"field_{i}": INT for i in range(n)}}
    out = {}
    sender = threading.Thread(
        target=lambda: out.update(big=post(server, CHAT[0], {**CHAT[1], **schema_field("response_format", big)}))
    )
    sender.start()
    deadline = time.monotonic() + 60
    while not timed.started:
        assert time.monotonic() < deadline and sender.is_alive(), "the compile did not start"
        time.sleep(0.01)
    for name, send in (
        ("other", lambda: post(server, PLAIN[0], {**PLAIN[1], **schema_field("guided_json", {"type": "integer"})})),
        ("health", lambda: httpx.get(server.url + "/health", timeout=120)),
        ("plain", lambda: post(server, *PLAIN)),
    ):
        start = time.monotonic()
        out[name] = send()
        out[name + "_s"], out[name + "_at"] = time.monotonic() - start, time.monotonic()
    sender.join(300)
    deadline = time.monotonic() + 300
    while not timed.ended:
        assert time.monotonic() < deadline, "the compile did not end"
        time.sleep(0.05)
    out["compile_s"], out["ended"] = timed.ended[0] - timed.started[0], timed.ended[0]
    return out


def test_compiling_stalls_nothing_and_a_slow_grammar_is_429_then_kept(served, monkeypatch, capsys):
    """The aim: /health and a plain request answer within 1 s while a grammar compiles (asserted: 5 s,
    and before the compile ends); the grammar, past grammar_timeout_s (1 s here), is a 429 naming the
    field; another grammar while the compiler is full (MAX_PENDING_COMPILES 1 here) is a 429 at once;
    once compiled, the same request is a 200 without compiling again."""
    server, pipe = served
    out = while_compiling(server, pipe, monkeypatch, BIG)
    with capsys.disabled():
        print(
            f"\ncompile {out['compile_s']:.2f} s; during it /health {out['health_s'] * 1000:.0f} ms, "
            f"a plain request {out['plain_s'] * 1000:.0f} ms, another grammar {out['other_s'] * 1000:.0f} ms"
        )
    assert out["compile_s"] > 1.5, "the test's grammar compiled too fast to show anything: raise BIG"
    assert out["health"].status_code == 200 and out["plain"].status_code == 200, out["plain"].text
    for name in ("health", "plain"):
        assert out[name + "_s"] < 5 and out[name + "_at"] < out["ended"], (name, out)
    assert out["other"].status_code == 429 and out["other"].json()["error"]["param"] == "guided_json"
    big = out["big"]
    assert big.status_code == 429, big.text
    assert big.json()["error"]["param"] == "response_format" and big.json()["error"]["code"] == "grammar_compiling"
    compiles = pipe.grammars.compiles
    schema = {"type": "object", "properties": {f"field_{i}": INT for i in range(BIG)}}
    again = post(server, CHAT[0], {**CHAT[1], **schema_field("response_format", schema)})
    assert again.status_code == 200, again.text
    assert pipe.grammars.compiles == compiles


def test_compiling_on_the_event_loop_is_caught(served, monkeypatch):
    """The planted bug: the grammar compiled in the request handler, on the event loop. /health then
    waits for the compile: the stall check sees it answer after the compile ended."""
    from concurrent.futures import Future

    from loopspec.runtime.constraint import Grammars

    server, pipe = served

    def on_the_loop(self, spec):
        future = Future()
        self.compiles += 1
        future.set_result(self.compiler.compile_grammar(spec.converted))
        return future

    monkeypatch.setattr(Grammars, "compiling", on_the_loop)
    out = while_compiling(server, pipe, monkeypatch, BIG - 400)
    assert out["health_at"] >= out["ended"], "the stall check should have seen /health wait for the compile"


# --------------------------------------------------------------------------------------------------
# The command line


def test_cli_refuses_unenforced_keywords_in_one_line(capsys, tmp_path):
    from loopspec.cli import main

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}))
    base = ["generate", "--prompt", "abc", "--target", str(tmp_path / "never-read")]
    for flags, words in (
        (["--json-schema", '{"type": "array", "contains": {"const": 42}}'], "'contains' at #"),
        (["--json-schema", str(schema)], "'not' at #/properties/n"),
        (["--json-schema", '{"allOf": [{"type": "string"}, {"type": "integer"}]}'], "'allOf' with 2 members"),
        (["--regex", "(?!b)[a-z]+"], "lookarounds"),
    ):
        with pytest.raises(SystemExit) as e:
            raise SystemExit(main(base + flags))
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("loopspec: error: ") and words in err and err.count("\n") == 1, err
