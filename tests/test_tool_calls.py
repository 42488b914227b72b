"""Tool calls on /v1/chat/completions (runtime/tool_calls.py): the call formats of Qwen's and Llama
3.1's chat templates, read from small real templates written after the public ones; calls parsed from
the committed text whatever pieces it came in; a call that breaks its schema left as text; under
tool_choice "required" or a named function, speculation commits what grammar-masked plain decoding
commits, token for token; and the server's answers, streamed and not, read by the OpenAI client.

The target is a tiny random Llama trained in-test until it answers the weather prompts below with a
call (so `auto` has a call to parse), and the drafter is trained to agree with it (so drafts are
accepted: their count has a floor)."""

import json
import random

import pytest
import torch

pytest.importorskip("xgrammar", reason="needs xgrammar: pip install 'loopspec[grammar]'")
pytest.importorskip("jsonschema", reason="needs jsonschema: pip install 'loopspec[serve]'")

from loopspec.decoding import SamplingParams  # noqa: E402
from loopspec.errors import LoopspecError  # noqa: E402
from loopspec.model.dflash import DrafterConfig  # noqa: E402
from loopspec.prompts import chat_ids  # noqa: E402
from loopspec.runtime.constraint import Constraint, Grammars  # noqa: E402
from loopspec.runtime.decoder import generate  # noqa: E402
from loopspec.runtime.tool_calls import (  # noqa: E402
    HERMES,
    LLAMA3_JSON,
    Call,
    ToolCallParser,
    ToolError,
    call_format,
    chat_answer,
    for_template,
    forced_grammar,
    history_message,
    tool_request,
)
from loopspec.settings import DecodingSettings as Method  # noqa: E402
from loopspec.weights import load_target_dir, load_tokenizer  # noqa: E402

from conftest import accepted_drafts, agreeing_drafter, tiny_hf_config  # noqa: E402

# --------------------------------------------------------------------------------------------------
# Tokenizers and chat templates, after the public Qwen2.5 and Llama 3.1 ones (shorter prose; the
# same structure where calls are concerned)

QWEN_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are helpful.' }}{%- endif %}
{{- '\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}' }}
{{- '\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- set plain = message.role == 'user' or (message.role == 'system' and not loop.first) %}
{%- if plain or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA_TEMPLATE = """
{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0].role == 'system' %}
{%- set system_message = messages[0].content | trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- if tools is not none %}
{%- set first_user_message = messages[0].content | trim %}{%- set messages = messages[1:] %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
{{- 'Do not use variables.\\n\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
{{- first_user_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- if not message.tool_calls | length == 1 %}
{{- raise_exception('This model only supports single tool-calls at once!') }}
{%- endif %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{{- '{"name": "' + tool_call.name + '", ' }}{{- '"parameters": ' }}{{- tool_call.arguments | tojson }}{{- '}' }}
{{- '<|eot_id|>' }}
{%- elif message.role == 'tool' or message.role == 'ipython' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

# Qwen3-Coder / Qwen3.5: parameters as XML inside <tool_call> (a format this server does not parse)
XML_TEMPLATE = (
    "{%- if tools %}{{- '<tools>' }}{%- endif %}{%- for m in messages %}{{- m.content }}{%- endfor %}"
    "{{- '<tool_call>\\n<function=name>\\n<parameter=key>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>' }}"
)
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

FAMILIES = {
    # added tokens as the families' tokenizers have them: Qwen's <tool_call> markers are not special
    # (they are text the grammar may write); the turn markers are
    "qwen": dict(
        template=QWEN_TEMPLATE,
        text_tokens=["<tool_call>", "</tool_call>"],
        special_tokens=["<|im_start|>", "<|im_end|>"],
        eos="<|im_end|>",
        bos=None,
    ),
    "llama": dict(
        template=LLAMA_TEMPLATE,
        text_tokens=[],
        special_tokens=[
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|python_tag|>",
        ],
        eos="<|eot_id|>",
        bos="<|begin_of_text|>",
    ),
}


def save_chat_tokenizer(directory, family: str, template: str | None = None) -> None:
    """A character-level tokenizer (printable characters and the newline) with the family's added
    tokens and a chat template (the family's, unless `template`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>"] + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["text_tokens"]])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special_tokens"]])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token=spec["bos"] or "<s>", eos_token=spec["eos"]
    )
    fast.chat_template = template if template is not None else spec["template"]
    fast.save_pretrained(str(directory))
    assert len(fast) < 127  # the drafter's mask token is 127


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}}},
}
# the same function, its city a number: the call the target learnt for the first prompt breaks it
WEATHER_BY_ID = json.loads(json.dumps(WEATHER).replace('"type": "string", "maxLength": 6', '"type": "integer"'))
TOOLS = [WEATHER, TIME]
CONTEXT = 768

