"""Every dense family on the GGUF block engine: Qwen2 (q/k/v biases, F32, added after the block
product) and Qwen3 (a q/k RMSNorm per head, a head size of its own) beside Llama
(tests/test_gguf_blocks.py). A tiny random target of each is written in-test as a GGUF the way
llama.cpp's converter writes one (its metadata, q/k rows in HF order, untied head), its checkpoint
rewritten to the blocks' expansion by the `gguf` package (the independent oracle); the block
engine's logits match that fp32 reference, greedy dflash / dloop / trees equal ar with accepted
drafts, the metadata read as the config is the checkpoint's, and what the file lacks or declares
otherwise is refused in one line."""

import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'loopspec[onnx]'")
pytest.importorskip("onnx", reason="needs onnx: pip install 'loopspec[onnx]'")
gguf = pytest.importorskip("gguf", reason="needs gguf: pip install gguf (a core dependency)")

from conftest import accepted_drafts, agreeing_drafter, save_tiny_target, save_tiny_tokenizer  # noqa: E402
from test_gguf_blocks import IDENTITY_PROMPT, write_tiny_gguf  # noqa: E402

import loopspec.gguf_blocks as gguf_blocks  # noqa: E402
from loopspec.convert.onnx_export import convert_onnx  # noqa: E402
from loopspec.engines.gguf_export import BlockLinear, block_target, precision_options  # noqa: E402
from loopspec.engines.ort_engine import OrtEngine  # noqa: E402
from loopspec.engines.specs import TARGET_VERIFY  # noqa: E402
from loopspec.errors import LoopspecError  # noqa: E402
from loopspec.gguf_blocks import check_target_config, read_gguf_target  # noqa: E402
from loopspec.model.dflash import Drafter, DrafterConfig  # noqa: E402
from loopspec.runtime.decoder import generate  # noqa: E402
from loopspec.settings import DecodingSettings  # noqa: E402
from loopspec.weights import gguf_to_hf_dir, load_target_dir, load_tokenizer, read_safetensors_dir  # noqa: E402
from loopspec.weights import write_safetensors  # noqa: E402

FAMILIES = ("qwen2", "qwen3")
PRECISIONS = ("gguf-fp32act", "gguf-int8act")


def write_gguf_tokenizer(writer) -> None:
    """tokenizer.ggml.* as llama.cpp writes a byte-level BPE (Qwen's): the tokens (padded to the
    embedding's 128 rows, as its converter pads them), their types, two merges."""
    tokens = ["<unk>", "<s>", "</s>", "Ġ"] + [chr(c) for c in range(33, 127)] + ["he", "ll"]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), 128)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * 97 + [5] * (len(tokens) - 100))  # control, normal, unused
    writer.add_token_merges(["h e", "l l"])


def lively_checkpoint(target_dir) -> None:
    """Weights scaled up before they are blocked: tiny random targets repeat one token otherwise, and
    an identity test over one repeated token shows nothing."""
    state = {k: v * 4.0 if v.dim() == 2 else v for k, v in read_safetensors_dir(target_dir).items()}
    for f in target_dir.glob("*.safetensors"):
        f.unlink()
    write_safetensors(state, target_dir / "model.safetensors")


