"""A training run's settings (`TrainConfig`), checked once where they are made: the family's recipe,
the loss terms and what each needs, refused in one line where a setting cannot apply."""

from __future__ import annotations

import math
from dataclasses import dataclass

from loopspec.errors import LoopspecError
from loopspec.model.dflash import DrafterConfig

# the recipes `loopspec train --family` chooses between: DFlash's block loss (DSpark's heads ride on
# it), EAGLE-3's training-time test (loopspec/train/eagle3_trainer.py) and DFlash2's block loss plus
# its candidate selector's (loopspec/train/dflash2_trainer.py)
TRAIN_FAMILIES = ("dflash", "eagle3", "dflash2")
DEFAULT_ANCHORS = 512
EAGLE3_TTT_STEPS = 7  # SpecForge's default unroll (its OnlineEagle3Model `length`)

# what a DSpark confidence head learns to predict at each drafted position: "hit", whether the
# drafter's (corrected) argmax is the data's token, which for greedy target-written data is whether
# greedy verification accepts it; "tv", 1 - TV(drafter, target), the probability that speculative
# sampling accepts a draft sampled from the drafter (DSpark's soft label; needs the target's logits)
CONFIDENCE_LABELS = ("hit", "tv")

# DFlash-only settings: (field, flag, the value that leaves it unset)
DFLASH_ONLY = (
    ("anchors", "--anchors", None),
    ("gamma", "--gamma", None),
    ("dpace", "--dpace", False),
    ("kl_weight", "--kl-weight", 0.0),
    ("ce_weight", "--ce-weight", 1.0),
    ("tv_weight", "--tv-weight", 0.0),
    ("confidence_label", "--confidence-label", "hit"),
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
    ce_weight: float = 1.0  # the drafts' cross-entropy against the data's tokens
    tv_weight: float = 0.0  # total variation to the target's distribution (needs online taps and logits)
    confidence_weight: float | None = None  # the confidence head's BCE beside the CE (None: 1; set, it needs the head)
    confidence_label: str = "hit"  # one of CONFIDENCE_LABELS: what the confidence head's BCE is against
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
        self._check_target_terms()

    def _check_target_terms(self) -> None:
        """The loss terms that read the target's distribution (--kl-weight, --tv-weight, the soft
        confidence label) and the cross-entropy's weight beside them."""
        for name, flag in (("ce_weight", "--ce-weight"), ("tv_weight", "--tv-weight")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise LoopspecError(f"the {flag} must be a finite number >= 0, got {value!r}")
        if self.ce_weight == 0 and self.tv_weight == 0:
            raise LoopspecError("--ce-weight 0 with --tv-weight 0 leaves the drafts without a loss: give one of them")
        if self.confidence_label not in CONFIDENCE_LABELS:
            raise LoopspecError(
                f"the confidence label (--confidence-label) must be one of {', '.join(CONFIDENCE_LABELS)}, "
                f"got {self.confidence_label!r}"
            )
        if self.family == "dflash2" and self.confidence_label != "hit":
            raise LoopspecError(
                "--confidence-label does not apply to DFlash2 training (--family dflash2): it labels a "
                "DSpark confidence head, and a DFlash2 drafter has none"
            )
        if self.loop_stages and self.needs_target_logits:
            # loop_sequence_loss drafts later stages from drafted anchors and reads no target logits:
            # the term would be dropped without a word
            given = [
                flag
                for flag, on in (
                    ("--kl-weight", self.kl_weight > 0),
                    ("--tv-weight", self.tv_weight > 0),
                    ("--confidence-label tv", self.confidence_label == "tv"),
                )
                if on
            ]
            raise LoopspecError(
                f"{', '.join(given)} with --loop-stages is not implemented: the loop-aware loss reads no "
                "target logits; train it with --loop-stages 0"
            )

    @property
    def needs_target_logits(self) -> bool:
        """Whether a step reads the target's logits at every labelled row (so its taps come online)."""
        return self.kl_weight > 0 or self.tv_weight > 0 or self.confidence_label == "tv"

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
        if self.confidence_label != "hit" and not kind.estimates_acceptance:
            raise LoopspecError(
                f"--confidence-label {self.confidence_label} labels a confidence head's loss: this drafter "
                "has no confidence head (add --confidence-head)"
            )
