"""DSpark drafter training: the trainer's Markov-corrected drafts against the inference path (every head
type, both block conventions), heads added to a trained drafter without changing its drafts, a tiny
run that teaches the Markov and confidence heads, and `loopspec train`'s DSpark options end to end."""

import json
import random
from dataclasses import replace

import pytest
import torch

from conftest import lively
from loopspec.cli import main
from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.model.drafter_kinds import require_zlab_block
from loopspec.model.dspark import DSparkHeads
from loopspec.errors import LoopspecError
from loopspec.engines.torch_engine import TorchEngine
from loopspec.train.trainer import DrafterTrainer, TrainConfig, sample_anchors
from loopspec.weights import load_target_dir


def dspark_drafter(target, head_type: str, anchor_predicts: bool, block_size: int = 5, seed: int = 0) -> Drafter:
    cfg = DrafterConfig.for_target(
        target.cfg, num_layers=1, block_size=block_size, mask_token_id=127, target_layer_ids=[1, 4]
    )
    cfg = replace(
        cfg,
        anchor_predicts=anchor_predicts,
        markov_rank=6,
        markov_head_type=head_type,
        confidence_head=True,
        confidence_with_markov=True,
    )
    torch.manual_seed(seed)
    drafter = Drafter(cfg)
    with torch.no_grad():  # a Markov bias strong enough to change the argmax
        drafter.markov_head.markov_w2.weight.normal_(0.0, 2.0)
    return drafter.eval()


def inference_drafts(engine, tokens: list[int], anchor: int, block_size: int) -> list[int]:
    """The argmax chain the runtime drafts at `anchor` (context: the tokens before it)."""
    engine.prefill(0, tokens[:anchor], want_taps=True)
    drafts, _, _ = engine.draft([0], [tokens[anchor]], [anchor], block_size)  # [1, D, C]
    return drafts[0, :, 0].tolist()


@pytest.mark.parametrize("anchor_predicts", [False, True], ids=["zlab", "deepspec"])
@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_trained_drafts_are_the_inference_drafts(tiny_targets, head_type, anchor_predicts):
    """The held-out τ the trainer computes (teacher-forced Markov prevs) equals τ counted from the drafts
    the runtime makes (its own drafted prevs), on a sequence that continues one anchor with the
    runtime's own drafts — so a whole block is accepted there and a misaligned prev would show."""
    target = lively(load_target_dir(tiny_targets["qwen3"]))
    B = 5
    drafter = dspark_drafter(target, head_type, anchor_predicts, B)
    engine = TorchEngine(target, drafter, max_context=128)
    tokens = torch.randint(3, 120, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    a0 = 17
    drafted = inference_drafts(engine, tokens, a0, B)
    tokens[a0 + 1 : a0 + 1 + len(drafted)] = drafted  # in either convention the first draft is a0+1's token
    D = drafter.cfg.drafts_per_block(B)
    assert len(drafted) == D

    trainer = DrafterTrainer(target, drafter, TrainConfig())
    t = torch.tensor(tokens)
    mask = torch.ones(len(tokens), dtype=torch.bool)
    mask[0] = False  # a one-token prompt: the runtime drafts after a non-empty context
    with torch.no_grad():
        taps, _ = trainer.target_pass(t, False)
        sums, n = trainer.expected_tau(t, mask, taps, max_anchors=64)

    oracle, full_blocks = 0, 0
    for a in sample_anchors(mask, 64, random.Random(0)).tolist():
        drafts = inference_drafts(engine, tokens, a, B)
        run = 0
        while run < D and a + 1 + run < len(tokens) and drafts[run] == tokens[a + 1 + run]:
            run += 1
        oracle += 1 + run
        full_blocks += run == D
    assert n > 30 and full_blocks >= 1
    assert sums["tau"] == oracle


def test_heads_added_to_a_drafter_keep_its_drafts(tiny_targets):
    target = lively(load_target_dir(tiny_targets["llama"]))
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=5, mask_token_id=127, target_layer_ids=[1, 4])
    torch.manual_seed(1)
    plain = Drafter(cfg).eval()
    with_heads = plain.with_heads(DSparkHeads(markov_rank=4, markov_head_type="gated", confidence_head=True)).eval()
    assert with_heads.cfg.markov_rank == 4 and with_heads.cfg.confidence_with_markov
    tokens = torch.randint(3, 120, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    for a in (6, 13, 22):
        assert inference_drafts(TorchEngine(target, with_heads, max_context=64), tokens, a, 5) == inference_drafts(
            TorchEngine(target, plain, max_context=64), tokens, a, 5
        )
    with pytest.raises(LoopspecError, match="Markov head type"):
        DSparkHeads(markov_rank=4, markov_head_type="lstm")
    with pytest.raises(LoopspecError, match="needs a Markov head"):
        DSparkHeads()


def test_markov_and_confidence_heads_learn(tiny_targets):
    """On a toy continuation whose next token follows from the previous one, the Markov head alone (the
    backbone frozen) lifts held-out τ, and the confidence head's Brier score falls."""
    target = load_target_dir(tiny_targets["llama"])
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=5, mask_token_id=127, target_layer_ids=[2])
    torch.manual_seed(0)
    drafter = Drafter(cfg).with_heads(DSparkHeads(markov_rank=8, confidence_head=True))
    for name, p in drafter.named_parameters():  # only the heads learn: the gain is theirs
        p.requires_grad_(name.startswith(("markov_head.", "confidence_head.")))
    trainer = DrafterTrainer(target, drafter, TrainConfig(anchors=16))
    g = random.Random(0)
    cycle = list(range(3, 3 + 13))
    data = []
    for _ in range(3):
        start = g.randrange(13)
        tokens = torch.tensor([cycle[(start + i) % 13] for i in range(30)])
        taps, _ = trainer.target_pass(tokens, False)
        data.append((tokens, torch.ones(30, dtype=torch.bool), taps))

    def measure():
        tau, count, brier, labels = 0.0, 0, 0.0, 0
        with torch.no_grad():
            for tokens, mask, taps in data:
                s, c = trainer.expected_tau(tokens, mask, taps)
                tau, count = tau + s["tau"], count + c
                _, st = trainer.sequence_loss(tokens, mask, taps, random.Random(1))
                brier, labels = brier + st["confidence_brier"], labels + st["labels"]
        return tau / count, brier / labels

    tau0, brier0 = measure()
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-2)
    rng = random.Random(0)
    for _ in range(60):
        opt.zero_grad()
        for tokens, mask, taps in data:
            trainer.sequence_loss(tokens, mask, taps, rng)[0].backward()
        opt.step()
    tau1, brier1 = measure()
    assert tau0 < 2.0 and tau1 > 4.5, (tau0, tau1)  # a block of 5 holds 4 drafts: τ ≤ 5
    assert brier1 < brier0 / 2, (brier0, brier1)


