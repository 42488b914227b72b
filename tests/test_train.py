"""Drafter training: block mask, anchors, weights, and a tiny overfit run."""

import json
import math
import random

import pytest
import torch

from loopspec.errors import LoopspecError
from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.train.samples import Sample
from loopspec.train.trainer import (
    DrafterTrainer,
    TrainConfig,
    block_mask_dense,
    default_gamma,
    position_weights,
    sample_anchors,
)
from loopspec.weights import load_target_dir


@pytest.mark.parametrize("causal", [False, True])
def test_block_mask_sees_strict_context_and_own_block(causal):
    anchors = torch.tensor([0, 3, 4, 9])
    B, C = 4, 12
    dense = block_mask_dense(anchors, B, C, causal)
    assert dense.shape == (16, C + 16)
    for q in range(16):
        blk, qi = divmod(q, B)
        for kv in range(C + 16):
            if kv < C:
                expect = kv < int(anchors[blk])  # strictly before its anchor
            else:
                kb, ki = divmod(kv - C, B)
                expect = kb == blk and (not causal or ki <= qi)
            assert bool(dense[q, kv]) == expect, (q, kv)


def test_anchor_sampling_respects_loss_mask():
    mask = torch.tensor([False] * 10 + [True] * 20 + [False] * 3 + [True] * 1)
    rng = random.Random(0)
    for limit in (5, 100):
        anchors = sample_anchors(mask, limit, rng)
        assert anchors.tolist() == sorted(anchors.tolist())
        assert len(anchors) == min(limit, 19)
        for a in anchors.tolist():
            assert mask[a] and mask[a + 1]
    assert sample_anchors(torch.tensor([True, False, True]), 8, rng).numel() == 0


def test_weight_formula():
    w = position_weights(15, default_gamma(16))  # a block of 16 in z-lab's convention drafts 15
    assert w.shape == (15,)
    assert torch.allclose(w, torch.exp(-torch.arange(15.0) / 7.0))
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4


def cycle_samples(n, length, cycle=11, prompt_len=4, seed=0):
    """Deterministic toy continuation: tokens walk a fixed cycle 3, 4, ..., 3 + cycle - 1, 3, ..."""
    g = random.Random(seed)
    return [
        Sample(f"s{i}", [3 + (g.randrange(cycle) + t) % cycle for t in range(length)], prompt_len, "length")
        for i in range(n)
    ]


def test_heldout_split_is_seeded_disjoint_and_capped():
    """--eval-samples N holds out min(N, a tenth of the data) samples, the same ones for the same seed,
    never also trained on."""
    from loopspec.train.run import heldout_split

    samples = list(range(500))
    held, train = heldout_split(samples, 64, random.Random(0))
    assert len(held) == 50 and sorted(held + train) == samples  # capped at a tenth; a partition
    held16, _ = heldout_split(samples, 16, random.Random(0))
    assert held16 == held[:16]  # a smaller held-out set is a prefix of the larger: the same seed's order
    assert heldout_split(samples, 64, random.Random(0))[0] == held
    assert heldout_split(samples, 64, random.Random(1))[0] != held
    assert len(heldout_split(samples[:5], 16, random.Random(0))[0]) == 1  # at least one


def test_heldout_top_k_tau_is_the_ceiling_of_top_k_trees(tiny_targets):
    """τ of top-k trees: k = 1 is the argmax τ, it grows with k, and with the whole vocabulary every
    supervised position counts, so it is 1 + the run of supervised positions after each anchor."""
    target = load_target_dir(tiny_targets["llama"])
    B = 5
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=B, mask_token_id=127, target_layer_ids=[1, 4])
    torch.manual_seed(0)
    trainer = DrafterTrainer(target, Drafter(cfg), TrainConfig())
    tokens = torch.randint(0, 120, (40,))
    mask = torch.ones(40, dtype=torch.bool)
    mask[:6] = False  # the prompt
    mask[20:23] = False  # a gap: runs stop there
    taps, _ = trainer.target_pass(tokens, False)
    V = target.cfg.vocab_size
    sums, n = trainer.expected_tau(tokens, mask, taps, max_anchors=64, top_ks=(1, 2, 4, V))
    anchors = sample_anchors(mask, 64, random.Random(0))
    assert n == anchors.numel() > 0
    assert sums[1] == sums["tau"] and sums["tau"] <= sums[2] <= sums[4] <= sums[V]
    runs = 0
    for a in anchors.tolist():
        k = 1
        while k < B and a + k < 40 and mask[a + k]:
            k += 1
        runs += k  # 1 + the supervised positions a+1 .. a+B-1 before the first unsupervised one
    assert sums[V] == runs


