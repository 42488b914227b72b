"""The decoding settings of a run, resolved once into one value.

Every entry point (CLI, bench, tune, server, Python API) resolves the method and its knobs here, from
what the user gave and what the drafter carries (its block size, and the DLoop setting `loopspec
tune` stored in its config), then passes the value down; every result carries it back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from typing import TYPE_CHECKING

from loopspec.errors import LoopspecError

if TYPE_CHECKING:  # annotations only: the settings, and the command line's flags made from them, load without torch
    from loopspec.model.dflash import DrafterConfig

METHODS = ("ar", "dflash", "dloop", "suffix")
DRAFTER_METHODS = ("dflash", "dloop")
SUFFIX_BLOCK_SIZE = 8  # `suffix` verifies up to 7 proposed tokens by default (as a block-8 chain)
DLOOP_DEFAULTS = {"gate_threshold": -0.5, "max_stages": 4, "gate": "logprob"}
# what a DLoop gate scores a stage by: the log-prob sum of its argmax drafts (the drafter's own belief
# that all are right), or the log of the product of a DSpark confidence head's per-draft estimates
# (trained to predict acceptance); either is an estimated log-probability that the whole stage holds
GATES = ("logprob", "confidence")
DRAFTING_METHODS = ("dflash", "dloop", "suffix")
# how drafts are made and accepted at T > 0 (DecodingSettings.draft_sampling)
DRAFT_SAMPLINGS = ("walk", "drafter")
# where a draft tree's nodes come from (DecodingSettings.tree_kind): best first over the drafter's
# stages (each depth's candidates; a DFlash2 selector's lattice), or EAGLE-2's dynamic tree, grown
# by a chain drafter node by node (loopspec/tree.py)
TREE_KINDS = ("best-first", "dynamic")
DYNAMIC_TOP_K = 4  # the dynamic tree's nodes expanded per step, and children per expanded node
# What the shared suffix library (DecodingSettings.shared_suffix, loopspec/suffix_library.py) may
# hold. It costs about 1 KiB per token it keeps (its n-gram index: five n-grams end at each token;
# tracemalloc measured 620-920 bytes a token, the token ids included, peaks under 1000 while its dicts
# grow, over outputs of 64 to 4096 tokens), and 8 Mi tokens (8 GiB) is a third of a 24 GB machine, the
# rest left to the model, its KV caches and the system. A server's N outputs hold up to N × (the most
# max_tokens a request may ask for + a 6-token lead-in) tokens (suffix_library.check_library_size); N
# alone is at most 2^20, whatever that limit (8 tokens an output).
SHARED_SUFFIX_BYTES_PER_TOKEN = 1024
SHARED_SUFFIX_MAX_TOKENS = 1 << 23
MAX_SHARED_SUFFIX = SHARED_SUFFIX_MAX_TOKENS // 8


@dataclass(frozen=True)
class Knob:
    """How a user sets one knob of DecodingSettings, declared once in its field's metadata: the
    flag every decoding command takes (its argparse destination is the field's name), its help, what
    its text parses to (`kind`: int, float, str, or bool for a --x / --no-x switch; `least`, `most`:
    an int's bounds; `choices`), and `unset`: what resolve_settings takes when the user gives nothing
    (None: resolved from the drafter's tuned setting, else the defaults). `tuned`: `loopspec tune`
    stores it with the drafter (loopspec/tuned.py). `methods`: the methods it applies to; given
    with any other it is refused, never dropped — unless `neutral` and given as its field's default,
    which asks for nothing (0 tree nodes, no suffix, one stage, the walk, the fallback off).
    A gate threshold or a gate type describes a gate, so only dloop takes one."""

    flag: str
    help: str
    methods: tuple[str, ...] = DRAFTING_METHODS
    neutral: bool = True
    kind: type = int
    least: int | None = None
    most: int | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    unset: object = None
    tuned: bool = False


def _knob(default, flag: str, help: str, **how):
    """A DecodingSettings field (its `default` when built directly) that users set through `flag`."""
    return field(default=default, metadata={"knob": Knob(flag, help, **how)})


@dataclass(frozen=True)
class DecodingSettings:
    """How every row drafts: `ar` is block size 1 (nothing drafted); `dflash` one stage of
    `block_size`; `dloop` adds stages while the gate score of the last is >= `gate_threshold`, up
    to `max_stages`; `suffix` drafts no model, only the continuation the committed text's own
    suffix index proposes (up to block_size - 1 tokens). `adaptive`: a row decodes plainly while
    drafting does not pay on it (speed only, never the output). `tree_budget`: the drafter's
    draft-tree nodes per verification (0 = its argmax chain). `suffix`: dflash/dloop also verify the
    suffix index's continuation as a branch of the same tree (up to max_drafts more nodes).
    `suffix_first` (the chain policy; 0 = off): dflash/dloop, per row and round — when the
    committed text's suffix matched an earlier occurrence of at least this many tokens, verify
    that occurrence's continuation (max_drafts tokens) as the chain and skip the drafter; else
    draft as set, the suffix branch included only with `suffix` (`suffix_branch`: the two are
    independent, and the policy alone verifies chains). A long match foretells a copy (code,
    quoted text, a repeated step), where the continuation is accepted far more often than the
    drafter's later positions, at no drafting cost.
    `suffix_then_draft` (the chain policy's second variant; needs suffix_first): in a copying round
    the drafter still runs one stage, anchored at the copy's last token, and its chain extends the
    copy — the drafter's context has no features for the copied positions (no drafter stage
    produced them), so its block attends past that gap. `gate`: what dloop's gate scores a stage by
    (GATES): its drafts' summed log-probs, or a DSpark confidence head's summed log-estimates.
    `draft_sampling` (rows sampling at T > 0; greedy rows always draft the argmax and keep the
    target's argmax): "walk" drafts the drafter's argmax chain or tree and commits, token by token,
    the target's own sample in plain decoding's order, following the draft that carries it — a
    seeded request then commits exactly the tokens `ar` does with the same seed; "drafter" samples
    each draft from the drafter's warped distribution q and accepts it with probability
    min(1, p/q), the bonus from normalize(max(0, p - q)) at the first rejection (standard
    speculative sampling: a position accepts with probability 1 - TV(p, q) instead of the walk's
    p(argmax q)); the output is distributed as `ar`'s but not the same tokens for a seed. "drafter"
    verifies the drafter's chain only (no tree, no suffix branch, no suffix-first).
    `shared_suffix` (0 = off; needs a suffix index): a Decoder keeps the last this many finished
    outputs in a suffix library (loopspec/suffix_library.py), read per scope by later rows' suffix
    indexes; only what is verified changes, never the output."""

    method: str = "ar"  # the one field that is no knob: each command names its method(s) its own way
    block_size: int = _knob(
        1, "--block-size", "draft block size k (default: the drafter's; suffix: 8)", least=1, tuned=True
    )
    max_stages: int = _knob(
        1, "--max-stages", "dloop: draft stages per verification (default 4)", least=1, tuned=True, methods=("dloop",)
    )
    gate_threshold: float = _knob(
        DLOOP_DEFAULTS["gate_threshold"],
        "--gate-threshold",
        "dloop: add a stage while the last one's summed draft log-prob is >= this (default -0.5)",
        kind=float,
        tuned=True,
        methods=("dloop",),
        neutral=False,
    )
    gate: str = _knob(
        DLOOP_DEFAULTS["gate"],
        "--gate",
        "dloop: what the gate scores a stage by: logprob (its drafts' summed log-probs; default) "
        "or confidence (a DSpark drafter's confidence head: the summed log of its estimates)",
        kind=str,
        metavar="SCORE",
        tuned=True,
        methods=("dloop",),
        neutral=False,
    )
    adaptive: bool = _knob(
        False, "--adaptive", "decode plainly while drafting does not pay (output unchanged; default on)", kind=bool
    )
    tree_budget: int = _knob(
        0,
        "--tree-budget",
        "dflash/dloop: draft-tree nodes per verification, best first over the drafter's "
        "candidates (0 = the argmax chain; default: the tuned setting, else 0)",
        least=0,
        tuned=True,
        methods=DRAFTER_METHODS,
    )
    suffix: bool = _knob(
        False,
        "--suffix",
        "dflash/dloop: also verify the continuation of the text's longest repeated suffix "
        "as a tree branch, in every round the drafter drafts (default: the tuned setting, else off)",
        kind=bool,
        tuned=True,
        methods=DRAFTER_METHODS,
    )
    suffix_first: int = _knob(
        0,
        "--suffix-first",
        "dflash/dloop chain policy: after the text repeats an earlier N-gram (N = 2..6), verify "
        "what followed it instead of drafting (0 = off; default: the tuned setting, else off); "
        "the other rounds draft as set, with the suffix branch only under --suffix",
        least=0,
        metavar="N",
        tuned=True,
        methods=DRAFTER_METHODS,
    )
    suffix_then_draft: bool = _knob(
        False,
        "--suffix-then-draft",
        "with --suffix-first: after the copy, the drafter's stage drafts on from its last token "
        "(default: the tuned setting, else off)",
        kind=bool,
        tuned=True,
        methods=DRAFTER_METHODS,
    )
    tree_kind: str = _knob(
        "best-first",
        "--tree-kind",
        "dflash: where the --tree-budget nodes come from: best-first (default; best first over each depth's "
        "candidates, a DFlash2 drafter's over its selector's lattice) | dynamic (EAGLE-3 drafters: EAGLE-2's "
        "dynamic tree, each expanded node drafted under its own path, then the best --tree-budget nodes kept)",
        kind=str,
        choices=TREE_KINDS,
        methods=("dflash",),
    )
    tree_top_k: int = _knob(
        DYNAMIC_TOP_K,
        "--tree-top-k",
        f"with --tree-kind dynamic: nodes expanded per drafter step and children per node (default {DYNAMIC_TOP_K})",
        least=1,
        metavar="K",
        methods=("dflash",),
    )
    tree_depth: int = _knob(
        0,
        "--tree-depth",
        "with --tree-kind dynamic: drafter steps, the tree's depth (0 = block size - 1; default 0)",
        least=0,
        metavar="D",
        methods=("dflash",),
    )
    draft_sampling: str = _knob(
        "walk",
        "--draft-sampling",
        "at temperature > 0: walk (default; the drafter's argmax drafts, and a seeded run commits "
        "exactly the tokens ar does) | drafter (drafts sampled from the drafter's distribution q, "
        "accepted with probability min(1, p/q): same output distribution, more accepted drafts "
        "where q is close to p; chains only, torch backend)",
        kind=str,
        choices=DRAFT_SAMPLINGS,
    )
    shared_suffix: int = _knob(
        0,
        "--shared-suffix",
        "serve: keep the last N finished outputs in a suffix library shared by later requests of the same "
        "scope (API key and `user`), whose continuation the suffix index proposes where it matches longer "
        "than the request's own text (0 = off; needs --method suffix, --suffix or --suffix-first). "
        "It holds up to N × (--max-tokens-limit + 6) tokens at about 1 KiB each, which must fit in "
        "8 GiB (a third of a 24 GB machine): N <= 2045 at the default limit of 4096, and never above "
        f"{MAX_SHARED_SUFFIX}",
        least=0,
        most=MAX_SHARED_SUFFIX,
        metavar="N",
    )

    def __post_init__(self):
        if self.method not in METHODS:
            raise LoopspecError(f"unknown method {self.method!r} (choose from {', '.join(METHODS)})")
        for name, knob in KNOBS.items():  # a knob set for a method it does not apply to (a value built
            # equal to its field's default cannot be told from one not given: resolve_settings refuses that)
            if not applies(name, getattr(self, name), self.method) and getattr(self, name) != KNOB_DEFAULTS[name]:
                raise LoopspecError(not_applicable(knob, self.method))
        self._check()

    def _check(self):
        if self.block_size < 1:
            raise LoopspecError(f"block size must be >= 1, got {self.block_size}")
        if self.method != "ar" and self.block_size < 2:
            raise LoopspecError(f"{self.method} needs a block size >= 2, got {self.block_size}")
        if self.max_stages < 1:
            raise LoopspecError(f"max stages must be >= 1, got {self.max_stages}")
        if not math.isfinite(self.gate_threshold):
            # inf never adds a stage and -inf always does: either is a max-stages setting, said as one
            raise LoopspecError(
                f"the gate threshold (--gate-threshold) must be a finite number, got "
                f"{self.gate_threshold}; use --max-stages to fix the stages"
            )
        if self.gate not in GATES:
            raise LoopspecError(f"unknown gate {self.gate!r} (choose from {', '.join(GATES)})")
        if self.tree_budget < 0:
            raise LoopspecError(f"tree budget must be >= 0, got {self.tree_budget}")
        self._check_tree_kind()
        from loopspec.tree import SUFFIX_MAX_MATCH, SUFFIX_MIN_MATCH

        if self.suffix_first and not SUFFIX_MIN_MATCH <= self.suffix_first <= SUFFIX_MAX_MATCH:
            raise LoopspecError(
                f"suffix-first match length must be {SUFFIX_MIN_MATCH}..{SUFFIX_MAX_MATCH} tokens "
                f"(0: off), got {self.suffix_first}"
            )
        if self.suffix_then_draft and not self.suffix_first:
            raise LoopspecError("suffix-then-draft extends the chain policy's copy: it needs suffix-first")
        if self.draft_sampling not in DRAFT_SAMPLINGS:
            raise LoopspecError(
                f"unknown draft sampling {self.draft_sampling!r} (choose from {', '.join(DRAFT_SAMPLINGS)})"
            )
        if self.draft_sampling == "drafter" and self.method not in DRAFTER_METHODS:
            raise LoopspecError(
                f"draft sampling 'drafter' samples the drafter's distribution: {self.method} has no "
                "drafter (use dflash or dloop)"
            )
        if self.draft_sampling == "drafter" and (self.tree_budget or self.suffix or self.suffix_first):
            raise LoopspecError(
                "draft sampling 'drafter' verifies the drafter's chain only: "
                "use --tree-budget 0 --no-suffix --suffix-first 0, or --draft-sampling walk"
            )
        if not 0 <= self.shared_suffix <= MAX_SHARED_SUFFIX:
            raise LoopspecError(
                f"the shared suffix library keeps >= 0 outputs (0: off) and at most {MAX_SHARED_SUFFIX} "
                f"(about {SHARED_SUFFIX_BYTES_PER_TOKEN} bytes a token: settings.SHARED_SUFFIX_MAX_TOKENS), "
                f"got {self.shared_suffix}"
            )
        if self.shared_suffix and not self.uses_suffix:
            raise LoopspecError(
                f"--shared-suffix {self.shared_suffix} feeds the suffix index, which {self.method} "
                "does not use here: add --suffix or --suffix-first N (dflash, dloop), or use "
                "--method suffix"
            )

    def _check_tree_kind(self):
        if self.tree_kind not in TREE_KINDS:
            raise LoopspecError(f"unknown tree kind {self.tree_kind!r} (choose from {', '.join(TREE_KINDS)})")
        if self.tree_kind != "dynamic":
            if self.tree_top_k != DYNAMIC_TOP_K or self.tree_depth:
                raise LoopspecError("--tree-top-k and --tree-depth shape the dynamic tree: add --tree-kind dynamic")
            return
        if self.tree_budget < 1:
            raise LoopspecError(
                "the dynamic tree keeps the best --tree-budget nodes of what it drafts: give --tree-budget N (N >= 1)"
            )
        if self.tree_top_k < 1:
            raise LoopspecError(f"the dynamic tree's top-K (--tree-top-k) must be >= 1, got {self.tree_top_k}")
        if not 0 <= self.tree_depth <= self.block_size - 1:
            raise LoopspecError(
                f"the dynamic tree's depth (--tree-depth) must be 1..{self.block_size - 1} (block "
                f"size - 1; 0: that), got {self.tree_depth}: raise --block-size for a deeper tree"
            )

    @property
    def dynamic_tree(self) -> "DynamicTreeShape | None":
        """The dynamic tree's shape (tree_kind "dynamic"), None for best-first trees."""
        if self.tree_kind != "dynamic":
            return None
        return DynamicTreeShape(self.tree_budget, self.tree_top_k, self.tree_depth or self.block_size - 1)

    @property
    def drafting(self) -> bool:
        """Something is drafted (by the drafter or the suffix index)."""
        return self.block_size > 1

    @property
    def uses_drafter(self) -> bool:
        return self.method in DRAFTER_METHODS

    @property
    def uses_suffix(self) -> bool:
        """The rows keep a suffix index: for the method, the branch or the chain policy."""
        return self.method == "suffix" or self.suffix or bool(self.suffix_first)

    @property
    def suffix_branch(self) -> bool:
        """A round without the chain policy's copy verifies the suffix index's continuation: the
        method suffix's whole proposal, or with `suffix` a branch of the drafter's tree. The chain
        policy (suffix_first) does not add it: its copy is a chain, and its other rounds draft as set."""
        return self.method == "suffix" or self.suffix

    @property
    def verifies_trees(self) -> bool:
        """Some round may verify a tree rather than a chain: a tree budget, or the suffix branch
        beside the drafter's chain (the method suffix's continuation alone is a chain)."""
        return bool(self.tree_budget) or (self.suffix_branch and self.uses_drafter)

    def check_sampling(self, greedy: bool) -> None:
        """Refuse a setting that cannot apply to a run's sampling: drafts sampled from the drafter
        apply only to rows sampling at temperature > 0 (a greedy row drafts the argmax either way)."""
        if self.draft_sampling == "drafter" and greedy:
            raise LoopspecError(
                "--draft-sampling drafter samples drafts at temperature > 0; this run is greedy "
                "(temperature 0): use --draft-sampling walk, or a temperature > 0"
            )

    @property
    def max_drafts(self) -> int:
        """The most drafts one verification checks."""
        return self.max_stages * (self.block_size - 1)

    def drafts_with(self, drafter: DrafterConfig | None) -> int:
        """The most drafts one verification checks with this drafter: a drafter of DeepSpec's block
        convention drafts every block position (k a stage), z-lab's all but the anchor's (k-1)."""
        if self.uses_drafter and drafter is not None:
            return self.max_stages * drafter.drafts_per_block(self.block_size)
        return self.max_drafts

    def describe(self) -> str:
        """What the stats line and reports name: 'dloop, k=4, gate -0.5, max stages 3'."""
        text = f"{self.method}, k={self.block_size}"
        if self.method == "dloop":
            text += f", gate {self.gate_threshold:g}" + (
                f" ({self.gate})" if self.gate != DLOOP_DEFAULTS["gate"] else ""
            )
            text += f", max stages {self.max_stages}"
        if self.tree_budget:
            text += f", tree {self.tree_budget}"
        if self.dynamic_tree is not None:
            shape = self.dynamic_tree
            text += f" (dynamic, top-{shape.top_k}, depth {shape.depth})"
        if self.suffix:
            text += ", + suffix"
        if self.suffix_first:
            text += f", suffix first at {self.suffix_first}-token matches"
            if self.suffix_then_draft:
                text += ", then the drafter"
        if self.draft_sampling == "drafter":
            text += ", drafts sampled from the drafter"
        if self.shared_suffix:
            text += f", shared suffix library of {self.shared_suffix} outputs"
        return text

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class DynamicTreeShape:
    """EAGLE-2's dynamic tree as one value: `depth` drafter steps, each expanding the `top_k` best
    nodes of the newest depth into `top_k` children each; the best `budget` drafted nodes are verified."""

    budget: int
    top_k: int
    depth: int


def knobs_of(settings_class: type) -> dict[str, Knob]:
    """{field name: Knob} of every field but `method`; a field declared without a Knob is refused,
    so a new knob cannot be added without the flag users set it with."""
    knobs = {}
    for f in fields(settings_class):
        if f.name == "method":
            continue
        if not isinstance(f.metadata.get("knob"), Knob):
            raise TypeError(
                f"{settings_class.__name__}.{f.name} is declared without a Knob: give its field "
                "metadata={'knob': Knob(flag, help, ...)} (see _knob)"
            )
        knobs[f.name] = f.metadata["knob"]
    return knobs


# the decoding knobs, in declaration order: the command line's decoding flags and resolve_settings'
# keywords are made from this
KNOBS = knobs_of(DecodingSettings)
KNOB_DEFAULTS = {f.name: f.default for f in fields(DecodingSettings)}


def applies(name: str, value, method: str) -> bool:
    """Whether the knob `name` given as `value` (None: not given) applies to `method` (Knob.methods,
    Knob.neutral)."""
    knob = KNOBS[name]
    return value is None or method in knob.methods or (knob.neutral and value == KNOB_DEFAULTS[name])


def not_applicable(knob: Knob, *methods: str) -> str:
    """The one line that refuses a knob given for a method (or methods) it does not apply to."""
    named = f"method{'s' if len(methods) > 1 else ''} {', '.join(methods)}"
    return f"{knob.flag} does not apply to {named}: it needs {' or '.join(knob.methods)}"


def knobs_for(method: str, knobs: dict) -> dict:
    """The given knobs (not None) that apply to `method`: what a command that runs several methods
    with one set of flags (bench) passes to each (check_knobs_apply refuses one that applies to none)."""
    return {
        name: value for name, value in knobs.items() if value is not None and method in KNOBS[name].methods
    }  # (a neutral value is the default anyway)


def check_knobs_apply(methods, knobs: dict) -> None:
    """Refuse a knob given (not None) that applies to none of `methods`."""
    for name, value in knobs.items():
        if not any(applies(name, value, method) for method in methods):
            raise LoopspecError(not_applicable(KNOBS[name], *dict.fromkeys(methods)))


def check_method(method: str, has_drafter: bool) -> None:
    """Refuse an unknown method, or a drafting one without a drafter (before anything slow is loaded)."""
    if method not in METHODS:
        raise LoopspecError(f"unknown method {method!r} (choose from {', '.join(METHODS)})")
    if method in DRAFTER_METHODS and not has_drafter:
        raise LoopspecError(f"method {method!r} needs a drafter (got --drafter none)")


def engine_key(backend: str, precision: str = "fp32") -> str:
    """Which engine a tuned setting was measured on: the backend, and the precision beyond fp32 (a
    4-bit engine's verification costs more plain steps than fp32's, so its best setting differs)."""
    return backend if precision == "fp32" else f"{backend} {precision}"


def tuned_setting(drafter: DrafterConfig | None, engine: str | None = None) -> dict:
    """The setting `loopspec tune` stored with the drafter (block size, gate, stages, tree budget,
    suffix): config.json loopspec.tuned[engine] (`engine_key`), measured on that engine, else
    loopspec.dloop, the drafter's setting for any engine; {} when none."""
    if drafter is None:
        return {}
    return dict((drafter.extra.get("tuned") or {}).get(engine) or drafter.extra.get("dloop") or {})


def resolve_settings(
    method: str,
    drafter: DrafterConfig | None,
    *,
    engine: str | None = None,
    chains_only: bool = False,
    tuned: dict | None = None,
    **knobs,
) -> DecodingSettings:
    """The settings of `method` for a drafter on `engine` (`engine_key`): each knob (KNOBS: block_size,
    gate_threshold, max_stages, gate, adaptive, tree_budget, tree_kind, tree_top_k, tree_depth, suffix,
    suffix_first, suffix_then_draft, draft_sampling, shared_suffix; one not given takes its Knob's
    `unset`: None, or on for adaptive) as given, else the drafter's tuned setting for that engine (its
    tree budget, suffix and suffix-first for dflash and dloop; block size, gate and stages for dloop),
    else its block size, the chain without suffix and the DLoop defaults. `tuned`: a setting stored
    elsewhere that replaces the drafter's (a user's result for a shipped drafter: loopspec/tuned.py).
    `draft_sampling` (default "walk"): "drafter" verifies chains, so a stored tree, suffix branch or
    suffix-first is not taken (one given is refused)."""
    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise TypeError(f"resolve_settings() got an unexpected keyword argument {unknown[0]!r}")
    given = {name: knobs.get(name, knob.unset) for name, knob in KNOBS.items()}
    check_method(method, drafter is not None)
    for name, value in given.items():
        if not applies(name, value, method):
            raise LoopspecError(not_applicable(KNOBS[name], method))
    if given["adaptive"] is None:
        given["adaptive"] = True  # on unless turned off: it changes speed only, never the output
    block_size, max_stages, gate_threshold, gate = (
        given[n] for n in ("block_size", "max_stages", "gate_threshold", "gate")
    )
    adaptive, tree_budget, suffix, suffix_first = (
        given[n] for n in ("adaptive", "tree_budget", "suffix", "suffix_first")
    )
    suffix_then_draft, draft_sampling = given["suffix_then_draft"], given["draft_sampling"]
    shared = {"shared_suffix": given["shared_suffix"] or 0}
    if block_size is not None and block_size < 1:
        raise LoopspecError(f"block size must be >= 1, got {block_size}")
    if max_stages is not None and max_stages < 1:
        raise LoopspecError(f"max stages must be >= 1, got {max_stages}")
    if method == "ar":
        return DecodingSettings()  # drafts nothing (a drafting knob given is refused above)
    if method == "suffix":
        return DecodingSettings(
            "suffix",
            block_size=block_size or SUFFIX_BLOCK_SIZE,
            adaptive=adaptive,
            draft_sampling=draft_sampling or "walk",
            **shared,
        )
    sampling = {"draft_sampling": draft_sampling or "walk"}
    stored = dict(tuned) if tuned is not None else tuned_setting(drafter, engine)
    if sampling["draft_sampling"] == "drafter":  # it verifies the drafter's chain: no stored tree or suffix use
        stored = {
            k: v for k, v in stored.items() if k not in ("tree_budget", "suffix", "suffix_first", "suffix_then_draft")
        }
    if chains_only:  # an engine that verifies only chains exactly (see engines/protocol.py): no stored tree
        stored = {k: v for k, v in stored.items() if k not in ("tree_budget", "suffix")}
    tree = {
        "tree_budget": tree_budget if tree_budget is not None else int(stored.get("tree_budget", 0)),
        "suffix": suffix if suffix is not None else bool(stored.get("suffix", False)),
        "suffix_first": suffix_first if suffix_first is not None else int(stored.get("suffix_first", 0)),
    }
    # the stored variant goes with the stored match length: a match length given alone drops it
    tree["suffix_then_draft"] = (
        suffix_then_draft
        if suffix_then_draft is not None
        else suffix_first is None and bool(stored.get("suffix_then_draft", False))
    )
    if method == "dflash":
        shape = {
            name: given[name] if given[name] is not None else KNOB_DEFAULTS[name]
            for name in ("tree_kind", "tree_top_k", "tree_depth")
        }
        return DecodingSettings(
            "dflash",
            block_size=block_size or drafter.block_size,
            adaptive=adaptive,
            **tree,
            **shape,
            **sampling,
            **shared,
        )
    k = block_size or stored.get("block_size") or drafter.block_size
    loop = {**DLOOP_DEFAULTS, **{key: v for key, v in stored.items() if key in DLOOP_DEFAULTS}}
    return DecodingSettings(
        "dloop",
        block_size=k,
        max_stages=max_stages if max_stages is not None else int(loop["max_stages"]),
        gate_threshold=gate_threshold if gate_threshold is not None else float(loop["gate_threshold"]),
        gate=gate if gate is not None else str(loop["gate"]),
        adaptive=adaptive,
        **tree,
        **sampling,
        **shared,
    )
