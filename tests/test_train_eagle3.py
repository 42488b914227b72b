"""EAGLE-3 training (`loopspec train --family eagle3`): the training-time test unrolls the drafter as a
round drafts (a planted bug in its attention fails that), a tiny drafter's loss falls and its held-out
τ beats the untrained one's, `loopspec data` → `train --family eagle3` → a checkpoint that loads back
through load_pair, resumes on the same trajectory and decodes plain decoding's tokens, and settings
that do not apply are refused in one line."""

import json
import random

import pytest
import torch

from loopspec.cli import main
from loopspec.errors import LoopspecError
from loopspec.model.eagle3 import Eagle3Drafter, fresh_eagle3
from loopspec.train import eagle3_trainer
from loopspec.train.eagle3_trainer import Eagle3Trainer
from loopspec.train.samples import Sample
from loopspec.train.trainer import DraftVocab, TrainConfig
from loopspec.weights import load_target_dir
from test_eagle3 import unrolled_logits

BLOCK = 6
TAPS = [0, 2, 4]  # of the tiny targets' 6 layers (vLLM's default (2, L/2, L-3) is not three distinct layers there)


def cycle_data(trainer, n=4, length=40, cycle=11, prompt_len=4, seed=0):
    """A toy continuation (tokens walk the cycle 3, 4, .., 3 + cycle - 1) with the target's taps."""
    g = random.Random(seed)
    data = []
    for i in range(n):
        s = Sample(f"s{i}", [3 + (g.randrange(cycle) + t) % cycle for t in range(length)], prompt_len, "length")
        tokens = torch.tensor(s.tokens)
        data.append((tokens, torch.tensor(s.loss_mask), trainer.target_pass(tokens, False)[0]))
    return data


def eagle3_trainer_for(target, seed=0, ttt_steps=4, vocab=None):
    torch.manual_seed(seed)
    ids = None if vocab is None else torch.tensor(vocab)
    drafter = fresh_eagle3(target.cfg, block_size=BLOCK, draft_ids=ids, target_layer_ids=TAPS)
    with torch.no_grad():  # as prepare_eagle3 starts it: the target's rows of the draft vocabulary
        drafter.lm_head.weight.copy_(target.lm_head.weight if ids is None else target.lm_head.weight[ids])
    return Eagle3Trainer(
        target, drafter, TrainConfig(family="eagle3", ttt_steps=ttt_steps), None if ids is None else DraftVocab(ids)
    )


def test_ttt_unroll_drafts_as_the_inference_module(tiny_targets, monkeypatch):
    """Every step of the unroll, at every row, equals the drafter's own forward run as a round runs it
    (dense masks over every step's keys, test_eagle3's reference); leaving a row's own earlier steps
    out of its attention (the planted bug) changes steps >= 2 and is caught."""
    target = load_target_dir(tiny_targets["llama"])
    trainer = eagle3_trainer_for(target)
    drafter = trainer.drafter
    with torch.no_grad():  # a drafter far from its start, so that every term of the attention counts
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    tokens = torch.randint(3, 120, (30,))
    taps, _ = trainer.target_pass(tokens, False)
    steps, rows = 4, torch.arange(2, 24)  # rows whose steps stay inside the sequence
    with torch.no_grad():
        reference = unrolled_logits(drafter, target.embed_tokens, taps, tokens.tolist(), steps)[:, rows]
        mine = torch.stack([drafter.logits(o) for o in trainer.unroll(tokens, taps, rows, steps)])
        assert torch.allclose(mine, reference, atol=1e-4), (mine - reference).abs().max()
        real = eagle3_trainer.unrolled_attention
        monkeypatch.setattr(
            eagle3_trainer, "unrolled_attention", lambda q, ck, cv, ok, ov, m: real(q, ck, cv, ok[:-1], ov[:-1], m)
        )
        planted = torch.stack([drafter.logits(o) for o in trainer.unroll(tokens, taps, rows, steps)])
    assert torch.allclose(planted[0], reference[0], atol=1e-4)  # step 1 has no own keys
    assert (planted[1:] - reference[1:]).abs().max() > 1e-2


