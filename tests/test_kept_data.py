"""Kept data: pack a data directory's token ids, resume `loopspec data` from them, train from the result."""

import hashlib
import json
import lzma

import pytest
import torch

import loopspec.runtime.decoder as decoder_module
from conftest import save_tiny_target, save_tiny_tokenizer
from loopspec.cli import main
from loopspec.errors import LoopspecError
from loopspec.train.samples import read_samples, safe_name
from loopspec.weights import read_safetensors

TEXTS = [f"prompt {i} " + "says hello " * (i % 4) for i in range(10)]


@pytest.fixture
def prompts(tmp_path):
    """10 prompts; line 4 is blank, so prompt k (k >= 3) is on line k + 2."""
    lines = [json.dumps({"turns": [t, "a second turn"]}) for t in TEXTS]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines[:3] + [""] + lines[3:]) + "\n")
    return path


@pytest.fixture
def generated(monkeypatch):
    """The prompts (token ids) every batch decoded by `loopspec data` in this test held."""
    calls: list[list[int]] = []
    real = decoder_module.regenerate_responses

    def counting(target, prompts, *args):
        calls.extend(prompts)
        return real(target, prompts, *args)

    monkeypatch.setattr(decoder_module, "regenerate_responses", counting)
    return calls


def data_args(target_dir, prompts, out, *extra):
    return [
        "data",
        "--prompts",
        str(prompts),
        "--target",
        str(target_dir),
        "--out",
        str(out),
        "--max-new-tokens",
        "12",
        "--batch-size",
        "3",
        "--tap-layers",
        "1,4",
        *extra,
    ]


def test_samples_name_their_prompt_line(tiny_pair, prompts, tmp_path):
    from loopspec.prompts import prompt_ids
    from loopspec.weights import load_tokenizer

    target_dir, _ = tiny_pair
    assert main(data_args(target_dir, prompts, tmp_path / "data", "--limit", "5")) == 0
    tokenizer = load_tokenizer(target_dir)
    lines = prompts.read_text().split("\n")
    samples = read_samples(tmp_path / "data")
    assert sorted(s.line for s in samples) == [1, 2, 3, 5, 6]
    for s in samples:
        assert s.id == f"p.jsonl:{s.line}" and s.file == "p.jsonl"
        text = json.loads(lines[s.line - 1])["turns"][0]
        assert s.tokens[: s.prompt_len] == prompt_ids(tokenizer, text)


def test_resume_from_kept_generates_only_the_missing_prompts(tiny_pair, prompts, tmp_path, generated, capsys):
    target_dir, _ = tiny_pair
    kept = tmp_path / "kept"
    assert main(data_args(target_dir, prompts, tmp_path / "first", "--limit", "6")) == 0
    assert main(["data", "--pack", str(kept), "--out", str(tmp_path / "first")]) == 0
    manifest = json.loads((kept / "manifest.json").read_text())
    assert manifest["samples"] == 6 and manifest["samples_per_file"] == {"p.jsonl": 6}
    assert manifest["settings"]["max_new_tokens"] == 12 and manifest["settings"]["max_prompt_tokens"] == 2048
    assert "tap_layer_ids" not in manifest["settings"] and manifest["settings"]["chat_template_sha256"]
    first = {s.id: s for s in read_samples(tmp_path / "first")}

    generated.clear()
    assert main(data_args(target_dir, prompts, tmp_path / "resumed", "--kept", str(kept))) == 0
    resumed = {s.id: s for s in read_samples(tmp_path / "resumed")}
    assert len(resumed) == 10
    kept_prompts = [s.tokens[: s.prompt_len] for s in first.values()]
    assert len(generated) == 4 and not any(p in kept_prompts for p in generated)
    for sid, s in first.items():
        assert resumed[sid] == s  # copied as kept
    assert json.loads((tmp_path / "resumed" / "manifest.json").read_text())["copied_from_kept_this_run"] == 6

    # packing again adds the 4 new samples to what the kept directory holds
    assert main(["data", "--pack", str(kept), "--out", str(tmp_path / "resumed")]) == 0
    assert "10 samples kept" in capsys.readouterr().out
    generated.clear()
    assert main(data_args(target_dir, prompts, tmp_path / "again", "--kept", str(kept))) == 0
    assert generated == [] and len(read_samples(tmp_path / "again")) == 10


