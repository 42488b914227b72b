"""DFlash and DSpark drafter training (docs/training.md).

Per sequence: the target's taps give context features for every position; up to `anchors` anchors
are sampled where the position and the next are supervised, each opening a block
`[x_a, MASK × (B-1)]` at positions a .. a+B-1. A block sees the context strictly before its anchor
and the whole of its own block, nothing else. The loss is cross-entropy at the block's drafting
positions (z-lab's convention: k = 1 .. B-1 draft the token at a+k; DeepSpec's: k = 0 .. B-1 draft
the token at a+k+1), the d-th draft weighted exp(-d/γ), normalised by the weight sum; the lm_head is
evaluated only at the rows that carry a label (and, with a reduced draft vocabulary, only over its
rows). A DSpark drafter's Markov head corrects those logits from the token before each drafted one
(teacher-forced: the data's token, which is the drafted one wherever the drafts so far were
accepted), and its confidence head learns, by binary cross-entropy, whether the corrected argmax is
the data's token — for greedy-regenerated data, whether the target accepts that draft — or, with
`confidence_label="tv"`, 1 − the total variation between the drafter's and the target's distributions
there (DSpark's soft label). `tv_weight` adds that total variation itself to the loss beside the
cross-entropy (`ce_weight`): DeepSpec's DSpark recipe is 0.1 · CE + 0.9 · TV + the confidence BCE.
"""

from __future__ import annotations

import contextlib
import math
import random

import torch
import torch.nn.functional as F

from loopspec.errors import LoopspecError
from loopspec.model.draft_head import confidence_logits
from loopspec.model.dflash import Drafter
from loopspec.model.target import Target
from loopspec.train.config import TrainConfig

GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """γ = 7 for B = 16, 5 for 10, 4 for 8; otherwise B/2 - 1 (the line through those), at least 1."""
    return GAMMA_BY_BLOCK.get(block_size, max(1.0, block_size / 2 - 1))


def position_weights(num_drafts: int, gamma: float) -> torch.Tensor:
    """exp(-d/γ) for a block's drafts d = 0 .. num_drafts-1 → [num_drafts]."""
    return torch.exp(-torch.arange(num_drafts, dtype=torch.float32) / gamma)


def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, generator: random.Random) -> torch.Tensor:
    """Uniformly sampled anchors (sorted) among positions a where a and a+1 are both supervised."""
    ok = loss_mask[:-1] & loss_mask[1:]
    candidates = ok.nonzero().flatten().tolist()
    if len(candidates) > max_anchors:
        candidates = generator.sample(candidates, max_anchors)
    return torch.tensor(sorted(candidates), dtype=torch.long)


def block_mask_dense(
    anchors: torch.Tensor, block_size: int, context_len: int, causal_in_block: bool = False
) -> torch.Tensor:
    """Dense bool mask [nA*B, context_len + nA*B]: query row of block b sees context slots j < a_b and
    the keys of its own block (all of them, or those up to itself with causal_in_block)."""
    n = anchors.numel()
    q_block = torch.arange(n * block_size) // block_size  # [Q]
    q_pos = torch.arange(n * block_size) % block_size
    ctx = torch.arange(context_len)[None, :] < anchors[q_block][:, None]  # [Q, C]
    k_block = torch.arange(n * block_size) // block_size
    k_pos = torch.arange(n * block_size) % block_size
    own = q_block[:, None] == k_block[None, :]
    if causal_in_block:
        own = own & (k_pos[None, :] <= q_pos[:, None])
    return torch.cat([ctx, own], dim=1)