def test_tiny_overfit_reaches_long_acceptance(tiny_targets):
    """On a deterministic toy continuation (counting), the drafter learns to draft whole blocks."""
    target = load_target_dir(tiny_targets["llama"])
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=6, mask_token_id=127, target_layer_ids=[1, 4])
    torch.manual_seed(0)
    drafter = Drafter(cfg)
    trainer = DrafterTrainer(target, drafter, TrainConfig(anchors=16))
    samples = cycle_samples(4, 30)
    data = []
    for s in samples:
        tokens = torch.tensor(s.tokens)
        taps, _ = trainer.target_pass(tokens, False)
        data.append((tokens, torch.tensor(s.loss_mask), taps))

    def tau():
        total, count = 0.0, 0
        for tokens, mask, taps in data:
            a, c = trainer.expected_tau(tokens, mask, taps)
            total, count = total + a["tau"], count + c
        return total / count

    before = tau()
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    rng = random.Random(0)
    for step in range(120):
        opt.zero_grad()
        for tokens, mask, taps in data:
            loss, _ = trainer.sequence_loss(tokens, mask, taps, rng)
            (loss / len(data)).backward()
        opt.step()
    after = tau()
    assert before < 2.0
    assert after >= 0.8 * cfg.block_size, after  # τ approaches the block size (6)


