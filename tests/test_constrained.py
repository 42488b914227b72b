"""Structured output with speculation: every method commits what constrained plain decoding (`ar` with
the same grammar masks) commits, token for token, greedy and seeded; every output is valid under its
grammar by an independent validator; rows with different grammars (or none) are batch-invariant; and
a constraint that masks with the wrong node's grammar state is caught."""

import json
import re

import pytest

pytest.importorskip("xgrammar", reason="needs xgrammar: pip install 'loopspec[grammar]'")
jsonschema = pytest.importorskip("jsonschema", reason="needs jsonschema (the dev extra): pip install 'loopspec[dev]'")

from loopspec.decoding import SamplingParams  # noqa: E402
from loopspec.engines.backends import torch_engine  # noqa: E402
from loopspec.errors import LoopspecError  # noqa: E402
from loopspec.model.dflash import DrafterConfig  # noqa: E402
from loopspec.runtime.constraint import Constraint, GrammarError, Grammars, GrammarSpec  # noqa: E402
from loopspec.runtime.decoder import Decoder, decode_all, generate  # noqa: E402
from loopspec.settings import DecodingSettings as Method  # noqa: E402
from loopspec.weights import load_target_dir, load_tokenizer  # noqa: E402

from conftest import accepted_drafts, agreeing_drafter, lively, save_tiny_target, save_tiny_tokenizer  # noqa: E402

STOP = frozenset({2})
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog", "owl"]},
    },
    "required": ["name", "ok", "kind"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}( [a-z]{2,5}){1,4}\."
CHOICES = ("alpha", "beta gamma", "delta")
SPECS = {
    "schema": GrammarSpec("json_schema", SCHEMA),
    "regex": GrammarSpec("regex", REGEX),
    "choice": GrammarSpec("choice", CHOICES),
}
PROMPTS = {"schema": [5, 40, 41, 9, 77], "regex": [60, 61, 12, 33, 70, 71, 72], "choice": [90, 14, 3]}
METHODS = {
    "ar": Method(),
    "dflash": Method("dflash", block_size=6),
    "dloop": Method("dloop", block_size=6, max_stages=3, gate_threshold=-1e9),
    "tree": Method("dflash", block_size=6, tree_budget=8, suffix=True),
    "suffix": Method("suffix", block_size=6),
}
NEW = 48
GREEDY, SEEDED = SamplingParams(), SamplingParams(temperature=0.7)