CALL_PARIS = HERMES.text("weather", {"city": "Paris"})
CALL_OSLO = HERMES.text("weather", {"city": "Oslo"})
# (messages, tools) → what the target learns to answer
LESSONS = [
    ([{"role": "user", "content": "Paris?"}], TOOLS, CALL_PARIS),
    ([{"role": "user", "content": "Oslo, say so?"}], TOOLS, "Checking.\n" + CALL_OSLO),
    ([{"role": "user", "content": "Paris?"}], [WEATHER_BY_ID, TIME], CALL_PARIS),
]


def save_taught_target(directory, tokenizer, lessons, steps: int = 250, seed: int = 0):
    """A tiny random Llama trained until its greedy answer to each lesson's rendered prompt is the
    lesson's answer (then its end of turn): a real model that writes calls of its own."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_hf_config("llama", num_layers=4)  # (a qwen2 config would load the tokenizer as Qwen2's)
    config.max_position_embeddings = CONTEXT  # a rendered history with tools is long in characters
    model = AutoModelForCausalLM.from_config(config).train()
    eos = tokenizer.eos_token_id
    data = []
    for messages, tools, answer in lessons:
        prompt = chat_ids(tokenizer, messages, tools)
        data.append((torch.tensor(prompt + tokenizer.encode(answer, add_special_tokens=False) + [eos]), len(prompt)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = 0.0
        for tokens, prompt_length in data:
            logits = model(input_ids=tokens[None]).logits[0, prompt_length - 1 : -1]
            loss = loss + torch.nn.functional.cross_entropy(logits, tokens[prompt_length:])
        loss.backward()
        optimizer.step()
        if float(loss.detach()) < 0.01 * len(data):  # (each answer is then its greedy one: checked below)
            break
    model.eval().save_pretrained(str(directory))


def request_for(body: dict, form=HERMES):
    """A request's tools checked, with the call format `form` → (ToolRequest, its forced grammar)."""
    from dataclasses import replace

    request = replace(tool_request(body), format=form)
    return request, forced_grammar(request)


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


# --------------------------------------------------------------------------------------------------
# Parsing: what a reply's text holds, per format


def parsed(text: str, body: dict, form=HERMES, parser_class=ToolCallParser) -> tuple[str, list[Call]]:
    """(content, calls) of a whole reply."""
    parser = parser_class(request_for(body, form)[0])
    pieces = parser.feed(text) + parser.finish()
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, Call)]


