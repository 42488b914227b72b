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
the data's token — for greedy-regenerated data, whether the target accepts that draft.
"""

from __future__ import annotations

import contextlib
import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loopspec.errors import LoopspecError
from loopspec.model.draft_head import confidence_logits
from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.model.target import Target

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


# the recipes `loopspec train --family` chooses between: DFlash's block loss (DSpark's heads ride on
# it), EAGLE-3's training-time test (loopspec/train/eagle3_trainer.py) and DFlash2's block loss plus
# its candidate selector's (loopspec/train/dflash2_trainer.py)
TRAIN_FAMILIES = ("dflash", "eagle3", "dflash2")
DEFAULT_ANCHORS = 512
EAGLE3_TTT_STEPS = 7  # SpecForge's default unroll (its OnlineEagle3Model `length`)

# DFlash-only settings: (field, flag, the value that leaves it unset)
DFLASH_ONLY = (
    ("anchors", "--anchors", None),
    ("gamma", "--gamma", None),
    ("dpace", "--dpace", False),
    ("kl_weight", "--kl-weight", 0.0),
    ("confidence_weight", "--confidence-weight", None),
    ("heads_only", "--heads-only", False),
    ("causal_in_block", "--causal-in-block", False),
    ("loop_stages", "--loop-stages", 0),
)


@dataclass
class TrainConfig:
    anchors: int | None = None  # DFlash: anchors per sequence (None: DEFAULT_ANCHORS); EAGLE-3 trains every position
    anchor_chunk: int = 64  # anchors per forward (bounds the dense mask's memory on CPU)
    gamma: float | None = None
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    clip: float = 1.0
    epochs: float = 1.0
    batch_sequences: int = 4  # sequences per optimizer step
    dpace: bool = False
    kl_weight: float = 0.0  # forward KL to the target's distribution (needs online taps)
    confidence_weight: float | None = None  # the confidence head's BCE beside the CE (None: 1; set, it needs the head)
    heads_only: bool = False  # train the DSpark heads alone: the drafter's own drafts stay as they were
    causal_in_block: bool = False
    loop_stages: int = 0  # DLoop loop-aware training: S-1 ~ U{1..N} extra stages per anchor (0 = DFlash)
    eval_samples: int = 16
    eval_every: int = 100
    save_every: int = 200
    seed: int = 0
    max_len: int = 1024
    compute_dtype: str = "float32"  # "bfloat16": the drafter's forward and backward under CPU autocast
    #                                 (fp32 master weights; ~1.8x faster matmuls where the CPU has AVX512-BF16)
    family: str = "dflash"  # one of TRAIN_FAMILIES
    ttt_steps: int | None = None  # EAGLE-3: drafter steps unrolled per position (None: EAGLE3_TTT_STEPS)

    def __post_init__(self):
        if self.family not in TRAIN_FAMILIES:
            raise LoopspecError(
                f"training family (--family) must be one of {', '.join(TRAIN_FAMILIES)}, got {self.family!r}"
            )
        if self.family == "eagle3":
            given = [flag for name, flag, unset in DFLASH_ONLY if getattr(self, name) != unset]
            if given:
                raise LoopspecError(
                    f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to DFlash training "
                    "only: EAGLE-3 training (--family eagle3) trains every position of a sequence "
                    "with training-time test, its steps weighted 0.8^j"
                )
            if self.ttt_steps is None:
                self.ttt_steps = EAGLE3_TTT_STEPS
            if isinstance(self.ttt_steps, bool) or not isinstance(self.ttt_steps, int) or self.ttt_steps < 1:
                raise LoopspecError(
                    f"training-time test steps (--ttt-steps) must be an integer >= 1, got {self.ttt_steps!r}"
                )
        else:
            if self.ttt_steps is not None:
                raise LoopspecError("--ttt-steps applies to EAGLE-3 training only (--family eagle3)")
            if self.anchors is None:
                self.anchors = DEFAULT_ANCHORS
        if self.family == "dflash2":
            for given, flag, why in (
                (
                    self.loop_stages,
                    "--loop-stages",
                    "a later stage would start from the selector's walk, which the loop-aware loss does not run",
                ),
                (
                    self.causal_in_block,
                    "--causal-in-block",
                    "a DFlash2 drafter's block causality is its config's is_causal",
                ),
                (self.heads_only, "--heads-only", "it trains DSpark heads, and a DFlash2 drafter has none"),
                (
                    self.confidence_weight is not None,
                    "--confidence-weight",
                    "it weighs a DSpark confidence head's loss, and a DFlash2 drafter has none",
                ),
            ):
                if given:
                    raise LoopspecError(f"{flag} does not apply to DFlash2 training (--family dflash2): {why}")
        if isinstance(self.loop_stages, bool) or not isinstance(self.loop_stages, int) or self.loop_stages < 0:
            raise LoopspecError(
                f"loop stages (--loop-stages) must be an integer >= 0 (0: DFlash training), got {self.loop_stages!r}"
            )
        if self.confidence_weight is not None and not (
            math.isfinite(self.confidence_weight) and self.confidence_weight >= 0
        ):
            raise LoopspecError(
                f"the confidence weight (--confidence-weight) must be a finite number >= 0, "
                f"got {self.confidence_weight}"
            )

    @property
    def confidence_loss_weight(self) -> float:
        return 1.0 if self.confidence_weight is None else self.confidence_weight

    def check_init(self, from_init: bool) -> None:
        """Refuse what needs a trained drafter to start from when there is none (`from_init`: --init)."""
        if self.heads_only and not from_init:
            raise LoopspecError(
                "--heads-only trains the DSpark heads over a trained drafter's frozen backbone: "
                "it needs --init DIR (without one the backbone is random and stays so)"
            )

    def check_drafter(self, drafter: DrafterConfig) -> None:
        """Refuse what this config asks of a drafter that cannot take it."""
        kind = drafter.kind
        if kind.training_family != self.family:
            raise LoopspecError(
                f"the drafter ({kind.title}) is trained with --family {kind.training_family}, "
                f"not --family {self.family}"
            )
        if self.loop_stages and not kind.trains_loop_aware:
            # a later stage's Markov chain starts from a drafted anchor the data does not hold
            raise LoopspecError(
                f"loop-aware training (--loop-stages) of a {kind.title} drafter is not "
                "implemented; train it with --loop-stages 0"
            )
        if self.heads_only and not kind.heads:
            raise LoopspecError("--heads-only trains the DSpark heads: give --markov-rank or --confidence-head")
        if self.confidence_weight is not None and not kind.estimates_acceptance:
            raise LoopspecError(
                "--confidence-weight weighs a confidence head's loss: this drafter has no confidence "
                "head (add --confidence-head)"
            )


COMPUTE_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def compute_context(cfg: TrainConfig):
    """The context a training loss is computed in: plain fp32, or CPU autocast to bfloat16."""
    if cfg.compute_dtype not in COMPUTE_DTYPES:
        raise LoopspecError(f"compute dtype {cfg.compute_dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}")
    dtype = COMPUTE_DTYPES[cfg.compute_dtype]
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


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
        if self.cfg.kl_weight > 0 and target_logits is not None:
            t_logits = target_logits[positions[rows] - 1]  # the target row predicting position a+k
            if self.draft_vocab is not None:
                t_logits = t_logits[:, self.draft_vocab.ids]
            p = torch.softmax(t_logits.float(), dim=-1)
            kl = (p * (torch.log(p.clamp_min(1e-30)) - logp)).sum(-1)
            loss = loss + self.cfg.kl_weight * (w * kl).sum()
        hit = logp.argmax(-1) == y  # [R]
        stats = {"correct": int(hit.sum()), "labels": int(y.numel())}
        extra = self._row_extra_loss(hidden[rows], logits, y, prev[rows], w)  # a DFlash2 selector's
        if extra is not None:
            loss = loss + extra[0]
            stats.update(extra[1])
        confidence_logit = confidence_logits(self.drafter, hidden[rows], prev[rows])  # [R], None without the head
        if confidence_logit is not None:
            bce = F.binary_cross_entropy_with_logits(confidence_logit, hit.float(), reduction="none")
            loss = loss + self.cfg.confidence_loss_weight * (w * bce).sum()
            # squared error of the estimate against the outcome (Brier score, summed over rows)
            stats["confidence_brier"] = float(((torch.sigmoid(confidence_logit.detach()) - hit.float()) ** 2).sum())
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
