"""EAGLE-3 drafter training: training-time test over the target's three fused taps (docs/training.md).

What SpecForge trains (its OnlineEagle3Model), over one sequence of L tokens with the target's taps:
entry p (0 <= p < L-1) is (token p+1, fc(taps p)) at position p, the context a round's first step
extends (the anchor a = p+1 with the taps before it). Step 1 runs every entry at once, causal over the
entries, and its output at p drafts token p+2. Step j >= 2 unrolls the drafter on its own state: row
p's entry is (token p+j, teacher-forced; the state step j-1 returned at p, before the final norm) at
position p+j-1, attending to the entries up to p and to its own steps 2..j — exactly the keys a
round's step j sees at inference (loopspec/model/eagle3.py) — and drafts token p+j+1. Step j's loss is
the cross-entropy of its drafts over the supervised tokens the draft vocabulary covers, weighted
0.8^(j-1) (SpecForge's weights, summed over its 7 steps), each step's sum divided by the number of
supervised labels of step 1 (SpecForge divides by the sequence length: a constant per sequence too).
The labels are the data's tokens: for greedy-regenerated data, the target's argmax, the mode of the
target distribution SpecForge's soft labels carry. The embedding is the target's, frozen; the
drafter's own lm_head covers the draft vocabulary (initialised from the target's rows of it).

Rows that no step supervises (the prompt, but for the last steps before the response) run only as
the context's keys; step 1's queries, and every later step, run for the rows that draft a label.
"""

from __future__ import annotations

import random

import torch

from loopspec.errors import LoopspecError
from loopspec.model.eagle3 import Eagle3Drafter
from loopspec.model.target import Target
from loopspec.train.trainer import DraftVocab, TrainConfig, sample_anchors

STEP_DECAY = 0.8  # SpecForge's loss weight of TTT step j: 0.8^(j-1)


def unrolled_attention(
    q: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    own_k: list[torch.Tensor],
    own_v: list[torch.Tensor],
    ctx_mask: torch.Tensor,
) -> torch.Tensor:
    """One TTT step's attention without a dense mask over every step's keys: queries q [1, h, R, hd]
    over the context's keys ctx_k/v [1, kvh, P, hd] where ctx_mask [R, P] allows (the entries up to the
    row's own), and over each row's own earlier steps and this one (own_k/v: [1, kvh, R, hd] each,
    row r's key at row r) → [1, h, R, hd]."""
    heads, kv_heads, dim = q.shape[1], ctx_k.shape[1], q.shape[-1]
    group, scale = heads // kv_heads, dim**-0.5
    keys, values = ctx_k.repeat_interleave(group, 1), ctx_v.repeat_interleave(group, 1)  # [1, h, P, hd]
    scores = (q @ keys.transpose(-1, -2)) * scale  # [1, h, R, P]
    scores = scores.float().masked_fill(~ctx_mask, float("-inf"))
    if own_k:
        ks = torch.stack(own_k, dim=-2).repeat_interleave(group, 1)  # [1, h, R, j, hd]
        vs = torch.stack(own_v, dim=-2).repeat_interleave(group, 1)
        own = ((q[..., None, :] * ks).sum(-1) * scale).float()  # [1, h, R, j]
        scores = torch.cat([scores, own], dim=-1)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    P = keys.shape[2]
    out = probs[..., :P] @ values  # [1, h, R, hd]
    if own_k:
        out = out + (probs[..., P:, None] * vs).sum(-2)
    return out


