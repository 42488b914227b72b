"""Drafter kinds: what a drafter is, stated once, for every layer that must treat kinds differently.

A drafter's kind is its family (DFlash, DSpark: a DFlash drafter with heads after the lm_head,
DFlash2: a DFlash drafter with grouped dynamic convolutions and a candidate selector (model/dflash2.py),
or EAGLE-3: one decoder layer that drafts a chain token by token), its block convention (which block
outputs are drafts) and its heads. `DrafterConfig.kind` looks it up
(`drafter_kind`); the config fields it is read from (`KIND_FIELDS`) are read inside loopspec/model
only, and every other layer asks the kind record: how many drafts a block gives, what the exported
block graph adds, whether loop-aware training runs it. Which serving framework takes which kind is
that framework's own fact, in its serving-bundle module: the kind record says what a drafter is, not
who serves it.

Runtime backends: the torch engine and the fp32 ONNX Runtime / TensorRT drafter graphs run every
kind: the block kinds (a DFlash2 drafter's graph unrolls its selector's walk: engines/dflash2_export.py)
and EAGLE-3's chain (its own fuse and step graphs: engines/eagle3_export.py). A quantized drafter graph
(FP8 / NVFP4), whose calibration and export run z-lab's block, takes the plain z-lab DFlash kind only
(`require_zlab_block`), and no quantized drafter graph takes an EAGLE-3 drafter
(`require_quantized_export`: the GGUF precisions' Q8_0 drafter, modelopt's FP8 / NVFP4).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from loopspec.errors import LoopspecError

ARCHITECTURE = "DFlashDraftModel"
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"  # z-lab's DFlash2 drafters
DEEPSPEC_ARCHITECTURE = "Qwen3DSparkModel"  # DeepSpec's DSpark drafters, and its DFlash ones (markov_rank 0)
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"  # SpecForge's EAGLE-3 drafters
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")

# DrafterConfig's fields (and the property) that decide a drafter's kind: only loopspec/model reads
# them; every other layer asks `DrafterConfig.kind` (tests/test_layout.py holds it to that)
KIND_FIELDS = (
    "anchor_predicts",
    "markov_rank",
    "markov_head_type",
    "confidence_head",
    "confidence_with_markov",
    "is_dspark",
)


@dataclass(frozen=True)
class BlockConvention:
    """Which outputs of a block [anchor, MASK × (k-1)] at positions a .. a+k-1 are drafts."""

    name: str  # "z-lab" | "deepspec": a serving bundle's manifest names it so
    owner: str  # whose convention, in prose
    first_draft: int  # the first block position whose output is a draft (it drafts the token at a+1)
    architecture: str  # the config.json architecture a drafter of this convention is written with

    def drafts_per_block(self, block_size: int) -> int:
        """How many drafts one stage of `block_size` positions yields."""
        return block_size - self.first_draft


# z-lab's: block position i (1..k-1) drafts the token at a+i (k-1 drafts)
ZLAB_BLOCK = BlockConvention("z-lab", "z-lab's", 1, ARCHITECTURE)
# DeepSpec's: every block position i (0..k-1) drafts the token at a+i+1 (k drafts)
DEEPSPEC_BLOCK = BlockConvention("deepspec", "DeepSpec's", 0, DEEPSPEC_ARCHITECTURE)
# EAGLE-3's chain: a stage of k runs k-1 drafter steps from the anchor, step i drafting the token at
# a+i (the stage's state i, i >= 1, is the one that drafted it)
EAGLE3_CHAIN = BlockConvention("eagle3", "EAGLE-3's", 1, EAGLE3_ARCHITECTURE)


@dataclass(frozen=True)
class MarkovHeadKind:
    """A DSpark drafter's low-rank Markov head: each position's logits corrected by the token before it."""

    head_type: str  # one of MARKOV_HEAD_TYPES
    rank: int


@dataclass(frozen=True)
class ConfidenceHeadKind:
    """A DSpark drafter's confidence head: each draft's estimated acceptance probability."""

    reads_markov: bool  # it reads [h ; W1[prev]] (the Markov head's embedding of the token before), else h


@dataclass(frozen=True)
class SelectorKind:
    """A DFlash2 drafter's draft step: grouped dynamic convolutions around each sublayer and a candidate
    selector that walks the target head's top-k per block slot (loopspec/model/dflash2.py)."""

    conv_taps: int  # conv_kernel_size
    conv_group_size: int  # channels sharing one dynamic coefficient
    rank: int  # selector_rank
    top_k: int  # selector_top_k: candidates per block slot
    width: int  # the hidden size its projection reads (the drafter's)
    input_embedding_scale: float = 1.0  # what the block's token embeddings are scaled by


