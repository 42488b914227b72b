"""The OpenAI-compatible server, over real HTTP on loopback, driven by the official `openai` client."""

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from loopspec.decoding import SamplingParams

openai = pytest.importorskip("openai", reason="needs openai: pip install 'loopspec[serve]'")
httpx = pytest.importorskip("httpx", reason="needs httpx: pip install 'loopspec[serve]'")
uvicorn = pytest.importorskip("uvicorn", reason="needs uvicorn: pip install 'loopspec[serve]'")

CONTEXT = 384


class ServerThread:
    """A uvicorn server for `app` on a free loopback port, in a background thread."""

    def __init__(self, app):
        from loopspec.runtime.server import http_server

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        self.url = f"http://127.0.0.1:{self.address[1]}"
        self.server = http_server(app, log_level="warning")  # what `loopspec serve` runs
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert match, f"{name} not in /metrics"
        return float(match.group(1))

    def wait_metric(self, name: str, value: float, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.metric(name) != value:
            assert time.monotonic() < deadline, f"{name} never reached {value} (now {self.metric(name)})"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def pipe(tiny_pair, tmp_path_factory):
    """The tiny pair, its target's matrices scaled up so that greedy text varies with the prompt
    (a random tiny target repeats one character; see test_batch.lively)."""
    import shutil

    from loopspec.runtime.pipeline import load_pipeline
    from loopspec.weights import read_safetensors, write_safetensors

    target_dir, drafter_dir = tiny_pair
    lively = tmp_path_factory.mktemp("lively") / "target"
    shutil.copytree(target_dir, lively)
    for f in lively.glob("*.safetensors"):
        write_safetensors({k: v * 8 if v.dim() == 2 else v for k, v in read_safetensors(f).items()}, f)
    return load_pipeline(str(lively), str(drafter_dir), max_context=CONTEXT, backend="torch")


def make_app(pipe, **kw):
    from loopspec.runtime.server import ServeConfig, create_app

    kw = {**dict(method="dloop", model_name="tiny", max_batch_size=4, max_body_bytes=16384, adaptive=False), **kw}
    decoding = {name: kw.pop(name) for name in ("method", "adaptive", "gate_threshold", "max_stages") if name in kw}
    return create_app(pipe, ServeConfig(settings=pipe.settings(decoding.pop("method"), **decoding), **kw))


@pytest.fixture(scope="module")
def server(pipe):
    with ServerThread(make_app(pipe)) as s:
        yield s


def alone(pipe, ids, n, method="ar", params=SamplingParams(), seed=0):
    """The same request decoded alone, in this process (no server, no batch)."""
    return pipe.run(ids, pipe.settings(method, adaptive=False), max_new_tokens=n, params=params, seed=seed)


PROMPTS = [
    "The quick brown fox",
    "Hello, world!",
    "def f(x): return",
    "1 2 3 4 5",
    "Once upon a time",
    "Lorem ipsum dolor",
    "abc",
    "zyx wvu",
]


def test_models_health_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    # the served engine is named: what its target computes with
    engine = {"backend": "torch", "precision": "fp32", "computes_with": "fp32 weights and activations"}
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["engine"] == engine == health.json()["engine"]
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    for name in (
        "loopspec_requests_total",
        "loopspec_generation_tokens_total",
        "loopspec_tokens_per_second",
        "loopspec_queue_depth",
        "loopspec_acceptance_length_bucket",
    ):
        assert name in metrics.text


def test_completions_and_chat_with_openai_client(server, pipe):
    client = server.client()
    prompt = PROMPTS[0]
    ref = alone(pipe, pipe.tokenizer.encode(prompt), 24)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    assert out.choices[0].text == pipe.decode(ref.tokens)
    assert out.choices[0].finish_reason == ref.stats.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(pipe.tokenizer.encode(prompt)), 24)
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"

    messages = [{"role": "user", "content": PROMPTS[1]}]
    chat_ref = alone(pipe, pipe.encode(PROMPTS[1]), 20)
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == pipe.decode(chat_ref.tokens)
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices


def test_raw_stream_is_server_sent_events_ending_with_done(server):
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_concurrent_streams_equal_requests_alone(server, pipe):
    """8 streaming clients at once on 4 batch rows (so some wait, and rows are reused mid-run)."""
    budgets = [40, 7, 33, 20, 12, 40, 25, 3]
    refs = [pipe.decode(alone(pipe, pipe.tokenizer.encode(p), n).tokens) for p, n in zip(PROMPTS, budgets)]
    assert len(set(refs)) == 8 and min(len(set(r)) for r in refs if len(r) > 10) >= 4  # varied text

    def one(i):
        stream = server.client().completions.create(
            model="tiny", prompt=PROMPTS[i], max_tokens=budgets[i], temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in stream)

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, range(8)))
    assert outs == refs


