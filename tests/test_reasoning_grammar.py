"""Structured output after a reasoning block (runtime/constraint.py `after_reasoning`): a tiny
Qwen3 target writes freely until the end token, then the grammar constrains what follows, also when
the boundary falls inside a verified draft; grammar-masked speculation equals grammar-masked plain
decoding token for token with drafts accepted; the pipeline starts the grammar after `</think>`
where the chat template opens a `<think>` block and not where the prompt already closed one."""

import re

import pytest

pytest.importorskip("xgrammar", reason="needs xgrammar: the grammar extra")

from conftest import accepted_drafts, agreeing_drafter, lively, save_tiny_target, save_tiny_tokenizer  # noqa: E402
from loopspec.engines.backends import torch_engine  # noqa: E402
from loopspec.errors import LoopspecError  # noqa: E402
from loopspec.model.dflash import DrafterConfig  # noqa: E402
from loopspec.runtime.constraint import Constraint, Grammars, GrammarSpec  # noqa: E402
from loopspec.runtime.decoder import generate  # noqa: E402
from loopspec.settings import DecodingSettings as Method  # noqa: E402
from loopspec.weights import load_target_dir, load_tokenizer  # noqa: E402

STOP = frozenset({2})
REGEX = r"[a-e]{3,6}\."
SPEC = GrammarSpec("regex", REGEX)
PROMPTS = [[5, 40, 41, 9, 77], [60, 61, 12, 33, 70], [90, 14, 3, 50]]
NEW = 30
METHODS = [Method("dflash", block_size=8), Method("dloop", block_size=6, max_stages=3, gate_threshold=-1e9)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A lively tiny Qwen3, its grammars, each prompt's boundary (the end token: the first token plain
    decoding writes, from its third on, that it has not written before) and a drafter trained on what
    gated plain decoding writes (so drafts span the boundary)."""
    root = tmp_path_factory.mktemp("reasoning")
    target_dir = save_tiny_target("qwen3", root / "target", seed=6)
    save_tiny_tokenizer(target_dir)
    target = lively(load_target_dir(target_dir))
    grammars = Grammars(load_tokenizer(target_dir), target.cfg.vocab_size, STOP)
    plain = torch_engine(target, None, 256)
    boundaries, texts = [], []
    for prompt in PROMPTS:
        free = generate(plain, prompt, max_new_tokens=NEW).tokens
        at = next(i for i in range(2, NEW) if free[i] not in free[:i] and free[i] not in STOP)
        boundaries.append((free[at], at))
        gated_plain = generate(
            plain, prompt, max_new_tokens=NEW, stop_token_ids=STOP, constraint=gated(grammars, free[at])
        )
        texts.append((prompt, gated_plain.tokens))
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=8, mask_token_id=127)
    drafter = agreeing_drafter(target, PROMPTS, cfg, also_texts=texts, steps=120)
    return torch_engine(target, drafter, 256), grammars, boundaries, texts, load_tokenizer(target_dir)


def gated(grammars, end, constraint_class=Constraint):
    constraint = grammars.constraint(SPEC)
    if constraint_class is not Constraint:  # a planted bug: the same matcher behind another class
        constraint = constraint_class(constraint.matcher, constraint.vocab_size, constraint.stop)
    constraint.after_reasoning(end)
    return constraint


def boundary_inside_a_draft(result, position: int) -> bool:
    """Whether the token at `position` (the end token) and a later one were committed by the same
    verification: the boundary fell inside a verified draft."""
    start = 0
    for accepted in result.stats.accepted_per_round:
        committed = accepted + 1
        if start <= position < start + committed - 1:
            return True
        start += committed
    return False


def test_the_grammar_starts_at_the_boundary_and_speculation_equals_plain(setup):
    engine, grammars, boundaries, texts, tokenizer = setup
    inside = accepted = 0
    for (prompt, reference), (end, at) in zip(texts, boundaries):
        rest = reference[at + 1 :]
        assert reference[at] == end  # before the boundary the row wrote what it writes unconstrained
        answer = [t for t in rest if t not in STOP]
        text = tokenizer.decode(answer)
        assert re.fullmatch(REGEX, text), text  # after it, the grammar's language
        for method in METHODS:
            result = generate(
                engine, prompt, method, max_new_tokens=NEW, stop_token_ids=STOP, constraint=gated(grammars, end)
            )
            assert result.tokens == reference, method
            accepted += accepted_drafts([result])
            inside += boundary_inside_a_draft(result, at)
    assert accepted >= 30, accepted  # drafts accepted over 6 runs
    assert inside >= 2, inside  # the boundary fell inside a verified draft


class GrammarAtCommitOnly(Constraint):
    """Planted bug: the boundary is honoured where a token is committed but not inside a draft (the
    whole draft is masked as if the row were still reasoning)."""

    def prune(self, tree):
        end, self.reasoning_end = self.reasoning_end, (None if self.reasoning_end is None else -1)
        try:
            return super().prune(tree)
        finally:
            self.reasoning_end = end


def test_a_boundary_ignored_inside_drafts_is_caught(setup):
    engine, grammars, boundaries, texts, _ = setup
    caught = 0
    for (prompt, reference), (end, _) in zip(texts, boundaries):
        try:
            result = generate(
                engine,
                prompt,
                METHODS[0],
                max_new_tokens=NEW,
                stop_token_ids=STOP,
                constraint=gated(grammars, end, GrammarAtCommitOnly),
            )
            caught += result.tokens != reference
        except LoopspecError:  # a draft verified unmasked past the boundary commits what breaks the grammar
            caught += 1
    assert caught >= 1


def test_the_pipeline_starts_the_grammar_after_think_only_where_the_reply_thinks(tmp_path):
    from loopspec.runtime.pipeline import Pipeline

    class Tokenizer:  # what after_reasoning reads of a tokenizer: its template, encode, decode
        chat_template = "{% for m in messages %}...{% endfor %}<think>\n"
        vocab = {"</think>": 7, "\n": 3, "x": 4}

        def encode(self, text, add_special_tokens=False):
            return [self.vocab[text]] if text in self.vocab else [4, 4]

        def decode(self, ids):
            return "".join({7: "</think>", 3: "\n", 4: "x"}[i] for i in ids)

    class Gate:
        def __init__(self):
            self.end = None

        def after_reasoning(self, end):
            self.end = end

    pipe = Pipeline.__new__(Pipeline)
    pipe.tokenizer = Tokenizer()
    thinking, closed = Gate(), Gate()
    pipe.after_reasoning(thinking, [4, 4, 3])  # the reply opens its own <think> block
    pipe.after_reasoning(closed, [4, 7, 3, 3])  # thinking off: the prompt ends with a closed block
    assert (thinking.end, closed.end) == (7, None)
    no_think = Pipeline.__new__(Pipeline)
    no_think.tokenizer = Tokenizer()
    no_think.tokenizer.chat_template = "{% for m in messages %}...{% endfor %}"
    gate = Gate()
    no_think.after_reasoning(gate, [4, 4])
    assert gate.end is None  # a template without a <think> block: the grammar starts at once
