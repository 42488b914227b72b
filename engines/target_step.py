"""The target's step graph in ONNX Runtime's own fused form, over the GGUF's blocks.

ONNX Runtime GenAI's model builder lays a decoder out as a few fused contrib ops: GroupQueryAttention
(rotary inside, the new K/V written into the past buffer itself: past and present are one buffer),
SkipSimplifiedLayerNormalization (the residual add and the next RMSNorm in one op), fused q/k/v and
MatMulNBits at accuracy level 4 — 343 nodes for the default target against 1,741 in `target_verify`
after ONNX Runtime's optimizations. This module writes that structure itself, node by node, over the
same block products `target_verify` computes with (engines/gguf_export.py `BlockLinear`: the GGUF's
codes and scales, the Q4_1 minimums as the exact term blocksum(x) · M), plus what loopspec needs:
the taps as an output, a `logit_index` (a prefill pays the lm_head once), and rows of different
lengths.

Two facts of ONNX Runtime's CPU GroupQueryAttention shape the graph and its calls (measured):
- it takes one row when a call continues a sequence with more than one token (it refuses batch > 1
  there), so the graph for R rows splits the fused q/k/v by row and runs one GroupQueryAttention per
  row, each over its own row of the cache; every other op runs over all rows at once. A graph per row
  count is derived from the exported one-row graph (`with_rows`), weights shared on disk.
- one query takes another kernel than several (its products differ in the last bits between 1 query
  and >= 2; not among >= 2), so each row's attention runs one query more than the row has tokens: a
  copy of its last (ATTENTION_PADDING), whose output is dropped and whose K/V land past the row's
  tokens, never seen. Only the attention pays for it; whether a lone token's products need a padding
  token too is the engine's measurement, as for target_verify (ArtifactEngine._measure_lone_step_width).
With both, a row computes bit for bit what it computes alone, and a verification of k tokens what k
one-token steps compute (tests/test_target_step.py).

Its attention has no draft-tree mask that keeps the order of the softmax's terms (target_verify's
order-free softmax does), so it verifies chains only (engines/artifact_engine.py
`verifies_chains_only`). The graph is built for the dense families whose layer is exactly this one
(`step_refusal` says why another is not).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from loopspec.engines.specs import TARGET_STEP, TensorSpec, row_past_name, step_spec
from loopspec.errors import LoopspecError
from loopspec.model.target import RotaryTable, Target, TargetConfig

ATTENTION_PADDING = 1  # the query each row's attention runs beside its own (the copy of its last)
STEP_PRECISION = "gguf-fused"  # the precision whose artifacts hold this graph (loopspec/precisions.py)
OPSET = 21
MS = "com.microsoft"
STEP_FAMILIES = ("llama", "qwen2", "qwen3")  # a dense decoder layer: RMSNorm, GQA with full RoPE, SwiGLU
# what the manifest says of the graph (engines/export.py's settings name target_verify's otherwise)
STEP_SETTINGS = {
    "exporter": "engines/target_step.py (the target, node by node); torch.onnx.export (the drafter)",
    "kv_layout": "each row's cache bound as GroupQueryAttention's past and present: written in place",
    "attention_values": "GroupQueryAttention",
    "softmax": "GroupQueryAttention's own: chains only",
}


def gqa_lengths(starts: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """GroupQueryAttention's (seqlens_k, total_sequence_length) for rows of lengths `starts` [R] that
    each run `width` tokens: a row's new K/V go to slots starts .. starts + width - 1 of its cache, and
    the copied query's to slot starts + width (ATTENTION_PADDING)."""
    total = (np.asarray(starts) + width + ATTENTION_PADDING).astype(np.int32)
    return total - 1, total


def step_refusal(cfg: TargetConfig) -> str | None:
    """Why the step graph cannot compute this target's layer (None: it can)."""
    if cfg.family not in STEP_FAMILIES:
        return f"the step graph builds {', '.join(STEP_FAMILIES)} targets, not {cfg.family}"
    other = {
        "sliding-window layers": bool(cfg.layer_types) and set(cfg.layer_types) != {"full_attention"},
        "partial rotary": cfg.rotary_dim != cfg.head_dim,
        "experts": cfg.experts is not None,
        "attention sinks": cfg.attention_sinks,
        "an output gate": cfg.attention_output_gate,
        "(1 + weight) norms": cfg.norm_plus_one,
    }
    found = [name for name, has in other.items() if has]
    return f"the step graph has no {', '.join(found)}" if found else None


