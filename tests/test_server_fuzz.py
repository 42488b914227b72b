"""Fuzzing the server, over real HTTP, against its own OpenAPI document and its table of request fields:
no input gets a 5xx, every answer has the shape the document promises, and a field the table does not
know gets a 400 naming it (bounded: a tiny pair, at most 4 new tokens, a fixed number of examples)."""

import json

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="needs hypothesis: pip install 'loopspec[dev]'")
jsonschema = pytest.importorskip("jsonschema", reason="needs jsonschema: pip install 'loopspec[dev]'")
pytest.importorskip("fastapi", reason="needs fastapi: pip install 'loopspec[serve]'")

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from loopspec.runtime.openai_api import CHAT, COMPLETIONS, ENDPOINT_PATHS, FIELDS, endpoint_fields  # noqa: E402
from loopspec.runtime.openai_wire import CHAT_BODY, COMPLETION_BODY  # noqa: E402
from test_server import ServerThread, httpx  # noqa: E402

# any JSON value, nested a little: what a careless or hostile client may send in any field
JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)


def valid(schema: dict):
    """Values of the JSON-schema subset the server's request bodies use."""
    if "oneOf" in schema:
        return st.one_of([valid(s) for s in schema["oneOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        props = schema.get("properties", {})
        required = {k: valid(v) for k, v in props.items() if k in schema.get("required", [])}
        return st.fixed_dictionaries(required, optional={k: valid(v) for k, v in props.items() if k not in required})
    if kind == "array":
        return st.lists(valid(schema["items"]), min_size=schema.get("minItems", 0), max_size=schema.get("maxItems", 4))
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=24)
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        return st.floats(
            schema.get("exclusiveMinimum", schema.get("minimum")),
            schema.get("maximum"),
            exclude_min="exclusiveMinimum" in schema,
            allow_nan=False,
        )
    return st.booleans()


def bodies(schema: dict):
    """Bodies the schema allows, bodies with each declared field set to anything, and anything at all."""
    fields = {name: JUNK for name in schema["properties"]}
    return st.one_of(valid(schema), st.fixed_dictionaries({}, optional=fields), JUNK)


def post(client, path: str, body):
    # NaN and infinities as JSON's common extension writes them (a client may send them)
    return client.post(path, content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"})


@pytest.fixture(scope="module")
def client(tiny_pair):
    from loopspec.runtime.pipeline import load_pipeline
    from loopspec.runtime.server import ServeConfig, create_app

    target_dir, drafter_dir = tiny_pair
    pipe = load_pipeline(str(target_dir), str(drafter_dir), max_context=96, backend="torch")
    config = ServeConfig(
        settings=pipe.settings("dloop", adaptive=False),
        model_name="tiny",
        max_batch_size=2,
        max_tokens_limit=4,
        default_max_tokens=4,
        max_body_bytes=4096,
    )
    with ServerThread(create_app(pipe, config)) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def spec(client):
    return client.get("/openapi.json").json()


def check_answer(response, spec: dict, path: str) -> None:
    assert response.status_code < 500, (response.status_code, response.text)
    documented = spec["paths"][path]["post"]["responses"]
    assert str(response.status_code) in documented, response.status_code
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all(json.loads(e) for e in events[:-1])
        return
    schema = documented[str(response.status_code)]["content"]["application/json"]["schema"]
    jsonschema.validate(response.json(), schema)


FUZZ = settings(
    max_examples=70,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(body=bodies(COMPLETION_BODY))
def test_completions_never_5xx(client, spec, body):
    check_answer(post(client, "/v1/completions", body), spec, "/v1/completions")


@FUZZ
@given(body=bodies(CHAT_BODY))
def test_chat_completions_never_5xx(client, spec, body):
    check_answer(post(client, "/v1/chat/completions", body), spec, "/v1/chat/completions")


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_raw_bytes_never_5xx(client, spec, raw):
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    check_answer(response, spec, "/v1/completions")


OK_BODIES = {
    COMPLETIONS: {"prompt": "hello", "max_tokens": 2},
    CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}
KNOWN = {f.name for f in FIELDS}


@FUZZ
@given(
    endpoint=st.sampled_from([CHAT, COMPLETIONS]),
    name=st.text(min_size=1, max_size=12).filter(lambda n: n not in KNOWN),
    value=JUNK,
)
def test_a_field_the_table_does_not_know_gets_a_400_naming_it(client, endpoint, name, value):
    response = post(client, ENDPOINT_PATHS[endpoint], {**OK_BODIES[endpoint], name: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == name and repr(name) in error["message"], error


@FUZZ
@given(endpoint=st.sampled_from([CHAT, COMPLETIONS]), data=st.data())
def test_any_value_of_a_known_field_is_answered_or_refused_naming_it(client, spec, endpoint, data):
    """A field the table knows, with anything in it: a 200, or a 4xx whose param names that field."""
    fields = sorted(endpoint_fields(endpoint))
    name = data.draw(st.sampled_from(fields))
    value = data.draw(JUNK)
    path = ENDPOINT_PATHS[endpoint]
    response = post(client, path, {**OK_BODIES[endpoint], name: value})
    check_answer(response, spec, path)
    if response.status_code != 200:  # (a prompt too long for the context is "messages/prompt")
        assert response.json()["error"]["param"] in (name, "messages/prompt"), response.text


def test_a_field_of_the_other_endpoint_is_refused_with_where_it_belongs(client):
    for endpoint, field in ((CHAT, "prompt"), (COMPLETIONS, "messages"), (COMPLETIONS, "max_completion_tokens")):
        response = post(client, ENDPOINT_PATHS[endpoint], {**OK_BODIES[endpoint], field: "x"})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
        other = CHAT if endpoint == COMPLETIONS else COMPLETIONS
        assert ENDPOINT_PATHS[other] in response.json()["error"]["message"]
