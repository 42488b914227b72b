"""Drafter kinds: what a drafter is, stated once, for every layer that must treat kinds differently.

A drafter's kind is its family (DFlash, DSpark: a DFlash drafter with heads after the lm_head,
DFlash2: a DFlash drafter with grouped dynamic convolutions and a candidate selector (model/dflash2.py),
or EAGLE-3: one decoder layer that drafts a chain token by token), its block convention (which block
outputs are drafts) and its heads. `DrafterConfig.kind` looks it up
(`drafter_kind`); the config fields it is read from (`KIND_FIELDS`) are read inside loopspec/model
only, and every other layer asks the kind record: how many drafts a block gives, what the exported
block graph adds, whether loop-aware training runs it, and which serving framework takes it
(`unsupported_in`: the kind family's record of `SERVING_RULES`, with the one-line reason of a
framework that does not).

Runtime backends: the torch engine and the fp32 ONNX Runtime / TensorRT drafter graphs run every
kind: the block kinds (a DFlash2 drafter's graph unrolls its selector's walk: engines/export_dflash2.py)
and EAGLE-3's chain (its own fuse and step graphs: engines/export_eagle3.py). A quantized drafter graph
(FP8 / NVFP4), whose calibration and export run z-lab's block, takes the plain z-lab DFlash kind only
(`require_zlab_block`), and no quantized drafter graph takes an EAGLE-3 drafter
(`require_quantized_export`: the GGUF precisions' Q8_0 drafter, modelopt's FP8 / NVFP4). The serving
frameworks run EAGLE-3 and DFlash2 themselves (SERVING_RULES says which).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from loopspec.errors import LoopspecError

ARCHITECTURE = "DFlashDraftModel"
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"  # z-lab's DFlash2, as vLLM (method dflash), SGLang and llama.cpp load it
DEEPSPEC_ARCHITECTURE = "Qwen3DSparkModel"  # DeepSpec's DSpark drafters, and its DFlash ones (markov_rank 0)
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"  # SpecForge's EAGLE-3 drafters, as vLLM and SGLang load them
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")

# DrafterConfig's fields (and the property) that decide a drafter's kind: only loopspec/model reads
# them; every other layer asks `DrafterConfig.kind` (tests/test_layout.py holds it to that)
KIND_FIELDS = ("anchor_predicts", "markov_rank", "markov_head_type", "confidence_head", "confidence_with_markov",
               "is_dspark")


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
        return tuple(name for name in ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual")
                     if getattr(self, name))


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
        if self.chain or self.selector:
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
        return self.markov is None and self.trains and not self.chain and self.selector is None

    @property
    def trains(self) -> bool:
        """loopspec's trainer (loopspec/train) trains it: every kind, each with its `training_family`."""
        return True

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
    def exports(self) -> bool:
        """The fp32 ONNX / TensorRT drafter graphs run it: every kind, the block kinds through the block
        graph (a selector's walk unrolled in it) and EAGLE-3's chain through its fuse and step graphs."""
        return True

    @property
    def exports_quantized(self) -> bool:
        """Quantized drafter graphs run it (modelopt's FP8 / NVFP4, the GGUF precisions' Q8_0 drafter):
        the block kinds without a selector; their quantizers are written for the block drafter's layers."""
        return not self.chain and self.selector is None

    def ranked_candidates(self, vocab_size: int, most: int) -> int:
        """How many ranked candidates per drafting position a stage returns, at most `most`: a
        selector ranks its top-k per slot, a draft head the whole (draft) vocabulary."""
        return min(most, vocab_size, self.selector.top_k if self.selector is not None else vocab_size)

    @property
    def zlab_dflash_reader(self) -> bool:
        """The frameworks' z-lab DFlash path runs it (vLLM method dflash, SGLang DFLASH, llama.cpp
        draft-dflash): z-lab's block convention and no DSpark head; a DFlash2 drafter's selector is
        picked there from its checkpoint (`DFlash2DraftModel`)."""
        return self.plain or self.selector is not None

    @property
    def drafts_in_steps(self) -> bool:
        """A serving bundle sets how many drafts (and which tree) its engines draft per verification from
        the decoding setting: a chain drafter runs any number of steps; a block drafter drafts its block."""
        return self.chain

    @property
    def serves_its_draft_vocab(self) -> bool:
        """Every serving framework that takes it reads its reduced draft vocabulary (d2t, its own lm_head
        rows) from one drafter directory: EAGLE-3's readers all do; a block drafter's bundle writes drafter/
        over the full vocabulary, since TensorRT-LLM and SGLang draft with the target's lm_head."""
        return self.chain

    def unsupported_in(self, framework: str, title: str) -> str | None:
        """Why the serving framework `framework` (`title` in prose) cannot serve this kind (None: it can):
        the rule its family's record (`SERVING_RULES`) holds for that framework."""
        rule = SERVING_RULES[self.name].get(framework)
        if rule is not None:
            return rule(self)
        if self.plain:
            return None
        return (f"the {title} bundle carries z-lab DFlash drafters only (block_size - 1 drafts from block "
                "positions 1.., no head after the lm_head)")