def test_data_train_resume_and_lossless_reduced_vocab(tiny_pair, tmp_path, capsys):
    """`loopspec data` → `loopspec train` (reduced vocab, resumed) → a drafter the loop runs losslessly."""
    from loopspec.cli import main
    from loopspec.runtime.decoder import generate
    from loopspec.engines.torch_engine import TorchEngine
    from loopspec.settings import DecodingSettings

    target_dir, _ = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"prompt number {i} says hello"]}) + "\n" for i in range(12)))
    data = tmp_path / "data"
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
                "24",
                "--batch-size",
                "5",
                "--cache-taps",
                "--tap-layers",
                "1,4",
                "--limit",
                "7",
            ]
        )
        == 0
    )
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
                "24",
                "--batch-size",
                "5",
                "--cache-taps",
                "--tap-layers",
                "1,4",
            ]
        )
        == 0
    )
    lines = (data / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 12 and len({json.loads(l)["id"] for l in lines}) == 12  # resumed, no duplicates
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["samples"] == 12 and manifest["settings"]["tap_layer_ids"] == [1, 4]
    first = json.loads(lines[0])
    from loopspec.weights import read_safetensors

    taps = read_safetensors(data / "taps" / "p.jsonl_1.safetensors")["taps"]
    assert taps.shape == (len(first["tokens"]) - 1, 2 * 64)

    out = tmp_path / "drafter"
    common = [
        "train",
        "--data",
        str(data),
        "--target",
        str(target_dir),
        "--out",
        str(out),
        "--block-size",
        "4",
        "--tap-layers",
        "1,4",
        "--mask-token-id",
        "127",
        "--anchors",
        "8",
        "--batch-sequences",
        "2",
        "--draft-vocab-size",
        "40",
        "--eval-every",
        "2",
        "--save-every",
        "2",
    ]
    assert main(common + ["--max-steps", "2"]) == 0
    with open(out / "train_log.jsonl", "a") as f:  # a step logged after the last save (then killed): redone
        f.write(json.dumps({"step": 3, "loss": -1.0}) + "\n")
    assert main(common + ["--max-steps", "4"]) == 0  # resumes from step 2
    log = [json.loads(l) for l in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 1, 2, 3, 4] and "heldout_tau" in log[0] and "heldout_tau" in log[-1]
    assert all(r.get("loss") != -1.0 for r in log)

    drafter = Drafter.load(out)
    assert drafter.draft_ids is not None and drafter.draft_ids.numel() == 40
    target = load_target_dir(target_dir)
    engine = TorchEngine(target, drafter, max_context=128)
    ar = generate(engine, [5, 6, 7, 8], max_new_tokens=30)
    spec = generate(engine, [5, 6, 7, 8], DecodingSettings("dflash", 4), max_new_tokens=30)
    assert spec.tokens == ar.tokens

    # --stop-after-steps stops on the unchanged schedule: stop at 3 + resume == 5 steps in one go
    from loopspec.weights import read_safetensors as read

    runs = {}
    for name, stops in (("straight", [None]), ("stopped", [3, None])):
        for stop in stops:
            extra = ["--stop-after-steps", str(stop)] if stop else []
            assert main(common[:6] + [str(tmp_path / name)] + common[7:] + ["--max-steps", "5"] + extra) == 0
        runs[name] = read(tmp_path / name / "model.safetensors")
    assert runs["straight"].keys() == runs["stopped"].keys()
    assert all(torch.equal(runs["straight"][k], runs["stopped"][k]) for k in runs["straight"])

    # --num-layers deepens an --init drafter (this one has 1 layer), keeping its draft vocabulary but
    # not its tuned setting (measured with the weights the run replaces); fewer layers than the
    # init's is refused with a one-line error and writes nothing
    from loopspec.runtime.tune import store_setting

    tuned = {"block_size": 4, "max_stages": 3, "gate_threshold": -0.5, "tree_budget": 0, "suffix": False}
    store_setting(out, tuned, "onnxruntime")
    assert Drafter.load(out).cfg.extra["dloop"] == tuned
    grown = tmp_path / "grown"
    deepen = [
        "train",
        "--data",
        str(data),
        "--target",
        str(target_dir),
        "--anchors",
        "8",
        "--batch-sequences",
        "2",
        "--max-steps",
        "1",
    ]
    assert main(deepen + ["--init", str(out), "--num-layers", "2", "--out", str(grown)]) == 0
    deeper = Drafter.load(grown)
    assert deeper.cfg.num_layers == 2 and deeper.draft_ids.numel() == 40
    assert "tuned" not in deeper.cfg.extra and "dloop" not in deeper.cfg.extra
    assert deeper.cfg.extra["draft_vocab_size"] == 40
    assert main(deepen + ["--init", str(grown), "--num-layers", "1", "--out", str(tmp_path / "shallower")]) == 2
    assert "can only be deepened" in capsys.readouterr().err
    assert not (tmp_path / "shallower").exists()


def test_prompt_file_with_unicode_line_separator(tmp_path):
    """JSON strings may hold U+2028; lines are split on newlines only."""
    from loopspec.prompts import read_prompts

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"turns": ["a\u2028b"]}, ensure_ascii=False) + "\n" + json.dumps({"turns": ["c"]}) + "\n")
    assert read_prompts(f) == ["a\u2028b", "c"]


