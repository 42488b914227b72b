"""The common llama.cpp block types on the block engine (loopspec/gguf_blocks.py `BlockProduct`,
engines/gguf_export.py `BlockLinear`): Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K beside Q4_1 and Q8_0.
Blocks are written in-test from the public format (tests/gguf_encoders.py) with chosen codes and
scales; the `gguf` package's dequantization is the independent oracle of every weight; a tiny llama
written as a GGUF that mixes every type (as llama.cpp's Q4_K_M files mix Q4_K, Q6_K and the 32-block
types where a row is not a multiple of 256) decodes greedy dflash / dloop / trees identical to its
own plain decoding, batched as alone."""

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'loopspec[onnx]'")
gguf = pytest.importorskip("gguf", reason="needs gguf: pip install gguf (a core dependency)")

from conftest import (  # noqa: E402
    accepted_drafts,
    agreeing_drafter,
    batched_greedy_equals_plain,
    save_tiny_target,
    save_tiny_tokenizer,
)
from gguf_encoders import pack, quantize_k  # noqa: E402
from test_gguf_blocks import run_one_product, write_tiny_gguf  # noqa: E402

import loopspec.gguf_blocks as gguf_blocks  # noqa: E402
from loopspec.cli import main  # noqa: E402
from loopspec.convert.onnx_export import convert_onnx  # noqa: E402
from loopspec.engines.gguf_export import BlockLinear, block_linear  # noqa: E402
from loopspec.engines.ort_engine import OrtEngine  # noqa: E402
from loopspec.errors import LoopspecError  # noqa: E402
from loopspec.gguf_blocks import BLOCK_BYTES, BlockMatrix, read_tensors, stack_rows  # noqa: E402
from loopspec.model.dflash import Drafter, DrafterConfig  # noqa: E402
from loopspec.runtime.decoder import generate  # noqa: E402
from loopspec.settings import DecodingSettings  # noqa: E402
from loopspec.weights import load_target_dir, read_safetensors_dir, write_safetensors  # noqa: E402

NEW_TYPES = ("Q4_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# each type's code range and zero point (w = d · (code − zero) [+ minimum])
LEVELS = {"Q4_0": 16, "Q4_1": 16, "Q5_0": 32, "Q5_1": 32, "Q8_0": 256, "Q4_K": 16, "Q5_K": 32, "Q6_K": 64}
ZERO = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128, "Q6_K": 32}


