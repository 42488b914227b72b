"""A training campaign's pieces: the total-variation term and DSpark's soft confidence label against a
hand computation, resume bit for bit with them on (and with held-out chain τ measured mid-run), the
campaign file a run keeps its record in across restarts, and what `loopspec train` refuses."""

import json
import math
import random

import pytest
import torch

from conftest import lively
from loopspec.cli import main
from loopspec.errors import LoopspecError
from loopspec.runtime.decoder import drafter_chain_tau
from loopspec.train import trainer as trainer_module
from loopspec.train.campaign import CAMPAIGN_KIND, Campaign
from loopspec.train.run import HeldOutPrompts, train_drafter
from loopspec.train.samples import sample_json
from loopspec.train.trainer import (
    DraftVocab,
    DrafterTrainer,
    TrainConfig,
    default_gamma,
    sample_anchors,
    total_variation,
)
from loopspec.weights import load_target_dir
from test_train import cycle_samples
from test_train_dspark import dspark_drafter


def test_total_variation_of_tiny_distributions_by_hand():
    """½ Σ|p − q| over the whole vocabulary; the drafter has no mass outside its draft vocabulary, so
    the target's mass there counts whole."""
    q = torch.tensor([[0.5, 0.1, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25]])
    # whole vocabulary: p = (0.7, 0.1, 0.1, 0.1) → ½ (0.2 + 0 + 0.2 + 0) = 0.2; p = q → 0
    p = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])
    tv = total_variation(p.log(), q.log(), None)
    assert torch.allclose(tv, torch.tensor([0.2, 0.0]), atol=1e-6)
    # draft vocabulary {0, 2}: p = (0.75, ·, 0.25, ·) → ½ (|0.75 − 0.5| + 0.1 + |0.25 − 0.3| + 0.1) = 0.25,
    # and (0.5, ·, 0.5, ·) against uniform → ½ (0.25 + 0.25 + 0.25 + 0.25) = 0.5
    p = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    tv = total_variation(p.log(), q.log(), torch.tensor([0, 2]))
    assert torch.allclose(tv, torch.tensor([0.25, 0.5]), atol=1e-6)
    # 1 − TV is the acceptance probability of a sampled draft, Σ min(p, q): (0.5 + 0.25) and (0.25 + 0.25)
    assert torch.allclose(1 - tv, torch.tensor([0.75, 0.5]), atol=1e-6)