def test_sampling_seed_and_stop_strings(server, pipe):
    client = server.client()
    params = SamplingParams(temperature=0.8, top_p=0.9)
    ids = pipe.tokenizer.encode(PROMPTS[4])
    ref = pipe.decode(alone(pipe, ids, 30, method="dloop", params=params, seed=7).tokens)

    def sampled(seed):
        return (
            client.completions.create(
                model="tiny", prompt=PROMPTS[4], max_tokens=30, temperature=0.8, top_p=0.9, seed=seed
            )
            .choices[0]
            .text
        )

    assert sampled(7) == sampled(7) == ref
    assert sampled(8) != ref

    greedy = pipe.decode(alone(pipe, ids, 40).tokens)
    stop = greedy[10:12]
    out = client.completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=40, temperature=0, stop=[stop, "\x00"])
    assert out.choices[0].text == greedy[: greedy.index(stop)] and out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="tiny", prompt=PROMPTS[4], max_tokens=40, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    url = server.url + "/v1/completions"
    ok = {"model": "tiny", "prompt": "hello", "max_tokens": 3}

    def error(response, status, code=None, param=None):
        assert response.status_code == status, response.text
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        if code:
            assert err["code"] == code
        if param:
            assert err["param"] == param
        return err

    error(
        httpx.post(url, content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"}),
        400,
        code="invalid_json",
    )
    error(httpx.post(url, json=[1, 2]), 400)
    error(httpx.post(url, json={**ok, "model": "gpt-17"}), 404, code="model_not_found", param="model")
    error(httpx.post(url, json={**ok, "max_tokens": -5}), 400, param="max_tokens")
    error(httpx.post(url, json={**ok, "max_tokens": "5"}), 400, param="max_tokens")
    error(httpx.post(url, json={**ok, "prompt": "a" * (CONTEXT + 10)}), 400, code="context_length_exceeded")
    error(httpx.post(url, json={**ok, "prompt": "a" * 300, "max_tokens": 200}), 400, code="context_length_exceeded")
    error(httpx.post(url, json={**ok, "prompt": "a" * 20000}), 413, code="request_too_large")
    chunked = (part for part in [b'{"prompt": "', b"a" * 20000, b'"}'])  # no content-length: counted while read
    error(httpx.post(url, content=chunked), 413, code="request_too_large")
    error(httpx.post(url, json={**ok, "n": 2}), 400, param="n")
    error(httpx.post(url, json={**ok, "temperature": -1}), 400, param="temperature")
    error(httpx.post(url, json={**ok, "top_p": 0}), 400, param="top_p")
    error(httpx.post(url, json={**ok, "stop": ["a", "b", "c", "d", "e"]}), 400, param="stop")
    error(httpx.post(url, json={**ok, "prompt": ""}), 400, param="prompt")
    error(httpx.post(url, json={**ok, "prompt": [1, 2, 999]}), 400, param="prompt")
    chat = server.url + "/v1/chat/completions"
    error(httpx.post(chat, json={"model": "tiny", "messages": []}), 400, param="messages")
    error(httpx.post(chat, json={"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}), 400)
    error(httpx.get(server.url + "/v1/nothing"), 404)
    error(httpx.get(url), 405)
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model="tiny", prompt="hello", max_tokens=-1)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    # still serving, and the failures were counted
    assert httpx.post(url, json=ok).json()["usage"]["completion_tokens"] == 3
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.metric('loopspec_requests_total{outcome="invalid"}') >= 19


LONG = {"model": "tiny", "prompt": "x", "max_tokens": CONTEXT - 4, "temperature": 0}


@pytest.fixture(scope="module")
def slow_server(pipe):
    """One batch row, one queue slot, four always-open DLoop stages: a long request takes seconds."""
    with ServerThread(make_app(pipe, max_batch_size=1, max_queue=1, gate_threshold=-1e9, max_stages=4)) as s:
        yield s


def test_queue_full_is_429_and_a_disconnect_cancels(slow_server):
    s = slow_server
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True}) as running:
            lines = running.iter_lines()  # keep it: a dropped line iterator closes the connection
            first = next(line for line in lines if line)  # A holds the only row
            assert first.startswith("data: ")
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(
                    httpx.post, s.url + "/v1/completions", json={**LONG, "max_tokens": 4}, timeout=60
                )  # B waits in the queue
                s.wait_metric("loopspec_queue_depth", 1)
                full = httpx.post(s.url + "/v1/completions", json={**LONG, "max_tokens": 4})  # C: no room
                assert full.status_code == 429
                assert full.json()["error"]["type"] == "rate_limit_error"
                assert full.json()["error"]["code"] == "queue_full"
                cancelled = s.metric('loopspec_requests_total{outcome="cancelled"}')
                running.close()  # A's client goes away: its row is freed for B
                assert waiting.result().json()["usage"]["completion_tokens"] == 4
    s.wait_metric('loopspec_requests_total{outcome="cancelled"}', cancelled + 1)
    assert s.metric('loopspec_requests_total{outcome="rejected"}') == 1
    # a non-streaming client that gives up is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(s.url + "/v1/completions", json=LONG, timeout=0.5)
    s.wait_metric('loopspec_requests_total{outcome="cancelled"}', cancelled + 2)
    s.wait_metric("loopspec_running_requests", 0)
    assert httpx.post(s.url + "/v1/completions", json={**LONG, "max_tokens": 2}).status_code == 200


def test_request_timeout(pipe):
    with ServerThread(make_app(pipe, max_batch_size=2, request_timeout_s=0.3, gate_threshold=-1e9)) as s:
        late = httpx.post(s.url + "/v1/completions", json=LONG, timeout=30)
        assert late.status_code == 504 and "timed out" in late.json()["error"]["message"]
        with httpx.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line]
        assert json.loads(lines[-2][6:])["error"]["type"] == "timeout_error" and lines[-1] == "data: [DONE]"
        assert s.metric('loopspec_requests_total{outcome="timeout"}') == 2
        assert httpx.post(s.url + "/v1/completions", json={**LONG, "max_tokens": 2}).status_code == 200


