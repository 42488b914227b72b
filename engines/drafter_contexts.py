"""Which `DrafterContext` (engines/protocol.py) an engine keeps for a drafter: one row per context,
looked up by the drafter kind's `context` (loopspec/model/drafter_kinds.py), with its torch
implementation and the one over exported graphs (ONNX Runtime, TensorRT). A drafter family that drafts
as a block drafter does (DFlash, DSpark, DFlash2) shares the block context; a family that drafts
another way adds its two classes and its row here."""

from __future__ import annotations

from dataclasses import dataclass

from loopspec.engines.dflash_context import DFlashContext
from loopspec.engines.dflash_graphs import DFlashGraphs
from loopspec.engines.eagle3_context import Eagle3Context
from loopspec.engines.eagle3_graphs import Eagle3Graphs
from loopspec.errors import LoopspecError
from loopspec.model.drafter_kinds import DrafterKind


@dataclass(frozen=True)
class DrafterContexts:
    """One context's implementations: `torch(drafter, target, max_length, rows)` on the torch engine,
    `graphs(engine, cfg, rows, max_length, dtype, growth)` on an artifact engine, whose class names the
    graphs it runs (`graphs`) and the one its cache feeds (`cache_graph`)."""

    torch: type
    graphs: type


DRAFTER_CONTEXTS = {
    "dflash": DrafterContexts(DFlashContext, DFlashGraphs),
    "eagle3": DrafterContexts(Eagle3Context, Eagle3Graphs),
}


def drafter_contexts(kind: DrafterKind) -> DrafterContexts:
    """The context implementations of a drafter of this kind."""
    found = DRAFTER_CONTEXTS.get(kind.context)
    if found is None:
        raise LoopspecError(f"no engine context for {kind.title} drafters (context {kind.context!r})")
    return found