AUTO = {"tools": TOOLS}
ONE_AT_A_TIME = {"tools": TOOLS, "parallel_tool_calls": False}
PARIS_ARGS = '{"city": "Paris"}'
# (format, request body, reply text, content, calls as (name, arguments))
CASES = [
    (HERMES, AUTO, CALL_PARIS, "", [("weather", PARIS_ARGS)]),
    (HERMES, AUTO, "Checking.\n" + CALL_OSLO + "\n", "Checking.", [("weather", '{"city": "Oslo"}')]),
    (HERMES, AUTO, "  \n" + CALL_PARIS + "\nDone  ", "Done  ", [("weather", PARIS_ARGS)]),
    (
        HERMES,
        AUTO,
        CALL_PARIS + "\n" + HERMES.text("time", {"tz": "utc"}),
        "",
        [("weather", PARIS_ARGS), ("time", '{"tz": "utc"}')],
    ),
    # the markers without the template's newlines, and other whitespace in the JSON: still a call
    (
        HERMES,
        AUTO,
        '<tool_call>{"name":"weather","arguments":{"city":"Rome"}}</tool_call>',
        "",
        [("weather", '{"city": "Rome"}')],
    ),
    # parallel_tool_calls false: the second call is text
    (
        HERMES,
        ONE_AT_A_TIME,
        CALL_PARIS + "\n" + CALL_OSLO,
        CALL_OSLO,
        [("weather", PARIS_ARGS)],
    ),
    # not calls: text as written
    (HERMES, AUTO, "Hello <tool", "Hello <tool", []),
    (HERMES, AUTO, "a <tool_call> b", "a <tool_call> b", []),  # never closed (cut by max_tokens)
    (HERMES, AUTO, HERMES.text("weather", {"city": "Marseille"}), HERMES.text("weather", {"city": "Marseille"}), []),
    (HERMES, AUTO, HERMES.text("weather", {"town": "Paris"}), HERMES.text("weather", {"town": "Paris"}), []),
    (HERMES, AUTO, HERMES.text("time", {"tz": "pst"}), HERMES.text("time", {"tz": "pst"}), []),
    (HERMES, AUTO, HERMES.text("stocks", {}), HERMES.text("stocks", {}), []),
    (HERMES, AUTO, '<tool_call>\n{"name": "time", "arguments": {}, "x": 1}\n</tool_call>', None, []),
    (HERMES, AUTO, '<tool_call>\n{"name": "time", "arguments": {"tz": NaN}}\n</tool_call>', None, []),
    (HERMES, AUTO, '<tool_call>\n{"name": "time", "arguments": {"tz": "utc"}\n</tool_call>', None, []),
    (
        HERMES,
        {"tools": TOOLS, "tool_choice": named("time")},
        CALL_PARIS,
        CALL_PARIS,
        [],
    ),  # a named choice allows that function only
    # Llama 3.1: the reply is the call
    (LLAMA3_JSON, AUTO, LLAMA3_JSON.text("weather", {"city": "Paris"}), "", [("weather", PARIS_ARGS)]),
    (LLAMA3_JSON, AUTO, '<|python_tag|>{"name": "time", "parameters": {}}', "", [("time", "{}")]),
    (LLAMA3_JSON, AUTO, '\n {"name": "time", "parameters": {"tz": "cet"}} \n', "", [("time", '{"tz": "cet"}')]),
    (LLAMA3_JSON, AUTO, "It is sunny.", "It is sunny.", []),
    (LLAMA3_JSON, AUTO, " <|python", " <|python", []),
    (LLAMA3_JSON, AUTO, '{"name": "time", "parameters": {}} and more', None, []),
    (LLAMA3_JSON, AUTO, '{"name": "time", "arguments": {}}', None, []),
    (LLAMA3_JSON, AUTO, '{"name": "weather", "parameters": {"city": 7}}', None, []),
    (LLAMA3_JSON, AUTO, 'Sure: {"name": "time", "parameters": {}}', None, []),
]


@pytest.mark.parametrize(
    "form, body, text, content, calls", CASES, ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES)]
)
def test_calls_are_parsed_per_format_and_bad_ones_stay_text(form, body, text, content, calls):
    got_content, got_calls = parsed(text, body, form)
    assert [(c.name, c.arguments) for c in got_calls] == calls
    if not calls:  # not a call: the reply as written
        assert got_content == text
    else:
        assert got_content == content
    for call in got_calls:  # arguments: the JSON text of an object
        assert isinstance(json.loads(call.arguments), dict)


def pieces_of(text: str, cuts: list[int]) -> list[str]:
    bounds = [0] + sorted(cuts) + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def fed_in_pieces(parser, pieces: list[str]) -> tuple[str, list[Call]]:
    out = []
    for piece in pieces:
        out += parser.feed(piece)
    out += parser.finish()
    return "".join(p for p in out if isinstance(p, str)), [p for p in out if isinstance(p, Call)]


def splits_agree(parser_class) -> bool:
    """Every case's text fed in pieces (cut once at every position, and at random places) parses as
    the whole text does: the parser reads the committed text, not each piece (a draft, a round's
    commit, a streamed chunk) on its own."""
    rng = random.Random(0)
    for form, body, text, _, _ in CASES:
        whole = parsed(text, body, form)
        cuts = [[i] for i in range(1, len(text))] + [
            rng.sample(range(1, len(text)), min(6, len(text) - 1)) for _ in range(20)
        ]
        for cut in cuts:
            if fed_in_pieces(parser_class(request_for(body, form)[0]), pieces_of(text, cut)) != whole:
                return False
    return True


