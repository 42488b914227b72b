"""`--drafter default` finds the shipped drafter by what identifies the model (family, shapes, the
vocabulary), not by the file: the same model in another file (another quantization, a checkpoint
directory) decodes with its drafter; a model with no shipped drafter drafts with an untrained one,
said so on the stats line with how to train one, and never asks for a mask token."""

import json
import shutil

import pytest
import torch

import loopspec.pair as pair_module
from conftest import save_tiny_target, save_tiny_tokenizer
from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.pair import TARGET_IDENTITY_FILE, UNTRAINED, load_pair, model_identity
from loopspec.weights import load_target_dir, load_tokenizer


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """A shipped-drafters folder holding one drafter trained (here: made) for a tiny llama."""
    target_dir = save_tiny_target("llama", tmp_path / "target", seed=2)
    save_tiny_tokenizer(target_dir)
    target = load_target_dir(target_dir)
    folder = tmp_path / "drafters"
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=4, mask_token_id=127)
    torch.manual_seed(0)
    Drafter(cfg).save(folder / "tiny", dtype=torch.float32)
    identity = model_identity(target.cfg, load_tokenizer(target_dir))
    (folder / "tiny" / TARGET_IDENTITY_FILE).write_text(json.dumps(identity))
    monkeypatch.setattr(pair_module, "SHIPPED_DRAFTERS", folder)
    return target_dir, folder / "tiny"


def test_the_same_model_in_another_file_finds_its_drafter(shipped, tmp_path):
    target_dir, drafter_dir = shipped
    copy = tmp_path / "copy"  # the same weights and tokenizer in another directory, saved in bf16
    shutil.copytree(target_dir, copy)
    state = {k: v.to(torch.bfloat16) for k, v in load_target_dir(target_dir).state_dict().items()}
    assert state  # (the identity reads no weights: only the family, the shapes and the vocabulary)
    pair = load_pair(copy, "default")
    assert pair.drafter_dir == drafter_dir and pair.drafter_description == "shipped (tiny)"
    assert pair.drafter.cfg.mask_token_id == 127


@pytest.mark.parametrize("change", ["vocabulary", "shape"])
def test_another_model_drafts_untrained_and_says_how_to_train_one(shipped, tmp_path, change):
    target_dir, _ = shipped
    other = tmp_path / "other"
    if change == "shape":
        save_tiny_target("llama", other, seed=2, num_layers=4)
        save_tiny_tokenizer(other)
    else:
        shutil.copytree(target_dir, other)
        vocab_file = other / "tokenizer.json"
        raw = json.loads(vocab_file.read_text())
        vocab = raw["model"]["vocab"]
        first = next(iter(vocab))
        vocab["renamed"] = vocab.pop(first)  # one token's string differs: another vocabulary
        vocab_file.write_text(json.dumps(raw))
    pair = load_pair(other, "default")
    assert pair.drafter_dir is None and pair.drafter_description == UNTRAINED
    assert "loopspec train" in UNTRAINED and "--drafter none" in UNTRAINED


def test_an_untrained_drafter_never_asks_for_a_mask_token(shipped, tmp_path, monkeypatch):
    monkeypatch.setattr(pair_module, "SHIPPED_DRAFTERS", tmp_path / "none")  # nothing shipped
    target_dir = tmp_path / "full"  # a vocabulary the tokenizer covers whole: no unused row for a mask token
    save_tiny_tokenizer(save_tiny_target("llama", target_dir, seed=2, vocab_size=98))
    assert len(load_tokenizer(target_dir)) == load_target_dir(target_dir).cfg.vocab_size
    pair = load_pair(target_dir, "default")
    assert pair.drafter_description == UNTRAINED and pair.drafter.cfg.mask_token_id is not None


@pytest.mark.e2e
def test_the_shipped_drafters_identity_is_the_default_targets():
    from loopspec.defaults import DEFAULT_DRAFTER_DIR
    from loopspec.weights import TargetSource

    directory = TargetSource.of("default").checkpoint_dir()
    identity = model_identity(load_target_dir(directory).cfg, load_tokenizer(directory))
    assert json.loads((DEFAULT_DRAFTER_DIR / TARGET_IDENTITY_FILE).read_text()) == identity


def test_two_files_of_one_model_are_told_apart_past_their_first_16_mib(tmp_path):
    """The export cache's key (loopspec.weights.target_fingerprint): two checkpoints whose first 16 MiB
    agree (one model's embedding, quantized alike) and whose later matrices differ get different keys.
    Planted: the old key (the first 16 MiB of each file) gives them one key."""
    from loopspec.files import file_sha256
    from loopspec.weights import target_fingerprint, write_safetensors

    embedding = torch.zeros(5 << 20)  # 20 MiB of fp32: the first 16 MiB of the file are the same
    for name, last in (("a", 0.0), ("b", 1.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        write_safetensors(
            {"a.embed": embedding, "z.down": torch.full((64,), last)}, tmp_path / name / "model.safetensors"
        )
    assert target_fingerprint(tmp_path / "a") != target_fingerprint(tmp_path / "b")
    old = [file_sha256(tmp_path / n / "model.safetensors", limit_bytes=16 << 20) for n in "ab"]
    assert old[0] == old[1]  # what the key read before: the two files looked the same