def test_kept_taps_are_recomputed_as_generation_caches_them(tiny_pair, prompts, tmp_path, generated):
    target_dir, _ = tiny_pair
    fresh, kept, resumed = tmp_path / "fresh", tmp_path / "kept", tmp_path / "resumed"
    assert main(data_args(target_dir, prompts, fresh, "--cache-taps")) == 0
    assert main(["data", "--pack", str(kept), "--out", str(fresh)]) == 0
    assert not list(kept.glob("*.safetensors")) and not (kept / "taps").exists()  # token ids only
    generated.clear()
    assert main(data_args(target_dir, prompts, resumed, "--cache-taps", "--kept", str(kept))) == 0
    assert generated == []
    for s in read_samples(fresh):
        name = f"{safe_name(s.id)}.safetensors"
        a, b = read_safetensors(fresh / "taps" / name)["taps"], read_safetensors(resumed / "taps" / name)["taps"]
        assert a.shape == b.shape == (len(s.tokens) - 1, 2 * 64) and a.dtype == b.dtype == torch.float16
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-3, atol=2e-3)  # fp16 storage


def test_mismatched_or_corrupt_kept_data_is_refused(tiny_pair, prompts, tmp_path, capsys):
    from loopspec.train.kept import pack_kept, read_kept

    target_dir, _ = tiny_pair
    kept = tmp_path / "kept"
    assert main(data_args(target_dir, prompts, tmp_path / "data", "--limit", "3")) == 0
    pack_kept(tmp_path / "data", kept)

    def refused(args, words):
        capsys.readouterr()  # drop earlier commands' progress bars
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and "\n" not in err, err

    refused(
        data_args(target_dir, prompts, tmp_path / "a", "--kept", str(kept), "--max-new-tokens", "5"),
        "other settings: max_new_tokens 12 there, 5 here",
    )
    other = save_tiny_target("llama", tmp_path / "other", seed=7)  # another random llama, same tokenizer
    save_tiny_tokenizer(other)
    refused(data_args(other, prompts, tmp_path / "b", "--kept", str(kept)), "was kept for another target")
    refused(
        data_args(target_dir, prompts, tmp_path / "c", "--kept", str(tmp_path / "nowhere")), "not a kept data directory"
    )
    # packing data of another target into it is refused as well, leaving it as it was
    assert main(data_args(other, prompts, tmp_path / "other-data", "--limit", "2")) == 0
    before = (kept / "samples.jsonl.xz").read_bytes()
    refused(["data", "--pack", str(kept), "--out", str(tmp_path / "other-data")], "was kept for another target")
    assert (kept / "samples.jsonl.xz").read_bytes() == before

    # a kept sample whose prompt no longer matches its line
    changed = tmp_path / "changed" / "p.jsonl"
    changed.parent.mkdir()
    changed.write_text(prompts.read_text().replace("prompt 1 ", "prompt one "))
    refused(data_args(target_dir, changed, tmp_path / "d", "--kept", str(kept)), "has another prompt than")

    damaged = bytearray(before)
    damaged[len(damaged) // 2] ^= 0xFF
    (kept / "samples.jsonl.xz").write_bytes(bytes(damaged))
    refused(data_args(target_dir, prompts, tmp_path / "e", "--kept", str(kept)), "is corrupt")

    # bytes that match the manifest's hash but are not xz (a hand-edited manifest)
    (kept / "samples.jsonl.xz").write_bytes(b"not xz")
    manifest = json.loads((kept / "manifest.json").read_text())
    manifest["samples_sha256"] = hashlib.sha256(b"not xz").hexdigest()
    (kept / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(LoopspecError, match="not xz-compressed"):
        read_kept(kept, manifest["target_sha256"], manifest["settings"])
    (kept / "samples.jsonl.xz").write_bytes(lzma.compress(b'{"id": "x"}\n'))
    manifest["samples_sha256"] = hashlib.sha256((kept / "samples.jsonl.xz").read_bytes()).hexdigest()
    (kept / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(LoopspecError, match="corrupt"):
        read_kept(kept, manifest["target_sha256"], manifest["settings"])

    refused(["data", "--out", str(tmp_path / "data")], "needs --prompts")


def test_training_runs_from_data_resumed_from_kept(tiny_pair, prompts, tmp_path):
    """v6's recipe at test size from kept data (token ids only): a base drafter, deepened by a layer and
    trained in bf16 with a tap cache, then a loop-aware run from it on the same cache."""
    from loopspec.model.dflash import Drafter

    target_dir, _ = tiny_pair
    kept, resumed = tmp_path / "kept", tmp_path / "resumed"
    assert main(data_args(target_dir, prompts, tmp_path / "first")) == 0
    assert main(["data", "--pack", str(kept), "--out", str(tmp_path / "first")]) == 0
    assert main(data_args(target_dir, prompts, resumed, "--kept", str(kept))) == 0
    common = [
        "train",
        "--data",
        str(resumed),
        "--target",
        str(target_dir),
        "--anchors",
        "8",
        "--batch-sequences",
        "2",
        "--max-steps",
        "2",
        "--eval-every",
        "2",
        "--save-every",
        "2",
    ]
    base, deeper, looped = tmp_path / "base", tmp_path / "deeper", tmp_path / "looped"
    assert (
        main(common + ["--out", str(base), "--block-size", "4", "--tap-layers", "1,4", "--mask-token-id", "127"]) == 0
    )
    cache = ["--tap-cache", str(tmp_path / "taps")]
    assert (
        main(
            common
            + ["--init", str(base), "--num-layers", "2", "--compute-dtype", "bfloat16", "--out", str(deeper), *cache]
        )
        == 0
    )
    assert main(common + ["--init", str(deeper), "--loop-stages", "3", "--out", str(looped), *cache]) == 0
    for out in (base, deeper, looped):
        log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
        assert [r["step"] for r in log] == [0, 1, 2] and "heldout_tau" in log[-1]
        assert (out / "model.safetensors").is_file()
    assert Drafter.load(looped).cfg.num_layers == 2
    assert (
        json.loads((deeper / "train_log.jsonl").read_text().splitlines()[0])["heldout_tau"]
        == json.loads((base / "train_log.jsonl").read_text().splitlines()[-1])["heldout_tau"]
    )  # grown = base


def test_half_written_last_line_is_not_a_sample(tiny_pair, prompts, tmp_path):
    """A run killed mid-write (or one still writing) leaves an unterminated line: readers skip it, a resume drops it."""
    target_dir, _ = tiny_pair
    out = tmp_path / "data"
    assert main(data_args(target_dir, prompts, out, "--limit", "3")) == 0
    with open(out / "samples.jsonl", "a") as f:
        f.write('{"id": "p.jsonl:5", "file": "p.jsonl", "tok')
    assert len(read_samples(out)) == 3
    assert main(["data", "--pack", str(tmp_path / "kept"), "--out", str(out)]) == 0  # packs the 3
    assert main(data_args(target_dir, prompts, out)) == 0
    samples = read_samples(out)
    assert len(samples) == 10 and len({s.id for s in samples}) == 10


def test_tap_cache_computes_taps_once_and_refuses_a_mismatch(tiny_pair, prompts, tmp_path, monkeypatch, capsys):
    """--tap-cache: data without taps → the first run computes each sample's taps once and keeps them
    (fp16); a second run on the same data reads them all back without a target pass and trains the same
    steps; another layer set, KL, or a foreign directory is refused with a one-line error."""
    from loopspec.train.trainer import DrafterTrainer

    target_dir, _ = tiny_pair
    data = tmp_path / "data"
    assert main(data_args(target_dir, prompts, data)) == 0  # no --cache-taps: token ids only
    cache = tmp_path / "taps"
    train = [
        "train",
        "--data",
        str(data),
        "--target",
        str(target_dir),
        "--block-size",
        "4",
        "--mask-token-id",
        "127",
        "--anchors",
        "8",
        "--batch-sequences",
        "2",
        "--epochs",
        "2",
        "--max-steps",
        "6",
        "--eval-every",
        "3",
        "--save-every",
        "3",
        "--tap-cache",
        str(cache),
    ]
    passes = []
    real = DrafterTrainer.target_pass
    monkeypatch.setattr(
        DrafterTrainer, "target_pass", lambda self, tokens, want: passes.append(1) or real(self, tokens, want)
    )
    assert main(train + ["--tap-layers", "1,4", "--out", str(tmp_path / "first")]) == 0
    samples = [s for s in read_samples(data) if len(s.tokens) - s.prompt_len >= 2]  # those training uses
    files = sorted(p.name for p in cache.glob("*.safetensors"))
    assert files == sorted(f"{safe_name(s.id)}.safetensors" for s in samples)  # 6 steps × 2 + held out: all
    assert len(passes) == len(samples)  # each sample's taps computed once, also when seen twice
    for s in samples:
        taps = read_safetensors(cache / f"{safe_name(s.id)}.safetensors")["taps"]
        assert taps.dtype == torch.float16 and taps.shape == (len(s.tokens) - 1, 2 * 64)
    assert json.loads((cache / "manifest.json").read_text())["tap_layer_ids"] == [1, 4]

    passes.clear()
    assert main(train + ["--tap-layers", "1,4", "--out", str(tmp_path / "second")]) == 0
    assert passes == []  # everything read back
    first, second = (read_safetensors(tmp_path / name / "model.safetensors") for name in ("first", "second"))
    assert all(torch.equal(first[k], second[k]) for k in first)  # the same taps, so the same training

    # other data under the same sample ids (other responses): their taps are recomputed, not reused
    other = tmp_path / "other-data"
    assert main(data_args(target_dir, prompts, other, "--max-new-tokens", "7")) == 0
    passes.clear()
    assert (
        main(["train", "--data", str(other)] + train[3:] + ["--tap-layers", "1,4", "--out", str(tmp_path / "o")]) == 0
    )
    changed = [s for s in read_samples(other) if len(s.tokens) - s.prompt_len >= 2]
    assert len(passes) == len(changed) > 0
    s = changed[0]
    assert read_safetensors(cache / f"{safe_name(s.id)}.safetensors")["tokens"].tolist() == s.tokens

    capsys.readouterr()
    assert main(train + ["--tap-layers", "1,3", "--out", str(tmp_path / "other")]) == 2
    assert "holds taps of another target or layers ([1, 4] there, [1, 3] here)" in capsys.readouterr().err
    assert main(train + ["--tap-layers", "1,4", "--kl-weight", "1", "--out", str(tmp_path / "kl")]) == 2
    assert "--tap-cache keeps taps only" in capsys.readouterr().err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert main(train[:-1] + [str(foreign), "--tap-layers", "1,4", "--out", str(tmp_path / "f")]) == 2
    assert "is not empty and not a tap cache" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "mine" and len(list(foreign.iterdir())) == 1
    (cache / "manifest.json").write_text("{not json")
    assert main(train + ["--tap-layers", "1,4", "--out", str(tmp_path / "g")]) == 2
    assert "is corrupt" in capsys.readouterr().err


@pytest.mark.e2e
def test_the_repository_kept_data_is_intact_and_matches_its_prompt_files():
    """The kept data of the default target: its sha256 and counts check out, and every sample of a
    prompt file kept beside it (the prompts the target wrote itself) holds that file's line as its
    prompt, so `loopspec data --kept` resumes from it instead of refusing."""
    from pathlib import Path

    from loopspec.prompts import prompt_ids, read_conversations
    from loopspec.train.kept import read_kept
    from loopspec.weights import load_tokenizer, resolve_target_dir, target_fingerprint

    kept_dir = Path(__file__).resolve().parent.parent / "data" / "smollm2-135m-instruct"
    manifest = json.loads((kept_dir / "manifest.json").read_text())
    target_dir = resolve_target_dir("default")
    kept = read_kept(kept_dir, target_fingerprint(target_dir), manifest["settings"])
    assert sum(manifest["samples_per_file"].values()) == len(kept) == manifest["samples"]
    tokenizer = load_tokenizer(target_dir)
    prompt_files = sorted(kept_dir.glob("*.jsonl"))
    assert prompt_files, "the self-written prompt files are kept beside the samples"
    for path in prompt_files:
        lines = dict(read_conversations(path))
        mine = [s for s in kept.values() if s.file == path.name]
        assert len(mine) == manifest["samples_per_file"].get(path.name, 0) <= len(lines)
        for s in mine:
            assert s.tokens[: s.prompt_len] == prompt_ids(tokenizer, lines[s.line][0])