class PerPieceParser(ToolCallParser):
    """Planted bug: each piece parsed on its own, as if a call never straddled a draft or a round."""

    def feed(self, text):
        whole = ToolCallParser(self.request)
        return whole.feed(text) + whole.finish()

    def finish(self):
        return []


class LaxParser(ToolCallParser):
    """Planted bug: the arguments are not checked against the function's schema."""

    def _valid_arguments(self, name, arguments):
        return True


def test_a_call_split_across_pieces_is_parsed_from_the_committed_text():
    assert splits_agree(ToolCallParser)
    assert not splits_agree(PerPieceParser)  # the check catches a parser that reads pieces alone


def test_a_call_that_breaks_its_schema_is_text():
    text = HERMES.text("weather", {"city": "Marseille"})  # longer than maxLength 6
    assert parsed(text, AUTO) == (text, [])
    assert parsed(text, AUTO, parser_class=LaxParser)[1]  # planted: without the check it is a call
    message, finish = chat_answer(text, "stop", request_for(AUTO)[0])
    assert message == {"role": "assistant", "content": text} and finish == "stop"
    message, finish = chat_answer(CALL_PARIS, "length", request_for(AUTO)[0])  # a whole call, then cut
    assert message["tool_calls"][0]["function"]["name"] == "weather" and finish == "length"


# --------------------------------------------------------------------------------------------------
# The templates: their call format, and the history rendered as the grammar writes a call


def tokenizer_with(tmp_path, family: str, template: str | None = None):
    directory = tmp_path / f"{family}-{abs(hash(template))}"
    directory.mkdir()
    save_chat_tokenizer(directory, family, template)
    return load_tokenizer(directory)


def test_each_template_is_read_for_its_call_format(tmp_path):
    assert call_format(QWEN_TEMPLATE) is HERMES
    assert call_format(LLAMA_TEMPLATE) is LLAMA3_JSON
    assert call_format(XML_TEMPLATE) is None and call_format(PLAIN_TEMPLATE) is None
    request = tool_request({"tools": TOOLS, "tool_choice": "required"})
    for template, words in ((XML_TEMPLATE, "format this server does not parse"), (PLAIN_TEMPLATE, "does not render")):
        tokenizer = tokenizer_with(tmp_path, "qwen", template)
        with pytest.raises(ToolError, match=words) as e:
            for_template(request, tokenizer)
        assert e.value.param == "tools" and "\n" not in str(e.value)
        # tool_choice "none": the tools are only shown (if the template can), never parsed
        none = tool_request({"tools": TOOLS, "tool_choice": "none"})
        assert for_template(none, tokenizer) == (none, None)