def valid(kind: str, text: str) -> bool:
    """The output checked by an independent validator."""
    if kind == "schema":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A lively tiny llama with a character tokenizer, its grammars, and a drafter trained to draft
    what constrained plain decoding continues the prompts with (so drafts are accepted)."""
    root = tmp_path_factory.mktemp("constrained")
    target_dir = save_tiny_target("llama", root / "target", seed=5)
    save_tiny_tokenizer(target_dir)
    target = lively(load_target_dir(target_dir))
    grammars = Grammars(load_tokenizer(target_dir), target.cfg.vocab_size, STOP)
    plain = torch_engine(target, None, 256)
    texts = []
    for kind, prompt in PROMPTS.items():
        for params in (GREEDY, SEEDED):
            out = generate(
                plain,
                prompt,
                max_new_tokens=NEW,
                params=params,
                stop_token_ids=STOP,
                constraint=grammars.constraint(SPECS[kind]),
            ).tokens
            texts.append((prompt, out))
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=6, mask_token_id=127)
    drafter = agreeing_drafter(target, list(PROMPTS.values()), cfg, also_texts=texts, steps=120)
    return torch_engine(target, drafter, 256, max_rows=4), grammars, load_tokenizer(target_dir)


def text_of(tokenizer, tokens):
    return tokenizer.decode([t for t in tokens if t not in STOP])


def run(engine, grammars, kind, method, params, constraint_class=None):
    constraint = grammars.constraint(SPECS[kind])
    if constraint_class is not None:  # a planted bug: the same matcher behind another class
        constraint = constraint_class(constraint.matcher, constraint.vocab_size, constraint.stop)
    return generate(
        engine.with_rows(1),
        PROMPTS[kind],
        METHODS[method],
        max_new_tokens=NEW,
        params=params,
        seed=3,
        stop_token_ids=STOP,
        constraint=constraint,
    )


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_speculation_commits_constrained_ar(setup, params):
    engine, grammars, tokenizer = setup
    drafted = {}
    for kind in SPECS:
        reference = run(engine, grammars, kind, "ar", params)
        assert reference.stats.finish_reason == "stop", (kind, text_of(tokenizer, reference.tokens))
        assert valid(kind, text_of(tokenizer, reference.tokens)), text_of(tokenizer, reference.tokens)
        for method in METHODS:
            result = run(engine, grammars, kind, method, params)
            assert result.tokens == reference.tokens, (kind, method)
            drafted[method] = drafted.get(method, 0) + accepted_drafts([result])
    for method in ("dflash", "dloop", "tree"):  # the drafter's drafts were accepted, under every grammar
        assert drafted[method] >= 10, drafted
    assert drafted["ar"] == 0


def test_drafts_the_grammar_rejects_are_pruned(setup):
    """Every node a constrained row verifies is one the grammar allows after its parent's path."""
    engine, grammars, _ = setup
    constraint = grammars.constraint(SPECS["regex"])
    verified = []
    original = constraint.prune

    def record(tree):
        pruned = original(tree)
        verified.append((tree, pruned))
        return pruned

    constraint.prune = record
    generate(
        engine.with_rows(1),
        PROMPTS["regex"],
        METHODS["tree"],
        max_new_tokens=NEW,
        stop_token_ids=STOP,
        constraint=constraint,
    )
    assert sum(len(t) - len(p) for t, p in verified) > 0  # some drafts were outside the grammar
    checker = grammars.constraint(SPECS["regex"])
    for tree, pruned in verified[:1]:  # the first round: the matcher at the prompt's end, anchor included
        checker.commit(pruned.tokens[0])
        for node in range(1, len(pruned)):
            path = pruned.path(node)
            for n in path[1:]:
                assert checker.allowed()[pruned.tokens[n]]
                checker.commit(pruned.tokens[n])
            checker.matcher.rollback(len(path) - 1)
            checker._now = None


def test_batch_invariance_across_grammars(setup):
    """Rows with different grammars, and one without, decoded together commit what each commits alone."""
    engine, grammars, _ = setup
    kinds = ["schema", None, "regex", "choice"]
    for method in ("dflash", "tree"):
        for params in (GREEDY, SEEDED):

            def request(i, kind):
                prompt = PROMPTS[kind] if kind else [50, 51, 52]
                return dict(
                    key=i,
                    prompt_ids=prompt,
                    max_new_tokens=NEW if kind else 20,
                    params=params,
                    seed=10 + i,
                    stop_token_ids=STOP,
                    constraint=grammars.constraint(SPECS[kind]) if kind else None,
                )

            together = decode_all(
                Decoder(engine.with_rows(4), METHODS[method]), [request(i, k) for i, k in enumerate(kinds)]
            )
            for i, kind in enumerate(kinds):
                alone = decode_all(Decoder(engine.with_rows(1), METHODS[method]), [request(i, kind)])
                assert together[i].tokens == alone[i].tokens, (method, kind)


class ParentState(Constraint):
    """Planted bug: each node masked with its parent's grammar state (one token behind)."""

    def masks(self, tree):
        m = super().masks(tree)
        return m[[max(p, 0) for p in tree.parents]]


class RootState(Constraint):
    """Planted bug: every node masked with the anchor's grammar state."""

    def masks(self, tree):
        m = super().masks(tree)
        return m[:1].expand(len(tree), -1)


@pytest.mark.parametrize("bug", [ParentState, RootState])
def test_a_wrong_state_mask_is_caught(setup, bug):
    """The identity and validity checks above fail for a constraint that masks a node with another
    node's state: some output differs from constrained ar or breaks its grammar."""
    engine, grammars, tokenizer = setup
    caught = 0
    for kind in SPECS:
        reference = run(engine, grammars, kind, "ar", GREEDY)
        for method in ("dflash", "tree"):
            try:
                result = run(engine, grammars, kind, method, GREEDY, constraint_class=bug)
            except LoopspecError:  # the committed token broke the grammar
                caught += 1
                continue
            caught += result.tokens != reference.tokens or not valid(kind, text_of(tokenizer, result.tokens))
    assert caught > 0