DRAFTER_KINDS = {kind.name: kind for kind in (DrafterKind("dflash", "DFlash"), DrafterKind("dspark", "DSpark"),
                                               DrafterKind("eagle3", "EAGLE-3", EAGLE3_CHAIN, chain=True,
                                                           eagle3=Eagle3Variant()),
                                               DrafterKind("dflash2", "DFlash2"))}


def drafter_kind(cfg) -> DrafterKind:
    """The kind of the drafter a DrafterConfig describes (`DrafterConfig.kind` returns it)."""
    markov = MarkovHeadKind(cfg.markov_head_type, cfg.markov_rank) if cfg.markov_rank else None
    confidence = ConfidenceHeadKind(cfg.confidence_with_markov) if cfg.confidence_head else None
    family = DRAFTER_KINDS["dspark" if markov or confidence else "dflash"]
    return replace(family, convention=DEEPSPEC_BLOCK if cfg.anchor_predicts else ZLAB_BLOCK, markov=markov,
                   confidence=confidence)


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
        raise LoopspecError(f"{what} supports z-lab DFlash drafters only, not this {kind.title} drafter; "
                            "decode it with --backend torch or onnxruntime")


def require_exportable(kind: DrafterKind, what: str) -> None:
    """Refuse, in one line naming the kind, a drafter whose graphs `what` (an export) does not build."""
    if not kind.exports:
        raise LoopspecError(f"{what} does not take {kind.title} drafters yet: {kind.title} drafters run on "
                            "--backend torch only")


def require_quantized_export(kind: DrafterKind, what: str) -> None:
    """Refuse, in one line naming the kind, a drafter whose graphs `what` (a quantized export) does not build."""
    require_exportable(kind, what)
    if not kind.exports_quantized:
        raise LoopspecError(f"{what} does not take {kind.title} drafters: their graphs are exported in fp32 only "
                            "(decode them with --backend torch, or onnxruntime at precision fp32)")


# --------------------------------------------------------------------------------------------------
# serving frameworks: which kinds each takes, and why it refuses the rest (each framework's facts are
# in its convert/bundles module, and llama.cpp's in engines/llamacpp.py)


def _vllm_refusal(kind: DrafterKind) -> str | None:
    if kind.plain:
        return None  # z-lab DFlash: method dflash
    if kind.convention is not DEEPSPEC_BLOCK:
        return ("vLLM's DSpark drafts from the anchor's own block position (DeepSpec's block convention: position "
                "i drafts the token at anchor+i+1), and this drafter's heads were trained in z-lab's (position i "
                "drafts the token at anchor+i): vLLM would draft one position off")
    if kind.markov is None:
        return ("vLLM's Qwen3 DSpark model always builds a Markov head, and this drafter has none (markov_rank 0) "
                "to load into it")
    if kind.markov.head_type != "vanilla":
        return (f"vLLM's DSpark Markov head is the vanilla one only (markov_w1, markov_w2), not this drafter's "
                f"{kind.markov.head_type} head")
    return None


def _trtllm_refusal(kind: DrafterKind) -> str | None:
    if kind.plain:
        return None  # z-lab DFlash: decoding_type DFlash
    if kind.convention is not DEEPSPEC_BLOCK:
        return ("TensorRT-LLM's standalone DSpark drafter drafts from the anchor's own block position (DeepSpec's "
                "block convention, its shift_label default), and this drafter's heads were trained in z-lab's "
                "(position i drafts the token at anchor+i): TensorRT-LLM would draft one position off")
    if kind.markov is not None and kind.markov.head_type != "vanilla":
        return (f"TensorRT-LLM's standalone DSpark drafter implements the vanilla Markov head only (markov_w1, "
                f"markov_w2), not this drafter's {kind.markov.head_type} head")
    return None  # DeepSpec's convention: decoding_type DSpark (markov_rank 0 for a DeepSpec DFlash drafter)


def _sglang_refusal(kind: DrafterKind) -> str | None:
    if kind.plain:
        return None  # z-lab DFlash: DFLASH
    if kind.convention is not DEEPSPEC_BLOCK:
        return ("SGLang's DSPARK reads block slot k as the draft of the token at anchor+k+1 (DeepSpec's block "
                "convention), and this drafter's heads were trained in z-lab's (position i drafts the token at "
                "anchor+i): SGLang would draft one position off")
    if kind.markov is None:
        return ("SGLang's DSPARK requires a Markov head (markov_rank > 0), and this drafter has none; its DFLASH "
                "reads z-lab's block convention")
    return None  # DSPARK, any of the three Markov heads