# --------------------------------------------------------------------------------------------------
# the graph


class _Graph:
    """Nodes, initializers and constants of one graph being written."""

    def __init__(self):
        from onnx import numpy_helper

        self.numpy_helper = numpy_helper
        self.nodes, self.initializers, self._constants = [], [], {}

    def node(self, op: str, inputs: list[str], outputs: list[str], domain: str = "", **attributes) -> list[str]:
        from onnx import helper

        self.nodes.append(helper.make_node(op, inputs, outputs, domain=domain or None, **attributes))
        return outputs

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(self.numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def ints(self, values: list[int]) -> str:
        key = tuple(values)
        if key not in self._constants:
            self._constants[key] = self.weight(f"const_{len(self._constants)}", np.array(values, np.int64))
        return self._constants[key]


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy() if t.is_floating_point() else t.detach().numpy()


def _linear(g: _Graph, x: str, module: nn.Module, name: str) -> str:
    """x [R, T, K] → module(x) [R, T, N]: a block product (engines/gguf_export.py BlockLinear: its
    codes, scales, zero points, minimums, bias) as MatMulNBits (+ its minimum term, + its bias), an fp32
    Linear (an F32/F16 tensor of the GGUF) as MatMul."""
    if getattr(module, "codes", None) is not None:  # a BlockLinear (not imported: it imports the exporter)
        n, k = module.codes.shape[0], module.codes.shape[1] * module.block
        inputs = [x, g.weight(f"{name}.codes", _numpy(module.codes)), g.weight(f"{name}.scales", _numpy(module.scales))]
        if module.zero_points is not None:
            inputs.append(g.weight(f"{name}.zero_points", _numpy(module.zero_points)))
        attributes = dict(K=k, N=n, bits=module.bits, block_size=module.block, accuracy_level=module.accuracy_level)
        y = g.node("MatMulNBits", inputs, [f"{name}.product"], MS, **attributes)[0]
        if module.minimum is not None:  # Σ over each block of x, times the block's minimums: exact (module doc)
            blocks = g.node("Reshape", [x, g.ints([0, 0, k // module.block, module.block])], [f"{name}.blocks"])[0]
            sums = g.node("ReduceSum", [blocks, g.ints([-1])], [f"{name}.block_sums"], keepdims=0)[0]
            term = g.node("MatMul", [sums, g.weight(f"{name}.minimum", _numpy(module.minimum))], [f"{name}.minimums"])[
                0
            ]
            y = g.node("Add", [y, term], [f"{name}.with_minimums"])[0]
        bias = module.bias
    elif isinstance(module, nn.Linear):
        weight_t = g.weight(f"{name}.weight_t", _numpy(module.weight).T)  # [K, N]
        y = g.node("MatMul", [x, weight_t], [f"{name}.product"])[0]
        bias = module.bias
    else:
        raise LoopspecError(f"{name}: the step graph has no product for {type(module).__name__}")
    if bias is not None:
        y = g.node("Add", [y, g.weight(f"{name}.bias", _numpy(bias))], [f"{name}.biased"])[0]
    return y


def _head_norm(g: _Graph, x: str, norm: nn.Module, heads: int, head_dim: int, eps: float, name: str) -> str:
    """Qwen3's RMSNorm over each head of x [R, T, heads * hd]."""
    per_head = g.node("Reshape", [x, g.ints([0, 0, heads, head_dim])], [f"{name}.heads"])[0]
    normed = g.node(
        "SimplifiedLayerNormalization",
        [per_head, g.weight(f"{name}.weight", _numpy(norm.weight))],
        [f"{name}.normed"],
        axis=-1,
        epsilon=eps,
        stash_type=1,
    )[0]
    return g.node("Reshape", [normed, g.ints([0, 0, heads * head_dim])], [f"{name}.out"])[0]


def _value_info(t: TensorSpec):
    from onnx import TensorProto, helper

    elem = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64, "int32": TensorProto.INT32}[t.dtype]
    return helper.make_tensor_value_info(t.name, elem, list(t.dims))


def step_model(target: Target, taps: list[int], max_context: int, max_verify: int = 16):
    """The one-row step graph of `target` (its linears BlockLinear or fp32 Linear: engines/gguf_export.py
    `block_target`) for contexts up to `max_context`, tapping `taps` → onnx.ModelProto."""
    from onnx import helper

    cfg = target.cfg
    refusal = step_refusal(cfg)
    if refusal is not None:
        raise LoopspecError(refusal)
    spec = step_spec(cfg, len(taps), 1, max_context, max_verify)
    L, hd, eps = cfg.num_layers, cfg.head_dim, cfg.rms_norm_eps
    g = _Graph()
    hidden = g.node(
        "Gather", [g.weight("embed_tokens", _numpy(target.embed_tokens.weight)), "input_ids"], ["embedded"]
    )[0]
    # the target's own RoPE table (loopspec/model/target.py) over every position a call may reach (the
    # past's range); GroupQueryAttention's tables hold each frequency once (rotate-half layout)
    table = RotaryTable(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, spec.ranges["past"][2] + ATTENTION_PADDING)
    cos = g.weight("cos_cache", _numpy(table.cos[:, : hd // 2]))
    sin = g.weight("sin_cache", _numpy(table.sin[:, : hd // 2]))
    layers = target.layers
    normed = g.node(
        "SimplifiedLayerNormalization",
        [hidden, g.weight("layers.0.input_layernorm", _numpy(layers[0].input_layernorm.weight))],
        ["layers.0.normed"],
        axis=-1,
        epsilon=eps,
        stash_type=1,
    )[0]
    residual, tapped = hidden, {}
    for i, layer in enumerate(layers):
        p, attn = f"layers.{i}", layer.self_attn
        qkv = _linear(g, normed, attn.qkv_proj, f"{p}.qkv_proj")
        if attn.q_norm is not None:
            q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
            q, k, v = g.node("Split", [qkv, g.ints([q_out, kv_out, kv_out])], [f"{p}.q", f"{p}.k", f"{p}.v"], axis=-1)
            q = _head_norm(g, q, attn.q_norm, cfg.num_heads, hd, eps, f"{p}.q_norm")
            k = _head_norm(g, k, attn.k_norm, cfg.num_kv_heads, hd, eps, f"{p}.k_norm")
            qkv = g.node("Concat", [q, k, v], [f"{p}.qkv_normed"], axis=-1)[0]
        # one more query: a copy of the last token's (its output dropped, its K/V written past the
        # row's tokens: never seen), so GroupQueryAttention never runs one query (module doc)
        padded = qkv
        if ATTENTION_PADDING:
            end = g.ints([np.iinfo(np.int64).max])
            last = g.node("Slice", [qkv, g.ints([-ATTENTION_PADDING]), end, g.ints([1])], [f"{p}.last"])[0]
            padded = g.node("Concat", [qkv, last], [f"{p}.qkv_padded"], axis=1)[0]
        row = 0
        attended = g.node(
            "GroupQueryAttention",
            [
                padded,
                "",
                "",
                row_past_name("past_key", i, row),
                row_past_name("past_value", i, row),
                "seqlens_k",
                "total_sequence_length",
                cos,
                sin,
            ],
            [f"{p}.attended_padded", row_past_name("present_key", i, row), row_past_name("present_value", i, row)],
            MS,
            num_heads=cfg.num_heads,
            kv_num_heads=cfg.num_kv_heads,
            scale=float(hd**-0.5),
            do_rotary=1,
            rotary_interleaved=0,
        )[0]
        if ATTENTION_PADDING:
            attended = g.node(
                "Slice", [attended, g.ints([0]), g.ints([-ATTENTION_PADDING]), g.ints([1])], [f"{p}.attended"]
            )[0]
        out = _linear(g, attended, attn.o_proj, f"{p}.o_proj")
        normed, _, _, residual = g.node(
            "SkipSimplifiedLayerNormalization",
            [residual, out, g.weight(f"{p}.post_attention_layernorm", _numpy(layer.post_attention_layernorm.weight))],
            [f"{p}.mlp_in", "", "", f"{p}.mid"],
            MS,
            epsilon=eps,
        )
        mlp = layer.mlp
        gate, up = g.node(
            "Split",
            [_linear(g, normed, mlp.gate_up_proj, f"{p}.gate_up_proj"), g.ints([mlp.intermediate] * 2)],
            [f"{p}.gate", f"{p}.up"],
            axis=-1,
        )
        silu = g.node("Mul", [gate, g.node("Sigmoid", [gate], [f"{p}.sigmoid"])[0]], [f"{p}.silu"])[0]
        down = _linear(g, g.node("Mul", [silu, up], [f"{p}.swiglu"])[0], mlp.down_proj, f"{p}.down_proj")
        last = i + 1 == L
        next_norm = target.norm if last else layers[i + 1].input_layernorm
        normed, _, _, residual = g.node(
            "SkipSimplifiedLayerNormalization",
            [residual, down, g.weight(f"{p}.next_norm", _numpy(next_norm.weight))],
            [f"{p}.next_in", "", "", f"{p}.out"],
            MS,
            epsilon=eps,
        )
        tapped[i] = residual  # the layer's output hidden state (HF hidden_states[i + 1])
    if taps:
        g.node("Concat", [tapped[i] for i in taps], ["taps"], axis=-1)
    picked = g.node("Gather", [normed, "logit_index"], ["picked"], axis=1)[0]
    g.node("Identity", [_linear(g, picked, target.lm_head, "lm_head")], ["logits"])
    graph = helper.make_graph(
        g.nodes,
        TARGET_STEP,
        [_value_info(t) for t in spec.inputs],
        [_value_info(t) for t in spec.outputs],
        g.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)])
    model.ir_version = 10
    return model


def with_rows(model, cfg: TargetConfig, num_taps: int, rows: int, max_context: int):
    """The one-row step graph `model` (its initializers as they are: external references stay
    references) for `rows` rows: the fused q/k/v of every layer split by row, one GroupQueryAttention
    per row over that row's past, their outputs concatenated; everything else as it was."""
    from onnx import helper

    if rows == 1:
        return model
    out = helper.make_model(helper.make_graph([], TARGET_STEP, [], []), opset_imports=list(model.opset_import))
    out.ir_version = model.ir_version
    graph = out.graph
    graph.initializer.extend(model.graph.initializer)
    spec = step_spec(cfg, num_taps, rows, max_context)
    graph.input.extend([_value_info(t) for t in spec.inputs])
    graph.output.extend([_value_info(t) for t in spec.outputs])
    per_row = [f"row_{r}" for r in range(rows)]
    graph.node.extend(
        [
            helper.make_node("Split", ["seqlens_k"], [f"seqlens_k.{r}" for r in per_row], axis=0, num_outputs=rows),
            helper.make_node(
                "Split", ["total_sequence_length"], [f"total.{r}" for r in per_row], axis=0, num_outputs=rows
            ),
        ]
    )
    for node in model.graph.node:
        if node.op_type != "GroupQueryAttention":
            graph.node.append(node)
            continue
        layer = int(node.input[3].split("_")[-2])
        qkv, attended = node.input[0], node.output[0]
        graph.node.append(helper.make_node("Split", [qkv], [f"{qkv}.{r}" for r in per_row], axis=0, num_outputs=rows))
        for r, tag in enumerate(per_row):
            inputs = list(node.input)
            inputs[0], inputs[5], inputs[6] = f"{qkv}.{tag}", f"seqlens_k.{tag}", f"total.{tag}"
            inputs[3], inputs[4] = (row_past_name(kind, layer, r) for kind in ("past_key", "past_value"))
            outputs = [f"{attended}.{tag}"] + [
                row_past_name(kind, layer, r) for kind in ("present_key", "present_value")
            ]
            copy = helper.make_node("GroupQueryAttention", inputs, outputs, domain=MS)
            copy.attribute.extend(node.attribute)
            graph.node.append(copy)
        graph.node.append(helper.make_node("Concat", [f"{attended}.{tag}" for tag in per_row], [attended], axis=0))
    return out


def write_step_graph(verify_target: Target, taps: list[int], max_context: int, out_dir: Path) -> str:
    """The one-row graph into `out_dir`, its weights in one file beside it (the graphs for more rows
    reference them; shape constants stay inline: shape inference reads them) → the graph's file name."""
    import onnx

    name = f"{TARGET_STEP}.onnx"
    onnx.save(
        step_model(verify_target, taps, max_context),
        out_dir / name,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=f"{name}.data",
        size_threshold=1024,
    )
    return name
