"""Export wrappers — `nn.Module`s that compute exactly what the engine specs declare — and the
export of all engines of a target (+ drafter) into one artifact directory with its manifest.

The export lives here, beside the wrappers, because two callers need it: the `convert onnx` stage
(convert/onnx_export.py, which adds validation) and the runtime's first-use cache for
`--backend onnxruntime` (the runtime must not import convert). torch.onnx is imported lazily.

They read the weights of the reference modules (`Target`, `Drafter`) — through `.weight`, so a
oneDNN-packed inference copy works too — and use only plain ops that map onto standard ONNX
operators: Gather, MatMul, Softmax, Where, Concat, Reshape, Transpose, ReduceMean, Sqrt, ...
(no mkldnn packed linears, no fused rms_norm / scaled_dot_product_attention kernels).

KV cache layout. The target graph takes the cache's past K/V, one input per layer (`past_key_i` /
`past_value_i` [B, kvh, W, hd]: a stacked input would be cut into layers, a copy of the whole past
every call), of dynamic width W with room for the call's new tokens (W >= every row's length + T),
and returns only the NEW tokens' `new_key`/`new_value` [L, B, kvh, T, hd].
The runtime keeps ONE buffer (as wide as its rows need: engines/artifact_engine.py) and writes the
new K/V at each row's current length; rollback is moving the length, nothing is copied back. Returning
the full `present` cache instead would make the graph copy the whole cache every step (past + new) and
the runtime swap buffers, and a graph over the static buffer itself would attend over the full maximum
length every step. The drafter's context K/V follows the same rule: `drafter_context*` return the new
positions' K/V, `drafter_block` reads the valid prefix.

Batch. Every graph takes B rows (one request, or several decoded together). Rows hold different
numbers of valid past slots, so the past passed in is as wide as the longest row (plus room) and each
row's length (`past_lengths` / `context_lengths`) says how much of it is valid. Each row's new K/V are
written right after its own valid past (`row_layout`, once per call) and the attention sums in an
order that no masked slot changes (`order_free_softmax`): a row computes, bit for bit, what it
computes alone, and a verification what plain decoding computes (`attend`).

Positions are inputs (absolute RoPE positions), so one graph serves prefill and decoding.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from loopspec.engines.graph_ops import (  # noqa: F401
    ORDER_FREE_SOFTMAX,
    SOFTMAX_SUM_UNITS,
    attend,
    attend_with_keys,
    fixed_linear,
    fused_linear,
    head_scales,
    linear,
    merge_heads,
    order_free_softmax,
    qkv_heads,
    rms_norm,
    rope,
    rotate_half_matrix,
    row_layout,
    swiglu,
)
from loopspec.engines.dflash2_export import DFlash2Block
from loopspec.engines.manifest import Manifest, source_hashes, write_manifest
from loopspec.errors import LoopspecError
from loopspec.weights import file_sha256
from loopspec.engines.specs import (
    DRAFTER_BLOCK,
    DRAFTER_CONTEXT,
    DRAFTER_CONTEXT_HIDDEN,
    MAX_BATCH,
    TARGET_STEP,
    TARGET_VERIFY,
    EngineSpec,
    engine_specs,
    step_spec,
)
from loopspec.engines.staging import check_out_dir, staged_dir
from loopspec.engines.target_step import STEP_PRECISION, STEP_SETTINGS, step_refusal, write_step_graph
from loopspec.model.dflash import Drafter
from loopspec.model.draft_head import draft_head_weight, draft_stage
from loopspec.model.dspark import DraftHeads
from loopspec.model.drafter_kinds import DrafterKind, require_quantized_export
from loopspec.model.families import export_refusal
from loopspec.model.target import Target


class TargetVerify(nn.Module):
    """(input_ids [B, T], positions [B, T], logit_index [n], past_lengths [B], tree_mask [B, T, T],
    then per layer past_key_i, past_value_i [B, kvh, W, hd] (W >= every row's length + T)) → logits
    [B, n, V], taps [B, T, taps·H] (when tap layers are given), new_key/new_value [L, B, kvh, T, hd].

    Written for a small graph: head counts are Python ints and every reshape has one symbolic dim
    (-1) besides the batch, read once from the input, so little shape arithmetic is traced per layer."""

    def __init__(self, target: Target, tap_layer_ids: list[int]):
        super().__init__()
        self.target = target
        self.cfg = cfg = target.cfg
        self.tap_layer_ids = list(tap_layer_ids)
        h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.register_buffer("rotate", rotate_half_matrix(hd))
        self.register_buffer("head_scale", head_scales(h, kvh, hd))
        if cfg.qk_norm:  # per layer [h + kvh, hd]: q_norm's weight on the query heads, k_norm's on the key heads
            self.register_buffer(
                "qk_norm_weight",
                torch.stack(
                    [
                        torch.cat(
                            [
                                l.self_attn.q_norm.weight.detach().expand(h, hd),
                                l.self_attn.k_norm.weight.detach().expand(kvh, hd),
                            ]
                        )
                        for l in target.layers
                    ]
                ),
            )
        else:
            self.qk_norm_weight = None

    def forward(self, input_ids, positions, logit_index, past_lengths, tree_mask, *past):
        cfg, t = self.cfg, self.target
        h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        group = h // kvh
        batch, width = input_ids.shape[0], past[0].shape[2]
        past_key, past_value = past[0::2], past[1::2]  # one input each per layer: no cut of a stacked cache
        cos = t.rotary.cos[positions][:, :, None] * self.head_scale  # [B, T, h + kvh, hd]
        sin = t.rotary.sin[positions][:, :, None] * self.head_scale
        # new token i sees its row's valid past keys and the new keys its tree_mask row marks (the
        # causal chain, or its ancestors in a draft tree); rows of the bias follow q's (g, T) order
        slots, mask = row_layout(past_lengths, width, tree_mask, kvh, group, hd)
        x = F.embedding(input_ids, t.embed_tokens.weight)  # [B, T, H]
        taps, new_keys, new_values, presents = {}, [], [], []
        last = cfg.num_layers - 1
        for i, layer in enumerate(t.layers):
            attn = layer.self_attn
            y = rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
            norm_w = self.qk_norm_weight[i] if self.qk_norm_weight is not None else None
            eps = attn.q_norm.eps if attn.q_norm is not None else 0.0
            q, k, v = qkv_heads(linear(y, attn.qkv_proj), batch, h, kvh, hd, norm_w, eps, cos, sin, self.rotate)
            new_keys.append(k)  # [B, kvh, T, hd]
            new_values.append(v)
            # the past with the new K/V in their slots is an output too: bound to the past's own memory,
            # the scatter writes into the cache instead of copying it (engines/ort_engine.py)
            out, present_k, present_v = attend_with_keys(q, past_key[i], past_value[i], k, v, slots, mask)
            presents += [present_k, present_v]
            x = x + linear(merge_heads(out, batch, h, hd), attn.o_proj)
            x = x + swiglu(
                rms_norm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps), layer.mlp
            )
            if i in self.tap_layer_ids and i != last:
                taps[i] = x
        x = rms_norm(x, t.norm.weight, t.norm.eps)
        if last in self.tap_layer_ids:
            taps[last] = x  # HF's hidden_states[L] is the final-normed output (as the reference)
        logits = linear(x[:, logit_index], t.lm_head)  # [B, n, V]
        outputs = [logits]
        if self.tap_layer_ids:
            outputs.append(torch.cat([taps[i] for i in self.tap_layer_ids], dim=-1))  # [B, T, taps·H]
        return (*outputs, torch.stack(new_keys), torch.stack(new_values), *presents)


class DrafterContext(nn.Module):
    """The fused KV injection: (taps [B, T, n·H] or hidden [B, T, H], positions [B, T]) →
    every drafter layer's context K/V [N, B, kvh, T, hd]: fc → hidden_norm (taps only) → ONE matmul
    producing all layers' K and V → k_norm → RoPE."""

    def __init__(self, drafter: Drafter, from_taps: bool = True):
        super().__init__()
        # persistent buffers: the exporter stores them as initializers (external data), not as inline constants
        self.drafter = drafter
        self.from_taps = from_taps
        cfg = drafter.cfg
        # [N·2·kvh·hd, H]: per layer, k_proj rows then v_proj rows (as Drafter.context_kv)
        self.kv_proj = fused_linear([p for l in drafter.layers for p in (l.self_attn.k_proj, l.self_attn.v_proj)])
        k_norm = torch.stack([l.self_attn.k_norm.weight for l in drafter.layers])  # [N, hd]
        self.register_buffer("k_norm_weight", k_norm.detach().clone()[:, None, None, None, :])
        self.register_buffer("rotate", rotate_half_matrix(cfg.head_dim))
        self.eps = cfg.rms_norm_eps

    def forward(self, features, positions):
        d, cfg = self.drafter, self.drafter.cfg
        N, kvh, hd = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        if self.from_taps:
            features = rms_norm(linear(features, d.fc), d.hidden_norm.weight, d.hidden_norm.eps)  # [B, T, H]
        kv = linear(features, self.kv_proj).reshape(features.shape[0], -1, N, 2, kvh, hd)
        k, v = kv.permute(3, 2, 0, 4, 1, 5).unbind(0)  # [N, B, kvh, T, hd] each
        k = rms_norm(k, self.k_norm_weight, self.eps)
        cos = d.rotary.cos[positions][:, None]  # [B, 1, T, hd]
        sin = d.rotary.sin[positions][:, None]
        return rope(k, cos, sin, self.rotate), v


class DrafterBlock(nn.Module):
    """(block_ids [B, k], positions [B, k], context_key/context_value [N, B, kvh, C, hd],
    context_lengths [B]) → draft_ids [B, D, C] (each drafting position's C best drafts as target ids,
    rank 0 the argmax), draft_logprobs [B, D, C], hidden [B, k, H], and with a confidence head
    confidence [B, D]; D = k-1 or k by the drafter's block convention.

    The block embeds with the target's embedding and drafts with the target's lm_head rows (only the
    reduced draft vocabulary's rows when the drafter has a d2t map; ids are mapped back in-graph).
    The draft-head step is `draft_stage` itself, traced: a DSpark drafter's Markov correction runs
    left to right, each position's argmax the next one's predecessor, so the trace unrolls it over
    a fixed number of positions — the most a block of `max_block` has. A shorter block's states are
    padded to that width and its outputs cut back: every position reads only those before it, so the
    padding changes nothing that is returned."""

    def __init__(
        self,
        drafter: Drafter,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        max_block: int | None = None,
        head: nn.Module | None = None,
    ):
        super().__init__()
        self.drafter = drafter
        cfg = drafter.cfg
        self.heads = DraftHeads(drafter)
        self.max_block = max_block or cfg.block_size
        h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.register_buffer("embed_weight", embed_weight.detach())
        draft_ids = drafter.draft_ids
        # the draft rows of the lm_head, unless a block product of them is given
        head = head if head is not None else fixed_linear(draft_head_weight(lm_head_weight.detach(), draft_ids))
        self.head = head  # states [..., H] → logits over the draft rows (a block product exports itself)
        self.register_buffer("draft_to_target", draft_ids.clone() if draft_ids is not None else None)
        # q, k and v of each layer as one product, as the target's qkv_proj
        self.qkv_proj = nn.ModuleList(
            fused_linear([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]) for l in drafter.layers
        )
        self.register_buffer(
            "qk_norm_weight",
            torch.stack(
                [
                    torch.cat(
                        [
                            l.self_attn.q_norm.weight.detach().expand(h, hd),
                            l.self_attn.k_norm.weight.detach().expand(kvh, hd),
                        ]
                    )
                    for l in drafter.layers
                ]
            ),
        )  # [N, h + kvh, hd]
        self.register_buffer("rotate", rotate_half_matrix(hd))
        self.register_buffer("head_scale", head_scales(h, kvh, hd))

    def forward(self, block_ids, positions, context_key, context_value, context_lengths):
        d, cfg = self.drafter, self.drafter.cfg
        h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        batch, context = block_ids.shape[0], context_key.shape[3]
        cos = d.rotary.cos[positions][:, :, None] * self.head_scale  # [B, k, h + kvh, hd]
        sin = d.rotary.sin[positions][:, :, None] * self.head_scale
        block = (
            torch.ones_like(block_ids, dtype=torch.bool)[:, :, None]
            & torch.ones_like(block_ids, dtype=torch.bool)[:, None, :]
        )
        slots, mask = row_layout(context_lengths, context, block, kvh, h // kvh, hd)  # the block sees all of itself
        x = F.embedding(block_ids, self.embed_weight)  # [B, k, H]
        for i, layer in enumerate(d.layers):
            attn = layer.self_attn
            y = rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
            q, k, v = qkv_heads(
                linear(y, self.qkv_proj[i]),
                batch,
                h,
                kvh,
                hd,
                self.qk_norm_weight[i],
                attn.q_norm.eps,
                cos,
                sin,
                self.rotate,
            )
            out = attend(q, context_key[i], context_value[i], k, v, slots, mask)
            x = x + linear(merge_heads(out, batch, h, hd), attn.o_proj)
            x = x + swiglu(
                rms_norm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps), layer.mlp
            )
        hidden = rms_norm(x, d.norm.weight, d.norm.eps)  # [B, k, H]
        states = hidden
        # the traced chain is unrolled over max_block positions; the last real one repeats past k
        if cfg.kind.unrolled_draft_head:
            padded = torch.cat([hidden, hidden[:, -1:].expand(-1, self.max_block, -1)], dim=1)
            states = padded[:, : self.max_block]  # [B, max_block, H]
        drafts, logprobs, confidence = draft_stage(
            self.heads, states, block_ids[:, 0], lambda h: linear(h, self.head), self.draft_to_target
        )
        width = hidden.shape[1] - cfg.first_draft  # D of this call's block
        outputs = (drafts[:, :width], logprobs[:, :width], hidden)  # [B, D, C], [B, D, C], [B, k, H]
        return outputs if confidence is None else (*outputs, confidence[:, :width])  # + [B, D]


# --------------------------------------------------------------------------------------------------
# Export of every engine into one directory

OPSET = 17
# sizes of the symbolic dims in the example inputs of the trace: distinct values, so that no two
# dims can be confused, none 0 or 1 (the graph itself accepts those: past = 0 at prefill)
EXAMPLE_SIZES = {"batch": 6, "tokens": 3, "past": 8, "logits": 2, "block": 4, "context": 9}
LENGTH_INPUTS = {"past_lengths": "past", "context_lengths": "context"}  # per-row valid length of that dim
TARGET_SUBDIR, DRAFTER_SUBDIR = "target", "drafter"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def example_inputs(spec: EngineSpec, vocab_size: int) -> tuple[torch.Tensor, ...]:
    """Valid inputs of the example sizes: token ids in the vocabulary, positions after the past,
    logit indices inside the tokens, rows' valid lengths that differ (1 .. the full width)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for t in spec.inputs:
        shape = t.shape(EXAMPLE_SIZES)
        if t.name in ("input_ids", "block_ids"):
            out.append(torch.randint(0, vocab_size, shape, generator=g))
        elif t.name == "positions":
            start = EXAMPLE_SIZES["past"] if spec.name == TARGET_VERIFY else EXAMPLE_SIZES["context"]
            out.append(torch.arange(start, start + shape[1]).expand(shape).contiguous())
        elif t.name == "logit_index":
            out.append(torch.arange(EXAMPLE_SIZES["tokens"] - shape[0], EXAMPLE_SIZES["tokens"]))
        elif t.name == "tree_mask":  # a small tree: token 2 beside token 1, both children of token 0
            mask = torch.ones(shape[1], shape[2], dtype=torch.bool).tril()
            mask[2:, 1] = False
            out.append(mask.expand(shape).contiguous())
        elif t.name in LENGTH_INPUTS:  # rows of different lengths, each with room for the new tokens
            room = (
                EXAMPLE_SIZES[LENGTH_INPUTS[t.name]]
                - EXAMPLE_SIZES["tokens" if spec.name == TARGET_VERIFY else "block"]
            )
            out.append(room - torch.arange(shape[0]) % (room + 1))
        else:
            out.append(torch.randn(shape, generator=g))
    return tuple(out)


def export_graph(module: nn.Module, spec: EngineSpec, args: tuple, path: Path, opset: int = OPSET) -> None:
    """One engine → `path` (graph) + `path`.data (weights, external data in the same directory)."""
    import onnx

    path = Path(path)
    traced = path.with_suffix(".traced.onnx")
    with warnings.catch_warnings():
        # the TorchScript exporter announces its deprecation and the tracer warns about shape
        # arithmetic that is traced symbolically anyway; the parity tests are the real check
        warnings.simplefilter("ignore")
        with torch.no_grad():
            torch.onnx.export(
                module.eval(),
                args,
                str(traced),
                input_names=spec.input_names,
                output_names=spec.output_names,
                dynamic_axes=spec.dynamic_axes(),
                opset_version=opset,
                dynamo=False,
                do_constant_folding=True,
            )
    model = onnx.load(str(traced))
    traced.unlink()
    for extra in traced.parent.glob(traced.name + "*"):  # exporter side files of very large graphs
        extra.unlink()
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=path.name + ".data",
        size_threshold=1024,
        convert_attribute=True,
    )
    onnx.checker.check_model(str(path))


def tensors_sha256(module: nn.Module) -> str:
    """Content hash of a module's tensors (for sources that exist only in memory)."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def drafter_source(drafter: Drafter, drafter_dir: Path | None) -> dict:
    if drafter_dir is not None:
        return source_hashes(drafter_dir)
    return {"path": None, "in_memory_sha256": tensors_sha256(drafter)}


# the drafter_block graph of each block drafter family: DFlash's draft head (DSpark's heads unrolled in
# it), DFlash2's selector walk (engines/dflash2_export.py); EAGLE-3's graphs are engines/eagle3_export.py's
BLOCK_GRAPHS = {"dflash": DrafterBlock, "dspark": DrafterBlock, "dflash2": DFlash2Block}


def block_graph(kind: DrafterKind):
    """The module class of a block drafter kind's drafter_block graph; a kind none is written for is
    refused in one line (it decodes on --backend torch)."""
    graph = BLOCK_GRAPHS.get(kind.name)
    if graph is None:
        raise LoopspecError(
            f"the ONNX / TensorRT export has no drafter graph for {kind.title} drafters: they run on --backend torch"
        )
    return graph


def export_code_sha256() -> str:
    """The wrappers', the specs' and the drafter model's source (the drafter-block graph traces its
    `draft_stage` and DSpark heads, a DFlash2 drafter's its own, and its kind decides the graph's outputs):
    a cached export made by other code (other graphs or other inputs and outputs) is not reused."""
    from loopspec.engines import dflash2_export, graph_ops, specs, target_step
    from loopspec.model import dflash, dflash2, draft_head, drafter_kinds, dspark

    h = hashlib.sha256()
    for source in (
        Path(__file__),
        Path(specs.__file__),
        Path(dflash.__file__),
        Path(draft_head.__file__),
        Path(dspark.__file__),
        Path(drafter_kinds.__file__),
        Path(graph_ops.__file__),
        Path(dflash2_export.__file__),
        Path(dflash2.__file__),
        Path(target_step.__file__),
    ):
        h.update(file_sha256(source).encode())
    return h.hexdigest()


def source_key(target_dir: Path, drafter: Drafter | None, drafter_dir: Path | None, settings: dict) -> str:
    """Short key of (target checkpoint, drafter, export settings, export code): names a cached export."""
    from loopspec.weights import target_fingerprint

    h = hashlib.sha256(target_fingerprint(target_dir).encode())
    h.update(export_code_sha256().encode())
    if drafter is not None:
        h.update(json.dumps(drafter_config(drafter.cfg), sort_keys=True).encode())
        h.update(json.dumps(drafter_source(drafter, drafter_dir), sort_keys=True).encode())
        if drafter.draft_ids is not None:
            h.update(drafter.draft_ids.numpy().tobytes())
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()[:16]


def drafter_config(cfg) -> dict:
    """The config.json an artifact's drafter/ holds: z-lab's for a block drafter, SpecForge's for EAGLE-3."""
    return cfg.to_hf() if cfg.kind.chain else cfg.to_zlab()


def copy_run_files(target_dir: Path, drafter: Drafter | None, out_dir: Path) -> None:
    """What running needs besides the graphs: the target's config + tokenizer files, the drafter's
    config (mask token resolved) and its d2t map."""
    (out_dir / TARGET_SUBDIR).mkdir()
    for f in sorted(Path(target_dir).iterdir()):
        if (
            f.is_file()
            and not f.name.startswith(".")
            and f.suffix not in WEIGHT_SUFFIXES
            and not f.name.endswith(".index.json")
        ):
            shutil.copy2(f, out_dir / TARGET_SUBDIR / f.name)
    if drafter is not None:
        (out_dir / DRAFTER_SUBDIR).mkdir()
        (out_dir / DRAFTER_SUBDIR / "config.json").write_text(json.dumps(drafter_config(drafter.cfg), indent=2) + "\n")
        if not drafter.cfg.kind.chain:  # an EAGLE-3 graph maps its draft rows to target ids itself
            drafter.save_d2t(out_dir / DRAFTER_SUBDIR)


def export_engines(
    target: Target,
    drafter: Drafter | None,
    out_dir: str | Path,
    *,
    target_dir: str | Path,
    drafter_dir: str | Path | None = None,
    max_context: int | None = None,
    block_size: int | None = None,
    max_batch: int = MAX_BATCH,
    opset: int = OPSET,
    verify_target: Target | None = None,
    draft_drafter: Drafter | None = None,
    draft_head: nn.Module | None = None,
    precision: str = "fp32",
    extra_settings: dict | None = None,
    chain_graphs=None,
) -> Manifest:
    """Export target_verify (+ the three drafter engines when a drafter is given) as ONNX into
    `out_dir`, with the run files and manifest.json; every engine takes 1 .. `max_batch` rows. Staged
    (engines/staging.py): an interrupted export never looks complete and never destroys the previous one.

    `verify_target`: the module target_verify computes instead of `target` (a copy with linears that
    export themselves, e.g. the GGUF's blocks: engines/gguf_export.py), named by `precision` and
    described by `extra_settings` in the manifest; `draft_drafter` and `draft_head` likewise what the
    drafter engines compute instead of `drafter` and its rows of `target`'s lm_head (the embedding
    stays `target`'s fp32 one). `chain_graphs`: what builds a chain drafter's (EAGLE-3's) specs, modules and
    example inputs (engines/eagle3_export.py `eagle3_engines`, which uses this module's helpers: it is
    passed in by engines/backends.py `export_pair`). Precision gguf-fused: the target's step graph over
    `verify_target` (engines/target_step.py: ONNX Runtime's fused ops, chains only) instead of target_verify."""
    if drafter is not None and not drafter.cfg.kind.chain:
        block_graph(drafter.cfg.kind)  # refuses, in one line, a kind no block graph is written for
    import onnx  # noqa: F401  (fail early, with the extra to install)

    refusal = export_refusal(target.cfg, "ONNX")
    if refusal is not None:
        raise LoopspecError(refusal)
    out_dir, target_dir = Path(out_dir), Path(target_dir)
    drafter_dir = Path(drafter_dir) if drafter_dir is not None else None
    check_out_dir(out_dir, "manifest.json", "an artifact directory")
    limits = [target.cfg.max_position_embeddings] + ([drafter.cfg.max_position_embeddings] if drafter else [])
    max_context = min([max_context or min(limits)] + limits)
    taps = drafter.cfg.target_layer_ids if drafter is not None else []
    if drafter is not None and drafter.cfg.kind.chain:  # EAGLE-3: its fuse and step graphs (engines/eagle3_export.py)
        if chain_graphs is None:
            raise LoopspecError(
                f"an {drafter.cfg.kind.title} drafter's graphs come from engines/eagle3_export.py: "
                "export the pair with engines/backends.py export_pair"
            )
        if draft_drafter is not None or draft_head is not None:
            require_quantized_export(drafter.cfg.kind, "a quantized drafter graph")
        specs, modules, examples = chain_graphs(
            target,
            drafter,
            max_context=max_context,
            block_size=block_size,
            max_batch=max_batch,
            verify_target=verify_target,
        )
    else:
        specs, examples = (
            engine_specs(
                target.cfg,
                drafter.cfg if drafter is not None else None,
                max_context=max_context,
                block_size=block_size,
                max_batch=max_batch,
            ),
            {},
        )
        modules = {TARGET_VERIFY: TargetVerify(verify_target if verify_target is not None else target, taps)}
    if drafter is not None and not drafter.cfg.kind.chain:
        computed = draft_drafter if draft_drafter is not None else drafter
        modules[DRAFTER_CONTEXT] = DrafterContext(computed, from_taps=True)
        modules[DRAFTER_CONTEXT_HIDDEN] = DrafterContext(computed, from_taps=False)
        modules[DRAFTER_BLOCK] = block_graph(drafter.cfg.kind)(
            computed,
            target.embed_tokens.weight,
            target.lm_head.weight,
            max_block=specs[DRAFTER_BLOCK].ranges["block"][2],
            head=draft_head,
        )

    step_graph = precision == STEP_PRECISION  # the target's step graph instead (engines/target_step.py)
    if step_graph:
        refusal = step_refusal(target.cfg)
        if refusal is not None:
            raise LoopspecError(f"precision {precision}: {refusal} (gguf-int8act runs it)")
        modules.pop(TARGET_VERIFY)
        specs = {TARGET_STEP: step_spec(target.cfg, len(taps), 1, max_context)} | {
            name: spec for name, spec in specs.items() if name != TARGET_VERIFY
        }
    with staged_dir(out_dir) as work:
        files = {}
        for name, module in modules.items():
            files[name] = f"{name}.onnx"
            args = examples[name] if name in examples else example_inputs(specs[name], target.cfg.vocab_size)
            export_graph(module, specs[name], args, work / files[name], opset)
        if step_graph:
            files[TARGET_STEP] = write_step_graph(verify_target, taps, max_context, work)
        copy_run_files(target_dir, drafter, work)
        settings = {
            "opset": opset,
            "max_context": max_context,
            "max_batch": max_batch,
            "block_size": None if drafter is None else block_size or drafter.cfg.block_size,
            "target_layer_ids": taps,
            "exporter": "torch.onnx.export (TorchScript)",
            "kv_layout": "past in (per layer, with room for the new tokens), new out, and the past with "
            "the new written in (present_*: bound in place where the backend allows)",
            "attention_values": "one product over [past; new]",
            "softmax": ORDER_FREE_SOFTMAX,
            "export_code_sha256": export_code_sha256(),
            **(STEP_SETTINGS if step_graph else {}),
            **(extra_settings or {}),
        }
        sources = {
            "target": source_hashes(target_dir),
            "drafter": drafter_source(drafter, drafter_dir) if drafter is not None else None,
        }
        write_manifest(
            work, stage="onnx", precision=precision, specs=specs, engine_files=files, sources=sources, settings=settings
        )
    return Manifest(out_dir, json.loads((out_dir / "manifest.json").read_text()))