def test_block_mask_with_private_pseudo_context():
    from loopspec.train.trainer import block_mask_with_private

    anchors, B, C, m = torch.tensor([2, 5]), 3, 6, 4
    mask = block_mask_with_private(anchors, B, C, m)
    assert mask.shape == (6, C + 2 * m + 2 * B)
    for q in range(6):
        b = q // B
        assert mask[q, :C].tolist() == [j < int(anchors[b]) for j in range(C)]
        assert mask[q, C : C + 2 * m].tolist() == [j // m == b for j in range(2 * m)]
        assert mask[q, C + 2 * m :].tolist() == [j // B == b for j in range(2 * B)]


def test_loop_aware_stages_match_inference_exactly(tiny_targets):
    """Training's stage 2 and 3 see exactly what DLoop's inference stages see."""
    from loopspec.runtime.decoder import draft_round
    from loopspec.engines.torch_engine import TorchEngine
    from loopspec.settings import DecodingSettings

    target = load_target_dir(tiny_targets["qwen3"])
    cfg = DrafterConfig.for_target(target.cfg, num_layers=2, block_size=5, mask_token_id=127, target_layer_ids=[1, 4])
    torch.manual_seed(3)
    drafter = Drafter(cfg)
    trainer = DrafterTrainer(target, drafter, TrainConfig(loop_stages=3))
    tokens = torch.randint(3, 120, (40,), generator=torch.Generator().manual_seed(5))
    taps, _ = trainer.target_pass(tokens, False)
    with torch.no_grad():
        ctx_k, ctx_v = drafter.context_kv(drafter.features(taps[None, :39]), torch.arange(39))
        anchors = torch.tensor([7, 20])
        trained = {stage: h for stage, _, h in trainer.loop_stages(tokens, anchors, ctx_k, ctx_v, 3)}

    class Recorder(TorchEngine):
        def draft(self, rows, anchors, positions, block_size):
            out = super().draft(rows, anchors, positions, block_size)
            self.hiddens.append(out[2][0])
            return out

    engine = Recorder(target, drafter, max_context=128)
    for i, a in enumerate(anchors.tolist()):
        engine.hiddens = []
        engine.prefill(0, tokens[:a].tolist(), want_taps=True)
        draft_round(engine, DecodingSettings("dloop", 5, 3, -1e9), [int(tokens[a])], [a], [100])
        assert len(engine.hiddens) == 3
        for stage in (1, 2, 3):
            assert (engine.hiddens[stage - 1] - trained[stage][i]).abs().max() <= 1e-4, stage


def adam_steps(drafter, steps, loss_of, context=None):
    """`steps` AdamW steps (lr 1e-2) on loss_of(rng), the loss computed inside `context`; → the losses."""
    import contextlib

    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    rng = random.Random(0)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with context if context is not None else contextlib.nullcontext():
            loss = loss_of(rng)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_loop_aware_loss_trains(tiny_targets):
    target = load_target_dir(tiny_targets["llama"])
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=4, mask_token_id=127, target_layer_ids=[2])
    torch.manual_seed(0)
    drafter = Drafter(cfg)
    trainer = DrafterTrainer(target, drafter, TrainConfig(anchors=8, loop_stages=3))
    tokens = torch.tensor(cycle_samples(1, 40)[0].tokens)
    mask = torch.tensor(cycle_samples(1, 40)[0].loss_mask)
    taps, _ = trainer.target_pass(tokens, False)
    losses = adam_steps(drafter, 80, lambda rng: trainer.loop_sequence_loss(tokens, mask, taps, rng)[0])
    assert torch.isfinite(torch.tensor(losses)).all()
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.4  # (this tiny target's logits start near uniform)


def test_dpace_and_kl_options_change_the_loss(tiny_targets):
    target = load_target_dir(tiny_targets["qwen2"])
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=4, mask_token_id=127, target_layer_ids=[2])
    torch.manual_seed(0)
    drafter = Drafter(cfg)
    s = cycle_samples(1, 30)[0]
    tokens, mask = torch.tensor(s.tokens), torch.tensor(s.loss_mask)
    losses = {}
    for name, tc in {
        "plain": TrainConfig(anchors=8),
        "dpace": TrainConfig(anchors=8, dpace=True),
        "kl": TrainConfig(anchors=8, kl_weight=1.0),
    }.items():
        trainer = DrafterTrainer(target, drafter, tc)
        taps, logits = trainer.target_pass(tokens, True)
        loss, _ = trainer.sequence_loss(tokens, mask, taps, random.Random(0), logits)
        loss.backward()
        losses[name] = loss.item()
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert losses["kl"] > losses["plain"]  # KL to the target is >= 0 and > 0 for a random drafter
    assert losses["dpace"] != losses["plain"]  # the option is wired in; its weights: the test below


def test_dpace_weights_match_a_hand_computed_case():
    """D-PACE weighs in-block position i by sum over k >= i of p_1 * ... * p_k (p: the drafter's
    probability of the label), normalized to mean 1; a position without a label ends the chain.
    Worked by hand on two blocks of 4 (position 0 is the anchor):
      block 0: p = 0.5, 0.8, 0.25 → products 0.5, 0.4, 0.1 → sums from i: 1.0, 0.5, 0.1
      block 1: p = 0.5, (no label), 0.25 → products 0.5, 0, 0 → labelled positions 1 and 3: 0.5, 0.0
    mean of the five = 2.1 / 5 = 0.42 → 1.0/0.42, 0.5/0.42, 0.1/0.42, 0.5/0.42, 0.0."""
    rows = (torch.tensor([0, 0, 0, 1, 1]), torch.tensor([1, 2, 3, 1, 3]))
    p = torch.tensor([0.5, 0.8, 0.25, 0.5, 0.25])
    factor = DrafterTrainer._dpace_factor(-torch.log(p), rows, 2, 4)
    expected = torch.tensor([1.0, 0.5, 0.1, 0.5, 0.0]) / 0.42
    assert torch.allclose(factor, expected, atol=1e-6), factor