def test_tiny_eagle3_loss_falls_and_tau_beats_the_untrained_drafter(tiny_targets):
    """On a toy continuation the drafter learns to draft whole stages: the loss falls by 5x and τ
    over its sequences goes from about 1 to most of the block (a random tiny target's taps let it
    memorise four sequences rather than learn the cycle, so τ is measured where it trained, as the
    DFlash trainer's test does); a drafter trained without the training-time test (one step)
    drafts its later steps from states it never saw, and falls short."""
    target = load_target_dir(tiny_targets["llama"])
    vocab = list(range(0, 40))  # the cycle's tokens 3..13 and others: a reduced draft vocabulary
    taus = {}
    for steps in (4, 1):
        trainer = eagle3_trainer_for(target, ttt_steps=steps, vocab=vocab)
        train = cycle_data(trainer)

        def tau():
            sums = [trainer.expected_tau(tokens, mask, taps) for tokens, mask, taps in train]
            return sum(s["tau"] for s, _ in sums) / sum(n for _, n in sums)

        before = tau()
        opt = torch.optim.AdamW([p for p in trainer.drafter.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for _ in range(100):
            opt.zero_grad()
            total = 0.0
            for tokens, mask, taps in train:
                loss, stats = trainer.sequence_loss(tokens, mask, taps, random.Random(0))
                (loss / len(train)).backward()
                total += loss.item()
            opt.step()
            losses.append(total / len(train))
        taus[steps] = (before, tau())
        if steps == 4:
            assert losses[-1] < losses[0] / 5, (losses[0], losses[-1])
            assert stats["labels"] > 0
    before, after = taus[4]
    assert before < 1.5 and after >= 0.7 * BLOCK, taus  # measured 1.09 → 5.34 of 6
    assert taus[1][1] < after - 1.0, taus  # without TTT the later steps fail


@pytest.fixture(scope="module")
def data_dir(tiny_pair, tmp_path_factory):
    target_dir, _ = tiny_pair
    root = tmp_path_factory.mktemp("e3data")
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"prompt number {i} says hello"]}) + "\n" for i in range(12)))
    assert (
        main(
            [
                "data",
                "--prompts",
                str(prompts),
                "--target",
                str(target_dir),
                "--out",
                str(root / "data"),
                "--max-new-tokens",
                "24",
                "--batch-size",
                "6",
            ]
        )
        == 0
    )
    return root / "data"


