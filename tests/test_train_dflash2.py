"""DFlash2 training (`loopspec train --family dflash2`): the selector's training-time scores are the
walk's (a transition read one slot off fails that), each anchor's block is the engine's stage, a
DFlash2 drafter made from a DFlash one drafts as it did, a tiny drafter's loss falls and its walk's
τ beats the untrained drafter's and the same drafter with its selector switched off, `loopspec data`
→ `train --family dflash2 --init DFLASH` → a checkpoint that resumes on the same trajectory, loads
back and decodes plain decoding's tokens, and settings that do not apply are refused in one line."""

import json
import random

import pytest
import torch

from loopspec.cli import main
from loopspec.errors import LoopspecError
from loopspec.model.dflash2 import DFlash2Drafter, selector_stage
from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.model.eagle3 import fresh_eagle3
from loopspec.train import dflash2_trainer
from loopspec.train.dflash2_trainer import DFlash2Trainer
from loopspec.train.trainer import DrafterTrainer, TrainConfig
from loopspec.weights import load_target_dir

BLOCK, MASK, TAPS = 6, 127, [1, 4]


def dflash_drafter(target, seed=0):
    torch.manual_seed(seed)
    return Drafter(
        DrafterConfig.for_target(target.cfg, num_layers=1, block_size=BLOCK, mask_token_id=MASK, target_layer_ids=TAPS)
    )


def dflash2_trainer_for(target, seed=0, top_k=16, rank=16, anchors=16):
    drafter = DFlash2Drafter.from_dflash(dflash_drafter(target, seed), selector_rank=rank, selector_top_k=top_k)
    return DFlash2Trainer(target, drafter, TrainConfig(family="dflash2", anchors=anchors))


def cycle_data(trainer, n=4, length=30, cycle=11, prompt_len=4, seed=0):
    """Toy continuations (tokens walk the cycle 3, 4, .., 3 + cycle - 1) with the target's taps."""
    g = random.Random(seed)
    data = []
    for _ in range(n):
        tokens = torch.tensor([3 + (g.randrange(cycle) + t) % cycle for t in range(length)])
        mask = torch.arange(length) >= prompt_len
        data.append((tokens, mask, trainer.target_pass(tokens, False)[0]))
    return data


def tau(trainer, data):
    sums = [trainer.expected_tau(tokens, mask, taps) for tokens, mask, taps in data]
    return sum(s["tau"] for s, _ in sums) / sum(n for _, n in sums)


def context(trainer, tokens, taps):
    features = trainer.drafter.features(taps[None, : tokens.numel() - 1])
    return trainer.drafter.context_kv(features, torch.arange(tokens.numel() - 1))


def shaken(trainer, scale=0.3):
    """The trainer's drafter far from its start (every convolution, edge and weight matters)."""
    with torch.no_grad():
        for p in trainer.drafter.parameters():
            p.add_(torch.randn_like(p) * scale)
    return trainer


def test_training_time_selector_scores_are_the_walks(tiny_targets, monkeypatch):
    """Data that follows the walk's own drafts: every slot's teacher-forced predecessor is the walk's,
    so the scores the loss reads (spied on `selector_scores`) must be the walk's at every slot of the
    anchor's block: candidates in the walk's order, log-softmax equal to `selector_stage`'s log-probs."""
    target = load_target_dir(tiny_targets["llama"])
    torch.manual_seed(1)
    trainer = shaken(dflash2_trainer_for(target, top_k=8))
    prefix = torch.randint(3, 120, (12,))
    anchor = prefix.numel() - 1
    with torch.no_grad():
        ctx_k, ctx_v = context(trainer, prefix, trainer.target_pass(prefix, False)[0])
        _, hidden = trainer.stage(prefix, torch.tensor([anchor]), ctx_k, ctx_v)
        drafts, logprobs, _ = selector_stage(trainer.drafter, hidden, prefix[[anchor]], target.lm_head)
    tokens = torch.cat([prefix, drafts[0, :, 0]])  # the data continues with the walk's path
    assert len(set(tokens[anchor + 1 :].tolist())) > 1  # a path, not one token repeated
    mask = torch.arange(tokens.numel()) >= anchor  # anchors from `anchor` on; the first one's block is its walk
    seen = []
    real = dflash2_trainer.selector_scores
    monkeypatch.setattr(dflash2_trainer, "selector_scores", lambda *a: seen.append(real(*a)) or seen[-1])
    with torch.no_grad():
        _, stats = trainer.sequence_loss(tokens, mask, trainer.target_pass(tokens, False)[0], random.Random(0))
    ((scores, candidates),) = seen
    D = BLOCK - 1
    assert stats["anchors"] == D and stats["selector_slots"] == D * (D + 1) // 2
    scores, candidates = scores[:D], candidates[:D]  # the rows of the first anchor's block (rows are block-major)
    order = scores.sort(dim=-1, descending=True, stable=True).indices[:, : drafts.shape[-1]]
    assert torch.equal(candidates.gather(-1, order), drafts[0])
    mine = torch.log_softmax(scores, -1).gather(-1, order)
    assert torch.allclose(mine, logprobs[0], atol=1e-5), (mine - logprobs[0]).abs().max()