def test_scheduler_isolates_a_failing_request(pipe):
    """A consumer that raises and an admission that fails end their own requests only."""
    from loopspec.runtime.decoder import Decoder
    from loopspec.runtime.scheduler import Request, Scheduler
    from loopspec.settings import DecodingSettings

    scheduler = Scheduler(
        Decoder(pipe.engine.with_rows(4), DecodingSettings("dflash", 6)),
        pipe.decode,
        stop_token_ids=pipe.stop_token_ids,
    ).start()
    try:
        events = {name: [] for name in ("good", "broken", "too_long")}
        done = threading.Event()

        def good(event):
            events["good"].append(event)
            if event.kind in ("done", "error"):
                done.set()

        def broken(event):
            raise RuntimeError("consumer failed")

        ids = pipe.tokenizer.encode("hello")
        scheduler.submit(Request(prompt_ids=ids, max_tokens=200, on_event=broken))
        scheduler.submit(
            Request(prompt_ids=list(range(3, 3 + CONTEXT)), max_tokens=5, on_event=events["too_long"].append)
        )
        scheduler.submit(Request(prompt_ids=ids, max_tokens=30, on_event=good))
        assert done.wait(30)
        assert events["good"][-1].kind == "done"
        assert "".join(e.text for e in events["good"][:-1]) == pipe.decode(alone(pipe, ids, 30).tokens)
        deadline = time.monotonic() + 10
        while not events["too_long"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert events["too_long"][0].kind == "error" and events["too_long"][0].status == 400
        assert scheduler.metrics.requests["cancelled"] == 1 and scheduler.alive
    finally:
        scheduler.close()
    assert not scheduler.alive


@pytest.mark.e2e
def test_default_pair_four_concurrent_greedy_streams_equal_alone():
    from loopspec.runtime.pipeline import load_pipeline

    pipe = load_pipeline("default", "default", max_context=1024, backend="torch")
    prompts = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Give me three tips for writing clean Python.",
        "Explain what a hash table is.",
    ]
    refs = [pipe.decode(alone(pipe, pipe.encode(p), 32).tokens) for p in prompts]
    with ServerThread(make_app(pipe, method="dloop", model_name=None, adaptive=True)) as s:
        name = s.client().models.list().data[0].id

        def one(prompt):
            stream = s.client().chat.completions.create(
                model=name, messages=[{"role": "user", "content": prompt}], max_tokens=32, temperature=0, stream=True
            )
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(one, prompts)) == refs