def chosen_blocks(kind: str, rows: int = 3, k: int = 512, seed: int = 0):
    """Blocks of `kind` packed from random codes and scales → (BlockMatrix, the weights they hold,
    computed here from the chosen numbers: d · sub-scale · (code − zero) − dmin · sub-minimum)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, LEVELS[kind], size=(rows, k))
    stored = codes - 128 if kind == "Q8_0" else codes  # Q8_0 stores signed codes
    per = 256 if kind.endswith("_K") else 32
    d = rng.uniform(-0.05, 0.05, size=(rows, k // per)).astype(np.float16).astype(np.float32)
    dmin = rng.uniform(-0.05, 0.05, size=(rows, k // per)).astype(np.float16).astype(np.float32)
    subs = 16 if kind == "Q6_K" else 8
    sub_scales = (
        rng.integers(-128, 128, size=(rows, k // per, subs))
        if kind == "Q6_K"
        else (rng.integers(0, 64, size=(rows, k // per, subs)))
    )
    sub_minimums = rng.integers(0, 64, size=(rows, k // per, subs))
    blocks = pack(kind, stored, d, sub_scales=sub_scales, dmin=dmin, sub_minimums=sub_minimums)
    q = (codes - ZERO.get(kind, 0)).astype(np.float32)
    if kind.endswith("_K"):
        group = 16 if kind == "Q6_K" else 32
        scale = np.repeat((d[..., None] * sub_scales.astype(np.float32)).reshape(rows, -1), group, axis=1)
        w = scale * q
        if kind != "Q6_K":
            w = w - np.repeat((dmin[..., None] * sub_minimums.astype(np.float32)).reshape(rows, -1), 32, axis=1)
    else:
        w = np.repeat(d, 32, axis=1) * q + (np.repeat(dmin, 32, axis=1) if kind in ("Q4_1", "Q5_1") else 0)
    return BlockMatrix(kind, blocks), w.astype(np.float32)


def gguf_expansion(matrix: BlockMatrix) -> np.ndarray:
    n = matrix.blocks.shape[0]
    return gguf.quants.dequantize(matrix.blocks.reshape(n, -1), gguf.GGMLQuantizationType[matrix.kind]).reshape(n, -1)


@pytest.mark.parametrize("kind", NEW_TYPES + ("Q4_1", "Q8_0"))
def test_every_weight_is_the_gguf_packages_bit_for_bit(kind):
    matrix, chosen = chosen_blocks(kind)
    assert matrix.blocks.shape[-1] == BLOCK_BYTES[kind]
    reference = gguf_expansion(matrix)
    assert np.array_equal(reference, chosen)  # the encoder wrote what was chosen (the format read both ways)
    ours = matrix.dequantize()
    assert np.array_equal(ours.view(np.uint32), reference.view(np.uint32))  # bit for bit, signed zeros too
    product = matrix.product()
    assert product.bits == (4 if kind in ("Q4_0", "Q4_1", "Q4_K") else 8)
    assert product.block == (16 if kind == "Q6_K" else 32) and int(product.codes.max()) < 2**product.bits


@pytest.mark.parametrize(
    "planted",
    [
        # a K-quant's sub-block scale read from the wrong 6 bits (the top two from the wrong byte)
        ("_k_scales", lambda real: lambda packed: (lambda s, m: (s ^ 0x10, m))(*real(packed)), "Q4_K"),
        # the fifth bit of a Q5 code dropped
        ("_high_bits", lambda real: lambda qh, count: real(qh, count) * 0, "Q5_0"),
        # the nibbles of a byte swapped (element j + 16 read as j)
        ("_nibbles", lambda real: lambda p: np.concatenate([p >> 4, p & 0x0F], axis=-1), "Q4_K"),
    ],
    ids=["k-scale bits", "q5 high bit", "nibble order"],
)
def test_planted_decoder_bugs_are_caught(planted, monkeypatch):
    name, mutant, kind = planted
    matrix, _ = chosen_blocks(kind, seed=3)
    monkeypatch.setattr(gguf_blocks, name, mutant(getattr(gguf_blocks, name)))
    assert not np.array_equal(matrix.dequantize(), gguf_expansion(matrix))


@pytest.mark.parametrize("kind", NEW_TYPES)
def test_one_product_per_type_on_onnxruntime(kind, tmp_path):
    matrix, w = chosen_blocks(kind, rows=24, k=256, seed=1)
    x = np.random.default_rng(2).standard_normal((2, 3, 256)).astype(np.float32)
    ref = x @ w.T
    scale = np.abs(ref).max()
    fp32 = block_linear(matrix, "gguf-fp32act")
    if matrix.product().bits == 4:  # fp32 activations: the 4-bit product, equal up to fp32 rounding
        got = run_one_product(fp32, x, tmp_path / "fp32.onnx")
        assert np.abs(got - ref).max() / scale < 1e-5
    else:  # 8-bit codes with fp32 activations run as the exact fp32 expansion (module doc)
        assert fp32 is None
    int8 = block_linear(matrix, "gguf-int8act")
    got = run_one_product(int8, x, tmp_path / "int8.onnx")
    assert np.abs(got - ref).max() / scale < 5e-2  # int8 activations: close, not equal
    eager = int8(torch.from_numpy(x)).numpy()  # the module's own product is the expansion's
    assert np.abs(eager - ref).max() / scale < 1e-5


def test_rows_of_several_types_stack_into_one_exact_product(tmp_path):
    parts = [chosen_blocks(kind, rows=8, k=256, seed=i) for i, kind in enumerate(("Q4_K", "Q4_0", "Q6_K", "Q5_1"))]
    stacked = stack_rows([m for m, _ in parts])
    assert stacked.kind == "Q4_K+Q4_0+Q6_K+Q5_1" and (stacked.bits, stacked.block) == (8, 16)
    w = np.concatenate([chosen for _, chosen in parts])
    assert np.array_equal(stacked.dequantize(), w)  # equal as numbers (a zero minimum may turn -0 into +0)
    x = np.random.default_rng(4).standard_normal((1, 4, 256)).astype(np.float32)
    got = run_one_product(BlockLinear(stacked, accuracy_level=4), x, tmp_path / "mixed.onnx")
    assert np.abs(got - x @ w.T).max() / np.abs(x @ w.T).max() < 5e-2
    same = stack_rows([parts[0][0], chosen_blocks("Q4_K", rows=8, k=256, seed=9)[0]])
    assert isinstance(same, BlockMatrix) and same.kind == "Q4_K"  # one type stays its own 4-bit blocks


def test_a_type_the_engine_lacks_is_refused_by_name(tmp_path):
    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    w = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    writer.add_tensor(
        "blk.0.ffn_down.weight", quantize_k(w, "Q6_K").reshape(4, -1), raw_dtype=gguf.GGMLQuantizationType.Q6_K
    )
    writer.add_tensor("blk.0.ffn_up.weight", np.ones((4, 84), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(LoopspecError, match=r"iq.gguf: tensor blk.0.ffn_up.weight is Q2_K; .*--precision fp32") as e:
        read_tensors(path)
    assert "\n" not in str(e.value)


# ---- a tiny llama in a GGUF that mixes every type --------------------------------------------------

PROMPTS = [[5, 17, 42, 9, 88, 11], [61, 2, 33, 70, 12], [7, 101, 54, 19, 23, 40, 3]]


def mixed_types(layer: str, name: str) -> str:
    """A Q4_K_M-like mix: 4-bit K-quants where rows are 256 long, Q6_K for v and the embedding, the
    32-block types where they are not (down_proj reads 96), alternating by layer."""
    odd = layer != "" and int(layer) % 2 == 1
    return {
        "embed_tokens": "Q6_K",
        "self_attn.q_proj": "Q4_K",
        "self_attn.k_proj": "Q5_1" if odd else "Q4_0",
        "self_attn.v_proj": "Q6_K",
        "self_attn.o_proj": "Q5_K",
        "mlp.gate_proj": "Q4_K",
        "mlp.up_proj": "Q4_K",
        "mlp.down_proj": "Q8_0" if odd else "Q5_0",
    }[name]


@pytest.fixture(scope="module")
def mixed_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    target_dir = save_tiny_target("llama", root / "target", seed=4, hidden_size=256, num_layers=2)
    save_tiny_tokenizer(target_dir)
    # livelier weights (its greedy continuations vary: 12-16 distinct tokens in 30) before they are blocked
    state = {k: v * 4.0 if v.dim() == 2 else v for k, v in read_safetensors_dir(target_dir).items()}
    for f in target_dir.glob("*.safetensors"):
        f.unlink()
    write_safetensors(state, target_dir / "model.safetensors")
    path = write_tiny_gguf(target_dir, root / "tiny.mixed.gguf", types=mixed_types)
    target = load_target_dir(target_dir)
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=5, mask_token_id=127)
    agreeing_drafter(target, PROMPTS, cfg, new_tokens=30, steps=60).save(root / "drafter", dtype=torch.float32)
    onnx_dir = root / "onnx"
    _, report = convert_onnx(
        target,
        Drafter.load(root / "drafter"),
        onnx_dir,
        target_dir=target_dir,
        drafter_dir=root / "drafter",
        precision="gguf-int8act",
        gguf_path=path,
        num_threads=1,
    )
    return target_dir, path, onnx_dir, report


def test_the_mixed_file_runs_every_type_on_the_block_engine(mixed_pair):
    from loopspec.engines.manifest import read_manifest

    _, path, onnx_dir, report = mixed_pair
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) == 2}
    assert kinds == {"Q4_0", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
    products = read_manifest(onnx_dir).data["settings"]["weights"]["products"]
    assert products["Q4_K+Q4_0+Q6_K as 8-bit BlockLinear"] == 1 and products["Q4_K as 4-bit BlockLinear"] == 2
    assert products["Q5_K as 8-bit BlockLinear"] == 2 and products["Q6_K as 8-bit BlockLinear"] == 1  # the tied head
    assert report["passed"], report


def test_the_mixed_file_decodes_losslessly_alone_and_batched(mixed_pair):
    _, _, onnx_dir, _ = mixed_pair
    engine = OrtEngine(onnx_dir, 160, num_threads=1, max_rows=len(PROMPTS))
    total = 0
    for settings in (
        DecodingSettings("dflash", 5),
        DecodingSettings("dloop", 5, 3, -1e9),
        DecodingSettings("dflash", 5, tree_budget=8, suffix=True),
    ):
        for prompt in PROMPTS:
            ar = generate(engine, prompt, max_new_tokens=30)
            result = generate(engine, prompt, settings, max_new_tokens=30)
            assert result.tokens == ar.tokens, settings
            total += accepted_drafts([result])
    assert total >= 60, total  # drafts accepted over 9 runs of 30 tokens
    assert batched_greedy_equals_plain(engine, PROMPTS, DecodingSettings("dflash", 5), new_tokens=30) >= 15


def test_the_cli_names_what_the_engine_computes_with(mixed_pair, capsys):
    target_dir, path, onnx_dir, _ = mixed_pair
    assert (
        main(["generate", "--onnx-dir", str(onnx_dir), "--prompt", "hello", "--max-new-tokens", "8", "--method", "ar"])
        == 0
    )
    # the stats line names what the engine computes with: the file's own types
    assert "gguf-int8act (the GGUF's own Q4_0/Q4_K/Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 blocks, int8 activations)" in (
        capsys.readouterr().err
    )