@dataclass(frozen=True)
class Eagle3Variant:
    """The switches an EAGLE-3 checkpoint's config.json may turn on (all off: EAGLE-3 as published).
    EAGLE 3.1 is fc_norm with norm_output; the others come from other trainers' checkpoints."""

    fc_norm: bool = False  # an RMSNorm on each of the three taps before fc (`fc_norm.{0,1,2}`)
    norm_before_fc: bool = False  # one RMSNorm over the three taps concatenated before fc (`input_norm`)
    norm_output: bool = False  # the next step reads the final-normed state (the logits' input), not the pre-norm one
    norm_before_residual: bool = False  # the layer's residual is hidden_norm(state), not the state

    @property
    def switched_on(self) -> tuple[str, ...]:
        """The config.json switches that are on, by their names."""
        return tuple(
            name for name in ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual") if getattr(self, name)
        )


@dataclass(frozen=True)
class DrafterKind:
    """One drafter kind. The registry (`DRAFTER_KINDS`) holds each family with its defaults; the
    lookup fills in the drafter's block convention and heads."""

    name: str  # "dflash" | "dspark" | "eagle3"
    family: str  # its name in prose
    convention: BlockConvention = ZLAB_BLOCK
    markov: MarkovHeadKind | None = None
    confidence: ConfidenceHeadKind | None = None
    # drafts autoregressively, one drafter step per draft, over a context of (token, fused taps)
    # pairs (EAGLE-3); False: one forward drafts a whole block of [anchor, MASK…] (DFlash, DSpark)
    chain: bool = False
    selector: SelectorKind | None = None  # DFlash2: its drafts are the candidate selector's walk
    eagle3: Eagle3Variant | None = None  # EAGLE-3: the config switches its checkpoint turns on
    # the engines' context for it (engines/drafter_contexts.py): "dflash", the block drafters' K/V of
    # the target's features; "eagle3", fused taps paired with the next token
    context: str = "dflash"
    # `--backend auto` runs it on the exported graphs (False: on PyTorch; its graphs run when asked
    # for: EAGLE-3's take one call per drafted token and were not timed against the torch engine)
    exported_by_default: bool = True

    @property
    def heads(self) -> tuple[str, ...]:
        """The heads it runs after the lm_head, as its modules (and their parameters) are named."""
        return (("markov_head",) if self.markov else ()) + (("confidence_head",) if self.confidence else ())

    @property
    def plain(self) -> bool:
        """z-lab DFlash: z-lab's block and no head after the lm_head, what every z-lab reader runs."""
        return self.convention is ZLAB_BLOCK and not self.heads and self.selector is None

    @property
    def title(self) -> str:
        """What it is, in a few words: its heads and its block convention."""
        if self.chain and self.eagle3 and self.eagle3.switched_on:
            return f"{self.family} ({', '.join(self.eagle3.switched_on)})"
        if self.name not in ("dflash", "dspark"):  # DFlash's title says its block convention and heads
            return self.family
        if not self.heads:
            return "DeepSpec DFlash" if self.convention is DEEPSPEC_BLOCK else "z-lab DFlash"
        heads = [f"{self.markov.head_type} Markov head of rank {self.markov.rank}"] if self.markov else []
        heads += ["confidence head"] if self.confidence else []
        return f"{self.family} ({', '.join(heads)}; {self.convention.owner} block convention)"

    def drafts_per_block(self, block_size: int) -> int:
        return self.convention.drafts_per_block(block_size)

    @property
    def unrolled_draft_head(self) -> bool:
        """Its draft-head step runs left to right (a head after the lm_head, or a selector's walk, reads
        the token drafted before), so an exported block graph unrolls it over a fixed number of positions."""
        return bool(self.heads) or self.selector is not None

    @property
    def added_graph_outputs(self) -> tuple[str, ...]:
        """What its exported block graph outputs beside draft_ids, draft_logprobs and hidden: a
        confidence head's estimate per drafting position."""
        return ("confidence",) if self.confidence else ()

    @property
    def estimates_acceptance(self) -> bool:
        """Its stages return each draft's estimated acceptance probability (the confidence gate reads it)."""
        return self.confidence is not None

    @property
    def trains_loop_aware(self) -> bool:
        """Loop-aware training (DLoop's later stages) runs it: a Markov chain's later stage would start
        from a drafted anchor the training data does not hold, so a Markov head rules it out; a
        selector's later stage would start from its walk, which loopspec's loop-aware loss does not run."""
        return self.markov is None and not self.chain and self.selector is None

    @property
    def training_family(self) -> str:
        """The training recipe of loopspec's trainer (`loopspec train --family`) that trains it:
        "dflash" for the block kinds (DSpark's heads included), "eagle3" for the chain kind, "dflash2"
        for the selector kind (DFlash's block loss plus the selector's, loopspec/train/dflash2_trainer.py)."""
        if self.chain:
            return "eagle3"
        return "dflash2" if self.selector else "dflash"

    @property
    def grows_dynamic_trees(self) -> bool:
        """It can grow EAGLE-2's dynamic tree (tree kind "dynamic"): it drafts one token a step, so each
        expanded node runs its own step conditioned on its path; a block drafter drafts every position
        of its block in one forward, after the anchor alone."""
        return self.chain

    @property
    def masks_block(self) -> bool:
        """Its stages fill the block after the anchor with a mask token (DFlash, DSpark)."""
        return not self.chain

    @property
    def drafts_past_a_gap(self) -> bool:
        """A stage may start past the end of its row's context (the chain policy's copy drafted on):
        a block stage attends to the context wherever it ends; a chain drafter's first step is the
        context's next entry, whose token must follow it."""
        return not self.chain

    @property
    def captured_stages(self) -> bool:
        """CUDA graphs capture its stages (engines/cuda_graphs.py): a block drafter's forward and draft
        head; a selector's walk and a chain drafter's steps run eagerly."""
        return not self.chain and self.selector is None

    @property
    def exports_quantized(self) -> bool:
        """Quantized drafter graphs run it (modelopt's FP8 / NVFP4, the GGUF precisions' Q8_0 drafter):
        the block kinds without a selector; their quantizers are written for the block drafter's layers."""
        return not self.chain and self.selector is None

    def ranked_candidates(self, vocab_size: int, most: int) -> int:
        """How many ranked candidates per drafting position a stage returns, at most `most`: a
        selector ranks its top-k per slot, a draft head the whole (draft) vocabulary."""
        return min(most, vocab_size, self.selector.top_k if self.selector is not None else vocab_size)