def test_serve_cli_rejects_bad_settings_with_one_line(tiny_pair, capsys):
    from loopspec.cli import main

    target_dir, drafter_dir = tiny_pair
    base = ["serve", "--target", str(target_dir), "--drafter", str(drafter_dir), "--max-context", "128"]
    for extra, message in (
        (["--method", "beam"], "unknown method"),
        (["--backend", "tpu"], "unknown backend"),
        (["--drafter", "none", "--method", "dloop"], "drafter"),
    ):
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1
    for extra in (["--max-batch-size", "0"], ["--request-timeout", "0"]):
        with pytest.raises(SystemExit) as e:  # argparse's own check, one line too
            main(base + extra)
        assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_inputs_that_once_broke_the_server_get_a_4xx(server):
    """Lone surrogates, JSON nested thousands deep and seeds beyond 64 bits: 400s naming the cause;
    a wrong method: 405 with Allow; the OpenAPI document describes the bodies and the errors."""
    url, chat = server.url + "/v1/completions", server.url + "/v1/chat/completions"
    as_json = {"content-type": "application/json"}

    def bad(response, param=None, code=None):
        assert response.status_code == 400, response.text
        err = response.json()["error"]
        assert (param is None or err["param"] == param) and (code is None or err["code"] == code), err
        return err["message"]

    surrogate = b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 3}'
    assert "surrogate" in bad(httpx.post(url, content=surrogate, headers=as_json), param="prompt")
    message = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 3}'
    assert "surrogate" in bad(httpx.post(chat, content=message, headers=as_json), param="messages")
    stop = b'{"model": "tiny", "prompt": "hi", "stop": "\\ud800", "max_tokens": 3}'
    bad(httpx.post(url, content=stop, headers=as_json), param="stop")
    deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert "nests deeper" in bad(httpx.post(url, content=deep, headers=as_json), code="invalid_json")
    shallow_but_deep = {
        "prompt": "hi",
        "stream_options": {
            "x": [
                [
                    [
                        [
                            [
                                [
                                    [
                                        [
                                            [
                                                [
                                                    [
                                                        [
                                                            [
                                                                [
                                                                    [
                                                                        [
                                                                            [
                                                                                [
                                                                                    [
                                                                                        [
                                                                                            [
                                                                                                [
                                                                                                    [
                                                                                                        [
                                                                                                            [
                                                                                                                [
                                                                                                                    [
                                                                                                                        [
                                                                                                                            [
                                                                                                                                [
                                                                                                                                    [
                                                                                                                                        [
                                                                                                                                            [
                                                                                                                                                [
                                                                                                                                                    [
                                                                                                                                                        [
                                                                                                                                                            [
                                                                                                                                                                [
                                                                                                                                                                    [
                                                                                                                                                                        [
                                                                                                                                                                            [
                                                                                                                                                                                [
                                                                                                                                                                                    [
                                                                                                                                                                                        [
                                                                                                                                                                                            [
                                                                                                                                                                                                [
                                                                                                                                                                                                    [
                                                                                                                                                                                                        [
                                                                                                                                                                                                            [
                                                                                                                                                                                                                [
                                                                                                                                                                                                                    [
                                                                                                                                                                                                                        [
                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                                                                                    1
                                                                                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                ]
                                                                                                                                                                                                            ]
                                                                                                                                                                                                        ]
                                                                                                                                                                                                    ]
                                                                                                                                                                                                ]
                                                                                                                                                                                            ]
                                                                                                                                                                                        ]
                                                                                                                                                                                    ]
                                                                                                                                                                                ]
                                                                                                                                                                            ]
                                                                                                                                                                        ]
                                                                                                                                                                    ]
                                                                                                                                                                ]
                                                                                                                                                            ]
                                                                                                                                                        ]
                                                                                                                                                    ]
                                                                                                                                                ]
                                                                                                                                            ]
                                                                                                                                        ]
                                                                                                                                    ]
                                                                                                                                ]
                                                                                                                            ]
                                                                                                                        ]
                                                                                                                    ]
                                                                                                                ]
                                                                                                            ]
                                                                                                        ]
                                                                                                    ]
                                                                                                ]
                                                                                            ]
                                                                                        ]
                                                                                    ]
                                                                                ]
                                                                            ]
                                                                        ]
                                                                    ]
                                                                ]
                                                            ]
                                                        ]
                                                    ]
                                                ]
                                            ]
                                        ]
                                    ]
                                ]
                            ]
                        ]
                    ]
                ]
            ]
        },
    }
    bad(httpx.post(url, json=shallow_but_deep), code="invalid_json")
    for seed in (2**70, -(2**70)):
        bad(httpx.post(url, json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "seed": seed}), param="seed")
    wrong = httpx.get(url)
    assert wrong.status_code == 405 and "POST" in wrong.headers["allow"]
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    spec = httpx.get(server.url + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        post = spec["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"]["required"]
        assert {"400", "404", "413", "429", "500"} <= set(post["responses"])
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert httpx.post(url, json={"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code == 200  # still serving


OK_COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
OK_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
# (endpoint, what the body adds or changes, the parameter the 400 must name)
REFUSED = [
    # options that would change the output and are not implemented
    ("completions", {"repetition_penalty": 1.2}, "repetition_penalty"),
    ("completions", {"min_p": 0.1}, "min_p"),
    ("completions", {"ignore_eos": True}, "ignore_eos"),
    ("completions", {"stop_token_ids": [5]}, "stop_token_ids"),
    ("completions", {"min_tokens": 2}, "min_tokens"),
    ("chat", {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("chat", {"function_call": "auto"}, "function_call"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),  # without tools (tool calls: tests/test_tool_calls.py)
    ("completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (
        "chat",
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function"}]},
            ]
        },
        "messages",
    ),
    ("completions", {"logprobs": 0}, "logprobs"),  # completions: a count; 0 still returns the token's own
    ("chat", {"logprobs": True}, "logprobs"),
    # the right value in the wrong JSON type (Python's == would let each one through)
    ("completions", {"n": True}, "n"),
    ("completions", {"best_of": 1.0}, "best_of"),
    ("completions", {"echo": 0}, "echo"),
    ("chat", {"logprobs": 0}, "logprobs"),
    ("chat", {"top_logprobs": False}, "top_logprobs"),
    ("completions", {"presence_penalty": False}, "presence_penalty"),
    ("completions", {"frequency_penalty": False}, "frequency_penalty"),
    ("completions", {"repetition_penalty": True}, "repetition_penalty"),
    ("completions", {"stream_options": False}, "stream_options"),
    ("completions", {"stream_options": []}, "stream_options"),
    ("completions", {"stream_options": 0}, "stream_options"),
    ("chat", {"stream": True, "stream_options": {"include_usage": "no"}}, "stream_options"),
    (
        "chat",
        {"stream": True, "stream_options": {"include_usage": True, "include_usage_stats": True}},
        "stream_options",
    ),
    ("chat", {"stream": True, "stream_options": {"continuous_usage_stats": 0}}, "stream_options"),
    ("chat", {"max_completion_tokens": 3, "max_tokens": "ten"}, "max_tokens"),
    ("completions", {"user": 42}, "user"),
    ("chat", {"user": {"id": "u1"}}, "user"),
    ("completions", {"suffix": 0}, "suffix"),
    ("completions", {"logit_bias": []}, "logit_bias"),
]


@pytest.mark.parametrize("endpoint, change, param", REFUSED, ids=[f"{e}-{json.dumps(c)[:40]}" for e, c, _ in REFUSED])
def test_unsupported_or_mistyped_options_get_a_400_naming_them(server, endpoint, change, param):
    body = {**(OK_CHAT if endpoint == "chat" else OK_COMPLETION), **change}
    response = httpx.post(f"{server.url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


@pytest.mark.parametrize(
    "change",
    [
        {"n": 1, "best_of": 1, "echo": False, "top_logprobs": 0},
        {
            "presence_penalty": 0.0,
            "frequency_penalty": 0,
            "repetition_penalty": 1.0,
            "min_p": 0,
            "min_tokens": 0,
            "ignore_eos": False,
            "stop_token_ids": [],
        },
        {
            "logprobs": False,
            "tools": [],
            "tool_choice": None,
            "user": "u1",
            "stream_options": None,
            "max_tokens": 3,
            "max_completion_tokens": 3,
        },
    ],
)
def test_the_neutral_value_of_each_unsupported_option_is_accepted(server, change):
    """The values that leave the output unchanged are no reason to refuse a request."""
    response = httpx.post(server.url + "/v1/chat/completions", json={**OK_CHAT, **change})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
def test_a_body_that_is_not_utf8_json_gets_a_400(server, encoding):
    raw = json.dumps(OK_COMPLETION).encode(encoding)
    assert json.loads(raw) == OK_COMPLETION  # Python's json alone would take it (it detects UTF-16/32)
    response = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json", response.text
    assert "UTF-8" in response.json()["error"]["message"]


def test_a_client_that_leaves_mid_body_is_a_cancellation_not_an_error(server, caplog):
    """The server logs it at info (no traceback) and counts it as cancelled, not as an error."""
    import logging

    errors = server.metric('loopspec_requests_total{outcome="error"}')
    cancelled = server.metric('loopspec_requests_total{outcome="cancelled"}')
    host, port = server.url.removeprefix("http://").split(":")
    with caplog.at_level(logging.INFO, logger="loopspec.server"):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 200\r\n\r\n" + b'{"prompt": "hel'
            )  # 15 of the 200 bytes promised
        server.wait_metric('loopspec_requests_total{outcome="cancelled"}', cancelled + 1)
    assert server.metric('loopspec_requests_total{outcome="error"}') == errors
    records = [r for r in caplog.records if r.name == "loopspec.server"]
    assert any(
        "before sending all of its request body" in r.getMessage() and r.levelno == logging.INFO for r in records
    ), records
    assert not any(r.levelno >= logging.WARNING or r.exc_info for r in records), records
    assert httpx.post(server.url + "/v1/completions", json=OK_COMPLETION).status_code == 200


# Byte-level text: token i of a reply is byte i of "😀😀..." (4 bytes each), the way a byte-level BPE
# splits an emoji. Every odd prefix of the reply decodes with a trailing U+FFFD; the whole reply has none.
EMOJI = "\N{GRINNING FACE}"


def emoji_bytes(tokens: list[int]) -> str:
    return (EMOJI.encode() * len(tokens))[: len(tokens)].decode("utf-8", errors="replace")


def test_a_replacement_character_stop_does_not_cut_a_reply_at_a_partial_character(pipe):
    """Through the scheduler: a stop string "\\ufffd" never matches the U+FFFD of a character whose
    bytes are still arriving; the reply is the whole text, ended by its length."""
    from loopspec.runtime.decoder import Decoder
    from loopspec.runtime.scheduler import Request, Scheduler

    scheduler = Scheduler(
        Decoder(pipe.engine.with_rows(2), pipe.settings("dflash", adaptive=False)),
        emoji_bytes,
        stop_token_ids=frozenset(),
    ).start()  # no end-of-sequence: exactly max_tokens tokens
    try:
        events, done = [], threading.Event()

        def collect(event):
            events.append(event)
            if event.kind in ("done", "error"):
                done.set()

        scheduler.submit(
            Request(prompt_ids=pipe.tokenizer.encode("hello"), max_tokens=8, on_event=collect, stop=("\ufffd",))
        )
        assert done.wait(30)
    finally:
        scheduler.close()
    assert "".join(e.text for e in events if e.kind == "text") == EMOJI * 2
    assert events[-1].kind == "done" and events[-1].finish_reason == "length"


def test_stop_strings_are_matched_in_decoded_text_only():
    """TextTail against an independent oracle: whatever the chunking of a byte-level reply, the text
    released is the decoded text up to the first occurrence of the stop string (all of it when
    there is none), and nothing else."""
    pytest.importorskip("hypothesis", reason="needs hypothesis (the dev extra): pip install 'loopspec[dev]'")
    from hypothesis import given, settings, strategies as st

    from loopspec.runtime.scheduler import TextTail

    alphabet = st.sampled_from(["a", "b", " ", "é", "\u20ac", EMOJI, "\ufffd"])  # 1- to 4-byte characters

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(
        st.lists(alphabet, max_size=12).map("".join),
        st.lists(alphabet, min_size=1, max_size=3).map("".join),
        st.lists(st.integers(1, 5), max_size=40),
    )
    def check(text, stop, cuts):
        data = text.encode()
        tail = TextTail(lambda tokens: bytes(tokens).decode("utf-8", errors="replace"), (stop,))
        released, stopped, fed = [], False, 0
        for size in cuts + [len(data)]:
            if fed >= len(data) or stopped:
                break
            out, stopped = tail.feed(list(data[fed : fed + size]))
            released.append(out)
            fed += size
        if not stopped:
            out, stopped = tail.flush()
            released.append(out)
        expected = text[: text.index(stop)] if stop in text else text
        assert ("".join(released), stopped) == (expected, stop in text)

    check()


# --------------------------------------------------------------------------------------------------
# Every request field: honoured, refused unless neutral, or ignored, as runtime/openai_api.py's table says

from loopspec.runtime.openai_api import (  # noqa: E402
    CHAT,
    COMPLETIONS,
    ENDPOINT_PATHS,
    FIELDS,
    HONOURED,
    NEUTRAL_ONLY,
)

FIELD_BASE = {
    COMPLETIONS: {"model": "tiny", "prompt": PROMPTS[4], "max_tokens": 8, "temperature": 0},
    CHAT: {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[4]}], "max_tokens": 8, "temperature": 0},
}
# an honoured field: a value it takes, and one it refuses naming itself
HONOURED_CASES = {
    "model": ("tiny", "gpt-17"),
    "prompt": ("abc", ""),
    "messages": ([{"role": "user", "content": "abc"}], []),
    "max_tokens": (2, 0),
    "max_completion_tokens": (2, "2"),
    "temperature": (0.5, 3),
    "top_p": (0.5, 0),
    "top_k": (5, -1),
    "seed": (3, 2**70),
    "stop": ("zz", [""]),
    "stream": (True, "yes"),
    "stream_options": ({"include_usage": True}, {"continuous_usage_stats": True}),
    "user": ("u1", 42),
    "response_format": ({"type": "json_object"}, {"type": "yaml"}),
    "guided_json": ({"type": "object"}, 3),
    "guided_regex": ("[a-z ]+", "a("),
    "guided_choice": (["yes", "no"], []),
    # (this template renders no tools: the values that need none; the rest is tests/test_tool_calls.py's)
    "tools": ([], [{"type": "function"}]),
    "tool_choice": ("none", "always"),
    "parallel_tool_calls": (False, "yes"),
}
IGNORED_EXAMPLES = {"string": ("anything", 7), "boolean": (True, "yes"), "object": ({"k": "v"}, ["k"])}


def other_values(neutral) -> list:
    """Values that are not `neutral` in JSON terms, the ones of another JSON type that Python's ==
    would take for it included."""
    if neutral is None:
        return [True, "text", {"type": "object"}]
    if isinstance(neutral, bool):
        return [not neutral, int(neutral)]
    if isinstance(neutral, int):
        return [neutral + 1, float(neutral), bool(neutral)]
    if isinstance(neutral, float):
        return [neutral + 0.5, bool(neutral)]
    if isinstance(neutral, str):
        return [neutral + "x"]
    if isinstance(neutral, list):
        return [neutral + [1]]
    return [{**neutral, "extra": 1}]


FIELD_CASES = [(field, endpoint) for field in FIELDS for endpoint in field.endpoints]


@pytest.fixture(scope="module")
def http():
    """One client for many small requests (each httpx.post would build its own, SSL context included)."""
    with httpx.Client(timeout=30) as client:
        yield client


@pytest.mark.parametrize("field, endpoint", FIELD_CASES, ids=[f"{e}-{f.name}" for f, e in FIELD_CASES])
def test_every_field_is_honoured_or_refused_naming_it_as_its_row_says(server, http, field, endpoint):
    """An honoured field takes a good value and refuses a bad one; a neutral-only field refuses every
    other value (of another JSON type too); an ignored field refuses a value of another JSON type. What
    they accept is checked below, all at once per endpoint (a decode each)."""
    assert set(HONOURED_CASES) == {f.name for f in FIELDS if f.use == HONOURED}

    def send(value):
        return http.post(server.url + ENDPOINT_PATHS[endpoint], json={**FIELD_BASE[endpoint], field.name: value})

    def refused(value, status=400):
        response = send(value)
        assert response.status_code == status, (value, response.text)
        error = response.json()["error"]
        assert error["param"] == field.name and field.name in error["message"], (value, error)

    if field.use == HONOURED:
        good, bad = HONOURED_CASES[field.name]
        assert send(good).status_code == 200
        refused(bad, 404 if field.name == "model" else 400)
    elif field.use == NEUTRAL_ONLY:
        for value in other_values(field.neutral):
            refused(value)
    else:
        refused(IGNORED_EXAMPLES[field.schema["type"]][1])


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_neutral_and_ignored_fields_leave_the_reply_as_it_is(server, http, endpoint):
    """The reply to a request is the same with every neutral-only field null, with each at its
    neutral value, and with every ignored field set: none of them changes the output."""
    fields = [f for f in FIELDS if endpoint in f.endpoints and f.use != HONOURED]
    bodies = {
        "none": {},
        "null": {f.name: None for f in fields},
        "neutral": {f.name: f.neutral for f in fields if f.use == NEUTRAL_ONLY},
        "ignored": {f.name: IGNORED_EXAMPLES[f.schema["type"]][0] for f in fields if f.use != NEUTRAL_ONLY},
    }
    replies = {}
    for name, extra in bodies.items():
        response = http.post(server.url + ENDPOINT_PATHS[endpoint], json={**FIELD_BASE[endpoint], **extra})
        assert response.status_code == 200, (name, response.text)
        replies[name] = response.json()["choices"][0]
    assert replies["none"]["finish_reason"] == "length"
    assert replies["null"] == replies["neutral"] == replies["ignored"] == replies["none"]


@pytest.mark.parametrize(
    "endpoint, field, value",
    [
        (CHAT, "guided_grammar", 'root ::= "a"+'),
        (CHAT, "structured_outputs", {"regex": "[0-9]+"}),
        (CHAT, "guided_decoding_backend", "xgrammar"),
        (COMPLETIONS, "guided_whitespace_pattern", " *"),
        (COMPLETIONS, "grammar", 'root ::= "a"+'),
        (COMPLETIONS, "json_schema", {"type": "object"}),
        (CHAT, "chat_template_kwargs", {"enable_thinking": False}),
        (CHAT, "skip_special_tokens", True),
        (COMPLETIONS, "include_stop_str_in_output", True),
        (COMPLETIONS, "typical_p", 0.9),
        (COMPLETIONS, "mirostat", 2),
        (COMPLETIONS, "max_new_tokens", 16),
    ],
)
def test_constrained_and_output_changing_extensions_are_refused(server, http, endpoint, field, value):
    """What vLLM and llama.cpp clients send to constrain or change the output that this server does not
    do is refused, never ignored (response_format and guided_json / regex / choice are honoured:
    tests/test_constrained.py)."""
    response = http.post(server.url + ENDPOINT_PATHS[endpoint], json={**FIELD_BASE[endpoint], field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text


def test_the_docs_list_every_field_as_the_table_does():
    """docs/serving.md's table of request fields is FIELDS, row for row."""
    from pathlib import Path

    from loopspec.runtime.openai_api import BOTH

    def row(field) -> str:
        where = "both" if field.endpoints == BOTH else ENDPOINT_PATHS[field.endpoints[0]]
        if field.use == HONOURED:
            use = "honoured"
        elif field.use == NEUTRAL_ONLY:
            neutral = "" if field.neutral is None else f" or `{json.dumps(field.neutral)}`"
            use = f"refused unless null{neutral}: {field.note}"
        else:
            use = f"ignored (any {field.schema['type']}): {field.note}"
        return f"| `{field.name}` | {where} | {use} |"

    docs = (Path(__file__).parents[1] / "docs" / "serving.md").read_text()
    table = docs[docs.index("| field | endpoint | handling |") :].split("\n\n")[0].splitlines()[2:]
    assert table == [row(f) for f in FIELDS]


# --------------------------------------------------------------------------------------------------
# Connections: incomplete requests time out, idle connections cannot lock anyone out


HALF_HEADER = b"GET /health HTTP/1.1\r\nHost: x\r\n"  # the blank line that ends a header never comes


def read_until_closed(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the server sends until it closes the connection (a timeout if it never does)."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)


def metric_at_least(s: ServerThread, name: str, value: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while s.metric(name) < value:
        assert time.monotonic() < deadline, f"{name} never reached {value} (now {s.metric(name)})"
        time.sleep(0.05)


def test_health_is_answered_beside_2000_idle_connections(pipe):
    """2000 connections that send half a header or nothing are all held open (none closed, none
    evicted), and /health still answers at once."""
    from loopspec.runtime.connections import raise_open_file_limit

    open_files = raise_open_file_limit()
    if open_files is not None and open_files < 4500:  # both ends of every connection are in this process
        pytest.skip(f"needs 4500 open files, the hard limit allows {open_files}")
    with ServerThread(make_app(pipe, read_timeout_s=60)) as s:
        idle = []
        try:
            for i in range(2000):
                idle.append(socket.create_connection(s.address))
                if i % 2:
                    idle[-1].sendall(HALF_HEADER)
            metric_at_least(s, "loopspec_open_connections", 2000)
            health = httpx.get(s.url + "/health", timeout=5)
            assert health.status_code == 200 and health.json()["status"] == "ok"
            for reason in ("evicted", "read_timeout", "refused"):
                assert s.metric(f'loopspec_connections_closed_total{{reason="{reason}"}}') == 0
            assert still_open(idle[0]) and still_open(idle[-1])
        finally:
            for sock in idle:
                sock.close()


def test_at_the_connection_limit_the_connection_waiting_longest_makes_room(pipe):
    with ServerThread(make_app(pipe, max_connections=8)) as s:
        idle = [socket.create_connection(s.address) for _ in range(8)]
        try:
            for sock in idle:
                sock.sendall(HALF_HEADER)
            # accepted in the order they connected, after the 8: the limit is reached, idle[0] waited longest
            assert httpx.get(s.url + "/health", timeout=5).status_code == 200
            assert read_until_closed(idle[0]) == b""  # closed without an answer
            assert all(still_open(sock) for sock in idle[1:])
            assert s.metric('loopspec_connections_closed_total{reason="evicted"}') >= 1
        finally:
            for sock in idle:
                sock.close()


def test_when_every_connection_is_busy_a_new_one_gets_503(pipe):
    with ServerThread(make_app(pipe, max_batch_size=1, gate_threshold=-1e9, max_stages=4, max_connections=1)) as s:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True}) as running:
                lines = running.iter_lines()
                assert next(line for line in lines if line).startswith("data: ")  # its connection is busy
                refused = httpx.get(s.url + "/health", timeout=5)
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "too_many_connections"
        deadline = time.monotonic() + 10  # the stream's connection closes: room again
        while (health := httpx.get(s.url + "/health", timeout=5)).status_code != 200:
            assert time.monotonic() < deadline, health.text
            time.sleep(0.05)
        assert s.metric('loopspec_connections_closed_total{reason="refused"}') >= 1


def test_requests_that_do_not_arrive_whole_in_time_are_closed(pipe, caplog):
    """With a 0.3 s read timeout: nothing sent, half a header, a header trickling in byte by byte and a
    body cut short are closed (408 where part of a request came); a request that arrived whole is
    answered however long it waits, and a keep-alive connection idle after its response is closed
    quietly."""
    import logging

    app = make_app(pipe, read_timeout_s=0.3, max_batch_size=1, gate_threshold=-1e9, max_stages=4)
    with ServerThread(app) as s, httpx.Client(timeout=30) as http, ThreadPoolExecutor(1) as pool:
        invalid = s.metric('loopspec_requests_total{outcome="invalid"}')
        cancelled = s.metric('loopspec_requests_total{outcome="cancelled"}')
        silent, half, short_body, kept_alive = (socket.create_connection(s.address) for _ in range(4))
        half.sendall(HALF_HEADER)
        short_body.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200\r\n\r\n" + b'{"prompt": "hel'
        )
        kept_alive.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        with caplog.at_level(logging.INFO, logger="loopspec.server"):
            with http.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True}) as running:
                lines = running.iter_lines()
                assert next(line for line in lines if line).startswith("data: ")  # it holds the only row
                queued = pool.submit(httpx.post, s.url + "/v1/completions", json={**LONG, "max_tokens": 2}, timeout=30)
                s.wait_metric("loopspec_queue_depth", 1)  # arrived whole; now it waits for the row
                trickle = socket.create_connection(s.address)  # a byte of header every 0.1 s: never whole
                for byte in HALF_HEADER[:8]:
                    try:
                        trickle.sendall(bytes([byte]))
                    except OSError:  # closed by now
                        break
                    time.sleep(0.1)
                trickle.setblocking(False)  # answered already: its time ran from the first byte, not the last
                assert trickle.recv(65536).startswith(b"HTTP/1.1 408 ")
                assert not queued.done()  # waited past the read timeout, its connection still open
            assert queued.result().json()["usage"]["completion_tokens"] == 2  # answered once the row was free
            assert read_until_closed(silent) == b""
            for sock in (half, short_body):
                answer = read_until_closed(sock)
                assert answer.startswith(b"HTTP/1.1 408 "), answer
                assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
            answer = read_until_closed(kept_alive)  # one response, then closed without a 408
            assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1") == 1, answer
            for sock in (silent, half, short_body, kept_alive, trickle):
                sock.close()
            metric_at_least(s, 'loopspec_requests_total{outcome="invalid"}', invalid + 1)  # the cut body
        assert s.metric('loopspec_requests_total{outcome="cancelled"}') == cancelled + 1  # only the closed stream
        assert s.metric('loopspec_connections_closed_total{reason="read_timeout"}') >= 5
        timeouts = [r for r in caplog.records if "did not arrive whole" in r.getMessage()]
        assert len(timeouts) <= 1, timeouts  # five of a kind within 10 s: one line
        assert not any("before sending all of its request body" in r.getMessage() for r in caplog.records)


def test_repeated_warnings_are_logged_once_per_interval_with_a_count(caplog):
    import logging

    from loopspec.runtime.connections import RepeatedLogFilter

    logger = logging.getLogger("loopspec.test_repeats")
    repeats = RepeatedLogFilter(interval_s=0.3)
    logger.addFilter(repeats)
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            for i in range(1000):
                logger.warning("accept failed: %s", "Too many open files")
            logger.warning("another kind")
            logger.info("info passes untouched")
            logger.info("info passes untouched")
            time.sleep(0.35)
            logger.warning("accept failed: %s", "Too many open files")
        messages = [r.getMessage() for r in caplog.records]
        assert messages[:4] == [
            "accept failed: Too many open files",
            "another kind",
            "info passes untouched",
            "info passes untouched",
        ]
        assert len(messages) == 5 and messages[4].startswith("accept failed: Too many open files [999 more like this")
    finally:
        logger.removeFilter(repeats)


def test_the_open_file_limit_is_raised_to_the_hard_limit(pipe):
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 2048:
        pytest.skip(f"hard open-file limit {hard}")
    from loopspec.runtime.server import http_server

    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        http_server(make_app(pipe))
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_serve_refuses_connection_settings_that_cannot_apply(tiny_pair, capsys):
    from loopspec.cli import main

    target_dir, drafter_dir = tiny_pair
    base = ["serve", "--target", str(target_dir), "--drafter", str(drafter_dir), "--max-context", "128"]
    assert main(base + ["--max-connections", str(1 << 40)]) == 2  # beyond any open-file limit
    err = capsys.readouterr().err.strip()
    assert "--max-connections" in err and "open files" in err and len(err.splitlines()) == 1
    for flag, value in (("--read-timeout", "0"), ("--read-timeout", "nan"), ("--max-connections", "0")):
        with pytest.raises(SystemExit) as e:
            main(base + [flag, value])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and flag in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "field, value",
    [
        ("request_timeout_s", float("inf")),
        ("request_timeout_s", 0),
        ("read_timeout_s", float("nan")),
        ("max_batch_size", 0),
        ("max_queue", 2.5),
        ("prefill_chunk", 0),
        ("max_stop_strings", -1),
    ],
)
def test_a_serve_config_that_cannot_serve_is_refused_in_one_line(field, value):
    """The Python API refuses what the serve flags refuse, naming the field, before any app exists."""
    from loopspec.errors import LoopspecError
    from loopspec.runtime.server import ServeConfig
    from loopspec.settings import DecodingSettings

    with pytest.raises(LoopspecError, match=rf"^ServeConfig\.{field} must be"):
        ServeConfig(settings=DecodingSettings(), **{field: value})


def test_metrics_count_every_verification_beside_tau(server):
    """Tokens per verification over every round (plain ones included) can be read beside τ: the
    verifications of a finished request and the tokens they committed (all but the prefill's first)."""

    def counters():
        text = httpx.get(server.url + "/metrics").text
        values = {}
        for line in text.splitlines():
            for name in (
                'loopspec_verifications_total{kind="drafting"}',
                'loopspec_verifications_total{kind="plain"}',
                "loopspec_verified_tokens_total",
            ):
                if line.startswith(name + " "):
                    values[name] = float(line.split()[-1])
        return values

    before = counters()
    out = server.client().completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=24, temperature=0)
    assert out.usage.completion_tokens == 24
    after = counters()
    delta = {k: after[k] - before[k] for k in after}
    assert delta["loopspec_verified_tokens_total"] == 23
    verifications = (
        delta['loopspec_verifications_total{kind="drafting"}'] + delta['loopspec_verifications_total{kind="plain"}']
    )
    assert 1 <= verifications <= 23
