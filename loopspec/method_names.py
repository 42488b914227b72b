"""A decoding setting's name as `bench` and `tune` write it: a method and the parts that fix its tree
and suffix choices ('dloop+tree16+suffix', 'dflash+chain'), read into overrides of the resolved
setting and written back from a setting."""

from __future__ import annotations

from loopspec.errors import LoopspecError
from loopspec.settings import DRAFTER_METHODS, METHODS, DecodingSettings


def method_variant(name: str) -> tuple[str, dict]:
    """A method as `bench` and `tune` name it → (method, overrides of its resolved settings).

    A bare name is the resolved setting (flags, else what `tune` stored); parts name the tree and
    the suffix branch completely, whatever was stored: 'dflash+chain' (no tree, no suffix branch),
    'dloop+tree16' (16 tree nodes, no suffix branch), 'dflash+suffix' (the chain and the suffix
    branch), 'dloop+tree16+suffix', 'dloop+first3' (the chain, and the suffix's continuation instead
    of the drafter's after a match of >= 3 tokens), 'dloop+first3+thendraft' (after such a match the
    drafter's stage extends the continuation), 'dloop+gateconf' (the chain, its stages gated by the DSpark
    confidence head), 'dflash+tree16+dynamic' (EAGLE-2's dynamic tree, its best 16 nodes verified).
    'suffix' is the drafter-free method."""
    from loopspec.tree import SUFFIX_MAX_MATCH, SUFFIX_MIN_MATCH

    method, *parts = name.split("+")
    if method not in METHODS:
        raise LoopspecError(f"unknown method {method!r} in {name!r} (choose from {', '.join(METHODS)})")
    if parts and method not in DRAFTER_METHODS:
        raise LoopspecError(
            f"{name!r}: only {' and '.join(DRAFTER_METHODS)} take +chain, +treeN, +suffix, +firstN or +thendraft"
        )
    overrides: dict = (
        {"tree_budget": 0, "suffix": False, "suffix_first": 0, "suffix_then_draft": False} if parts else {}
    )
    for part in parts:
        if part == "suffix":
            overrides["suffix"] = True
        elif part.startswith("tree") and part[4:].isdigit() and int(part[4:]) > 0:
            overrides["tree_budget"] = int(part[4:])
        elif part.startswith("first") and part[5:].isdigit() and SUFFIX_MIN_MATCH <= int(part[5:]) <= SUFFIX_MAX_MATCH:
            overrides["suffix_first"] = int(part[5:])
        elif part == "thendraft":
            overrides["suffix_then_draft"] = True
        elif part == "gateconf" and method == "dloop":
            overrides["gate"] = "confidence"
        elif part == "dynamic" and method == "dflash":
            overrides["tree_kind"] = "dynamic"  # EAGLE-2's dynamic tree of the +treeN nodes
        elif part != "chain":
            raise LoopspecError(
                f"{name!r}: unknown part {part!r} (+chain, +treeN with N >= 1, +suffix, "
                f"+firstN with N in {SUFFIX_MIN_MATCH}..{SUFFIX_MAX_MATCH}, +thendraft, "
                "+dynamic with dflash)"
            )
    if overrides.get("suffix_then_draft") and not overrides["suffix_first"]:
        raise LoopspecError(f"{name!r}: +thendraft extends +firstN's copy; name a match length too")
    return method, overrides


def variant_name(settings: DecodingSettings) -> str:
    """The bench/tune name of a setting's tree and suffix choice ('dloop+tree16+suffix', 'dflash+chain')."""
    if settings.method not in DRAFTER_METHODS:
        return settings.method
    parts = (
        ([f"tree{settings.tree_budget}"] if settings.tree_budget else [])
        + (["suffix"] if settings.suffix else [])
        + ([f"first{settings.suffix_first}"] if settings.suffix_first else [])
        + (["thendraft"] if settings.suffix_then_draft else [])
        + (["gateconf"] if settings.gate == "confidence" else [])
        + (["dynamic"] if settings.tree_kind == "dynamic" else [])
    )
    return "+".join([settings.method] + (parts or ["chain"]))