def test_each_anchors_block_is_the_engines_stage(tiny_targets):
    """Anchors trained together give each block what it gives alone over the context before its
    anchor (a block never convolves or attends into another)."""
    target = load_target_dir(tiny_targets["llama"])
    torch.manual_seed(2)
    trainer = shaken(dflash2_trainer_for(target))
    tokens = torch.randint(3, 120, (24,))
    anchors = torch.tensor([3, 4, 10, 17])
    with torch.no_grad():
        ctx_k, ctx_v = context(trainer, tokens, trainer.target_pass(tokens, False)[0])
        positions, together = trainer.stage(tokens, anchors, ctx_k, ctx_v)
        for row, a in enumerate(anchors.tolist()):
            ids = torch.full((1, BLOCK), MASK)
            ids[0, 0] = tokens[a]
            alone = trainer.drafter(
                target.embed_tokens(ids), positions[row][None, None], ctx_k[:, :, :, :a], ctx_v[:, :, :, :a]
            )
            assert torch.allclose(together[row], alone[0], atol=1e-5), (row, (together[row] - alone[0]).abs().max())


def test_a_dflash2_drafter_made_from_a_dflash_one_drafts_as_it_did(tiny_targets):
    """Identity convolutions and zero edges: the DFlash trainer's block states, and a walk that drafts
    each slot's unary ranks (its argmax first), as the DFlash drafter drafts."""
    target = load_target_dir(tiny_targets["llama"])
    base = dflash_drafter(target, seed=3)
    with torch.no_grad():
        for p in base.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    dflash = DrafterTrainer(target, base, TrainConfig(anchors=16))
    dflash2 = DFlash2Trainer(
        target,
        DFlash2Drafter.from_dflash(base, selector_rank=8, selector_top_k=8),
        TrainConfig(family="dflash2", anchors=16),
    )
    tokens = torch.randint(3, 120, (24,))
    anchors = torch.tensor([2, 5, 11, 18])
    with torch.no_grad():
        ctx_k, ctx_v = context(dflash, tokens, dflash.target_pass(tokens, False)[0])
        ((_, _, reference),) = dflash.loop_stages(tokens, anchors, ctx_k, ctx_v, 1)
        _, hidden = dflash2.stage(tokens, anchors, ctx_k, ctx_v)
        assert torch.allclose(hidden, reference, atol=1e-5), (hidden - reference).abs().max()
        drafts, logprobs, _ = selector_stage(dflash2.drafter, hidden, tokens[anchors], target.lm_head)
        unary = target.lm_head(reference[:, 1:]).topk(8, dim=-1)  # the selector's 8 candidates
    C = drafts.shape[-1]
    assert torch.equal(drafts, unary.indices[..., :C])
    # every edge is exactly 0: the walk's scores are the unary logits
    assert torch.allclose(logprobs, torch.log_softmax(unary.values, -1)[..., :C], atol=1e-6, rtol=0)
    with pytest.raises(LoopspecError, match="starts from a z-lab DFlash drafter"):
        DFlash2Drafter.from_dflash(base.with_heads(_markov_heads()))


def _markov_heads():
    from loopspec.model.dspark import DSparkHeads

    return DSparkHeads(markov_rank=4)