HISTORY = [
    {"role": "user", "content": "Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": PARIS_ARGS}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def template_ready(history: list[dict]) -> list[dict]:
    """The history as runtime/openai_api.py chat_prompt gives it to the template."""
    out = []
    for i, m in enumerate(history):
        if m["role"] == "tool" or m.get("tool_calls"):
            out.append(history_message(i, m, m.get("content") or ""))
        else:
            out.append(m)
    return out


@pytest.mark.parametrize("family, form", [("qwen", HERMES), ("llama", LLAMA3_JSON)])
def test_a_past_call_renders_as_the_grammar_writes_one(tmp_path, family, form):
    """The template's own rendering of an earlier call is the format's text of that call: what the
    forced grammar makes the model write is what its template taught it."""
    from dataclasses import replace

    tokenizer = tokenizer_with(tmp_path, family)
    text = tokenizer.decode(chat_ids(tokenizer, template_ready(HISTORY), TOOLS))
    assert form.text("weather", {"city": "Paris"}) in text and "sunny" in text
    wrong_key = replace(form, arguments_key="arguments" if form is LLAMA3_JSON else "parameters")
    assert wrong_key.text("weather", {"city": "Paris"}) not in text  # planted: the other family's key
    # the grammar of a required call accepts exactly that text
    grammars = Grammars(tokenizer, 128, frozenset({tokenizer.eos_token_id}))
    constraint = grammars.constraint(request_for({"tools": TOOLS, "tool_choice": "required"}, form)[1])
    for token in tokenizer.encode(form.text("weather", {"city": "Paris"}), add_special_tokens=False):
        assert constraint.allowed()[token]
        constraint.commit(token)
    assert constraint.allowed()[tokenizer.eos_token_id]  # a whole call may end the reply


# --------------------------------------------------------------------------------------------------
# A target that writes calls, and a drafter that agrees with it


@pytest.fixture(scope="module")
def one_thread():
    """A tiny model trains and decodes fastest on one thread (and the machine is shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


FORCED = {
    "qwen-required": ({"tools": TOOLS, "tool_choice": "required"}, HERMES),
    "qwen-required-one": ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, HERMES),
    "qwen-named-time": ({"tools": TOOLS, "tool_choice": named("time")}, HERMES),
    "llama-required": ({"tools": TOOLS, "tool_choice": "required"}, LLAMA3_JSON),
    "llama-named-weather": ({"tools": TOOLS, "tool_choice": named("weather")}, LLAMA3_JSON),
}
NEW = 64
METHODS = {
    "ar": Method(),
    "dflash": Method("dflash", block_size=6),
    "dloop": Method("dloop", block_size=6, max_stages=3, gate_threshold=-1e9),
    "tree": Method("dflash", block_size=6, tree_budget=8, suffix=True),
}


@pytest.fixture(scope="module")
def taught(tmp_path_factory, one_thread):
    """(target dir with its tokenizer, drafter dir, tokenizer, torch engine with the drafter,
    Grammars, stop ids): the target taught LESSONS, the drafter trained to draft what it writes, free
    and under every FORCED grammar."""
    from loopspec.engines.backends import torch_engine
    from loopspec.pair import stop_token_ids

    from conftest import target_greedy

    root = tmp_path_factory.mktemp("tool-calls")
    target_dir = root / "target"
    target_dir.mkdir()
    save_chat_tokenizer(target_dir, "qwen")
    tokenizer = load_tokenizer(target_dir)
    save_taught_target(target_dir, tokenizer, LESSONS)
    target = load_target_dir(target_dir)
    prompts = [chat_ids(tokenizer, m, t) for m, t, _ in LESSONS]
    for prompt, (_, _, answer) in zip(prompts, LESSONS):  # it learnt its lessons
        assert tokenizer.decode(target_greedy(target, prompt, 70)[len(prompt) :]).startswith(answer + "<|im_end|>")
    stop = stop_token_ids(target.cfg, tokenizer)
    grammars = Grammars(tokenizer, target.cfg.vocab_size, stop)
    plain = torch_engine(target, None, CONTEXT)
    texts = []
    for body, form in FORCED.values():
        for prompt in prompts[:2]:
            out = generate(
                plain,
                prompt,
                max_new_tokens=NEW,
                stop_token_ids=stop,
                constraint=grammars.constraint(request_for(body, form)[1]),
            ).tokens
            texts.append((prompt, out))
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=6, mask_token_id=127)
    drafter = agreeing_drafter(target, prompts, cfg, new_tokens=NEW, also_texts=texts, steps=120)
    drafter.save(root / "drafter", dtype=torch.float32)
    engine = torch_engine(target, drafter, CONTEXT, max_rows=2)
    return target_dir, root / "drafter", tokenizer, engine, grammars, stop, prompts


def forced_run(taught, case: str, prompt, method: str, constraint_class=None):
    _, _, _, engine, grammars, stop, _ = taught
    body, form = FORCED[case]
    constraint = grammars.constraint(request_for(body, form)[1])
    if constraint_class is not None:  # a planted bug: the same matcher behind another class
        constraint = constraint_class(constraint.matcher, constraint.vocab_size, constraint.stop)
    return generate(
        engine.with_rows(1),
        prompt,
        METHODS[method],
        max_new_tokens=NEW,
        params=SamplingParams(),
        stop_token_ids=stop,
        constraint=constraint,
    )


def test_forced_calls_with_speculation_are_grammar_masked_plain_decoding(taught):
    """Under tool_choice "required" or a named function, in both formats, every method commits what
    `ar` with the same grammar masks commits, token for token, and that is a reply of valid calls."""
    tokenizer, prompts = taught[2], taught[6]
    accepted = {}
    for case, (body, form) in FORCED.items():
        for prompt in prompts[:2]:
            reference = forced_run(taught, case, prompt, "ar")
            text = tokenizer.decode([t for t in reference.tokens if t not in taught[5]])
            content, calls = parsed(text, body, form)
            assert calls and content == "", (case, text)  # calls only, each valid under its schema
            if body["tool_choice"] != "required":
                assert {c.name for c in calls} == {body["tool_choice"]["function"]["name"]}
            if form is LLAMA3_JSON or body.get("parallel_tool_calls") is False:  # one call: the grammar ends it
                assert len(calls) == 1 and reference.stats.finish_reason == "stop", (case, text)
            for method in ("dflash", "dloop", "tree"):
                result = forced_run(taught, case, prompt, method)
                assert result.tokens == reference.tokens, (case, method)
                accepted[method] = accepted.get(method, 0) + accepted_drafts([result])
    assert min(accepted.values()) >= 50, accepted  # drafts accepted under every grammar (measured: 100, 100, 372)


class ParentState(Constraint):
    """Planted bug: each draft node masked with its parent's grammar state (one token behind)."""

    def masks(self, tree):
        return super().masks(tree)[[max(p, 0) for p in tree.parents]]


def test_a_wrong_grammar_state_under_a_forced_call_is_caught(taught):
    caught = 0
    for case in ("qwen-required", "llama-required"):
        reference = forced_run(taught, case, taught[6][0], "ar")
        try:
            result = forced_run(taught, case, taught[6][0], "dflash", constraint_class=ParentState)
        except LoopspecError:  # a committed token broke the grammar
            caught += 1
            continue
        caught += result.tokens != reference.tokens
    assert caught > 0


# --------------------------------------------------------------------------------------------------
# The server: /v1/chat/completions with tools, over real HTTP


@pytest.fixture(scope="module")
def served(taught):
    """The taught pair served with dloop (the tiny server of tests/test_server.py)."""
    pytest.importorskip("fastapi", reason="needs fastapi: pip install 'loopspec[serve]'")
    from test_server import ServerThread, make_app

    from loopspec.runtime.pipeline import load_pipeline

    pipe = load_pipeline(str(taught[0]), str(taught[1]), max_context=CONTEXT, backend="torch")
    with ServerThread(make_app(pipe, max_body_bytes=65536)) as server:
        yield server, pipe


def chat(server, body: dict):
    import httpx

    return httpx.post(
        server.url + "/v1/chat/completions", json={"model": "tiny", "temperature": 0, **body}, timeout=120
    )


def ask(messages, tools=TOOLS, **extra) -> dict:
    return {"messages": messages, "tools": tools, "max_tokens": 80, **extra}


PARIS, OSLO = LESSONS[0][0], LESSONS[1][0]


def without_ids(message: dict) -> dict:
    calls = message.get("tool_calls")
    if calls:
        assert all(c["id"].startswith("call_") and len(c["id"]) > 10 for c in calls)
        assert len({c["id"] for c in calls}) == len(calls)
        message = {**message, "tool_calls": [{k: v for k, v in c.items() if k != "id"} for c in calls]}
    return message


def paris_call() -> dict:
    return {"type": "function", "function": {"name": "weather", "arguments": PARIS_ARGS}}


def test_auto_answers_the_calls_the_model_wrote(served):
    server, pipe = served
    reply = chat(server, ask(PARIS))
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert without_ids(choice["message"]) == {"role": "assistant", "content": None, "tool_calls": [paris_call()]}
    # what the model wrote is plain decoding's text of the same rendered prompt
    prompt = chat_ids(pipe.tokenizer, PARIS, TOOLS)
    assert reply.json()["usage"]["prompt_tokens"] == len(prompt)
    plain = pipe.run(prompt, pipe.settings("ar", adaptive=False), max_new_tokens=80)
    assert pipe.decode(plain.tokens) == CALL_PARIS
    # text before the call is the content
    oslo = chat(server, ask(OSLO)).json()["choices"][0]
    assert oslo["message"]["content"] == "Checking." and oslo["finish_reason"] == "tool_calls"
    assert oslo["message"]["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}


def test_a_call_that_breaks_the_schema_is_answered_as_text(served):
    server, _ = served
    choice = chat(server, ask(PARIS, tools=[WEATHER_BY_ID, TIME])).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": CALL_PARIS}  # city must be a number
    assert choice["finish_reason"] == "stop"


def test_tool_choice_none_shows_the_tools_and_parses_nothing(served):
    server, _ = served
    choice = chat(server, ask(PARIS, tool_choice="none")).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": CALL_PARIS} and choice["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "extra, names",
    [
        ({"tool_choice": "required"}, None),
        ({"tool_choice": "required", "parallel_tool_calls": False}, 1),
        ({"tool_choice": named("time")}, None),
        ({"tool_choice": named("weather"), "parallel_tool_calls": False}, 1),
    ],
)
def test_required_and_named_choices_answer_calls(served, extra, names):
    server, _ = served
    for messages in (PARIS, OSLO):
        choice = chat(server, ask(messages, **extra)).json()["choices"][0]
        calls = choice["message"]["tool_calls"]
        assert choice["message"]["content"] is None and calls, choice
        if "function" in extra["tool_choice"]:
            assert {c["function"]["name"] for c in calls} == {extra["tool_choice"]["function"]["name"]}
        if names == 1:
            assert len(calls) == 1 and choice["finish_reason"] == "tool_calls"
    # the taught answer is a call the grammar allows: forced, the model writes it
    paris = chat(server, ask(PARIS, tool_choice="required", parallel_tool_calls=False)).json()["choices"][0]
    assert without_ids(paris["message"])["tool_calls"] == [paris_call()]


def streamed(server, body: dict) -> tuple[list[dict], dict, str]:
    """The chunks of a streamed reply, and the message and finish reason its deltas add up to."""
    import httpx

    body = {"model": "tiny", "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    content, calls, finish = None, {}, None
    for c in chunks:
        choice = c["choices"][0]
        delta = choice["delta"]
        if delta.get("content"):
            content = (content or "") + delta["content"]
        for d in delta.get("tool_calls", []):
            if "id" in d:  # a call opens: id, type, name, then its arguments in fragments
                assert d["index"] == len(calls) and d["type"] == "function" and d["function"]["arguments"] == ""
                calls[d["index"]] = {"id": d["id"], "type": "function", "function": dict(d["function"])}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in range(len(calls))]
    else:
        message["content"] = content or ""
    return chunks, message, finish


@pytest.mark.parametrize(
    "body",
    [
        ask(PARIS),
        ask(OSLO),
        ask(PARIS, tools=[WEATHER_BY_ID, TIME]),
        ask(OSLO, tool_choice="required"),
        ask(PARIS, tool_choice="none"),
        ask(OSLO, max_tokens=30),  # cut inside the call: text
    ],
    ids=["auto", "auto-content", "schema-broken", "required", "none", "cut"],
)
def test_a_streamed_reply_adds_up_to_the_answer(served, body):
    server, _ = served
    answer = chat(server, body).json()["choices"][0]
    chunks, message, finish = streamed(server, body)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert without_ids(message) == without_ids(answer["message"]) and finish == answer["finish_reason"]


def test_the_openai_client_reads_tool_calls(served):
    server, _ = served
    client = server.client()
    reply = client.chat.completions.create(model="tiny", messages=OSLO, tools=TOOLS, temperature=0, max_tokens=80)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content == "Checking."
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    # streamed: the client's own accumulation of the deltas
    stream = client.chat.completions.create(
        model="tiny",
        messages=PARIS,
        tools=TOOLS,
        tool_choice=named("weather"),
        temperature=0,
        max_tokens=80,
        stream=True,
    )
    names, arguments, finish = [], "", None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            names += [d.function.name] if d.function.name else []
            arguments += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["weather"] and json.loads(arguments) == {"city": "Paris"} and finish == "tool_calls"
    # a conversation goes on: the call and its result sent back, rendered by the template
    history = OSLO + [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    again = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, temperature=0, max_tokens=8)
    rendered = chat_ids(server_tokenizer(served), template_ready(history), TOOLS)
    assert again.usage.prompt_tokens == len(rendered)
    assert CALL_OSLO in server_tokenizer(served).decode(rendered)


def server_tokenizer(served):
    return served[1].tokenizer


def tool(name="f", parameters=None, **extra) -> dict:
    function = {"name": name, **({"parameters": parameters} if parameters is not None else {}), **extra}
    return {"type": "function", "function": function}


CALLED = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {}}]}
# (what the body adds or changes, the field the 400 must name)
REFUSALS = [
    ({"tools": "weather"}, "tools"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "extra": 1}]}, "tools"),
    ({"tools": [tool("bad name")]}, "tools"),
    ({"tools": [tool("")]}, "tools"),
    ({"tools": [tool("x" * 65)]}, "tools"),
    ({"tools": [tool(3)]}, "tools"),
    ({"tools": [tool("f"), tool("g"), tool("f")]}, "tools"),
    ({"tools": [tool("f", {"type": "array"})]}, "tools"),
    ({"tools": [tool("f", {"properties": {}})]}, "tools"),
    ({"tools": [tool("f", [1])]}, "tools"),
    ({"tools": [tool("f", {"type": "object", "properties": 3})]}, "tools"),
    ({"tools": [tool("f", {"type": "object", "required": "x"})]}, "tools"),
    ({"tools": [tool("f", returns={})]}, "tools"),
    ({"tools": [tool("f", description=7)]}, "tools"),
    ({"tools": [tool("f", strict="yes")]}, "tools"),
    ({"tools": [tool()] * 129}, "tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": 1}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "stocks"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "weather"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "function": {"name": "weather"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": named("weather")}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "parallel_tool_calls": 0}, "parallel_tool_calls"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "guided_regex"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages"),
    ({"messages": [{"role": "tool", "tool_call_id": 3, "content": "sunny"}]}, "messages"),
    ({"messages": [{"role": "tool", "tool_call_id": "c1"}]}, "messages"),
    ({"messages": PARIS + [CALLED]}, "messages"),
    ({"messages": PARIS + [{**CALLED, "tool_calls": "weather"}]}, "messages"),
    (
        {"messages": PARIS + [{**CALLED, "tool_calls": [{"function": {"name": "weather", "arguments": "{nope"}}]}]},
        "messages",
    ),
    (
        {"messages": PARIS + [{**CALLED, "tool_calls": [{"function": {"name": "weather", "arguments": "[1]"}}]}]},
        "messages",
    ),
    (
        {"messages": PARIS + [{**CALLED, "tool_calls": [{"function": {"name": "weather", "arguments": {}}}]}]},
        "messages",
    ),
    ({"messages": PARIS + [{"role": "assistant", "content": "", "function_call": {"name": "f"}}]}, "messages"),
]


