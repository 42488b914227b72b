"""What every backend over exported engines shares (ONNX Runtime, TensorRT): the Engine protocol
(engines/protocol.py) over the exported graphs, bound by the names their EngineSpecs declare.

The engine owns the target's K/V and the drafter's context K/V as `KVCache`s of `max_rows` rows
with one length per row, whose buffers are as wide as the rows need (`SlotGrowth`). Each call passes
its rows' past at least as wide as the longest row plus the call's tokens (room for the new K/V, which
the graph writes after each row's own length) and every row's length (the graphs mask the rest). The
graphs take dense inputs: the past of rows 0..R-1 is the buffer itself, each layer one block, so
nothing is copied; other rows are copied once per call. The K/V the graph returns for the new
positions are written back at each row's own length; rollback moves the lengths. A backend supplies
`_open` (one runner per engine: `run(**tensors) → {output: tensor}`), the buffers' dtype and device;
everything else is here. An artifact of the `gguf-fused` precision holds the target's step graph
instead of target_verify (engines/target_step.py): its backend's runner (`_open_step`) binds each
row of the cache as the graph's past and present, so the graph writes the new K/V itself and the
cache only moves the lengths; it verifies chains only. The drafter's context and its stages are a
`DrafterContext` over the drafter's graphs, looked up by its kind (engines/drafter_contexts.py: the
block drafters' engines/dflash_graphs.py, EAGLE-3's engines/eagle3_graphs.py).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from loopspec.engines.drafter_contexts import drafter_contexts
from loopspec.engines.export import ORDER_FREE_SOFTMAX
from loopspec.engines.manifest import Manifest, read_manifest
from loopspec.engines.target_step import ATTENTION_PADDING
from loopspec.engines.specs import MIN_PRODUCT_ROWS, TARGET_STEP, TARGET_VERIFY, EngineSpec, past_feeds, past_width
from loopspec.errors import LoopspecError
from loopspec.model.draft_head import StageDrafts
from loopspec.model.drafters import drafter_config
from loopspec.model.families import target_config
from loopspec.model.kv_cache import KVCache, SlotGrowth
from loopspec.weights import read_json

# slots a cache buffer grows by: a call reads at most this many - 1 slots past its rows' need, and the
# buffers are copied once per this many positions of the longest row
CACHE_SLOT_STEP = 32


def verifies_chains_only(settings: dict) -> bool:
    """Whether artifacts with these manifest settings verify only chains exactly (engines/protocol.py):
    int8 activations without the order-free softmax, or arithmetic its builder declared not order-exact
    (a TensorRT plan in fp16/bf16/fp8/nvfp4: engines/trt_engine.py plan_arithmetic)."""
    arithmetic = settings.get("arithmetic", {})
    int8_unordered = (
        str(arithmetic.get("activations", "")).startswith("int8") and settings.get("softmax") != ORDER_FREE_SOFTMAX
    )
    return int8_unordered or arithmetic.get("order_exact") is False


class ArtifactEngine:
    backend = ""
    device = torch.device("cpu")
    tree_span = 0  # see engines/protocol.py; a backend that measures its products sets it
    lone_step_width = MIN_PRODUCT_ROWS  # until measured (_measure_lone_step_width)
    # the exported drafter graph returns its top candidates, not the distribution they come from
    samples_drafts = False
    grows_dynamic_trees = False  # the EAGLE-3 graphs run one entry per row a step: no tree attention

    def __init__(self, artifact_dir: str | Path, max_context: int | None = None, max_rows: int = 1):
        self.artifact_dir = Path(artifact_dir)
        self.manifest = read_manifest(self.artifact_dir)
        self._check(self.manifest)
        # the target's graph: target_verify, or its chains-only fused form (engines/target_step.py)
        self.target_graph = TARGET_STEP if TARGET_STEP in self.manifest.engines else TARGET_VERIFY
        inputs = self.manifest.spec(self.target_graph).input_names
        if self.target_graph == TARGET_VERIFY and ("tree_mask" not in inputs or "past_key" in inputs):
            raise LoopspecError(
                f"{self.artifact_dir} was exported by an older loopspec (its target graph takes "
                f"{'a stacked past' if 'tree_mask' in inputs else 'no draft-tree mask'}): export it again"
            )
        self.target_cfg = target_config(read_json(self.artifact_dir / "target" / "config.json", "target config"))
        # the drafter's config.json read by its architecture (loopspec/model/drafters.py), and its context
        self.drafter_cfg = drafter_config(self.artifact_dir / "drafter") if self.manifest.has_drafter else None
        self.drafter_context = drafter_contexts(self.drafter_cfg.kind).graphs if self.drafter_cfg is not None else None
        self.precision = self.manifest.precision
        settings = self.manifest.data.get("settings", {})
        self.chains_only = verifies_chains_only(settings)
        spec_limit = self.manifest.spec(self.target_graph).ranges["tokens"][2]  # the exported max context
        self.max_context = min(max_context or spec_limit, spec_limit)
        # the target's step graph is run by its backend's runner (chains only: its settings say so)
        self.step = self._open_step(self.manifest) if self.target_graph == TARGET_STEP else None
        if self.target_graph == TARGET_STEP and self.step is None:
            raise LoopspecError(
                f"{self.artifact_dir}: its {TARGET_STEP} graph runs on ONNX Runtime, not {self.backend}"
            )
        names = ([TARGET_VERIFY] if self.step is None else []) + (
            list(self.drafter_context.graphs) if self.has_drafter else []
        )
        self.runners = {n: self._open(self.manifest.path(n), self.manifest.spec(n)) for n in names}
        self._new_caches(max_rows)
        self.lone_step_width = self._measure_lone_step_width()

    def _new_caches(self, max_rows: int) -> None:
        if max_rows < 1:
            raise LoopspecError(f"max batch size must be >= 1, got {max_rows}")
        if max_rows > self.max_batch:
            raise LoopspecError(
                f"max batch size {max_rows} is outside the exported engines' batch range "
                f"[1, {self.max_batch}] ({self.artifact_dir})"
            )
        t, d = self.target_cfg, self.drafter_cfg
        self.max_rows = max_rows
        self._staging: dict[str, torch.Tensor] = {}  # dense copies of the prefixes a call passes (`dense`)
        self.cache = KVCache(
            t.num_layers,
            max_rows,
            t.num_kv_heads,
            self.max_context,
            t.head_dim,
            self._dtype(self.target_graph, "past_key_0"),
            self.device,
            self._growth(self.target_graph, "past"),
        )
        kind = self.drafter_context
        self.context = (
            kind(
                self,
                d,
                max_rows,
                self.max_context,
                self._dtype(kind.cache_graph, "context_key"),
                self._growth(kind.cache_graph, "context"),
            )
            if d is not None
            else None
        )

    def _growth(self, engine: str, past_dim: str) -> SlotGrowth:
        # the widest past the engine takes (its spec's range): a TensorRT profile refuses a wider one
        return SlotGrowth(CACHE_SLOT_STEP, self.manifest.spec(engine).ranges[past_dim][2])

    def dense(self, name: str, view: torch.Tensor, per_layer: bool) -> torch.Tensor:
        """`view` (a cache prefix [layers, R, ...]) dense as the graph takes it, each layer on its own
        (`per_layer`: the target's past) or as a whole: itself when it already is (rows that follow
        each other, `KVCache.dense_prefix`), else copied into a dense buffer kept
        across calls: a fresh allocation every call costs more than the copy (new pages are faulted in
        and zeroed; measured on the default engine at 16 rows: 16.5 ms a K/V prefix against 7.5 ms
        into a kept buffer)."""
        if view[0].is_contiguous() if per_layer else view.is_contiguous():  # every layer has the same strides
            return view
        n, buffer = view.numel(), self._staging.get(name)
        if buffer is None or buffer.numel() < n:
            grown = max(n, 2 * buffer.numel()) if buffer is not None else n
            buffer = self._staging[name] = torch.empty(grown, dtype=view.dtype, device=view.device)
        return buffer[:n].view(view.shape).copy_(view)

    def with_rows(self, max_rows: int) -> "ArtifactEngine":
        twin = copy.copy(self)  # the same runners (sessions, plans)
        twin._new_caches(max_rows)
        return twin

    @property
    def block_types(self) -> tuple[str, ...]:
        """The GGUF types its target computes with, as the manifest counts its products ("Q4_K+Q6_K as
        8-bit BlockLinear": Q4_K and Q6_K); () for an export in fp32 or another precision."""
        products = self.manifest.data.get("settings", {}).get("weights", {}).get("products", {})
        kinds = {kind for how in products for kind in how.split(" as ")[0].split("+")}
        return tuple(sorted(kinds))

    @property
    def max_batch(self) -> int:
        """The most rows one call of these engines takes (the exported `batch` range)."""
        step = [self.manifest.data["settings"]["max_batch"]] if self.step is not None else []  # its rows: a graph each
        return min([self.manifest.spec(n).ranges["batch"][2] for n in self.runners] + step)

    # ---- what a backend supplies -----------------------------------------------------------------
    def _check(self, manifest: Manifest) -> None:
        """Refuse artifacts this backend cannot run (stage, precision, hardware)."""

    def _open(self, path: Path, spec: EngineSpec):
        raise NotImplementedError

    def _open_step(self, manifest: Manifest):
        """The runner of the target's step graph, if the artifact has one and this backend runs it
        (`run(cache, first_row, ids, logit_index)`: engines/ort_engine.py StepSessions); else None."""
        return None

    def _dtype(self, engine: str, tensor: str) -> torch.dtype:
        return torch.float32

    @property
    def has_drafter(self) -> bool:
        return self.drafter_cfg is not None

    # ---- target ----------------------------------------------------------------------------------
    def _measure_lone_step_width(self, probes: int = 2) -> int:
        """How wide a lone one-token step's call is on this machine: 1 when the target computes, bit
        for bit, the same logits, K/V and taps for a token alone as for the same token followed by a
        padding token, on `probes` random contexts; else MIN_PRODUCT_ROWS (a one-row product takes
        another kernel than a batch's rows: 4-bit MatMulNBits on AVX2 differs in the last bits; on
        AVX-512 it does not, and the padding token costs 13 % of the step). Measured, not assumed,
        like tree_span; the cache is left empty."""
        generator = torch.Generator().manual_seed(0)
        vocab, same = self.target_cfg.vocab_size, True
        for probe in range(probes):
            length = min(16 + 8 * probe, self.max_context - MIN_PRODUCT_ROWS)  # room for the padded call
            if length < 1:
                return MIN_PRODUCT_ROWS
            context = torch.randint(0, vocab, (length,), generator=generator).tolist()
            self.cache.lengths[0] = 0
            self._target([0], [context], all_logits=False)
            token = [torch.randint(0, vocab, (1,), generator=generator).tolist()]
            alone, padded = (self._probe(token, width, length) for width in (1, MIN_PRODUCT_ROWS))
            same = same and all(torch.equal(alone[name], padded[name]) for name in alone)
        self.cache.lengths[0] = 0
        return 1 if same else MIN_PRODUCT_ROWS

    def _probe(self, token: list[list[int]], width: int, start: int) -> dict[str, torch.Tensor]:
        """Row 0's one token at `start`, in a call `width` wide → its logits, taps and K/V (those the
        graph returns, or, written by the step graph into the cache, read back from its slot)."""
        out = self.run_target([0], token, width, all_logits=True)
        first = {name: out[name][:, :1] for name in ("logits", "taps") if name in out}
        if "new_key" in out:
            return first | {name: out[name][..., :1, :] for name in ("new_key", "new_value")}
        return first | {
            "new_key": self.cache.k[:, :1, :, start].clone(),
            "new_value": self.cache.v[:, :1, :, start].clone(),
        }

    def _target(
        self, rows: list[int], tokens: list[list[int]], all_logits: bool, tree_masks: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """`rows` run their tokens (right-padded) after their own KV — a chain, or the draft trees of
        `tree_masks` [R, T, T] — and the first len(tokens[b]) new K/V of row b are stored at its length."""
        # a lone one-token step gets a padding token (never stored, never seen) where this machine
        # needs it: see MIN_PRODUCT_ROWS and _measure_lone_step_width
        width = max(max(len(t) for t in tokens), self.lone_step_width if len(tokens) == 1 else 1)
        out = self.run_target(rows, tokens, width, all_logits, tree_masks)
        counts = torch.tensor([len(t) for t in tokens])
        if self.step is not None:  # the step graph wrote them into the cache
            self.cache.advance(rows, counts)
        else:
            self.cache.append(out["new_key"], out["new_value"], rows, counts)
        return out

    def run_target(
        self,
        rows: list[int],
        tokens: list[list[int]],
        width: int,
        all_logits: bool,
        tree_masks: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """One target call over `rows`, their tokens right-padded to `width`; nothing is stored (the
        cache is left as it was): a probe, as _measure_lone_step_width and scripts/lone_step_ab.py use it."""
        ids = torch.zeros(len(tokens), width, dtype=torch.long)  # [R, T]
        for b, t in enumerate(tokens):
            ids[b, : len(t)] = torch.tensor(t)
        counts = torch.tensor([len(t) for t in tokens])
        starts = self.cache.lengths[rows]
        if int((starts + counts).max()) > self.max_context:
            raise LoopspecError(
                f"sequence of {int((starts + counts).max())} tokens exceeds the context of {self.max_context}"
            )
        last = torch.tensor([max(len(t) for t in tokens) - 1])
        if self.step is not None:  # the new K/V go into the cache's slots past each row's length
            if tree_masks is not None:
                raise LoopspecError("the target's step graph verifies chains only (engines/target_step.py)")
            if rows != list(range(rows[0], rows[0] + len(rows))):
                raise LoopspecError(f"the step graph runs rows that follow each other, not {rows}")
            self.cache.make_room(int(starts.max()) + width + ATTENTION_PADDING)
            index = torch.arange(width) if all_logits else last
            return self.step.run(self.cache, rows[0], ids.numpy(), index.numpy())
        past_key, past_value = self.cache.dense_prefix(rows, past_width(starts, width))  # [L, R, kvh, W, hd], with room
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        if tree_masks is None:
            tree_masks = causal.expand(len(tokens), -1, -1)
        elif tree_masks.shape[-1] < width:  # padding tokens see what a chain's would: never seen by a real token
            padded = causal.repeat(len(tokens), 1, 1)
            padded[:, : tree_masks.shape[1], : tree_masks.shape[2]] = tree_masks
            tree_masks = padded
        depths = tree_masks.sum(-1) - 1  # [R, T]: a node sits at its row's length + its depth
        out = self.runners[TARGET_VERIFY].run(
            input_ids=ids,
            positions=(starts[:, None] + depths).clamp_max(self.max_context - 1),
            logit_index=torch.arange(width) if all_logits else last,
            past_lengths=starts,
            tree_mask=tree_masks.contiguous(),
            **past_feeds(
                self.dense("past_key", past_key, per_layer=True), self.dense("past_value", past_value, per_layer=True)
            ),
        )
        return out

    def prefill(self, row: int, prompt_ids: list[int], want_taps: bool, start: int = 0) -> torch.Tensor:
        self.cache.lengths[row] = start
        out = self._target([row], [prompt_ids], all_logits=False)
        if self.context is not None:
            self.context.target_wrote([row], [start], [prompt_ids])
            if want_taps:
                self.context.restart(row, start)
                self.context.append_taps([row], out["taps"], [len(prompt_ids)])
        return out["logits"][0, -1].float().cpu()

    def verify(
        self, tokens: list[list[int]], want_taps: bool, tree_masks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.context is not None:  # the tokens at the slots the target stores them in
            rows = list(range(len(tokens)))
            self.context.target_wrote(rows, self.cache.lengths[rows].tolist(), tokens)
        out = self._target(list(range(len(tokens))), tokens, all_logits=True, tree_masks=tree_masks)
        taps = out["taps"] if want_taps and self.has_drafter else None
        return out["logits"].float().cpu(), taps

    def target_rollback(self, lengths: list[int]) -> None:
        self.cache.rollback(lengths)

    def target_commit(self, starts: list[int], kept: list[list[int]]) -> None:
        self.cache.commit(starts, kept)
        if self.context is not None:
            self.context.target_committed(starts, kept)

    # ---- drafter context -------------------------------------------------------------------------
    def append_context(self, taps: torch.Tensor, counts: list[int]) -> None:
        self.context.append_taps(list(range(taps.shape[0])), taps, counts)

    def append_pseudo_context(self, rows: list[int], hidden: torch.Tensor) -> None:
        self.context.append_pseudo(rows, hidden)

    def context_lengths(self, rows: list[int]) -> list[int]:
        return self.context.lengths[rows].tolist() if self.context is not None else [0] * len(rows)

    def context_rollback(self, rows: list[int], lengths: list[int]) -> None:
        self.context.rollback(rows, lengths)

    # ---- drafter ---------------------------------------------------------------------------------
    def draft(
        self, rows: list[int], anchors: list[int], positions: list[int], block_size: int, sampling: list | None = None
    ) -> StageDrafts:
        return self.context.draft(rows, anchors, positions, block_size, sampling)

    # ---- rows ------------------------------------------------------------------------------------
    def swap_rows(self, a: int, b: int) -> None:
        self.cache.swap_rows(a, b)
        if self.context is not None:
            self.context.swap_rows(a, b)