def test_tiny_dflash2_loss_falls_and_its_walk_beats_the_controls(tiny_targets):
    """On toy continuations the loss falls and the walk's τ over the trained sequences goes from
    about 1 to well above both the untrained drafter's and the same trained drafter's with its
    selector switched off (successor codebook zeroed: the walk takes the unary argmax)."""
    target = load_target_dir(tiny_targets["llama"])
    trainer = dflash2_trainer_for(target)
    data = cycle_data(trainer, n=3)
    before = tau(trainer, data)
    drafter = trainer.drafter
    selector = [p for n, p in drafter.named_parameters() if n.startswith("candidate_selector.")]
    backbone = [p for n, p in drafter.named_parameters() if not n.startswith("candidate_selector.")]
    # the selector's edge is a product of three factors starting at (0.02, 0.02, 0): at the backbone's
    # rate it would take many more steps than a test has to grow
    opt = torch.optim.AdamW([{"params": backbone, "lr": 1e-2}, {"params": selector, "lr": 1e-1}])
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for tokens, mask, taps in data:
            loss, stats = trainer.sequence_loss(tokens, mask, taps, random.Random(step))
            (loss / len(data)).backward()
            total += loss.item()
        opt.step()
        losses.append(total / len(data))
    after = tau(trainer, data)
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.zero_()
    switched_off = tau(trainer, data)
    print(f"τ {before:.2f} → {after:.2f}; selector off {switched_off:.2f}; loss {losses[0]:.2f} → {losses[-1]:.2f}")
    # measured: τ 1.00 → 2.60, selector off 1.23; loss 5.26 → 4.70 (the selector's term rises at first, as
    # more slots' tokens become candidates)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.3, losses
    assert before < 1.3 and after > before + 1.2, (before, after)
    assert after > switched_off + 1.0, (after, switched_off)


STEPS = 50


@pytest.fixture(scope="module")
def data_dir(tiny_pair, tmp_path_factory):
    target_dir, _ = tiny_pair
    root = tmp_path_factory.mktemp("d2data")
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


def test_cli_trains_a_dflash2_drafter_from_a_dflash_one_that_resumes_loads_and_decodes_losslessly(
    tiny_pair, data_dir, tmp_path
):
    from loopspec.engines.torch_engine import TorchEngine
    from loopspec.pair import load_pair
    from loopspec.runtime.decoder import generate
    from loopspec.settings import DecodingSettings
    from loopspec.weights import read_safetensors

    target_dir, dflash_dir = tiny_pair
    common = [
        "train",
        "--family",
        "dflash2",
        "--data",
        str(data_dir),
        "--target",
        str(target_dir),
        "--init",
        str(dflash_dir),
        "--anchors",
        "8",
        "--batch-sequences",
        "2",
        "--lr",
        "3e-3",
        "--eval-every",
        "4",
        "--save-every",
        "2",
        "--epochs",
        "3",
        "--max-steps",
        "6",
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
    assert [r["step"] for r in log] == list(range(7)) and "heldout_tau" in log[0] and "heldout_tau" in log[-1]
    assert (
        all(0 <= r["selector_acc"] <= r["selector_coverage"] <= 1 for r in log[1:]) and log[-1]["selector_coverage"] > 0
    )

    config = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["selector_top_k"] == 16
    assert config["loopspec"]["training"]["config"]["family"] == "dflash2"
    pair = load_pair(str(target_dir), str(tmp_path / "straight"))
    assert isinstance(pair.drafter, DFlash2Drafter)
    # the DFlash drafter's layers were loaded: its attention weights moved from there, not from a fresh start
    init = read_safetensors(dflash_dir / "model.safetensors")["layers.0.self_attn.q_proj.weight"]
    trained = pair.drafter.layers[0].self_attn.q_proj.weight.detach()
    assert (trained - init.float()).abs().max() < 0.05
    engine = TorchEngine(pair.target, pair.drafter, max_context=128)
    for prompt in ([5, 6, 7, 8], [9, 3, 30, 4, 12]):
        ar = generate(engine, prompt, max_new_tokens=30)
        spec = generate(engine, prompt, DecodingSettings("dflash", 4), max_new_tokens=30)
        assert spec.tokens == ar.tokens

    # --init continues a DFlash2 drafter
    assert (
        main(
            [
                "train",
                "--family",
                "dflash2",
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
                "--anchors",
                "8",
                "--batch-sequences",
                "2",
            ]
        )
        == 0
    )
    assert isinstance(DFlash2Drafter.load(tmp_path / "more"), DFlash2Drafter)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--family", "dflash2", "--loop-stages", "2"], "--loop-stages does not apply to DFlash2 training"),
        (["--family", "dflash2", "--causal-in-block"], "--causal-in-block does not apply to DFlash2 training"),
        (
            ["--family", "dflash2", "--markov-rank", "4"],
            "--markov-rank / --markov-head / --confidence-head does not apply to DFlash2 training",
        ),
        (["--family", "dflash2", "--draft-vocab-size", "40"], "--draft-vocab-size does not apply to DFlash2 training"),
        (["--family", "dflash2", "--init", "DFLASH2", "--num-layers", "2"], "a DFlash2 drafter cannot be deepened"),
        (["--init", "DFLASH2"], "the --init drafter (DFlash2) is trained with --family dflash2, not --family dflash"),
        (["--family", "eagle3", "--init", "DFLASH2"], "trained with --family dflash2, not --family eagle3"),
        (["--family", "dflash2", "--init", "EAGLE3"], "not this EAGLE-3 drafter"),
    ],
)
def test_bad_settings_are_refused_in_one_line(tiny_pair, data_dir, tmp_path, capsys, flags, message):
    target_dir, dflash_dir = tiny_pair
    dirs = {"DFLASH2": tmp_path / "d2", "EAGLE3": tmp_path / "e3"}
    if "DFLASH2" in flags:
        DFlash2Drafter.from_dflash(Drafter.load(dflash_dir), selector_rank=8, selector_top_k=8).save(dirs["DFLASH2"])
    if "EAGLE3" in flags:
        fresh_eagle3(load_target_dir(target_dir).cfg, target_layer_ids=[0, 2, 4]).save(dirs["EAGLE3"])
    flags = [str(dirs[f]) if f in dirs else f for f in flags]
    out = tmp_path / "out"
    code = main(
        ["train", "--data", str(data_dir), "--target", str(target_dir), "--out", str(out), "--max-steps", "1"] + flags
    )
    assert code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("loopspec: error:") and message in err[0], err
    assert not (out / "train_log.jsonl").exists()


