"""What an engine's target computes with — every precision loopspec names, in one registry.

Each module that used to keep its own list reads this one: the pipeline (which precisions a pair
runs in, and "auto"), the ONNX Runtime sessions (which graphs run on this CPU), the TensorRT builder
(the GPU generation a precision needs, whether its plans are order-exact), the quantizer and the
serving bundles (what modelopt quantizes), the GGUF export (which precisions read the GGUF's own
blocks), the validator (the tolerance of each), the manifest and the stats line (the words for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loopspec.errors import LoopspecError


@dataclass(frozen=True)
class Precision:
    name: str
    computes_with: str  # in words: the stats line, bench rows, the server and the manifest name it
    backends: tuple[str, ...]  # the engines that run it ("onnxruntime": on this CPU)
    weights: str  # "fp32": the pair's weights as they are | "gguf": the target GGUF's own blocks |
    #              "modelopt": weights and scales a `convert quantize` stage makes
    # the lowest CUDA compute capability whose TensorRT kernels run it (None: no TensorRT plan)
    min_capability: tuple[int, int] | None = None
    gpu_needed: str = ""  # that GPU generation in words, where it says more than the number
    # a plan or graph in it verifies a draft tree bit for bit as plain decoding (False: chains only).
    # ONNX Runtime graphs declare theirs in their manifest (engines/export.py's order-free softmax).
    order_exact: bool = True
    trees_instead: str = ""  # where not order_exact: the precision over the same weights that verifies trees
    # validation against the PyTorch fp32 reference (convert/validate.py): relative error of every
    # output, the largest relative τ drop (None: reported, not gated), "target": the target_verify's
    # own error where it differs, whether greedy decoding must equal the reference's, whether one
    # verification of the engine's own greedy tokens must give back exactly those tokens
    tolerance: dict = field(default_factory=dict)


REGISTRY: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision(
            "fp32",
            "fp32 weights and activations",
            ("torch", "onnxruntime", "tensorrt"),
            "fp32",
            min_capability=(7, 5),
            tolerance={"relative": 1e-4, "tau_drop": 0.02, "greedy": True, "verify_equals_plain": True},
        ),
        Precision(
            "fp16",
            "fp16 weights and activations",
            ("tensorrt",),
            "fp32",
            min_capability=(7, 5),
            order_exact=False,
            tolerance={"relative": 1e-2, "tau_drop": 0.05, "greedy": False, "verify_equals_plain": True},
        ),
        Precision(
            "bf16",
            "bf16 weights and activations",
            ("tensorrt",),
            "fp32",
            min_capability=(8, 0),
            gpu_needed="an Ampere or newer GPU",
            order_exact=False,
        ),
        # on this CPU as standard QuantizeLinear/DequantizeLinear with float8e4m3fn (opset 19)
        Precision(
            "fp8",
            "FP8 weights and activations (modelopt)",
            ("onnxruntime", "tensorrt"),
            "modelopt",
            min_capability=(8, 9),
            gpu_needed="an Ada, Hopper or newer GPU",
            order_exact=False,
            tolerance={"relative": 5e-2, "tau_drop": 0.10, "greedy": False, "verify_equals_plain": True},
        ),
        # graphs hold TensorRT's FP4 ops: built and run on Blackwell only (its numerics are emulated on the
        # CPU for validation: convert/qdq.py)
        Precision(
            "nvfp4",
            "NVFP4 weights and activations (modelopt)",
            ("tensorrt",),
            "modelopt",
            min_capability=(10, 0),
            gpu_needed="a Blackwell GPU",
            order_exact=False,
            tolerance={"relative": 1e-1, "tau_drop": 0.15, "greedy": False, "verify_equals_plain": True},
        ),
        # the GGUF's Q4_1/Q8_0 blocks as ONNX Runtime's MatMulNBits (engines/gguf_export.py); the
        # validation reference is their fp32 expansion
        Precision(
            "gguf-fp32act",
            "the GGUF's own blocks, fp32 activations",
            ("onnxruntime",),
            "gguf",
            tolerance={"relative": 1e-4, "target": 1e-3, "tau_drop": 0.02, "greedy": True, "verify_equals_plain": True},
        ),
        # a different model: its deviation from fp32 is bounded only loosely (a wrong block layout or a
        # missing minimum term gives errors of order 1), τ along the fp32 trajectory is reported; what
        # makes its speculative decoding lossless is checked: a verification equals its plain decoding.
        # Its drafter engines compute with Q8_0 blocks and int8 activations too (bounded the same way)
        Precision(
            "gguf-int8act",
            "the GGUF's own blocks, int8 activations",
            ("onnxruntime",),
            "gguf",
            tolerance={
                "relative": 1e-4,
                "target": 0.25,
                "drafter": 0.25,
                "tau_drop": None,
                "greedy": False,
                "verify_equals_plain": True,
            },
        ),
        # the same blocks and activations in ONNX Runtime's fused ops (engines/target_step.py:
        # GroupQueryAttention writing each row's cache in place, fused norms): a model of its own, whose
        # attention sums in its own order, so it verifies chains only (trees: gguf-int8act)
        Precision(
            "gguf-fused",
            "the GGUF's own blocks, int8 activations, fused attention",
            ("onnxruntime",),
            "gguf",
            order_exact=False,
            trees_instead="gguf-int8act",
            tolerance={
                "relative": 1e-4,
                "target": 0.25,
                "drafter": 0.25,
                "tau_drop": None,
                "greedy": False,
                "verify_equals_plain": True,
            },
        ),
    )
}


def precision(name: str) -> Precision:
    """The registry's entry, or one clear line naming the known ones."""
    if name not in REGISTRY:
        raise LoopspecError(f"unknown precision {name!r} (choose from {', '.join(REGISTRY)})")
    return REGISTRY[name]


def precision_names(
    *, backend: str | None = None, weights: tuple[str, ...] | None = None, trt: bool = False
) -> tuple[str, ...]:
    """Registry names, in order: those `backend` runs, whose weights come from one of `weights`,
    or (trt) that have a TensorRT plan."""
    return tuple(
        p.name
        for p in REGISTRY.values()
        if (backend is None or backend in p.backends)
        and (weights is None or p.weights in weights)
        and (not trt or p.min_capability is not None)
    )


def describe_precision(name: str, block_types: tuple[str, ...] = ()) -> str:
    """What an engine of this precision computes with, in words (a name the registry lacks: itself);
    `block_types`: the GGUF types an engine over a file's own blocks computes with (its manifest's)."""
    text = REGISTRY[name].computes_with if name in REGISTRY else name
    return text.replace("own blocks", f"own {'/'.join(block_types)} blocks") if block_types else text
