"""`loopspec prompts`: the target writes user prompts from its chat template's user header."""

import json
import shutil

import pytest

from loopspec.cli import main
from loopspec.decoding import SamplingParams
from loopspec.errors import LoopspecError
from loopspec.prompts import read_conversations, user_turn_prefix_ids
from loopspec.runtime.decoder import regenerate_responses
from loopspec.train.data import write_prompts
from loopspec.weights import load_target_dir, load_tokenizer

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def chat_target(tiny_pair, tmp_path_factory):
    """The tiny target with a template that has a user header ("<s>user: ")."""
    target_dir = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(tiny_pair[0], target_dir)
    tokenizer = load_tokenizer(target_dir)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(target_dir))
    return load_target_dir(target_dir), load_tokenizer(target_dir), target_dir


def ending_ids(tokenizer):
    """Stop at a space or a vowel: the random tiny model ends most prompts within a few tokens."""
    return {tokenizer.convert_tokens_to_ids(c) for c in " aeiou"}


def write(chat_target, path, count, **kw):
    target, tokenizer, _ = chat_target
    kw = {
        "params": SamplingParams(temperature=1.0),
        "max_prompt_tokens": 6,
        "batch_size": 4,
        "stop_ids": ending_ids(tokenizer),
        **kw,
    }
    return write_prompts(
        target=target,
        tokenizer=tokenizer,
        out_path=path,
        count=count,
        progress=False,
        respond=regenerate_responses,
        **kw,
    )


def test_user_turn_prefix_is_the_template_before_the_user_text(chat_target):
    _, tokenizer, _ = chat_target
    prefix = user_turn_prefix_ids(tokenizer)
    assert tokenizer.decode(prefix) == "<s>user: "
    whole = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False), add_special_tokens=False
    )
    assert whole[: len(prefix)] == prefix and len(whole) > len(prefix)


def test_templates_that_cannot_write_prompts_are_refused(chat_target):
    _, tokenizer, _ = chat_target
    tokenizer = type(tokenizer).from_pretrained(str(chat_target[2]))
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"  # never shows the text
    with pytest.raises(LoopspecError, match="does not show a user message"):
        user_turn_prefix_ids(tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(LoopspecError, match="no chat template"):
        user_turn_prefix_ids(tokenizer)


def test_prompts_are_distinct_begin_with_the_steer_and_resume(chat_target, tmp_path):
    path = tmp_path / "self.jsonl"
    report = write(chat_target, path, 5, starts_with="Wr", seed=3)
    assert report["prompts"] == 5 and report["written_this_run"] == 5 and report["tries_this_run"] >= 5
    first = path.read_text(encoding="utf-8")
    texts = [turns[0] for _, turns in read_conversations(path)]  # the file `loopspec data --prompts` reads
    assert len(texts) == 5 == len(set(texts))
    assert all(t.startswith("Wr") and t == t.strip() for t in texts)

    # a half-written line (a killed run) is cut; resuming adds only the missing prompts, the first stay
    path.write_text(first + '{"turns": ["cut', encoding="utf-8")
    report = write(chat_target, path, 8, starts_with="Wr", seed=3)
    assert report == {**report, "prompts": 8, "written_this_run": 3}
    now = path.read_text(encoding="utf-8")
    assert now.startswith(first) and len(read_conversations(path)) == 8
    assert len({turns[0] for _, turns in read_conversations(path)}) == 8

    # a file that already holds enough is left as it is
    assert write(chat_target, path, 6)["written_this_run"] == 0
    assert path.read_text(encoding="utf-8") == now


def test_a_model_that_never_ends_a_prompt_stops_with_a_clear_error(chat_target, tmp_path):
    path = tmp_path / "self.jsonl"
    write(chat_target, path, 2)
    before = path.read_text(encoding="utf-8")
    with pytest.raises(LoopspecError, match="ended only 0 usable prompts in .* tries"):
        write(chat_target, path, 4, stop_ids=set())  # no stop token: every prompt runs out of tokens
    assert path.read_text(encoding="utf-8") == before  # what was written is kept


def test_cli_prompts_refuses_greedy(chat_target, tmp_path, capsys):
    out = tmp_path / "p.jsonl"
    assert (
        main(["prompts", "--target", str(chat_target[2]), "--out", str(out), "--count", "2", "--temperature", "0"]) == 2
    )
    assert "needs --temperature > 0" in capsys.readouterr().err
    assert not out.exists()
    assert main(["prompts", "--target", str(chat_target[2]), "--out", str(tmp_path), "--count", "2"]) == 2
    assert "is not a file" in capsys.readouterr().err


def test_written_prompts_feed_loopspec_data(chat_target, tmp_path):
    path = tmp_path / "self.jsonl"
    write(chat_target, path, 3)
    out = tmp_path / "data"
    assert (
        main(
            [
                "data",
                "--prompts",
                str(path),
                "--target",
                str(chat_target[2]),
                "--out",
                str(out),
                "--max-new-tokens",
                "4",
                "--batch-size",
                "3",
                "--tap-layers",
                "1,4",
            ]
        )
        == 0
    )
    lines = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted(s["id"] for s in lines) == ["self.jsonl:1", "self.jsonl:2", "self.jsonl:3"]