@pytest.fixture(scope="module", params=FAMILIES)
def family_gguf(request, tmp_path_factory):
    """(family, target dir holding the expansion, its GGUF, a drafter dir that drafts its continuation
    of IDENTITY_PROMPT, {precision: (artifact dir, validation report)})."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    target_dir = save_tiny_target(family, root / "target", seed=11)
    save_tiny_tokenizer(target_dir)
    lively_checkpoint(target_dir)
    (root / "file").mkdir()
    path = write_tiny_gguf(target_dir, root / "file" / f"tiny-{family}.Q4_1.gguf", tokenizer=write_gguf_tokenizer)
    target = load_target_dir(target_dir)
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=5, mask_token_id=127)
    agreeing_drafter(target, [IDENTITY_PROMPT], cfg).save(root / "drafter", dtype=torch.float32)
    exported = {}
    for precision in PRECISIONS:
        onnx_dir = root / precision
        _, report = convert_onnx(
            target,
            Drafter.load(root / "drafter"),
            onnx_dir,
            target_dir=target_dir,
            drafter_dir=root / "drafter",
            precision=precision,
            gguf_path=path,
            num_threads=1,
        )
        exported[precision] = (onnx_dir, report)
    return family, target_dir, path, root / "drafter", exported


def test_the_metadata_is_the_checkpoints_config(family_gguf):
    family, target_dir, path, _, _ = family_gguf
    ours, theirs = read_gguf_target(path).config, load_target_dir(target_dir).cfg
    for field in ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.num_kv_heads, ours.head_dim, ours.tie_word_embeddings) == (2, theirs.head_dim, False)
    assert (ours.attention_bias, ours.qk_norm) == (family == "qwen2", family == "qwen3")
    assert np.float32(ours.rms_norm_eps) == np.float32(theirs.rms_norm_eps) and ours.rope_theta == theirs.rope_theta
    if family == "qwen3":  # key_length: a head size other than hidden / heads (64 / 4)
        assert ours.head_dim == 32
    check_target_config(theirs, read_gguf_target(path))  # nothing to refuse


def test_every_tensor_reaches_the_target_in_hf_order(family_gguf):
    """Each family's extras are read (Qwen2's biases, Qwen3's q/k norms) and every tensor, q/k rows
    included (llama.cpp does not permute them for these architectures), is the oracle's."""
    family, target_dir, path, _, _ = family_gguf
    blocks = read_gguf_target(path).blocks()
    state = load_target_dir(target_dir).state_dict()
    extras = {"qwen2": {"self_attn.qkv_proj.bias"}, "qwen3": {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}}
    layer0 = {name.removeprefix("layers.0.") for name in blocks if name.startswith("layers.0.")}
    assert extras[family] <= layer0 and not (set().union(*extras.values()) - extras[family]) & layer0
    assert set(blocks) == set(state)  # nothing the target computes with is left out
    for name, matrix in blocks.items():
        assert np.array_equal(matrix.dequantize(), state[name].numpy()), name
    assert {m.kind for m in blocks.values() if len(m.shape) == 2} == {"Q4_1", "Q8_0"}
    assert {m.kind for m in blocks.values() if len(m.shape) == 1} == {"F32"}


def test_the_bias_goes_with_its_block_product(family_gguf):
    family, target_dir, path, _, _ = family_gguf
    target = load_target_dir(target_dir)
    copy, counts = block_target(target, read_gguf_target(path).blocks(), "gguf-int8act")
    qkv = copy.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, BlockLinear) and (qkv.bias is not None) == (family == "qwen2")
    # the untied head is Q4_1 here, the Q8_0 embedding a Gather of its expansion
    assert counts == {"Q4_1 as 4-bit BlockLinear": 4 * target.cfg.num_layers + 1}
    if family == "qwen2":
        x = torch.randn(1, 3, target.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        reference = target.layers[0].self_attn.qkv_proj(x)
        assert torch.allclose(BlockLinear(qkv_product(path), 1, qkv.bias.numpy())(x), reference, atol=1e-5)
        # the bias carries real weight: without it the product is far off
        assert (BlockLinear(qkv_product(path), 1)(x) - reference).abs().max() > 0.05


def qkv_product(path):
    return read_gguf_target(path).blocks()["layers.0.self_attn.qkv_proj.weight"].product()


def test_the_block_engine_matches_the_fp32_reference(family_gguf):
    _, _, _, _, exported = family_gguf
    _, report = exported["gguf-fp32act"]
    assert report["passed"], report
    assert report["engines"][TARGET_VERIFY]["errors"]["logits"] < 1e-4  # the llama test's bound
    assert report["greedy_identical"] and report["verify_equals_plain"]
    _, report = exported["gguf-int8act"]  # int8 activations: another model, close to fp32, its own plain decoding
    assert report["passed"], report
    assert 1e-5 < report["engines"][TARGET_VERIFY]["errors"]["logits"] < 0.25
    assert report["verify_equals_plain"] and report["verify_plain_agreement"] == 1.0


@pytest.mark.parametrize("precision", PRECISIONS)
def test_ar_dflash_dloop_identical_on_the_block_engines(family_gguf, precision):
    _, _, _, _, exported = family_gguf
    engine = OrtEngine(exported[precision][0], 160, num_threads=1)
    ar = generate(engine, IDENTITY_PROMPT, max_new_tokens=40)
    assert len(ar.tokens) == 40 and len(set(ar.tokens)) >= 3  # a continuation that varies
    for settings in (
        DecodingSettings("dflash", 5),
        DecodingSettings("dloop", 5, 3, -1e9),
        DecodingSettings("dflash", 5, tree_budget=8, suffix=True),
    ):
        result = generate(engine, IDENTITY_PROMPT, settings, max_new_tokens=40)
        assert result.tokens == ar.tokens, settings
        assert accepted_drafts([result]) >= 20, (settings, accepted_drafts([result]))


@pytest.mark.parametrize(
    "planted",
    [
        # a reader that permutes q/k rows as for llama: the rows no longer expand to the checkpoint's
        ("permute_qk", {"permute_qk": True}, "does not expand to the target's weight"),
        # a reader that drops the architecture's extra tensors (Qwen2's biases; Qwen3's q/k norms)
        ("extras", {"layer_extras": ()}, "the target's linear has a bias, the GGUF's none|holds no layers.0.self_attn"),
    ],
    ids=["q/k permuted", "extras dropped"],
)
def test_a_wrong_architecture_record_is_refused(family_gguf, planted, monkeypatch):
    family, target_dir, path, _, _ = family_gguf
    _, change, message = planted
    record = gguf_blocks.ARCHITECTURES[family]
    monkeypatch.setitem(gguf_blocks.ARCHITECTURES, family, type(record)(**{**record.__dict__, **change}))
    with pytest.raises(LoopspecError, match=message) as e:
        block_target(load_target_dir(target_dir), read_gguf_target(path).blocks(), "gguf-fp32act")
    assert "\n" not in str(e.value)


def test_a_config_the_file_does_not_declare_is_refused(family_gguf, tmp_path):
    family, target_dir, path, _, _ = family_gguf
    other = tmp_path / "other"
    shutil.copytree(target_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 20000.0
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoopspecError, match=r"declares rope_theta 10000.0, the target 20000.0: the GGUF and the"):
        precision_options(load_target_dir(other), "gguf-int8act", path)
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoopspecError, match=r"declares RoPE scaling None, the target scaling \{'rope_type': 'linear'"):
        precision_options(load_target_dir(other), "gguf-int8act", path)