def test_bad_grammars_are_refused_naming_their_source():
    for kind, value, param in (
        ("regex", "a(b", "guided_regex"),
        ("json_schema", {"type": "objectx"}, "guided_json"),
        ("json_schema", {"type": "integer", "minimum": "x"}, "response_format"),
        ("choice", [], "guided_choice"),
        ("choice", ["a", 3], "guided_choice"),
        ("json_schema", [1], "--json-schema"),
        ("regex", "", "--regex"),
    ):
        with pytest.raises(GrammarError) as e:
            GrammarSpec(kind, value, param)
        assert e.value.param == param and str(e.value).startswith(param) and "\n" not in str(e.value)


def test_a_grammar_no_token_can_begin_is_refused(setup):
    """A regex over a character the tokenizer has no token for: refused when compiled, not at the first token."""
    _, grammars, _ = setup
    with pytest.raises(GrammarError, match="no token of this model's vocabulary can begin it") as e:
        grammars.constraint(GrammarSpec("regex", "\x1f", "guided_regex"))
    assert e.value.param == "guided_regex"


def test_drafter_sampling_with_a_grammar_is_refused(setup):
    engine, grammars, _ = setup
    settings = Method("dflash", block_size=6, draft_sampling="drafter")
    with pytest.raises(LoopspecError, match="draft-sampling walk"):
        Decoder(engine.with_rows(1), settings).admit(
            0, [5, 6], max_new_tokens=4, params=SEEDED, constraint=grammars.constraint(SPECS["choice"])
        )


# --------------------------------------------------------------------------------------------------
# The server: response_format and guided_* on both endpoints


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    pytest.importorskip("fastapi", reason="needs fastapi: pip install 'loopspec[serve]'")
    from test_server import CONTEXT, ServerThread, make_app

    from loopspec.runtime.pipeline import load_pipeline

    target_dir, drafter_dir = tiny_pair
    with ServerThread(
        make_app(load_pipeline(str(target_dir), str(drafter_dir), max_context=CONTEXT, backend="torch"))
    ) as s:
        yield s


def post(server, path, body):
    import httpx

    return httpx.post(server.url + path, json=body, timeout=120)


@pytest.mark.parametrize(
    "path, base",
    [
        ("/v1/completions", {"prompt": "abc"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}]}),
    ],
)
def test_server_answers_valid_structured_output(server, path, base):
    chat = "chat" in path
    for extra, kind in (
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}}, "schema"),
        ({"guided_json": SCHEMA}, "schema"),
        ({"guided_json": json.dumps(SCHEMA)}, "schema"),
        ({"guided_regex": REGEX}, "regex"),
        ({"guided_choice": list(CHOICES)}, "choice"),
        ({"response_format": {"type": "json_object"}, "max_tokens": 8}, None),
    ):
        response = post(server, path, {**base, "max_tokens": 64, "temperature": 0, **extra})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        if kind is not None:
            assert choice["finish_reason"] == "stop" and valid(kind, text), (extra, text)
        else:  # any JSON object, cut at 8 tokens: what there is opens one
            assert text.startswith("{"), text


