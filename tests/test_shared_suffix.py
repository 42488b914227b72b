"""The suffix library shared across requests (loopspec/suffix_library.py, --shared-suffix): a later
request is proposed what an earlier one of its scope wrote; the output stays plain decoding's, a row's
tokens do not depend on its batch, text never crosses API keys, and the server scopes by key and `user`."""

import copy

import pytest
import torch

from loopspec.decoding import SamplingParams
from loopspec.engines.backends import torch_engine
from loopspec.errors import LoopspecError
from loopspec.model.dflash import Drafter
from loopspec.runtime.decoder import Decoder, decode_all, generate
from loopspec.settings import DecodingSettings as Method, resolve_settings
from loopspec.suffix_library import SuffixLibrary
from loopspec.tree import SuffixIndex
from loopspec.weights import load_target_dir

from conftest import accepted_drafts, lively

NEW = 40


def prompt(seed: int, n: int = 10) -> list[int]:
    return torch.randint(3, 120, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# P: a prompt whose output the request's own index never proposes anything for (its text does not
# repeat itself within 40 tokens on this target); EDIT: P with its first token changed (same task,
# small edit); Q: another task
P, Q = prompt(4), prompt(7)
EDIT = [5] + P[1:]
METHODS = {
    "suffix": Method("suffix", block_size=6, shared_suffix=4),
    "dflash+suffix": Method("dflash", block_size=5, suffix=True, shared_suffix=4),
    "dloop+first2": Method("dloop", block_size=5, max_stages=2, gate_threshold=-1e9, suffix_first=2, shared_suffix=4),
}


@pytest.fixture(scope="module")
def engine(tiny_pair):
    """A lively tiny llama (its greedy text follows the context) with a random drafter, 4 rows."""
    target_dir, drafter_dir = tiny_pair
    return torch_engine(lively(load_target_dir(target_dir)), Drafter.load(drafter_dir).float().eval(), 256, max_rows=4)


def one_by_one(decoder, prompts, scopes=None, **kw) -> list:
    """Each prompt decoded alone through `decoder`, in order (its library growing) → their Rows."""
    rows = []
    for i, p in enumerate(prompts):
        scope = None if scopes is None else scopes[i]
        rows.append(decode_all(decoder, [dict(key=i, prompt_ids=p, max_new_tokens=NEW, scope=scope, **kw)])[i])
    return rows


# --------------------------------------------------------------------------------------------------
# The library itself


def test_the_library_keeps_the_last_n_outputs_first_in_first_out():
    library = SuffixLibrary(2)
    library.add("a", [9, 9, 9, 9, 9, 9, 7, 8], [1, 2, 3])  # led in by the prompt's last 6 tokens
    assert library.scopes["a"].outputs[0] == [9, 9, 9, 9, 7, 8, 1, 2, 3]
    assert library.match("a", [0, 7, 8]) == (2, 0, 5) and library.continuation("a", 0, 5, 9) == [1, 2, 3]
    library.add("b", [], [4, 5, 6])
    library.add("a", [], [1, 2, 4])  # "1 2" now proposes 4 (the latest occurrence)
    assert len(library) == 2 and set(library.scopes) == {"a", "b"}
    assert library.match("a", [7, 8]) == (0, -1, -1)  # the first output is gone, and its n-grams
    n, oid, end = library.match("a", [1, 2])
    assert n == 2 and library.continuation("a", oid, end, 4) == [4]
    for i in range(5):
        library.add("c", [], [10 + i, 20 + i, 30 + i])
    assert len(library) == 2 and set(library.scopes) == {"c"}  # a scope whose outputs all went is dropped
    assert all(oid in library.scopes["c"].outputs for oid, _ in library.scopes["c"].last_end.values())
    # each output of 3 holds one n-gram followed by a token ("x y" before z): those of the gone ones went
    assert sum(len(book.last_end) for book in library.scopes.values()) == 2
    library.add("c", [1], [])  # nothing written: nothing filed
    assert len(library) == 2


def test_the_longer_match_proposes_and_the_request_s_own_text_wins_a_tie():
    library = SuffixLibrary(4)
    library.add("s", [], [1, 2, 3, 40, 41])
    own_tie = SuffixIndex([2, 3, 50, 51, 2, 3], shared=library.view("s"))  # both match "2 3"
    assert own_tie.match_length() == 2 and own_tie.continuation(2) == [50, 51]
    longer = SuffixIndex([7, 2, 3, 50, 1, 2, 3], shared=library.view("s"))  # the library matches "1 2 3"
    assert longer.match_length() == 3 and longer.continuation(5) == [40, 41]  # as far as the output goes
    assert SuffixIndex([1, 2, 3], shared=library.view("other")).continuation(3) == []  # another scope: nothing


# --------------------------------------------------------------------------------------------------
# Decoding with it


def test_a_later_request_is_proposed_an_earlier_request_s_output(engine):
    """The second request of P repeats the first's output: with the library its suffix index proposes
    it from the first round (the lead-in is P's tail); without, its own text never repeats."""
    on = one_by_one(Decoder(engine, METHODS["suffix"]), [P, P])
    off = one_by_one(Decoder(engine, Method("suffix", block_size=6)), [P, P])
    assert on[1].tokens == on[0].tokens == off[1].tokens
    assert off[0].stats.suffix_tokens == off[1].stats.suffix_tokens == on[0].stats.suffix_tokens == 0
    assert on[1].stats.suffix_tokens >= NEW * 3 // 4
    assert len(on[1].stats.accepted_per_round) < len(off[1].stats.accepted_per_round) / 3


@pytest.mark.parametrize("name", list(METHODS))
def test_greedy_output_is_plain_decoding_s_with_the_library_on(engine, name):
    """Repeated tasks with small edits, one decoder: every output is what `ar` commits alone, and the
    library's proposals are accepted (measured: 63 to 69 suffix tokens of 200, the random drafter's
    drafts almost never; the floor is 40)."""
    prompts = [P, EDIT, P, Q, EDIT]
    rows = one_by_one(Decoder(engine, METHODS[name]), prompts)
    assert [r.tokens for r in rows] == [generate(engine, p, max_new_tokens=NEW).tokens for p in prompts]
    assert sum(r.stats.suffix_tokens for r in rows) >= 40 and accepted_drafts(rows) >= 40


def test_seeded_sampling_walks_plain_decoding_s_tokens_with_the_library_on(engine):
    """At T > 0 the walk commits the target's own sample in plain decoding's order, whatever was
    proposed: a seeded request returns what `ar` returns with its seed."""
    params = SamplingParams(temperature=0.8, top_p=0.95)
    rows = one_by_one(Decoder(engine, METHODS["suffix"]), [P, P, EDIT], params=params, seed=11)
    assert [r.tokens for r in rows] == [
        generate(engine, p, max_new_tokens=NEW, params=params, seed=11).tokens for p in (P, P, EDIT)
    ]


def test_a_row_commits_the_same_tokens_in_any_batch(engine):
    """With the library in one state (two finished requests), rows decoded together commit what each
    commits alone from the same state."""
    warm = Decoder(engine, METHODS["dflash+suffix"])
    one_by_one(warm, [P, Q])
    prompts, budgets = [P, EDIT, Q, prompt(9)], [NEW, 17, 33, NEW]

    def fresh():
        decoder = Decoder(engine, METHODS["dflash+suffix"])
        decoder.library = copy.deepcopy(warm.library)
        return decoder

    requests = [dict(key=i, prompt_ids=p, max_new_tokens=n) for i, (p, n) in enumerate(zip(prompts, budgets))]
    together = decode_all(fresh(), requests)
    alone = [decode_all(fresh(), [r])[r["key"]] for r in requests]
    assert [together[i].tokens for i in range(len(prompts))] == [r.tokens for r in alone]
    assert sum(r.stats.suffix_tokens for r in alone) >= NEW  # the library proposed, and was accepted


def test_no_proposal_crosses_scopes(engine):
    """Tenant B's request of P after tenant A's: no proposal from A's text — its rounds are those of
    a run without the library, node for node; A's own next request is proposed its output."""
    rows = one_by_one(Decoder(engine, METHODS["dflash+suffix"]), [P, P, P], scopes=["A", "B", "A"])
    plain = one_by_one(Decoder(engine, Method("dflash", block_size=5, suffix=True)), [P])
    assert rows[1].stats.nodes_per_round == plain[0].stats.nodes_per_round
    assert rows[1].stats.suffix_tokens == plain[0].stats.suffix_tokens == 0
    assert rows[2].stats.suffix_tokens >= NEW // 2


# --------------------------------------------------------------------------------------------------
# Settings and the command line


def test_shared_suffix_is_refused_in_one_line_where_it_cannot_apply(capsys):
    from loopspec.cli import main
    from loopspec.model.dflash import DrafterConfig

    cfg = DrafterConfig(
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        vocab_size=16,
        num_target_layers=4,
        target_layer_ids=[2],
        mask_token_id=3,
        block_size=8,
    )
    assert resolve_settings("suffix", None, shared_suffix=16).shared_suffix == 16
    assert resolve_settings("dflash", cfg, suffix=True, shared_suffix=16).describe().endswith("library of 16 outputs")
    assert resolve_settings("dflash", cfg, suffix=True).shared_suffix == 0
    with pytest.raises(LoopspecError, match="^--shared-suffix 16 feeds the suffix index, which dflash does not"):
        resolve_settings("dflash", cfg, suffix=False, shared_suffix=16)
    with pytest.raises(LoopspecError, match="^--shared-suffix does not apply to method ar"):
        resolve_settings("ar", None, shared_suffix=16)
    with pytest.raises(LoopspecError, match="^the shared suffix library keeps >= 0 outputs"):
        Method("suffix", block_size=6, shared_suffix=-1)
    for argv, needle in (
        (["generate", "--prompt", "x", "--shared-suffix", "-1"], "--shared-suffix must be in [0, 1048576], got -1"),
        (["serve", "--shared-suffix", "many"], "--shared-suffix must be an integer"),
        (["generate", "--prompt", "x", "--method", "suffix", "--shared-suffix", "4"], "generate decodes one request"),
        (
            ["bench", "--prompts", "mbpp", "--methods", "suffix", "--shared-suffix", "4"],
            "bench decodes each prompt alone",
        ),
        (["serve", "--api-key", ""], "an API key must be a non-empty string"),
        (["serve", "--api-key", "two words"], "printable ASCII without spaces"),
    ):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and err.startswith("loopspec: error: ") and needle in err, err


def library_bytes_per_token(outputs: int, length: int) -> float:
    """What a library holding `outputs` outputs of `length` new token ids each costs a token it holds
    (tracemalloc: its index, its lists and the token ids themselves)."""
    import random
    import tracemalloc

    rng, library = random.Random(outputs), SuffixLibrary(outputs)
    tracemalloc.start()
    try:
        for i in range(outputs):
            library.add(
                i % 3,
                [rng.randrange(300, 150_000) for _ in range(6)],
                [rng.randrange(300, 150_000) for _ in range(length)],
            )
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return held / (outputs * (length + 6))


def serve_refusal(argv, capsys) -> str:
    """The one line `loopspec serve ARGV` exits 2 with (its target never loads: the line says so when
    every check before it passes)."""
    import socket

    from loopspec.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    try:
        code = main(["serve", "--target", "/never-loaded", "--port", port, *argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("loopspec: error: "), err
    return err


def shared_suffix_is_bounded(capsys) -> None:
    from loopspec.runtime.server import ServeConfig
    from loopspec.settings import SHARED_SUFFIX_BYTES_PER_TOKEN, SHARED_SUFFIX_MAX_TOKENS, KNOBS
    from loopspec.tree import SUFFIX_MAX_MATCH

    limit = ServeConfig(settings=Method("ar")).max_tokens_limit  # serve's default --max-tokens-limit
    at_default = SHARED_SUFFIX_MAX_TOKENS // (limit + SUFFIX_MAX_MATCH)
    help_text = KNOBS["shared_suffix"].help
    assert f"N <= {at_default} at the default limit of {limit}" in help_text and f"+ {SUFFIX_MAX_MATCH})" in help_text
    assert "--shared-suffix must be in [0, 1048576], got 1000000000000" in serve_refusal(
        ["--shared-suffix", "1000000000000"], capsys
    )
    assert "--shared-suffix must be in [0, 1048576], got -1" in serve_refusal(["--shared-suffix", "-1"], capsys)
    over = serve_refusal(["--method", "suffix", "--shared-suffix", str(at_default + 1)], capsys)
    assert f"use --shared-suffix {at_default} or less, or a lower --max-tokens-limit" in over, over
    # the bound is the memory: at the bound, or with shorter outputs, the next refusal is the target's
    for argv in (["--shared-suffix", str(at_default)], ["--shared-suffix", "100000", "--max-tokens-limit", "64"]):
        assert "/never-loaded" in serve_refusal(["--method", "suffix", *argv], capsys)
    with pytest.raises(LoopspecError, match=f"use --shared-suffix {at_default} or less"):
        ServeConfig(settings=Method("suffix", block_size=6, shared_suffix=at_default + 1))
    with pytest.raises(LoopspecError, match="^the shared suffix library keeps >= 0 outputs .* at most 1048576"):
        Method("suffix", block_size=6, shared_suffix=2**20 + 1)
    # and the memory a token costs is what the bound assumes
    assert max(library_bytes_per_token(3, 1024), library_bytes_per_token(40, 64)) <= SHARED_SUFFIX_BYTES_PER_TOKEN


def test_shared_suffix_is_bounded_by_the_memory_its_library_may_take(capsys):
    shared_suffix_is_bounded(capsys)


def test_a_server_that_takes_any_library_size_is_caught(capsys, monkeypatch):
    """The planted bug: no bound at serve (the CLI's and ServeConfig's check gone)."""
    import loopspec.runtime.server
    import loopspec.suffix_library

    monkeypatch.setattr(loopspec.suffix_library, "check_library_size", lambda outputs, max_tokens: None)
    monkeypatch.setattr(loopspec.runtime.server, "check_library_size", lambda outputs, max_tokens: None)
    with pytest.raises(AssertionError):
        shared_suffix_is_bounded(capsys)


# --------------------------------------------------------------------------------------------------
# The server: API keys and scopes, over real HTTP


KEYS = ("key-a-0123", "key-b-4567")
TEXT = "def f(x): return x + 1\n"


@pytest.fixture(scope="module")
def pipe(tiny_pair, tmp_path_factory):
    """The tiny pair through a pipeline, its target lively (its greedy text follows the prompt)."""
    import shutil

    from loopspec.runtime.pipeline import load_pipeline
    from loopspec.weights import read_safetensors, write_safetensors

    target_dir, drafter_dir = tiny_pair
    target = tmp_path_factory.mktemp("lively") / "target"
    shutil.copytree(target_dir, target)
    for f in target.glob("*.safetensors"):
        write_safetensors({k: v * 8 if v.dim() == 2 else v for k, v in read_safetensors(f).items()}, f)
    return load_pipeline(str(target), str(drafter_dir), max_context=256, backend="torch")


class Served:
    """A server with the shared library on (`api_keys` as given), counting the library's proposals."""

    def __init__(self, pipe, api_keys=KEYS):
        from loopspec.runtime.server import ServeConfig, create_app
        from test_server import ServerThread

        settings = pipe.settings("suffix", block_size=6, adaptive=False, shared_suffix=8)
        app = create_app(pipe, ServeConfig(settings=settings, model_name="tiny", max_batch_size=2, api_keys=api_keys))
        self.thread = ServerThread(app)
        library = app.state.server.scheduler.decoder.library
        self.proposals, continuation = 0, library.continuation

        def counted(*args):  # a continuation is asked for only where the library matched longer
            self.proposals += 1
            return continuation(*args)

        library.continuation = counted

    def __enter__(self):
        self.thread.__enter__()
        return self

    def __exit__(self, *exc):
        self.thread.__exit__(*exc)

    def post(self, key=None, user=None, path="/v1/completions", **body):
        import httpx

        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        body = {"model": "tiny", "prompt": TEXT, "max_tokens": 24, "temperature": 0, "user": user} | body
        return httpx.post(
            self.thread.url + path, json={k: v for k, v in body.items() if v is not None}, headers=headers, timeout=60
        )

    def proposed(self, key=None, user=None) -> tuple[int, str]:
        """One request's library proposals and its text (requests go one at a time)."""
        before = self.proposals
        response = self.post(key, user)
        assert response.status_code == 200, response.text
        return self.proposals - before, response.json()["choices"][0]["text"]


def test_without_a_valid_key_a_v1_request_gets_401(pipe):
    pytest.importorskip("uvicorn", reason="needs uvicorn: pip install 'loopspec[serve]'")
    import httpx

    with Served(pipe) as served:
        url = served.thread.url
        for headers in (
            {},
            {"Authorization": "Bearer nope"},
            {"Authorization": KEYS[0]},
            {"Authorization": f"Basic {KEYS[0]}"},
            {"Authorization": f"Bearer {KEYS[0]}x"},
        ):
            for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
                response = httpx.request(method, url + path, headers=headers, json={"prompt": "x"})
                assert response.status_code == 401, (headers, path, response.text)
                assert response.json()["error"]["code"] == "invalid_api_key"
                assert response.headers["www-authenticate"] == "Bearer"
                assert KEYS[0] not in response.text and KEYS[1] not in response.text
        assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
        for key in KEYS:
            assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
            assert served.post(key).status_code == 200
        assert (
            served.post(
                KEYS[0], path="/v1/chat/completions", prompt=None, messages=[{"role": "user", "content": "hi"}]
            ).status_code
            == 200
        )


def cross_key_proposals(pipe) -> int:
    """Key A's request, then key B's of the same text: the library's proposals to B's."""
    with Served(pipe) as served:
        served.proposed(KEYS[0])
        return served.proposed(KEYS[1])[0]


def test_text_never_crosses_keys_and_user_opts_into_a_scope_of_its_own(pipe):
    pytest.importorskip("uvicorn", reason="needs uvicorn: pip install 'loopspec[serve]'")
    assert cross_key_proposals(pipe) == 0
    with Served(pipe) as served:
        first, text = served.proposed(KEYS[0])
        again, same = served.proposed(KEYS[0])  # the key's user-less requests share
        assert first == 0 and again > 0 and same == text  # proposals change what is verified, not the text
        assert served.proposed(KEYS[1])[0] == 0  # another key: nothing of key A's
        assert served.proposed(KEYS[0], user="u1")[0] == 0  # a user's own scope starts empty ...
        assert served.proposed(KEYS[0], user="u1")[0] > 0  # ... and is shared by that user's requests
        assert served.proposed(KEYS[0], user="u2")[0] == 0
        assert served.proposed(KEYS[1], user="u1")[0] == 0  # the same user under another key is another scope


def test_a_scope_that_ignores_the_key_is_caught(pipe, monkeypatch):
    """The planted bug: a scope made of the user alone lets key B's request be proposed key A's text,
    and the isolation check above sees it."""
    pytest.importorskip("uvicorn", reason="needs uvicorn: pip install 'loopspec[serve]'")
    from loopspec.runtime import server

    monkeypatch.setattr(server, "request_scope", lambda key, user: (None, user or None))
    assert cross_key_proposals(pipe) > 0


def test_without_keys_every_user_less_request_shares_one_scope(pipe):
    pytest.importorskip("uvicorn", reason="needs uvicorn: pip install 'loopspec[serve]'")
    with Served(pipe, api_keys=()) as served:
        assert served.proposed()[0] == 0 and served.proposed()[0] > 0
        assert served.proposed(user="u1")[0] == 0
        assert served.proposed(key="anything")[0] > 0  # no keys configured: a header is no key