def test_train_cli_adds_dspark_heads(tiny_pair, tmp_path, capsys):
    """`loopspec train --init D --markov-rank R --confidence-head` writes a z-lab-convention DSpark drafter
    that loads back with its heads, decodes losslessly, and that z-lab-only writers refuse."""
    from loopspec.runtime.decoder import generate
    from loopspec.settings import DecodingSettings

    target_dir, drafter_dir = tiny_pair
    data = tmp_path / "data"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"prompt {i} says hi"]}) + "\n" for i in range(6)))
    assert (
        main(
            [
                "data",
                "--prompts",
                str(prompts),
                "--target",
                str(target_dir),
                "--out",
                str(data),
                "--max-new-tokens",
                "16",
                "--batch-size",
                "3",
            ]
        )
        == 0
    )
    out = tmp_path / "dspark"
    common = [
        "train",
        "--data",
        str(data),
        "--target",
        str(target_dir),
        "--init",
        str(drafter_dir),
        "--anchors",
        "8",
        "--batch-sequences",
        "2",
        "--max-steps",
        "2",
        "--eval-every",
        "1",
    ]
    assert (
        main(
            common
            + [
                "--out",
                str(out),
                "--markov-rank",
                "4",
                "--markov-head",
                "rnn",
                "--confidence-head",
                "--draft-vocab-size",
                "40",
            ]
        )
        == 0
    )
    log = [json.loads(l) for l in (out / "train_log.jsonl").read_text().splitlines()]
    assert "confidence_brier" in log[-1] and "heldout_tau" in log[-1]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]  # z-lab's block convention, heads beside it
    heads = config["dflash_config"]
    assert heads["markov_rank"] == 4 and heads["markov_head_type"] == "rnn" and heads["enable_confidence_head"]
    drafter = Drafter.load(out)
    assert (
        not drafter.cfg.anchor_predicts
        and drafter.markov_head.head_type == "rnn"
        and drafter.confidence_head is not None
    )
    misplaced = dict(config, markov_rank=heads["markov_rank"])  # DeepSpec's place on a z-lab architecture: refused
    with pytest.raises(
        LoopspecError, match="markov_rank of a \\['DFlashDraftModel'\\] drafter belong inside dflash_config"
    ):
        DrafterConfig.from_checkpoint(misplaced)
    with pytest.raises(LoopspecError, match="z-lab DFlash drafters only"):
        require_zlab_block(drafter.cfg, "the vLLM DFlash bundle")

    engine = TorchEngine(load_target_dir(target_dir), drafter, max_context=128)
    ar = generate(engine, [5, 6, 7, 8], max_new_tokens=24)
    for settings in (DecodingSettings("dflash", 6), DecodingSettings("dloop", 4, 3, -1e9)):
        assert generate(engine, [5, 6, 7, 8], settings, max_new_tokens=24).tokens == ar.tokens

    # --heads-only: the backbone (and the mask/anchor embedding path) stays bit for bit the init's
    heads_only = tmp_path / "heads-only"
    assert main(common + ["--out", str(heads_only), "--markov-rank", "4", "--heads-only"]) == 0
    init, trained = Drafter.load(drafter_dir).state_dict(), Drafter.load(heads_only).state_dict()
    backbone = [k for k in init if not k.startswith(("markov_head.", "confidence_head."))]
    assert backbone and all(torch.equal(init[k].to(torch.bfloat16), trained[k].to(torch.bfloat16)) for k in backbone)
    assert trained["markov_head.markov_w2.weight"].abs().sum() > 0  # while the head moved off its zero start

    capsys.readouterr()
    assert main(common + ["--out", str(tmp_path / "bad"), "--heads-only"]) == 2
    assert "--heads-only trains the DSpark heads" in capsys.readouterr().err
    assert main(common + ["--out", str(tmp_path / "bad"), "--markov-rank", "4", "--markov-head", "lstm"]) == 2
    assert capsys.readouterr().err.strip().startswith("loopspec: error: unknown Markov head type 'lstm'")
    assert main(common + ["--out", str(tmp_path / "bad"), "--markov-rank", "4", "--loop-stages", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("loopspec: error:") and "--loop-stages" in err and "\n" not in err
    assert not (tmp_path / "bad").exists()


def test_the_train_config_refuses_what_cannot_apply(tiny_targets):
    """One place (TrainConfig, DSparkHeads): a negative stage count, --heads-only without a trained
    backbone, a confidence weight without the head, a Markov head type without a rank."""
    import math

    from loopspec.train.trainer import TrainConfig
    from loopspec.weights import load_target_dir

    for bad, says in (
        (dict(loop_stages=-2), r"\(--loop-stages\) must be an integer >= 0"),
        (dict(loop_stages=True), "--loop-stages"),
        (dict(confidence_weight=math.nan), r"\(--confidence-weight\) must be a finite number >= 0"),
        (dict(confidence_weight=-1.0), "--confidence-weight"),
    ):
        with pytest.raises(LoopspecError, match=says):
            TrainConfig(**bad)
    with pytest.raises(LoopspecError, match="--heads-only .* needs --init"):
        TrainConfig(heads_only=True).check_init(from_init=False)
    TrainConfig(heads_only=True).check_init(from_init=True)
    TrainConfig().check_init(from_init=False)
    cfg = DrafterConfig.for_target(
        load_target_dir(tiny_targets["qwen3"]).cfg, num_layers=1, block_size=4, mask_token_id=127
    )
    plain, confident = cfg, replace(cfg, confidence_head=True)
    with pytest.raises(LoopspecError, match="--confidence-weight weighs a confidence head's loss"):
        TrainConfig(confidence_weight=0.5).check_drafter(plain)
    TrainConfig(confidence_weight=0.5).check_drafter(confident)
    assert (TrainConfig().confidence_loss_weight, TrainConfig(confidence_weight=0.5).confidence_loss_weight) == (
        1.0,
        0.5,
    )
    with pytest.raises(LoopspecError, match="--heads-only trains the DSpark heads"):
        TrainConfig(heads_only=True).check_drafter(plain)
    with pytest.raises(LoopspecError, match="loop-aware training"):
        TrainConfig(loop_stages=2).check_drafter(replace(cfg, markov_rank=4))
    with pytest.raises(LoopspecError, match=r"a gated Markov head \(--markov-head\) needs its rank"):
        DSparkHeads(markov_head_type="gated", confidence_head=True)
    assert DSparkHeads(markov_rank=4).markov_head_type == "vanilla"
    with pytest.raises(LoopspecError, match="markov_rank 1099511627776 is larger than the vocabulary"):
        replace(cfg, markov_rank=2**40)