def test_the_kind_record_says_how_dflash2_trains():
    from loopspec.model.dflash2 import DFlash2Config

    base = DrafterConfig(
        hidden_size=64,
        intermediate_size=80,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=128,
        num_target_layers=6,
        target_layer_ids=[1],
        mask_token_id=MASK,
        block_size=BLOCK,
    )
    kind = DFlash2Config.over(base).kind
    assert kind.training_family == "dflash2" and not kind.trains_loop_aware
    assert TrainConfig(family="dflash2").anchors == 512
    with pytest.raises(LoopspecError, match="--loop-stages does not apply to DFlash2 training"):
        TrainConfig(family="dflash2", loop_stages=2)
    with pytest.raises(LoopspecError, match=r"trained with --family dflash2, not --family dflash\b"):
        TrainConfig().check_drafter(DFlash2Config.over(base))


def test_a_fresh_drafter_and_one_from_a_reduced_vocabulary_start_as_dflash2_drafters(tiny_pair):
    """No --init: a fresh DFlash drafter made a DFlash2 one (z-lab's sizes, zero edges); an --init drafter
    with a reduced draft vocabulary (as v6d) leaves its d2t behind: the selector reads the whole head."""
    from loopspec.pair import load_pair
    from loopspec.train.run import prepare_drafter

    target_dir, dflash_dir = tiny_pair
    pair = load_pair(str(target_dir), "none")
    drafter, vocab = prepare_drafter(pair, str(target_dir), block_size=BLOCK, train=TrainConfig(family="dflash2"))
    assert isinstance(drafter, DFlash2Drafter) and vocab is None and drafter.cfg.block_size == BLOCK
    assert (drafter.cfg.selector_rank, drafter.cfg.selector_top_k, drafter.cfg.conv_kernel_size) == (256, 16, 2)
    assert not drafter.candidate_selector.successor_codebook.any()
    base = Drafter.load(dflash_dir)
    base.draft_ids = torch.arange(0, 128, 2)
    base.cfg.extra = {"draft_vocab_size": 64}
    made = DFlash2Drafter.from_dflash(base)
    assert made.draft_ids is None and "draft_vocab_size" not in made.cfg.extra