@pytest.mark.parametrize("change, param", REFUSALS, ids=[f"{p}-{json.dumps(c)[:50]}" for c, p in REFUSALS])
def test_malformed_tool_fields_get_a_400_naming_the_field(served, change, param):
    response = chat(served[0], {"messages": PARIS, "max_tokens": 4, **change})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert "\n" not in error["message"], error


@pytest.fixture(scope="module")
def plain_server(tiny_pair):
    """The tiny pair of tests/conftest.py: its chat template has no tools."""
    pytest.importorskip("fastapi", reason="needs fastapi: pip install 'loopspec[serve]'")
    from test_server import ServerThread, make_app

    from loopspec.runtime.pipeline import load_pipeline

    target_dir, drafter_dir = tiny_pair
    with ServerThread(
        make_app(load_pipeline(str(target_dir), str(drafter_dir), max_context=256, backend="torch"))
    ) as s:
        yield s


def test_a_template_without_tools_is_refused_naming_tools(plain_server):
    base = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 4}
    for extra in (
        {"tools": TOOLS},
        {"tools": TOOLS, "tool_choice": "required"},
        {"tools": TOOLS, "tool_choice": named("time")},
    ):
        response = chat(plain_server, {**base, **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == "tools", response.text
        assert "does not render tools" in response.json()["error"]["message"]
    # tool_choice "none": nothing to show them with, nothing parsed: the plain answer
    plain = chat(plain_server, base).json()["choices"][0]
    assert chat(plain_server, {**base, "tools": TOOLS, "tool_choice": "none"}).json()["choices"][0] == plain
    # a history of calls it cannot render
    history = [{"role": "user", "content": "abc"}, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    response = chat(plain_server, {**base, "messages": history})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages", response.text