@pytest.mark.parametrize(
    "path, base",
    [
        ("/v1/completions", {"prompt": "abc"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}]}),
    ],
)
def test_server_refuses_bad_grammars_naming_the_field(server, path, base):
    for field, value in (
        ("guided_json", {"type": "objectx"}),
        ("guided_json", "{not json"),
        ("guided_regex", "a(b"),
        ("guided_choice", []),
        ("guided_choice", ["a", 1]),
        ("guided_regex", "\\x1f"),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": "x"}}},
        ),
        ("response_format", {"type": "yaml"}),
    ):
        response = post(server, path, {**base, field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, (field, response.text)
    both = post(server, path, {**base, "guided_regex": "a+", "guided_choice": ["a"]})
    assert both.status_code == 400 and both.json()["error"]["param"] == "guided_choice", both.text
    text = post(server, path, {**base, "response_format": {"type": "text"}, "max_tokens": 2})
    assert text.status_code == 200, text.text


# --------------------------------------------------------------------------------------------------
# The command line: loopspec generate --json-schema / --json-object / --regex / --choice


def test_cli_generates_structured_output(tiny_pair, capsys, tmp_path):
    from loopspec.cli import main

    target_dir, drafter_dir = tiny_pair
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    base = [
        "generate",
        "--prompt",
        "abc",
        "--backend",
        "torch",
        "--target",
        str(target_dir),
        "--drafter",
        str(drafter_dir),
        "--max-new-tokens",
        "64",
        "--method",
        "dflash",
    ]
    for flags, kind in (
        (["--json-schema", str(schema)], "schema"),
        (["--json-schema", json.dumps(SCHEMA)], "schema"),
        (["--regex", REGEX], "regex"),
        (["--choice", CHOICES[0], "--choice", CHOICES[1]], "choice"),
    ):
        assert main(base + flags) == 0
        captured = capsys.readouterr()
        assert valid(kind, captured.out.rstrip("\n")), (flags, captured.out)
        assert "output:" in captured.err


def test_cli_refuses_bad_grammar_flags_in_one_line(capsys, tmp_path):
    from loopspec.cli import main

    base = ["generate", "--prompt", "abc", "--target", str(tmp_path / "never-read")]
    for flags, words in (
        (["--regex", "a("], "--regex"),
        (["--json-schema", "{nope"], "--json-schema"),
        (["--json-schema", str(tmp_path / "missing.json")], "--json-schema"),
        (["--json-schema", '{"type": "objectx"}'], "--json-schema"),
        (["--regex", "a+", "--choice", "a"], "not allowed with"),
        (["--choice", ""], "--choice"),
    ):
        with pytest.raises(SystemExit) as e:
            raise SystemExit(main(base + flags))
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("loopspec: error:") and words in err and err.count("\n") == 1, err


@pytest.mark.e2e
def test_default_model_writes_schema_valid_json_as_constrained_ar():
    """SmolLM2-135M-Instruct with its shipped drafter: dloop under a JSON schema commits what
    constrained ar commits, and the text is valid under the schema."""
    from loopspec.runtime.pipeline import load_pipeline

    pipe = load_pipeline("default", "default", backend="torch")
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    ids = pipe.encode("Describe a person as JSON with a name and an age.")
    spec = GrammarSpec("json_schema", schema)
    ar = pipe.run(ids, pipe.settings("ar"), max_new_tokens=48, grammar=spec)
    dloop = pipe.run(ids, pipe.settings("dloop"), max_new_tokens=48, grammar=spec)
    assert dloop.tokens == ar.tokens and ar.stats.finish_reason == "stop"
    jsonschema.validate(json.loads(pipe.decode(ar.tokens)), schema)


def test_the_verification_budget_keeps_constrained_output(setup):
    """Greedy under each grammar with the verification budget cutting trees: constrained `ar`'s tokens."""
    from loopspec.runtime.budget import VerifyBudget
    from loopspec.runtime.step_costs import StepCosts

    engine, grammars, _ = setup
    # a table on which a wide step costs little more than a plain one: the budget drafts
    costs = StepCosts("torch fp32", 64, (1,), (1, 2, 4, 8), ((0.010, 0.0102, 0.0104, 0.0108),), (0.0002,))
    method = Method("dflash", block_size=6, tree_budget=8, suffix=True, adaptive=True)
    accepted = 0
    for kind in SPECS:
        reference = run(engine, grammars, kind, "ar", GREEDY)
        result = generate(
            engine.with_rows(1),
            PROMPTS[kind],
            method,
            max_new_tokens=NEW,
            stop_token_ids=STOP,
            constraint=grammars.constraint(SPECS[kind]),
            pacing=VerifyBudget(costs, method, 5),
        )
        assert result.tokens == reference.tokens, kind
        accepted += accepted_drafts([result])
    assert accepted >= 10