class Eagle3Trainer:
    """The loss and held-out τ of an EAGLE-3 drafter, with the calls `train_drafter` makes of a trainer."""

    def __init__(self, target: Target, drafter: Eagle3Drafter, cfg: TrainConfig, draft_vocab: DraftVocab | None = None):
        self.target, self.drafter, self.cfg = target, drafter, cfg
        for p in target.parameters():
            p.requires_grad_(False)
        cfg.check_drafter(drafter.cfg)
        self.draft_vocab = draft_vocab
        rows = drafter.cfg.vocab_size if draft_vocab is None else draft_vocab.ids.numel()
        if rows != drafter.cfg.draft_vocab_size:
            raise LoopspecError(
                f"the drafter's lm_head has {drafter.cfg.draft_vocab_size} rows, its draft vocabulary {rows} tokens"
            )
        self.steps = cfg.ttt_steps
        target.set_taps(drafter.cfg.target_layer_ids)

    @torch.no_grad()
    def target_pass(self, tokens: torch.Tensor, want_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced target forward → taps [L, 3*H] (and logits [L, V] when asked)."""
        out = self.target(
            tokens[None], self.target.new_cache(tokens.numel()), want_taps=True, last_logits_only=not want_logits
        )
        return out.taps[0], (out.logits[0] if want_logits else None)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The drafter's own embedding where its checkpoint carries one, else the target's (frozen)."""
        own = self.drafter.embed_tokens
        return (own if own is not None else self.target.embed_tokens)(ids)

    def unroll(self, tokens: torch.Tensor, taps: torch.Tensor, rows: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Steps 1..`steps` of the rounds anchored at rows + 1 (teacher-forced) → each step's output
        before the final norm [R, H]; step j's output at row p drafts token p+j+1. tokens [L]; taps
        [>= L-1, 3*H]; rows [R] entry indices (sorted, < L-1)."""
        drafter = self.drafter
        L = tokens.numel()
        P = L - 1
        fused = drafter.fuse(taps[None, :P].to(drafter.fc.weight.dtype))  # [1, P, H]
        q, ctx_k, ctx_v, residual = drafter.project(self._embed(tokens[None, 1:]), fused, torch.arange(P)[None])
        ctx_mask = torch.arange(P)[None, :] <= rows[:, None]  # [R, P]: the entries up to the row's own
        out = drafter.finish(residual[:, rows], unrolled_attention(q[:, :, rows], ctx_k, ctx_v, [], [], ctx_mask))
        outs, own_k, own_v = [out[0]], [], []
        for j in range(2, steps + 1):
            following = tokens[(rows + j).clamp(max=L - 1)]  # token p+j (past the end: a row no label reads)
            q, k, v, residual = drafter.project(
                self._embed(following[None]), drafter.next_state(out), (rows + j - 1)[None]
            )
            own_k.append(k)
            own_v.append(v)
            out = drafter.finish(residual, unrolled_attention(q, ctx_k, ctx_v, own_k, own_v, ctx_mask))
            outs.append(out[0])
        return outs

    def _draft_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Target ids → draft rows (-1 where the draft vocabulary does not hold the token)."""
        if self.draft_vocab is None:
            return labels
        return self.draft_vocab.target_to_draft(self.target.cfg.vocab_size)[labels]

    # ---- loss of one sequence ----------------------------------------------------------------------
    def sequence_loss(
        self,
        tokens: torch.Tensor,
        loss_mask: torch.Tensor,
        taps: torch.Tensor,
        rng: random.Random,
        target_logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, dict]:
        """tokens/loss_mask [L]; taps [>= L-1, 3*H] → (Σ_j 0.8^(j-1) · CE sum of step j / step 1's
        label count, stats). `rng` and `target_logits` are the DFlash trainer's (anchors, KL): unused."""
        L = tokens.numel()
        supervised = loss_mask.nonzero().flatten()
        supervised = supervised[supervised >= 2]  # token p+2 is the first any row drafts
        if supervised.numel() == 0:
            return None, {}
        # rows whose steps draft a supervised token: p + 1 + j >= the first one for some j <= steps
        first_row = max(0, int(supervised[0]) - 1 - self.steps)
        rows = torch.arange(first_row, L - 2)  # row p drafts p+2 at step 1, so p <= L-3
        outs = self.unroll(tokens, taps, rows, self.steps)
        norm = float(loss_mask[rows + 2].sum().clamp_min(1))
        losses, stats = [], {"correct": 0, "labels": 0}
        for j, out in enumerate(outs, start=1):
            label_pos = rows + j + 1
            keep = (label_pos < L) & loss_mask[label_pos.clamp(max=L - 1)]
            y = self._draft_labels(tokens[label_pos[keep]])
            inside = y >= 0  # a token outside the draft vocabulary cannot be drafted: no loss (SpecForge's mask)
            hidden, y = out[keep][inside], y[inside]
            if y.numel() == 0:
                continue
            logp = torch.log_softmax(self.drafter.logits(hidden).float(), dim=-1)  # [n, Vd]
            nll = -logp.gather(1, y[:, None])[:, 0]
            losses.append(STEP_DECAY ** (j - 1) * nll.sum())
            stats["correct"] += int((logp.argmax(-1) == y).sum())
            stats["labels"] += int(y.numel())
        if not losses:
            return None, {}
        return torch.stack(losses).sum() / norm, stats

    # ---- held-out acceptance ---------------------------------------------------------------------
    @torch.no_grad()
    def expected_tau(
        self,
        tokens: torch.Tensor,
        loss_mask: torch.Tensor,
        taps: torch.Tensor,
        max_anchors: int = 64,
        top_ks: tuple[int, ...] = (),
    ) -> tuple[dict, int]:
        """Held-out acceptance of a stage of the drafter's block size (block_size - 1 steps) at up to
        `max_anchors` anchors (the DFlash trainer's: positions a where a and a+1 are supervised) →
        ({"tau": Σ 1 + leading drafts equal to the data's tokens, k: the same for the top k}, anchors).
        Teacher-forced steps are the drafter's own within the accepted leading run, so "tau" is the
        chain's exact acceptance of greedy-regenerated data."""
        L = tokens.numel()
        anchors = sample_anchors(loss_mask, max_anchors, random.Random(0))
        anchors = anchors[anchors >= 1]
        if anchors.numel() == 0:
            return {"tau": 0.0, **{k: 0.0 for k in top_ks}}, 0
        drafts = self.drafter.cfg.drafts_per_block(self.drafter.cfg.block_size)
        rows = anchors - 1  # the round anchored at a runs entry a-1 first
        outs = self.unroll(tokens, taps, rows, drafts)
        logits = self.drafter.logits(torch.stack(outs, dim=1))  # [n, D, Vd]
        label_pos = rows[:, None] + torch.arange(2, drafts + 2)[None]  # [n, D]
        counted = (label_pos < L) & loss_mask[label_pos.clamp(max=L - 1)]
        labels = tokens[label_pos.clamp(max=L - 1)]
        ids = self.drafter.draft_ids
        to_target = (lambda d: ids[d]) if ids is not None else (lambda d: d)

        def accepted(good: torch.Tensor) -> float:  # good [n, D] → Σ over anchors of 1 + leading run
            return float((torch.cumprod((good & counted).long(), dim=1).sum(1) + 1).sum())

        sums = {"tau": accepted(to_target(logits.argmax(-1)) == labels)}
        if top_ks:
            top = to_target(logits.topk(max(top_ks), dim=-1).indices)  # [n, D, kmax]
            for k in top_ks:
                sums[k] = accepted((top[..., :k] == labels[..., None]).any(-1))
        return sums, anchors.numel()