def _llamacpp_refusal(kind: DrafterKind) -> str | None:
    if not kind.heads:
        if kind.convention is DEEPSPEC_BLOCK:  # draft-dflash drafts from block position 1; only draft-dspark from 0
            return ("llama.cpp drafts from the anchor's own block position (DeepSpec's block convention) only "
                    "with a Markov head (draft-dspark); this DeepSpec DFlash drafter has none")
        return None
    if kind.markov is None:
        return "llama.cpp runs a DSpark confidence head only beside a Markov head (markov_rank > 0)"
    if kind.markov.head_type != "vanilla":
        return (f"llama.cpp's DSpark implements the vanilla Markov head only (bias = W2 · W1[prev]), not this "
                f"drafter's {kind.markov.head_type} head")
    if kind.confidence and not kind.confidence.reads_markov:
        return ("llama.cpp's DSpark confidence head reads [h ; W1[prev]] (n_embd + rank inputs); this drafter's "
                "reads h alone (confidence_head_with_markov false)")
    return None


# the EAGLE-3 config switches each framework's reader implements (vLLM 0.33 models/llama_eagle3.py: all
# four; SGLang 0.5.23 models/llama_eagle3.py: fc_norm (or its older name use_aux_norm), norm_before_fc,
# norm_output; llama.cpp's converter and eagle3 graph (llama-cpp-python 0.3.36's): norm_before_residual and
# norm_before_fc; TensorRT-LLM: see convert/bundles/trtllm.py)
EAGLE3_SWITCHES_READ = {"vllm": ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual"),
                        "sglang": ("fc_norm", "norm_before_fc", "norm_output"),
                        "llamacpp": ("norm_before_fc", "norm_before_residual"),
                        "trtllm": ()}


def _eagle3_refusal(framework: str, title: str):
    def refusal(kind: DrafterKind) -> str | None:
        # every framework runs SpecForge's LlamaForCausalLMEagle3 drafter as loopspec saves it; a switch its
        # reader does not implement would be silently dropped there, so it is refused here; what a framework
        # cannot take of a setting (a draft tree) its convert/bundles module refuses
        unread = [name for name in kind.eagle3.switched_on if name not in EAGLE3_SWITCHES_READ[framework]]
        if not unread:
            return None
        return (f"{title}'s EAGLE-3 reader does not implement {', '.join(unread)} (this drafter's config.json turns "
                f"{'it' if len(unread) == 1 else 'them'} on), so it would draft with a different model")
    return refusal


# one record per kind family, looked up by DrafterKind.name: {framework: why it refuses a drafter of
# that family (None: it serves it)}; a framework a record does not name serves the plain kind only
BLOCK_RULES = {"trtllm": _trtllm_refusal, "vllm": _vllm_refusal, "sglang": _sglang_refusal,
               "llamacpp": _llamacpp_refusal}


# DFlash2: vLLM >= 0.28 (pull request 52816) and SGLang >= 0.5.19 (pull request 35371) pick z-lab's
# DFlash2 model from the checkpoint's `DFlash2DraftModel` under their DFlash method; llama.cpp's
# converter writes it as its `dflash` architecture with the selector (pull request 27342, master from
# pull request 27816); TensorRT-LLM has DFlashDecodingConfig only. Each fact is in its convert/bundles
# module.


def _dflash2_vllm(kind: DrafterKind) -> str | None:
    return None  # method dflash: vLLM's Qwen3 DFlash2 model reads every DFlash2 field


def _dflash2_sglang(kind: DrafterKind) -> str | None:
    if kind.selector.input_embedding_scale != 1.0:
        return (f"SGLang's DFLASH (0.5.19 to 0.5.23) does not read dflash_config.input_embedding_scale "
                f"({kind.selector.input_embedding_scale:g} in this drafter): it would draft with unscaled embeddings")
    return None


def _dflash2_llamacpp(kind: DrafterKind) -> str | None:
    selector = kind.selector
    if selector.width < selector.top_k * (selector.top_k + 1):
        return (f"llama.cpp's DFlash2 loader needs a hidden size of at least selector_top_k x (selector_top_k + 1) "
                f"= {selector.top_k * (selector.top_k + 1)} for its selector lattice, and this drafter's is "
                f"{selector.width}")
    return None


def _dflash2_trtllm(kind: DrafterKind) -> str | None:
    return ("TensorRT-LLM's DFlashDecodingConfig runs z-lab DFlash drafters only: it has no DFlash2 model "
            "(no grouped dynamic convolutions, no candidate selector for DFlash2DraftModel)")


SERVING_RULES = {"dflash": BLOCK_RULES, "dspark": BLOCK_RULES,
                 "eagle3": {name: _eagle3_refusal(name, title) for name, title in
                            (("trtllm", "TensorRT-LLM"), ("vllm", "vLLM"), ("sglang", "SGLang"), ("llamacpp", "llama.cpp"))},
                 "dflash2": {"trtllm": _dflash2_trtllm, "vllm": _dflash2_vllm, "sglang": _dflash2_sglang,
                             "llamacpp": _dflash2_llamacpp}}