def test_cli_trains_an_eagle3_drafter_that_loads_resumes_and_decodes_losslessly(tiny_pair, data_dir, tmp_path):
    from loopspec.engines.torch_engine import TorchEngine
    from loopspec.pair import load_pair
    from loopspec.runtime.decoder import generate
    from loopspec.settings import DecodingSettings
    from loopspec.weights import read_safetensors

    target_dir, _ = tiny_pair
    common = [
        "train",
        "--family",
        "eagle3",
        "--data",
        str(data_dir),
        "--target",
        str(target_dir),
        "--block-size",
        "4",
        "--tap-layers",
        ",".join(map(str, TAPS)),
        "--draft-vocab-size",
        "40",
        "--batch-sequences",
        "2",
        "--lr",
        "3e-3",
        "--eval-every",
        "4",
        "--save-every",
        "2",
        "--ttt-steps",
        "3",
        "--epochs",
        "3",
        "--max-steps",
        "8",
    ]
    runs = {}
    for name, stops in (("straight", [None]), ("stopped", [3, None])):
        for stop in stops:
            extra = ["--stop-after-steps", str(stop)] if stop else []
            assert main(common + ["--out", str(tmp_path / name)] + extra) == 0
        runs[name] = read_safetensors(tmp_path / name / "model.safetensors")
    assert runs["straight"].keys() == runs["stopped"].keys()  # stopped at 3 and resumed: the same trajectory
    assert all(torch.equal(runs["straight"][k], runs["stopped"][k]) for k in runs["straight"])
    log = [json.loads(line) for line in (tmp_path / "straight" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(9)) and log[-1]["heldout_tau"] > log[0]["heldout_tau"]
    assert log[-1]["loss"] < log[1]["loss"]

    config = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 40
    assert config["loopspec"]["training"]["config"]["family"] == "eagle3"
    pair = load_pair(str(target_dir), str(tmp_path / "straight"))
    assert isinstance(pair.drafter, Eagle3Drafter) and pair.drafter.draft_ids.numel() == 40
    engine = TorchEngine(pair.target, pair.drafter, max_context=128)
    for prompt in ([5, 6, 7, 8], [9, 3, 30, 4, 12]):
        ar = generate(engine, prompt, max_new_tokens=30)
        spec = generate(engine, prompt, DecodingSettings("dflash", 4), max_new_tokens=30)
        assert spec.tokens == ar.tokens

    # --init continues an EAGLE-3 drafter (its d2t kept)
    assert (
        main(
            [
                "train",
                "--family",
                "eagle3",
                "--data",
                str(data_dir),
                "--target",
                str(target_dir),
                "--init",
                str(tmp_path / "straight"),
                "--out",
                str(tmp_path / "more"),
                "--max-steps",
                "1",
                "--batch-sequences",
                "2",
            ]
        )
        == 0
    )
    assert torch.equal(Eagle3Drafter.load(tmp_path / "more").draft_ids, pair.drafter.draft_ids)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--family", "eagle4"], "training family (--family) must be one of dflash, eagle3"),
        (["--family", "eagle3", "--anchors", "8"], "--anchors applies to DFlash training only"),
        (["--family", "eagle3", "--loop-stages", "2", "--dpace"], "--dpace, --loop-stages apply to DFlash training"),
        (["--family", "eagle3", "--ttt-steps", "0"], "--ttt-steps"),
        (["--ttt-steps", "3"], "--ttt-steps applies to EAGLE-3 training only"),
        (["--family", "eagle3", "--num-layers", "2"], "--num-layers does not apply to EAGLE-3 training"),
        (["--family", "eagle3", "--num-taps", "5"], "--num-taps does not apply"),
        (["--family", "eagle3", "--tap-layers", "1,2"], "EAGLE-3 fuses exactly 3 distinct target layers"),
        (["--family", "eagle3", "--markov-rank", "4"], "--markov-rank / --markov-head / --confidence-head does not"),
        (["--family", "eagle3", "--mask-token-id", "5"], "--mask-token-id does not apply"),
        (
            ["--family", "eagle3", "--init", "DFLASH"],
            "the --init drafter (z-lab DFlash) is trained with --family dflash, not --family eagle3",
        ),
        (["--init", "EAGLE3"], "the --init drafter (EAGLE-3) is trained with --family eagle3, not --family dflash"),
    ],
)
def test_bad_settings_are_refused_in_one_line(tiny_pair, data_dir, tmp_path, capsys, flags, message):
    target_dir, dflash_dir = tiny_pair
    eagle3_dir = tmp_path / "e3"
    if "EAGLE3" in flags:
        fresh_eagle3(load_target_dir(target_dir).cfg, target_layer_ids=TAPS).save(eagle3_dir)
    flags = [{"DFLASH": str(dflash_dir), "EAGLE3": str(eagle3_dir)}.get(f, f) for f in flags]
    out = tmp_path / "out"
    try:
        code = main(
            ["train", "--data", str(data_dir), "--target", str(target_dir), "--out", str(out), "--max-steps", "1"]
            + flags
        )
    except SystemExit as e:  # a flag's own type check is argparse's exit
        code = e.code
    assert code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("loopspec: error:") and message in err[0], err
    assert not (out / "train_log.jsonl").exists()


def test_train_config_checks_the_family_once():
    assert TrainConfig().anchors == 512 and TrainConfig().ttt_steps is None
    assert TrainConfig(family="eagle3").ttt_steps == 7 and TrainConfig(family="eagle3").anchors is None
    with pytest.raises(LoopspecError, match="--kl-weight applies to DFlash training only"):
        TrainConfig(family="eagle3", kl_weight=1.0)