def test_an_unknown_architecture_is_one_clear_line(family_gguf, tmp_path):
    family, target_dir, _, _, _ = family_gguf
    other = tmp_path / "other"
    shutil.copytree(target_dir, other)
    path = write_tiny_gguf(other, tmp_path / "mamba.gguf", arch="mamba")
    for call in (
        lambda: read_gguf_target(path),
        lambda: precision_options(load_target_dir(other), "gguf-fp32act", path),
    ):
        with pytest.raises(LoopspecError) as e:
            call()
        assert str(e.value) == (
            "mamba.gguf: the GGUF block engine builds llama, qwen2, qwen3 GGUFs, not 'mamba' "
            "(its general.architecture): run this file with --precision fp32"
        )


def test_the_gguf_alone_expands_to_the_checkpoint_with_its_own_tokenizer(family_gguf, tmp_path):
    """What a user runs: the .gguf file alone. transformers expands it (its head size and vocabulary as
    the file declares them), the tokenizer is built from its metadata; an HF tokenizer beside the
    file is taken instead; neither: one line saying what to add."""
    family, target_dir, path, _, _ = family_gguf
    expanded = load_target_dir(gguf_to_hf_dir(path, tmp_path / "expanded"))
    reference = load_target_dir(target_dir)
    assert expanded.cfg.head_dim == reference.cfg.head_dim and expanded.cfg.vocab_size == 128
    state = reference.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in expanded.state_dict().items())
    tokenizer = load_tokenizer(tmp_path / "expanded")
    assert tokenizer.tokenize("hello") == ["he", "ll", "o"]  # the file's merges
    assert tokenizer.eos_token == "</s>"  # the file's eos id 2
    # an HF tokenizer beside the file: the model's own, taken instead of the metadata's
    beside = tmp_path / "beside"
    beside.mkdir()
    shutil.copy(path, beside / path.name)
    save_tiny_tokenizer(beside)
    load_target_dir(gguf_to_hf_dir(beside / path.name, tmp_path / "expanded2"))
    assert load_tokenizer(tmp_path / "expanded2").tokenize("hello") == list("hello")  # character-level
    # no tokenizer anywhere
    bare = tmp_path / "bare"
    shutil.copytree(target_dir, tmp_path / "copy")
    bare.mkdir()
    plain = write_tiny_gguf(tmp_path / "copy", bare / "plain.gguf")
    with pytest.raises(LoopspecError) as e:
        gguf_to_hf_dir(plain, tmp_path / "expanded3")
    assert str(e.value) == (
        f"plain.gguf holds no tokenizer (no tokenizer.ggml.* metadata): put the model's tokenizer.json and "
        f"tokenizer_config.json beside it, in {bare}"
    )
    assert not (tmp_path / "expanded3").exists()