DRAFTER_KINDS = {
    kind.name: kind
    for kind in (
        DrafterKind("dflash", "DFlash"),
        DrafterKind("dspark", "DSpark"),
        DrafterKind(
            "eagle3",
            "EAGLE-3",
            EAGLE3_CHAIN,
            chain=True,
            eagle3=Eagle3Variant(),
            context="eagle3",
            exported_by_default=False,
        ),
        DrafterKind("dflash2", "DFlash2"),
    )
}


def drafter_kind(cfg) -> DrafterKind:
    """The kind of the drafter a DrafterConfig describes (`DrafterConfig.kind` returns it)."""
    markov = MarkovHeadKind(cfg.markov_head_type, cfg.markov_rank) if cfg.markov_rank else None
    confidence = ConfidenceHeadKind(cfg.confidence_with_markov) if cfg.confidence_head else None
    family = DRAFTER_KINDS["dspark" if markov or confidence else "dflash"]
    return replace(
        family, convention=DEEPSPEC_BLOCK if cfg.anchor_predicts else ZLAB_BLOCK, markov=markov, confidence=confidence
    )


def dflash2_kind(selector: SelectorKind) -> DrafterKind:
    """The kind of a DFlash2 drafter (`DFlash2Config.kind` returns it): z-lab's block, its selector."""
    return replace(DRAFTER_KINDS["dflash2"], selector=selector)


def require_zlab_block(cfg, what: str) -> None:
    """Refuse a drafter of DeepSpec's block convention or with DSpark heads where only the z-lab
    block (k-1 drafts from block positions 1.., no head after the lm_head) is implemented (quantized
    drafter graphs). The torch engine, the fp32 ONNX / TensorRT drafter graphs and training run both
    conventions, the DSpark heads and a DFlash2 drafter's selector (an EAGLE-3 drafter: the torch engine
    and its fp32 graphs)."""
    kind = cfg.kind
    require_quantized_export(kind, what)
    if not kind.plain:
        raise LoopspecError(
            f"{what} supports z-lab DFlash drafters only, not this {kind.title} drafter; "
            "decode it with --backend torch or onnxruntime"
        )


def require_quantized_export(kind: DrafterKind, what: str) -> None:
    """Refuse, in one line naming the kind, a drafter whose graphs `what` (a quantized export) does not build."""
    if not kind.exports_quantized:
        raise LoopspecError(
            f"{what} does not take {kind.title} drafters: their graphs are exported in fp32 only "
            "(decode them with --backend torch, or onnxruntime at precision fp32)"
        )