def block_mask_with_private(anchors: torch.Tensor, block_size: int, context_len: int, private_len: int) -> torch.Tensor:
    """DLoop stages: keys are [shared target context (C) ; per-block private pseudo-context
    (private_len entries per block, block-major) ; blocks]. A block sees the shared context strictly
    before its anchor, its own pseudo-context and its own block. → bool [nA*B, C + nA*m + nA*B]."""
    n = anchors.numel()
    q_block = torch.arange(n * block_size) // block_size
    ctx = torch.arange(context_len)[None, :] < anchors[q_block][:, None]
    private = (torch.arange(n * private_len) // max(private_len, 1))[None, :] == q_block[:, None]
    own = (torch.arange(n * block_size) // block_size)[None, :] == q_block[:, None]
    return torch.cat([ctx, private, own], dim=1)


COMPUTE_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def compute_context(cfg: TrainConfig):
    """The context a training loss is computed in: plain fp32, or CPU autocast to bfloat16."""
    if cfg.compute_dtype not in COMPUTE_DTYPES:
        raise LoopspecError(f"compute dtype {cfg.compute_dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}")
    dtype = COMPUTE_DTYPES[cfg.compute_dtype]
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def total_variation(
    draft_logp: torch.Tensor, target_logits: torch.Tensor, draft_ids: torch.Tensor | None
) -> torch.Tensor:
    """TV(p, q) = ½ Σ_v |p(v) − q(v)| over the target's whole vocabulary, per row: draft_logp [R, Vd]
    the drafter's log-probabilities over its draft vocabulary (target ids `draft_ids` [Vd]; None: the
    whole vocabulary), target_logits [R, V] the target's. The drafter puts no mass outside its draft
    vocabulary, so the target's mass there counts whole: 1 − TV is then the probability that
    speculative sampling accepts a token the drafter samples (Σ_v min(p, q)), which a reduced
    vocabulary does lower. → [R], differentiable in draft_logp."""
    q = torch.softmax(target_logits.float(), dim=-1)
    p = draft_logp.float().exp()
    if draft_ids is None:
        return 0.5 * (p - q).abs().sum(-1)
    q_in = q[:, draft_ids]
    outside = torch.ones(q.shape[-1], dtype=torch.bool, device=q.device)
    outside[draft_ids] = False
    return 0.5 * ((p - q_in).abs().sum(-1) + q[:, outside].sum(-1))


class DraftVocab:
    """An optional reduced draft vocabulary: target ids `ids` [Vd] (d2t offsets = ids - arange)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids.long()
        self.t2d = None

    def target_to_draft(self, vocab_size: int) -> torch.Tensor:
        if self.t2d is None:
            self.t2d = torch.full((vocab_size,), -1, dtype=torch.long)
            self.t2d[self.ids] = torch.arange(self.ids.numel())
        return self.t2d


def top_token_vocab(samples, size: int, vocab_size: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent response tokens (plus `always`), as sorted target ids."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(torch.tensor(s.tokens[s.prompt_len :], dtype=torch.long), minlength=vocab_size)
    for t in always:
        counts[t] = counts.max() + 1
    return torch.sort(torch.topk(counts, min(size, vocab_size)).indices).values


class DrafterTrainer:
    def __init__(self, target: Target, drafter: Drafter, cfg: TrainConfig, draft_vocab: DraftVocab | None = None):
        self.target, self.drafter, self.cfg = target, drafter, cfg
        for p in target.parameters():
            p.requires_grad_(False)
        self.draft_vocab = draft_vocab
        self.head_weight = target.lm_head.weight if draft_vocab is None else target.lm_head.weight[draft_vocab.ids]
        if cfg.gamma is not None and not (math.isfinite(cfg.gamma) and cfg.gamma > 0):
            # 0 once fell back to the default silently; a decay length must be a positive number
            raise LoopspecError(f"gamma must be a finite number > 0 (or None for the default), got {cfg.gamma}")
        cfg.check_drafter(drafter.cfg)
        gamma = default_gamma(drafter.cfg.block_size) if cfg.gamma is None else cfg.gamma
        self.first = drafter.cfg.first_draft  # block positions before the first draft (0 or 1)
        self.weights = position_weights(drafter.cfg.drafts_per_block(drafter.cfg.block_size), gamma)

        target.set_taps(drafter.cfg.target_layer_ids)

    # ---- taps ------------------------------------------------------------------------------------
    @torch.no_grad()
    def target_pass(self, tokens: torch.Tensor, want_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced target forward → taps [L, n*H] (and logits [L, V] when asked)."""
        cache = self.target.new_cache(tokens.numel())
        # without KL only the taps are used: skip the lm_head over every position ([L, V] fp32)
        out = self.target(tokens[None], cache, want_taps=True, last_logits_only=not want_logits)
        return out.taps[0], (out.logits[0] if want_logits else None)

    # ---- loss of one sequence ----------------------------------------------------------------------
    def sequence_loss(
        self,
        tokens: torch.Tensor,
        loss_mask: torch.Tensor,
        taps: torch.Tensor,
        rng: random.Random,
        target_logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict]:
        """tokens/loss_mask [L]; taps [>= L-1, n*H] → (weighted loss, stats). Backward is the caller's."""
        L = tokens.numel()
        anchors = sample_anchors(loss_mask, self.cfg.anchors, rng)
        if anchors.numel() == 0:
            return None, {}
        taps = taps[: L - 1].to(self.drafter.fc.weight.dtype)
        features = self.drafter.features(taps[None])  # [1, L-1, H]
        ctx_k, ctx_v = self.drafter.context_kv(features, torch.arange(L - 1))  # [N, 1, kvh, L-1, hd]
        total_weight, stats, losses = 0.0, {"correct": 0, "labels": 0}, []
        for chunk in anchors.split(self.cfg.anchor_chunk):
            loss_sum, weight_sum, st = self._chunk_loss(tokens, loss_mask, chunk, ctx_k, ctx_v, target_logits)
            losses.append(loss_sum)
            total_weight += weight_sum
            for k, v in st.items():
                stats[k] = stats.get(k, 0) + v
        loss = torch.stack(losses).sum() / max(total_weight, 1e-9)
        stats["anchors"] = anchors.numel()
        return loss, stats

    def _labelled_rows(self, hidden, tokens, loss_mask, positions, keep, target_logits=None):
        """Weighted CE over the block rows that carry a label (lm_head on those rows only), plus
        D-PACE weighting and forward KL when configured. hidden [n, B, H]; positions [n, B];
        keep [n] which blocks count; target_logits [L, V] for KL. → (loss sum, weight sum, stats)."""
        n, B = positions.shape
        L = tokens.numel()
        label_positions = positions + (1 - self.first)  # the token each block row drafts
        valid = (label_positions < L) & keep[:, None]
        label_pos = label_positions.clamp(max=L - 1)
        supervised = valid & loss_mask[label_pos]
        supervised[:, : self.first] = False
        rows = supervised.nonzero(as_tuple=True)
        y = tokens[label_pos][rows]
        if self.draft_vocab is not None:
            y = self.draft_vocab.target_to_draft(self.target.cfg.vocab_size)[y]
            inside = y >= 0  # labels outside the draft vocabulary cannot be drafted: no loss
            rows, y = (rows[0][inside], rows[1][inside]), y[inside]
        if y.numel() == 0:
            return hidden.sum() * 0.0, 0.0, {"correct": 0, "labels": 0}
        w = self.weights[rows[1] - self.first]
        prev = tokens[label_pos - 1]  # [n, B] teacher forcing: the token before each drafted one
        latent = self._markov_latent(hidden, prev)  # [n, B, r] or None
        logits = self._draft_logits(hidden[rows], None if latent is None else latent[rows])  # [R, Vd]
        logp = torch.log_softmax(logits.float(), dim=-1)
        nll = -logp.gather(1, y[:, None])[:, 0]
        if self.cfg.dpace:
            w = w * self._dpace_factor(nll.detach(), rows, n, B)
        loss = (w * nll).sum()
        if self.cfg.ce_weight != 1.0:  # (the default multiplies nothing: the loss stays bit for bit as it was)
            loss = self.cfg.ce_weight * loss
        t_logits = None
        if self.cfg.needs_target_logits:
            if target_logits is None:
                raise LoopspecError(
                    "--kl-weight, --tv-weight and --confidence-label tv read the target's logits, "
                    "and this step was given none (its taps came from a cache)"
                )
            # the target's row predicting each label: logits at position j predict the token at j+1
            # (the label sits at a+k in z-lab's convention, a+k+1 in DeepSpec's)
            t_logits = target_logits[label_pos[rows] - 1]  # [R, V]
        if self.cfg.kl_weight > 0:
            q_logits = t_logits if self.draft_vocab is None else t_logits[:, self.draft_vocab.ids]
            p = torch.softmax(q_logits.float(), dim=-1)
            kl = (p * (torch.log(p.clamp_min(1e-30)) - logp)).sum(-1)
            loss = loss + self.cfg.kl_weight * (w * kl).sum()
        tv = None
        if self.cfg.tv_weight > 0 or self.cfg.confidence_label == "tv":
            tv = total_variation(logp, t_logits, None if self.draft_vocab is None else self.draft_vocab.ids)  # [R]
            if self.cfg.tv_weight > 0:
                loss = loss + self.cfg.tv_weight * (w * tv).sum()
        hit = logp.argmax(-1) == y  # [R]
        stats = {"correct": int(hit.sum()), "labels": int(y.numel())}
        if tv is not None:
            stats["tv_sum"] = float(tv.detach().sum())
        extra = self._row_extra_loss(hidden[rows], logits, y, prev[rows], w)  # a DFlash2 selector's
        if extra is not None:
            loss = loss + extra[0]
            stats.update(extra[1])
        confidence_logit = confidence_logits(self.drafter, hidden[rows], prev[rows])  # [R], None without the head
        if confidence_logit is not None:
            # the label is a target, not a path for gradients: the soft one must not pull the drafts
            label = (1.0 - tv.detach()).clamp(0.0, 1.0) if self.cfg.confidence_label == "tv" else hit.float()
            bce = F.binary_cross_entropy_with_logits(confidence_logit, label, reduction="none")
            loss = loss + self.cfg.confidence_loss_weight * (w * bce).sum()
            # squared error of the estimate against its label (Brier score, summed over rows)
            stats["confidence_brier"] = float(((torch.sigmoid(confidence_logit.detach()) - label) ** 2).sum())
        return loss, float(w.sum()), stats

    def _row_extra_loss(self, hidden, logits, labels, prev, weights) -> tuple[torch.Tensor, dict] | None:
        """A loss beside the drafts' cross-entropy over the labelled rows (hidden [R, H], their logits
        [R, Vd], labels [R], the data's token before each [R], the rows' weights [R]) → (weighted sum,
        stats); None here (DFlash2Trainer adds its selector's)."""
        return None

    def _markov_latent(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """The Markov head's latent at every drafting row, unrolled over the block as draft_stage runs
        it (the rnn state starts at zero at the first drafting position): hidden [n, B, H], prev [n, B]
        (the token before each row's draft) → [n, B, r] (zero at non-drafting rows), or None."""
        markov = self.drafter.markov_head
        if markov is None:
            return None
        n, B, _ = hidden.shape
        state, latents = None, []
        for i in range(self.first, B):
            u, state = markov.latent(prev[:, i], hidden[:, i], state)  # [n, r]
            latents.append(u)
        skipped = hidden.new_zeros(n, self.first, markov.markov_w1.embedding_dim)
        return torch.cat([skipped, torch.stack(latents, dim=1).to(hidden.dtype)], dim=1)

    def _draft_logits(self, hidden: torch.Tensor, latent: torch.Tensor | None) -> torch.Tensor:
        """Draft-vocabulary logits of hidden [..., H], Markov-corrected by latent [..., r] when given."""
        logits = hidden @ self.head_weight.T
        if latent is None:
            return logits
        w2 = self.drafter.markov_head.markov_w2.weight  # [V, r]; re-indexed per call: it is trained
        if self.draft_vocab is not None:  # the bias over the draft rows only, as draft_stage computes it
            w2 = w2[self.draft_vocab.ids]
        return logits + latent @ w2.T.to(latent.dtype)

    def loop_sequence_loss(
        self, tokens: torch.Tensor, loss_mask: torch.Tensor, taps: torch.Tensor, rng: random.Random
    ) -> tuple[torch.Tensor | None, dict]:
        """Loop-aware loss (DLoop): per anchor S-1 ~ U{1..N}; stage 1 on the target context;
        stages 2..S anchored on the previous stage's argmax at its last position, with the previous
        stages' final-norm hidden states as pseudo-context (feature(p) = z(p+1)), exactly as at
        inference. L = (L(1) + L(S)) / 2; middle stages get no loss (only their last row's argmax)."""
        N = self.cfg.loop_stages
        L = tokens.numel()
        anchors = sample_anchors(loss_mask, self.cfg.anchors, rng)
        if anchors.numel() == 0:
            return None, {}
        taps = taps[: L - 1].to(self.drafter.fc.weight.dtype)
        features = self.drafter.features(taps[None])
        ctx_k, ctx_v = self.drafter.context_kv(features, torch.arange(L - 1))
        first_loss, first_w, last_loss, last_w = [], 0.0, [], 0.0
        stats = {"correct": 0, "labels": 0}
        for chunk in anchors.split(self.cfg.anchor_chunk):
            n = chunk.numel()
            total_stages = torch.tensor([1 + rng.randint(1, N) for _ in range(n)])  # S per anchor
            for stage, positions, hidden in self.loop_stages(tokens, chunk, ctx_k, ctx_v, int(total_stages.max())):
                if stage == 1:
                    keep = torch.ones(n, dtype=torch.bool)
                elif (total_stages == stage).any():
                    keep = total_stages == stage
                else:
                    continue  # a middle stage for every block here: no loss, no logits
                loss_sum, w_sum, st = self._labelled_rows(hidden, tokens, loss_mask, positions, keep)
                if stage == 1:
                    first_loss.append(loss_sum)
                    first_w += w_sum
                else:
                    last_loss.append(loss_sum)
                    last_w += w_sum
                for k, v in st.items():
                    stats[k] = stats.get(k, 0) + v
        loss_first = torch.stack(first_loss).sum() / max(first_w, 1e-9)
        loss_last = torch.stack(last_loss).sum() / max(last_w, 1e-9) if last_loss else loss_first * 0.0
        stats["anchors"] = anchors.numel()
        return (loss_first + loss_last) / 2, stats

    def loop_stages(self, tokens: torch.Tensor, anchors: torch.Tensor, ctx_k, ctx_v, num_stages: int):
        """Run stages 1..num_stages for every anchor as inference does; yields (stage, positions [n, B],
        final-norm hidden [n, B, H]). Stage s+1's anchor is stage s's argmax at its last row; its
        context adds the previous stages' hidden states z[1:] as pseudo-features at a .. a_s - 1."""
        B = self.drafter.cfg.block_size
        D = self.drafter.cfg.drafts_per_block(B)
        n = anchors.numel()
        anchor_tokens = tokens[anchors]
        pseudo: list[torch.Tensor] = []  # per finished stage: [n, D, H]
        for stage in range(1, num_stages + 1):
            start = anchors + (stage - 1) * D  # this stage's anchor position (the previous stage's last draft)
            positions = start[:, None] + torch.arange(B)[None]
            ids = torch.full((n, B), self.drafter.cfg.mask_token_id, dtype=torch.long)
            ids[:, 0] = anchor_tokens
            with torch.no_grad():
                embeds = self.target.embed_tokens(ids.flatten())[None]
            if pseudo:
                private = torch.cat(pseudo, dim=1)  # [n, m, H] at positions a .. start-1 of each block
                m = private.shape[1]
                private_pos = (anchors[:, None] + torch.arange(m)[None]).flatten()
                pk, pv = self.drafter.context_kv(private.reshape(1, n * m, -1), private_pos)
                keys_k, keys_v = torch.cat([ctx_k, pk], dim=3), torch.cat([ctx_v, pv], dim=3)
                mask = block_mask_with_private(anchors, B, ctx_k.shape[3], m)
            else:
                keys_k, keys_v = ctx_k, ctx_v
                mask = block_mask_dense(anchors, B, ctx_k.shape[3], self.cfg.causal_in_block)
            hidden = self.drafter(embeds, positions.flatten(), keys_k, keys_v, mask[None, None])[0].view(n, B, -1)
            yield stage, positions, hidden
            if stage < num_stages:
                with torch.no_grad():  # the next anchor: this stage's argmax at its last row
                    best = (hidden[:, -1] @ self.head_weight.T).argmax(-1)
                    anchor_tokens = self.draft_vocab.ids[best] if self.draft_vocab is not None else best
                pseudo.append(hidden[:, self.first :])

    def _chunk_loss(self, tokens, loss_mask, anchors, ctx_k, ctx_v, target_logits):
        """DFlash: one stage per anchor on the target context, loss over its labelled rows."""
        ((_, positions, hidden),) = self.loop_stages(tokens, anchors, ctx_k, ctx_v, 1)
        keep = torch.ones(anchors.numel(), dtype=torch.bool)
        return self._labelled_rows(hidden, tokens, loss_mask, positions, keep, target_logits)

    @staticmethod
    def _dpace_factor(nll: torch.Tensor, rows, n: int, B: int) -> torch.Tensor:
        """D-PACE: weight of position i ∝ ∂E[accepted]/∂log p_i = Σ_{k≥i} Π_{j≤k} p_j (detached),
        with E[accepted] = Σ_k Π_{j≤k} p_j the differentiable surrogate of the accepted length."""
        grid = torch.zeros(n, B)
        grid[rows] = torch.exp(-nll)
        has = torch.zeros(n, B, dtype=torch.bool)
        has[rows] = True
        p = torch.where(has, grid, torch.zeros_like(grid))  # unsupervised positions end the chain
        cum = torch.cumprod(p[:, 1:], dim=1)  # [n, B-1]: Π_{j≤k} p_j
        tail = torch.flip(torch.cumsum(torch.flip(cum, [1]), 1), [1])  # Σ_{k≥i}
        factor = torch.zeros(n, B)
        factor[:, 1:] = tail
        f = factor[rows]
        return f / f.mean().clamp_min(1e-9)

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
        """Held-out acceptance over anchors of one sequence → ({"tau": sum, k: sum, ...}, anchors).
        "tau": 1 + the number of leading block positions whose drafted argmax equals the data token
        (for greedy-regenerated data: the target's own prediction). k in top_ks: 1 + the leading
        positions whose data token is among the drafter's k most likely there — what a draft tree
        holding the top k of every position accepts, the ceiling of trees built from these drafts."""
        B = self.drafter.cfg.block_size
        L = tokens.numel()
        anchors = sample_anchors(loss_mask, max_anchors, random.Random(0))
        if anchors.numel() == 0:
            return {"tau": 0.0, **{k: 0.0 for k in top_ks}}, 0
        features = self.drafter.features(taps[None, : L - 1].to(self.drafter.fc.weight.dtype))
        ctx_k, ctx_v = self.drafter.context_kv(features, torch.arange(L - 1))
        n = anchors.numel()
        pos = anchors[:, None] + torch.arange(B)[None]
        ids = torch.full((n, B), self.drafter.cfg.mask_token_id, dtype=torch.long)
        ids[:, 0] = tokens[anchors]
        mask = block_mask_dense(anchors, B, L - 1, self.cfg.causal_in_block)[None, None]
        hidden = self.drafter(self.target.embed_tokens(ids.flatten())[None], pos.flatten(), ctx_k, ctx_v, mask)
        hidden = hidden[0].view(n, B, -1)
        drafted_pos = pos + (1 - self.first)  # the position each block row drafts
        label_pos = drafted_pos.clamp(max=L - 1)
        # the Markov head reads the data's previous token: within the accepted leading run that IS the
        # drafted one, so "tau" is exact; the top-k ceilings take the data's path through the tree
        latent = self._markov_latent(hidden, tokens[label_pos - 1])
        f = self.first
        logits = self._draft_logits(hidden[:, f:], None if latent is None else latent[:, f:])  # [n, D, Vd]
        labels = tokens[label_pos[:, f:]]  # [n, D]
        counted = (drafted_pos[:, f:] < L) & loss_mask[label_pos[:, f:]]
        to_target = (lambda d: self.draft_vocab.ids[d]) if self.draft_vocab is not None else (lambda d: d)

        def accepted(good: torch.Tensor) -> float:  # good [n, D] → Σ over anchors of 1 + leading run
            return float((torch.cumprod((good & counted).long(), dim=1).sum(1) + 1).sum())

        sums = {"tau": accepted(to_target(logits.argmax(-1)) == labels)}
        if top_ks:
            top = to_target(logits.topk(max(top_ks), dim=-1).indices)  # [n, D, kmax]
            for k in top_ks:
                sums[k] = accepted((top[..., :k] == labels[..., None]).any(-1))
        return sums, n


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    warm = max(1, int(cfg.warmup * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