@pytest.mark.parametrize("vocab", ["whole", "reduced"])
@pytest.mark.parametrize("label", ["hit", "tv"])
@pytest.mark.parametrize("anchor_predicts", [False, True], ids=["zlab", "deepspec"])
def test_tv_term_and_confidence_labels_match_a_hand_computation(
    tiny_targets, monkeypatch, anchor_predicts, label, vocab
):
    """The loss of one sequence, with every term on, recomputed row by row from the drafter's own logits
    and confidence logits (recorded as the trainer computes them) and the target's logits: each drafted
    position's label position written out, its TV and KL against the target row that predicts that
    position, its confidence label (the hit, or 1 − that TV) and its weight. A target distribution
    taken one position off, or confidence labels of the neighbouring row, change the figure."""
    target = lively(load_target_dir(tiny_targets["qwen3"]))
    B = 5
    drafter = dspark_drafter(target, "vanilla", anchor_predicts, B).train()
    V = target.cfg.vocab_size
    ids = torch.arange(0, V, 2) if vocab == "reduced" else None  # even tokens: odd labels get no row
    cfg = TrainConfig(
        anchors=4, ce_weight=0.3, tv_weight=0.9, kl_weight=0.4, confidence_weight=0.7, confidence_label=label
    )
    trainer = DrafterTrainer(target, drafter, cfg, DraftVocab(ids) if ids is not None else None)
    recorded = {}
    draft_logits, confidence = DrafterTrainer._draft_logits, trainer_module.confidence_logits

    def record_draft_logits(self, hidden, latent):
        recorded["logits"] = draft_logits(self, hidden, latent)
        return recorded["logits"]

    def record_confidence(drafter, h, prevs):
        recorded["confidence"] = confidence(drafter, h, prevs)
        return recorded["confidence"]

    monkeypatch.setattr(DrafterTrainer, "_draft_logits", record_draft_logits)
    monkeypatch.setattr(trainer_module, "confidence_logits", record_confidence)

    L = 30
    tokens = torch.randint(3, V, (L,), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(L, dtype=torch.bool)
    mask[:6] = False  # the prompt
    mask[16] = False  # a hole: rows drafting it carry no label
    taps, target_logits = trainer.target_pass(tokens, True)
    loss, stats = trainer.sequence_loss(tokens, mask, taps, random.Random(0), target_logits)

    first = 0 if anchor_predicts else 1  # DeepSpec's row 0 drafts a+1; z-lab's row k drafts a+k
    gamma = default_gamma(B)
    rows = []  # (label position, weight) in the trainer's row order: block by block, k ascending
    for a in sample_anchors(mask, 4, random.Random(0)).tolist():
        for k in range(first, B):
            t = a + k + (1 - first)
            if t < L and mask[t] and (ids is None or int(tokens[t]) % 2 == 0):
                rows.append((t, math.exp(-(k - first) / gamma)))
    logits, conf = recorded["logits"].detach().double(), recorded["confidence"].detach().double()
    assert logits.shape[0] == conf.shape[0] == len(rows) > 8
    total = weights = tv_sum = brier = 0.0
    for r, (t, w) in enumerate(rows):
        p = torch.zeros(V, dtype=torch.float64)  # the drafter's distribution over the whole vocabulary
        p[ids if ids is not None else slice(None)] = torch.softmax(logits[r], -1)
        q = torch.softmax(target_logits[t - 1].double(), -1)  # the target's row at t-1 predicts the token at t
        tv = 0.5 * (p - q).abs().sum().item()
        # forward KL from the target's distribution renormalised over the draft vocabulary
        q_draft = q if ids is None else q[ids] / q[ids].sum()
        p_draft = p if ids is None else p[ids]
        kl = (q_draft * (q_draft.log() - p_draft.log())).sum().item()
        y = int(tokens[t])
        nll = -math.log(p[y].item())
        hit = float(int(p.argmax()) == y)
        c = 1.0 - tv if label == "tv" else hit
        s = 1 / (1 + math.exp(-conf[r].item()))
        bce = -(c * math.log(s) + (1 - c) * math.log(1 - s))
        total += w * (0.3 * nll + 0.9 * tv + 0.4 * kl + 0.7 * bce)
        weights += w
        tv_sum += tv
        brier += (s - c) ** 2
    assert loss.item() == pytest.approx(total / weights, rel=1e-5)
    assert stats["tv_sum"] == pytest.approx(tv_sum, rel=1e-5)
    assert stats["confidence_brier"] == pytest.approx(brier, rel=1e-5)


def test_default_loss_is_unchanged_by_the_new_settings(tiny_targets):
    """CE weight 1, no TV and hard labels (the defaults) give the loss bit for bit as the same config
    spelled out, and a TV term moves it only by its own weighted sum."""
    target = lively(load_target_dir(tiny_targets["qwen3"]))
    tokens = torch.randint(3, 120, (30,), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(30, dtype=torch.bool)
    mask[:5] = False
    losses = {}
    for name, cfg in {
        "default": TrainConfig(anchors=6),
        "spelled": TrainConfig(anchors=6, ce_weight=1.0, tv_weight=0.0, confidence_label="hit"),
        "tv": TrainConfig(anchors=6, tv_weight=0.5),
    }.items():
        trainer = DrafterTrainer(target, dspark_drafter(target, "gated", False), cfg)
        taps, logits = trainer.target_pass(tokens, True)
        losses[name] = trainer.sequence_loss(tokens, mask, taps, random.Random(0), logits)
    assert torch.equal(losses["default"][0], losses["spelled"][0]) and "tv_sum" not in losses["default"][1]
    assert losses["tv"][0].item() > losses["default"][0].item() and losses["tv"][1]["tv_sum"] > 0


def write_data(directory, samples):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "samples.jsonl").write_text("".join(sample_json(s) + "\n" for s in samples))
    return directory


class Killed(Exception):
    """What a kill between two checkpoints looks like to the code after it: nothing more runs."""


def test_resume_is_bit_identical_with_tv_soft_labels_and_heldout_tau(tiny_targets, tmp_path):
    """4 steps straight = 2 steps stopped (--stop-after-steps) then resumed = a run killed at step 3
    (its checkpoint at 2) then resumed: the fp32 weights and the optimizer state (AdamW's moments and
    step counts) equal bit for bit, with CE + TV + soft confidence labels on and the held-out chain τ
    measured every step. A run that measures no held-out τ ends equal too (measuring leaves the
    modules it reads as they were), and the campaign file holds one record per run."""
    data = write_data(tmp_path / "data", cycle_samples(10, 24))
    prompts = [[3, 4, 5, 6, 7, 8, 9], [9, 10, 11, 12, 13, 3]]

    def run(out, *, stop=None, kill_at_call=None, measure=True, campaign=None):
        target = lively(load_target_dir(tiny_targets["llama"]))  # each run its own, as each process loads one
        calls = []

        def chain(drafter):
            calls.append(1)
            if kill_at_call is not None and len(calls) == kill_at_call:
                raise Killed
            return drafter_chain_tau(target, drafter, prompts, 12, set())

        cfg = TrainConfig(
            anchors=6,
            batch_sequences=2,
            epochs=2.0,
            ce_weight=0.1,
            tv_weight=0.9,
            confidence_label="tv",
            eval_every=2,
            save_every=2,
            eval_samples=1,
            lr=3e-3,
        )
        heldout = HeldOutPrompts(prompts, ["a:1", "a:2"], chain, every=1) if measure else None
        drafter = dspark_drafter(target, "vanilla", False, block_size=5, seed=4).train()
        return train_drafter(
            data_dir=data,
            target=target,
            drafter=drafter,
            out_dir=out,
            cfg=cfg,
            progress=False,
            max_steps=4,
            stop_after_steps=stop,
            heldout=heldout,
            campaign=campaign,
        )

    run(tmp_path / "straight")
    run(tmp_path / "unmeasured", measure=False)
    run(tmp_path / "stopped", stop=2)
    run(tmp_path / "stopped")
    book = tmp_path / "campaign.json"
    with pytest.raises(Killed):  # calls at steps 0, 1, 2, 3: killed after step 3, before its save
        run(tmp_path / "killed", kill_at_call=4, campaign=Campaign(book, ["loopspec", "train", "first"]))
    assert torch.load(tmp_path / "killed" / "checkpoint" / "train_state.pt", weights_only=False)["step"] == 2
    run(tmp_path / "killed", campaign=Campaign(book, ["loopspec", "train", "second"]))

    def state(name):
        return torch.load(tmp_path / name / "checkpoint" / "train_state.pt", weights_only=False)

    def flat(obj, prefix=""):  # every tensor and number of a nested state, by its path
        if isinstance(obj, dict):
            return {k: v for key, value in obj.items() for k, v in flat(value, f"{prefix}/{key}").items()}
        if isinstance(obj, (list, tuple)):
            return {k: v for i, value in enumerate(obj) for k, v in flat(value, f"{prefix}/{i}").items()}
        return {prefix: obj}

    straight = state("straight")
    assert straight["step"] == 4
    reference = flat({"drafter": straight["drafter"], "optimizer": straight["optimizer"]})
    assert any("exp_avg_sq" in k for k in reference) and any("confidence_head" in k for k in reference)
    for name in ("unmeasured", "stopped", "killed"):
        other = state(name)
        theirs = flat({"drafter": other["drafter"], "optimizer": other["optimizer"]})
        assert other["step"] == 4 and theirs.keys() == reference.keys(), name
        for k, v in reference.items():
            same = torch.equal(v, theirs[k]) if isinstance(v, torch.Tensor) else v == theirs[k]
            assert same, (name, k)

    def log(name):
        rows = [json.loads(line) for line in (tmp_path / name / "train_log.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in rows]

    rows = log("straight")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert all("heldout_chain_tau" in r and r["heldout_chain_block"] == 5 for r in rows)
    assert all(r["tv"] > 0 and "confidence_brier" in r for r in rows[1:])
    assert log("stopped") == log("killed") == rows  # the killed run's step-3 row is written again, once
    # measuring the chain τ changes nothing else in the log (the expected τ of the split included)
    assert log("unmeasured") == [{k: v for k, v in r.items() if not k.startswith("heldout_chain")} for r in rows]

    campaign = json.loads(book.read_text())
    assert campaign["kind"] == CAMPAIGN_KIND and len(campaign["runs"]) == 2
    first, second = campaign["runs"]
    assert first["command"] == ["loopspec", "train", "first"] and second["command"][-1] == "second"
    # the killed run's record says where its checkpoint got, which is where the next run began
    assert first["steps"] == {"from": 0, "to": 2, "schedule": 4} and not first["finished"]
    assert second["steps"] == {"from": 2, "to": 4, "schedule": 4} and second["finished"]
    assert [p["step"] for p in first["curve"]] == [0, 1, 2] and [p["step"] for p in second["curve"]] == [3, 4]
    by_step = {r["step"]: r for r in rows}
    for point in first["curve"] + second["curve"]:  # the log's held-out figures of that step, all of them
        row = by_step[point["step"]]
        assert point == {k: v for k, v in row.items() if k == "step" or k.startswith("heldout_")}
    assert "heldout_tau" in first["curve"][2] and "heldout_tau" not in first["curve"][1]  # (--eval-every 2)
    import hashlib

    sha = hashlib.sha256((data / "samples.jsonl").read_bytes()).hexdigest()
    assert first["data"] == second["data"] == {"path": str(data.resolve()), "samples_sha256": sha}
    assert first["cpu_s"] >= 0 and second["cpu_s"] > 0 and second["config"]["tv_weight"] == 0.9


def test_heldout_chain_tau_is_the_runtimes_and_leaves_its_modules_alone(tiny_targets):
    """The held-out τ is measured at the block asked for (else the drafter's own), over every prompt's
    tokens; the modules it was given keep their weights, their mode and their plain Linear layers
    (the engine prepacks copies for inference, not them)."""
    from loopspec.model.target import PackedLinear

    target = lively(load_target_dir(tiny_targets["llama"]))
    drafter = dspark_drafter(target, "vanilla", False, block_size=5, seed=1).train()
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    prompts = [[3, 4, 5, 6], [7, 8, 9, 10, 11]]
    out = drafter_chain_tau(target, drafter, prompts, 16, set(), block_size=4)
    assert out["block_size"] == 4 and out["tau"] >= 1.0 and out["tokens"] == 32
    assert drafter_chain_tau(target, drafter, prompts, 16, set())["block_size"] == 5  # the drafter's own block
    assert drafter.training  # left in training mode: the engine set a copy to eval
    for module in (target, drafter):
        assert not any(isinstance(m, PackedLinear) for m in module.modules())
    assert all(torch.equal(before[k], v) for k, v in drafter.state_dict().items())


def test_campaign_file_refuses_what_is_not_one(tmp_path):
    bad = tmp_path / "notes.json"
    bad.write_text(json.dumps({"runs": []}))
    with pytest.raises(LoopspecError, match="is not a training campaign file"):
        Campaign(bad, ["loopspec"])
    bad.write_text("{half")
    with pytest.raises(LoopspecError, match="not JSON"):
        Campaign(bad, ["loopspec"])
    empty = tmp_path / "empty.json"
    empty.write_text("")
    Campaign(empty, ["loopspec"])  # an empty file (as --campaign's check leaves it) starts a campaign


def test_the_new_settings_are_refused_where_they_cannot_apply(tiny_targets):
    from dataclasses import replace

    from loopspec.model.dflash import DrafterConfig

    for bad, says in (
        (dict(tv_weight=-0.5), r"--tv-weight must be a finite number >= 0"),
        (dict(ce_weight=math.inf), r"--ce-weight must be a finite number >= 0"),
        (dict(ce_weight=0.0), "leaves the drafts without a loss"),
        (dict(confidence_label="soft"), r"\(--confidence-label\) must be one of hit, tv"),
        (dict(family="eagle3", tv_weight=0.9), "--tv-weight applies to DFlash training only"),
        (dict(family="eagle3", confidence_label="tv"), "--confidence-label applies to DFlash training only"),
        (dict(family="dflash2", confidence_label="tv"), "--confidence-label does not apply to DFlash2"),
        (dict(loop_stages=2, tv_weight=0.5), "--tv-weight with --loop-stages is not implemented"),
        (dict(loop_stages=2, kl_weight=0.5), "--kl-weight with --loop-stages is not implemented"),
    ):
        with pytest.raises(LoopspecError, match=says):
            TrainConfig(**bad)
    assert TrainConfig(ce_weight=0.0, tv_weight=1.0).needs_target_logits
    assert not TrainConfig().needs_target_logits and TrainConfig(confidence_label="tv").needs_target_logits
    cfg = DrafterConfig.for_target(
        load_target_dir(tiny_targets["qwen3"]).cfg, num_layers=1, block_size=4, mask_token_id=127
    )
    with pytest.raises(LoopspecError, match="--confidence-label tv labels a confidence head's loss"):
        TrainConfig(confidence_label="tv").check_drafter(cfg)
    TrainConfig(confidence_label="tv").check_drafter(replace(cfg, confidence_head=True))
    TrainConfig(tv_weight=0.9).check_drafter(cfg)  # TV trains any block drafter's drafts


def test_train_cli_campaign_tv_and_heldout_prompts(tiny_pair, tmp_path, capsys):
    """`loopspec train` with DSpark's recipe, held-out prompts and a campaign file, end to end; then the
    one-line refusals of its new flags."""
    target_dir, drafter_dir = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"prompt number {i} says hi"]}) + "\n" for i in range(8)))
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"turns": [f"a question kept apart {i}"]}) + "\n" for i in range(2)))
    data = tmp_path / "data"
    common = ["--target", str(target_dir), "--max-new-tokens", "16", "--batch-size", "4"]
    assert main(["data", "--prompts", str(prompts), "--out", str(data)] + common) == 0
    book = tmp_path / "campaign.json"
    train = [
        "train",
        "--data",
        str(data),
        "--target",
        str(target_dir),
        "--init",
        str(drafter_dir),
        "--anchors",
        "6",
        "--batch-sequences",
        "2",
        "--max-steps",
        "2",
        "--eval-every",
        "1",
    ]
    dspark = ["--markov-rank", "4", "--confidence-head", "--ce-weight", "0.1", "--tv-weight", "0.9"]
    run = train + dspark + ["--confidence-label", "tv", "--heldout-prompts", str(heldout), "--campaign", str(book)]
    out = tmp_path / "drafter"
    assert main(run + ["--out", str(out), "--heldout-max-new-tokens", "8", "--heldout-block-size", "3"]) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 1, 2]
    assert all(r["heldout_chain_block"] == 3 and r["heldout_chain_tau"] >= 1.0 for r in log)
    assert all(r["tv"] > 0 for r in log[1:])
    (record,) = json.loads(book.read_text())["runs"]
    assert record["command"][:2] == ["loopspec", "train"] and "--campaign" in record["command"]
    assert record["steps"] == {"from": 0, "to": 2, "schedule": 2} and record["finished"]
    assert [p["step"] for p in record["curve"]] == [0, 1, 2]
    assert record["config"]["confidence_label"] == "tv" and record["config"]["ce_weight"] == 0.1

    capsys.readouterr()
    for args, says in (
        (train + ["--heldout-every", "2"], "--heldout-every sets how held-out prompts are measured"),
        (train + ["--tv-weight", "0.9", "--tap-cache", str(tmp_path / "taps")], "--tap-cache keeps taps only"),
        (train + ["--confidence-label", "tv"], "--confidence-label tv labels a confidence head's loss"),
        (train + ["--ce-weight", "0"], "leaves the drafts without a loss"),
        (train + ["--family", "eagle3", "--tv-weight", "1"], "--anchors, --tv-weight apply to DFlash training only"),
        (train + ["--heldout-prompts", str(prompts)], "are prompts the run trains on"),
        (train + ["--campaign", str(prompts)], "is not a training campaign file"),
    ):
        assert main(args + ["--out", str(tmp_path / "refused")]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("loopspec: error:") and says in err and err.count("\n") == 1, (args, err)
    with pytest.raises(SystemExit) as exit:  # argparse's own refusal, in the same one line
        main(train + ["--confidence-label", "soft", "--out", str(tmp_path / "refused")])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith("loopspec: error: train: argument --confidence-label")
    assert not (tmp_path / "refused").exists()
    assert "kind" not in prompts.read_text()  # a refused campaign file is left as it was


def test_heldout_chain_tau_follows_the_drafter_as_it_trains(tiny_targets, tmp_path):
    """On data the target wrote itself (greedy), a few dozen steps teach the drafter its continuations:
    the logged held-out chain τ rises from its step-0 value, and the last one is the τ of the drafter
    the checkpoint holds, measured afresh — not that of a copy made at an earlier measurement."""
    import copy

    from loopspec.decoding import SamplingParams
    from loopspec.model.dflash import Drafter, DrafterConfig
    from loopspec.runtime.decoder import regenerate_responses
    from loopspec.train.samples import Sample

    target = load_target_dir(tiny_targets["llama"])
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 120, (6,), generator=g).tolist() for _ in range(14)]
    responses = regenerate_responses(copy.deepcopy(target), prompts, 24, set(), SamplingParams(), g)
    samples = [Sample(f"s{i}", p + r, len(p), f) for i, (p, (r, f)) in enumerate(zip(prompts[:12], responses))]
    data = write_data(tmp_path / "data", samples)
    heldout = prompts[12:]

    def make_drafter():
        cfg = DrafterConfig.for_target(
            target.cfg, num_layers=1, block_size=4, mask_token_id=127, target_layer_ids=[1, 4]
        )
        torch.manual_seed(0)
        return Drafter(cfg)

    measure = HeldOutPrompts(heldout, ["h:1", "h:2"], lambda d: drafter_chain_tau(target, d, heldout, 16, set()), 6)
    cfg = TrainConfig(anchors=16, batch_sequences=4, epochs=20.0, lr=1e-2, eval_every=10, save_every=10)
    train_drafter(
        data_dir=data,
        target=target,
        drafter=make_drafter(),
        out_dir=tmp_path / "out",
        cfg=cfg,
        progress=False,
        max_steps=12,
        heldout=measure,
    )
    rows = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    curve = {r["step"]: r["heldout_chain_tau"] for r in rows if "heldout_chain_tau" in r}
    assert sorted(curve) == [0, 6, 12]
    assert curve[12] > curve[0] + 0.3, curve  # (this target repeats the prompt's last token: 1.0 → about 1.6)
    trained = make_drafter()
    trained.load_state_dict(
        torch.load(tmp_path / "out" / "checkpoint" / "train_state.pt", weights_only=False)["drafter"]
    )
    fresh = load_target_dir(tiny_targets["llama"])
    assert drafter_chain_tau(fresh, trained, heldout, 16, set())["tau"] == curve[12]