def test_gamma_must_be_positive(tiny_targets):
    """A decay length of 0 once became the default silently; now it is refused, like a negative one."""
    target = load_target_dir(tiny_targets["qwen2"])
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=4, mask_token_id=127, target_layer_ids=[2])
    for gamma in (0.0, -1.0, float("nan")):
        with pytest.raises(LoopspecError, match="gamma must be a finite number > 0"):
            DrafterTrainer(target, Drafter(cfg), TrainConfig(gamma=gamma))
    trainer = DrafterTrainer(target, Drafter(cfg), TrainConfig(gamma=2.0))
    assert torch.allclose(trainer.weights, torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))


def test_bfloat16_compute_matches_float32_and_trains(tiny_targets):
    """--compute-dtype bfloat16: the same loss as fp32 up to bf16 rounding, gradients reach fp32 weights,
    and an unknown dtype is refused before any work."""
    from loopspec.errors import LoopspecError
    from loopspec.train.trainer import compute_context

    target = load_target_dir(tiny_targets["llama"])
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=6, mask_token_id=127, target_layer_ids=[1, 4])
    torch.manual_seed(0)
    drafter = Drafter(cfg)
    s = cycle_samples(1, 30)[0]
    tokens, mask = torch.tensor(s.tokens), torch.tensor(s.loss_mask)
    losses = {}
    for dtype in ("float32", "bfloat16"):
        tc = TrainConfig(anchors=16, compute_dtype=dtype)
        trainer = DrafterTrainer(target, drafter, tc)
        taps, _ = trainer.target_pass(tokens, False)
        with compute_context(tc):
            loss, _ = trainer.sequence_loss(tokens, mask, taps, random.Random(0))
        losses[dtype] = loss
    assert losses["bfloat16"].dtype == torch.float32  # the loss itself is reduced in fp32
    assert abs(losses["bfloat16"].item() - losses["float32"].item()) < 0.02 * losses["float32"].item()
    assert losses["bfloat16"].item() != losses["float32"].item()  # bf16 really ran
    drafter.zero_grad()
    losses["bfloat16"].backward()
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in drafter.parameters())
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0

    final = {}
    for dtype in ("float32", "bfloat16"):  # the same run in both: bf16 follows fp32's trajectory
        torch.manual_seed(0)
        drafter = Drafter(cfg)
        tc = TrainConfig(anchors=16, compute_dtype=dtype)
        trainer = DrafterTrainer(target, drafter, tc)
        taps, _ = trainer.target_pass(tokens, False)
        history = adam_steps(
            drafter, 60, lambda rng: trainer.sequence_loss(tokens, mask, taps, rng)[0], compute_context(tc)
        )
        assert sum(history[-5:]) / 5 < sum(history[:5]) / 5 - 0.3, (dtype, history)
        final[dtype] = sum(history[-5:]) / 5
    assert abs(final["bfloat16"] - final["float32"]) < 0.1 * final["float32"], final
    with pytest.raises(LoopspecError, match="compute dtype 'float16'"):
        compute_context(TrainConfig(compute_dtype="float16"))


def test_taps_only_target_pass_skips_the_lm_head(tiny_targets):
    target = load_target_dir(tiny_targets["llama"])
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=4, mask_token_id=127, target_layer_ids=[1, 4])
    trainer = DrafterTrainer(target, Drafter(cfg), TrainConfig())
    tokens = torch.tensor(cycle_samples(1, 20)[0].tokens)
    taps_only, none = trainer.target_pass(tokens, False)
    taps, logits = trainer.target_pass(tokens, True)
    assert none is None and logits.shape == (20, target.cfg.vocab_size)
    assert torch.equal(taps_only, taps)
