"""DFlash drafter: z-lab checkpoint format, forward against a plain reference written from the z-lab format,
config defaults, target/drafter fit checks and bad checkpoints.

Everything runs on tiny random models on the CPU in fp32 (the reference in fp64)."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from loopspec.errors import LoopspecError
from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.pair import resolve_mask_token_id
from loopspec.model.target import TargetConfig, default_target_layer_ids
from loopspec.weights import load_target_dir

from conftest import FAMILIES, tiny_hf_config

MASK = 127  # the tiny targets have a vocabulary of 128
BLOCK = 8
LAYERS = 2


def make_drafter(target_cfg: TargetConfig, seed: int = 0, **kw) -> Drafter:
    """A random 2-layer drafter for `target_cfg`, with random norm weights (so that every norm matters)."""
    torch.manual_seed(seed)
    kw = {"num_layers": LAYERS, "block_size": BLOCK, "mask_token_id": MASK, **kw}
    drafter = Drafter(DrafterConfig.for_target(target_cfg, **kw))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return drafter.eval()


def expected_keys_and_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """The z-lab tensor list, with the shapes a Qwen3 layer gives them."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    out = {"fc.weight": (H, cfg.num_taps * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        out.update(
            {
                p + "self_attn.q_proj.weight": (q, H),
                p + "self_attn.k_proj.weight": (kv, H),
                p + "self_attn.v_proj.weight": (kv, H),
                p + "self_attn.o_proj.weight": (H, q),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (I, H),
                p + "mlp.up_proj.weight": (I, H),
                p + "mlp.down_proj.weight": (H, I),
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
            }
        )
    return out


def file_keys_and_shapes(path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def file_dtypes(path) -> set[torch.dtype]:
    from safetensors.torch import load_file

    return {t.dtype for t in load_file(str(path)).values()}


@torch.inference_mode()
def run_stage(drafter: Drafter, taps: torch.Tensor, block_embeds: torch.Tensor, block_start: int | None = None):
    """Context K/V for taps [1, C, n*H] at positions 0..C-1, then one stage at block_start.. (default C)."""
    C = taps.shape[1]
    start = C if block_start is None else block_start
    k, v = drafter.context_kv(drafter.features(taps), torch.arange(C))
    return drafter(block_embeds, torch.arange(start, start + block_embeds.shape[1]), k, v)


def block_ids(anchor: int = 5) -> torch.Tensor:
    return torch.tensor([[anchor] + [MASK] * (BLOCK - 1)])


# --------------------------------------------------------------------------------------------------
# 1. z-lab format round trip


@pytest.mark.parametrize("family", FAMILIES)
def test_zlab_round_trip_fp32(family, tiny_targets, tmp_path):
    target = load_target_dir(tiny_targets[family])
    drafter = make_drafter(target.cfg)
    cfg = drafter.cfg
    drafter.save(tmp_path, dtype=torch.float32)

    zlab = json.loads((tmp_path / "config.json").read_text())
    assert zlab["architectures"] == ["DFlashDraftModel"]
    assert zlab["block_size"] == BLOCK
    assert zlab["num_target_layers"] == target.cfg.num_layers == 6
    assert zlab["dflash_config"]["mask_token_id"] == MASK
    assert zlab["dflash_config"]["target_layer_ids"] == default_target_layer_ids(6, LAYERS) == [1, 3]
    # a Qwen3 config underneath
    assert zlab["model_type"] == "qwen3"
    assert zlab["num_hidden_layers"] == LAYERS
    assert zlab["hidden_size"] == target.cfg.hidden_size
    assert zlab["num_attention_heads"] == target.cfg.num_heads
    assert zlab["num_key_value_heads"] == target.cfg.num_kv_heads
    assert zlab["head_dim"] == target.cfg.head_dim
    assert zlab["vocab_size"] == target.cfg.vocab_size
    from transformers import Qwen3Config

    hf = Qwen3Config.from_dict(zlab)  # transformers reads it as a Qwen3 config
    assert (hf.hidden_size, hf.num_hidden_layers, hf.head_dim) == (cfg.hidden_size, LAYERS, cfg.head_dim)

    weights = tmp_path / "model.safetensors"
    found = file_keys_and_shapes(weights)
    assert found == expected_keys_and_shapes(cfg)  # exactly these names, nothing more
    assert found["fc.weight"] == (cfg.hidden_size, 2 * cfg.hidden_size)
    assert not any("embed_tokens" in k or "lm_head" in k for k in found)
    assert file_dtypes(weights) == {torch.float32}

    loaded = Drafter.load(tmp_path)
    assert loaded.cfg == cfg  # includes rope_scaling (llama3 for the llama target)
    ref_state, new_state = drafter.state_dict(), loaded.state_dict()
    assert ref_state.keys() == new_state.keys()
    for name in ref_state:
        assert torch.equal(ref_state[name], new_state[name]), name

    taps = torch.randn(1, 11, 2 * cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    embeds = target.embed_tokens(block_ids()).detach()
    assert torch.equal(run_stage(drafter, taps, embeds), run_stage(loaded, taps, embeds))


def test_zlab_round_trip_bf16_default(tiny_targets, tmp_path):
    target = load_target_dir(tiny_targets["qwen3"])
    drafter = make_drafter(target.cfg)
    drafter.save(tmp_path)  # default dtype: bfloat16
    zlab = json.loads((tmp_path / "config.json").read_text())
    assert zlab["torch_dtype"] == "bfloat16"
    weights = tmp_path / "model.safetensors"
    assert file_dtypes(weights) == {torch.bfloat16}
    assert file_keys_and_shapes(weights) == expected_keys_and_shapes(drafter.cfg)

    loaded = Drafter.load(tmp_path)  # fp32 by default
    assert loaded.fc.weight.dtype == torch.float32
    rounded = {k: v.to(torch.bfloat16).float() for k, v in drafter.state_dict().items()}
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, rounded[name]), name

    as_bf16 = Drafter.load(tmp_path, dtype=torch.bfloat16)
    assert as_bf16.fc.weight.dtype == torch.bfloat16
    taps = torch.randn(1, 9, 2 * drafter.cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    embeds = target.embed_tokens(block_ids()).detach()
    out32 = run_stage(loaded, taps, embeds)
    out16 = run_stage(as_bf16, taps.bfloat16(), embeds.bfloat16())
    assert out16.dtype == torch.bfloat16 and torch.isfinite(out16).all()
    assert (out16.float() - out32).abs().max() < 0.25  # same model, bf16 arithmetic
    ctx = as_bf16.new_context(32)
    assert ctx.k.dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------------
# 2. forward against a plain reference written from the z-lab format


def ref_rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def ref_rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def reference_stage(
    sd: dict, zlab: dict, taps: torch.Tensor, block: torch.Tensor, block_start: int, inv_freq: torch.Tensor
) -> torch.Tensor:
    """One DFlash stage from the z-lab tensors and config.json alone, in fp64.

    taps [C, n*H] at positions 0..C-1; block [k, H] (already embedded) at block_start..block_start+k-1.
    """
    sd = {k: v.double() for k, v in sd.items()}
    eps = zlab["rms_norm_eps"]
    nh, kvh, hd = zlab["num_attention_heads"], zlab["num_key_value_heads"], zlab["head_dim"]
    taps, x = taps.double(), block.double()
    C, k = taps.shape[0], x.shape[0]

    ctx = ref_rms(taps @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)  # context features [C, H]

    def rope_at(positions):
        angles = positions.double()[:, None] * inv_freq.double()[None, :]
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]  # [T, 1, hd]: broadcast over heads

    q_cos, q_sin = rope_at(torch.arange(block_start, block_start + k))
    kv_positions = torch.cat([torch.arange(C), torch.arange(block_start, block_start + k)])
    k_cos, k_sin = rope_at(kv_positions)

    for i in range(zlab["num_hidden_layers"]):
        p = f"layers.{i}."
        a = p + "self_attn."
        h = ref_rms(x, sd[p + "input_layernorm.weight"], eps)
        q = (h @ sd[a + "q_proj.weight"].T).view(k, nh, hd)
        q = ref_rotate(ref_rms(q, sd[a + "q_norm.weight"], eps), q_cos, q_sin)
        src = torch.cat([ctx, h], dim=0)  # keys/values from [context ; block], same projections
        keys = (src @ sd[a + "k_proj.weight"].T).view(C + k, kvh, hd)
        keys = ref_rotate(ref_rms(keys, sd[a + "k_norm.weight"], eps), k_cos, k_sin)
        values = (src @ sd[a + "v_proj.weight"].T).view(C + k, kvh, hd)
        keys = keys.repeat_interleave(nh // kvh, dim=1)  # query head j uses kv head j // (nh / kvh)
        values = values.repeat_interleave(nh // kvh, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(hd)  # no mask at all
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(k, nh * hd)
        x = x + attn @ sd[a + "o_proj.weight"].T
        h = ref_rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        m = p + "mlp."
        x = (
            x
            + (F.silu(h @ sd[m + "gate_proj.weight"].T) * (h @ sd[m + "up_proj.weight"].T))
            @ sd[m + "down_proj.weight"].T
        )
    return ref_rms(x, sd["norm.weight"], eps)


def reference_inv_freq(family: str, zlab: dict) -> torch.Tensor:
    hd = zlab["head_dim"]
    if family == "llama":  # llama3-scaled RoPE: take the frequencies from transformers
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scale = ROPE_INIT_FUNCTIONS["llama3"](tiny_hf_config("llama"), "cpu")
        assert scale == 1.0
        return inv_freq
    assert zlab["rope_scaling"] is None
    return 1.0 / zlab["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)


# (family, rope_theta override): a non-default theta proves the drafter uses its own config's theta
REFERENCE_CASES = [("qwen3", 1_000_000.0), ("qwen2", None), ("llama", None)]


@pytest.fixture(scope="module")
def reference_setups(tiny_targets, tmp_path_factory):
    """{family: (target, drafter, z-lab state dict read from the file, config.json dict)}."""
    from safetensors.torch import load_file

    out = {}
    for family, theta in REFERENCE_CASES:
        target = load_target_dir(tiny_targets[family])
        tcfg = target.cfg if theta is None else dataclasses.replace(target.cfg, rope_theta=theta)
        drafter = make_drafter(tcfg, seed=7)
        d = tmp_path_factory.mktemp(f"drafter-{family}")
        drafter.save(d, dtype=torch.float32)
        zlab = json.loads((d / "config.json").read_text())
        if theta is not None:
            assert zlab["rope_theta"] == theta
        target.set_taps(zlab["dflash_config"]["target_layer_ids"])
        out[family] = (target, drafter, load_file(str(d / "model.safetensors")), zlab)
    return out


def real_taps(target, length: int, seed: int = 11) -> torch.Tensor:
    """The target's taps [1, length, n*H] for a random prompt (empty for length 0)."""
    if length == 0:
        return torch.zeros(1, 0, len(target.target_layer_ids) * target.cfg.hidden_size)
    ids = torch.randint(0, 120, (1, length), generator=torch.Generator().manual_seed(seed))
    return target(ids, target.new_cache(64)).taps


@pytest.mark.parametrize("family", [c[0] for c in REFERENCE_CASES])
@pytest.mark.parametrize("context", [0, 1, 17])
def test_forward_matches_reference(family, context, reference_setups):
    target, drafter, sd, zlab = reference_setups[family]
    taps = real_taps(target, context)
    with torch.inference_mode():
        embeds = target.embed_tokens(block_ids(anchor=9))
    got = run_stage(drafter, taps, embeds)
    assert got.shape == (1, BLOCK, zlab["hidden_size"])
    want = reference_stage(sd, zlab, taps[0], embeds[0], context, reference_inv_freq(family, zlab))
    assert (got[0].double() - want).abs().max() <= 1e-5


@pytest.mark.parametrize("family", [c[0] for c in REFERENCE_CASES])
def test_forward_uses_absolute_positions(family, reference_setups):
    """A block that does not start right after the context (positions are absolute, not relative)."""
    target, drafter, sd, zlab = reference_setups[family]
    taps = real_taps(target, 17)
    with torch.inference_mode():
        embeds = target.embed_tokens(block_ids(anchor=3))
    got = run_stage(drafter, taps, embeds, block_start=40)
    want = reference_stage(sd, zlab, taps[0], embeds[0], 40, reference_inv_freq(family, zlab))
    assert (got[0].double() - want).abs().max() <= 1e-5
    shifted = run_stage(drafter, taps, embeds)  # same tokens at 17..24: must differ (RoPE matters)
    assert (shifted - got).abs().max() > 1e-4


@pytest.mark.parametrize("family", [c[0] for c in REFERENCE_CASES])
def test_incremental_context_equals_one_go(family, reference_setups):
    target, drafter, sd, zlab = reference_setups[family]
    taps = real_taps(target, 17)
    with torch.inference_mode():
        embeds = target.embed_tokens(block_ids(anchor=9))
        one = drafter.new_context(64)
        k, v = drafter.context_kv(drafter.features(taps), torch.arange(17))
        one.append(k, v)
        two = drafter.new_context(64)
        for lo, hi in ((0, 10), (10, 17)):
            k, v = drafter.context_kv(drafter.features(taps[:, lo:hi]), torch.arange(lo, hi))
            two.append(k, v)
        # a rejected stretch appended and rolled back leaves no trace
        three = drafter.new_context(64)
        k, v = drafter.context_kv(drafter.features(taps[:, :10]), torch.arange(10))
        three.append(k, v)
        junk = torch.randn(1, 5, taps.shape[2], generator=torch.Generator().manual_seed(1))
        k, v = drafter.context_kv(drafter.features(junk), torch.arange(10, 15))
        three.append(k, v)
        three.rollback([10])
        k, v = drafter.context_kv(drafter.features(taps[:, 10:]), torch.arange(10, 17))
        three.append(k, v)

        assert one.lengths[0] == two.lengths[0] == three.lengths[0] == 17
        assert one.k.shape == (LAYERS, 1, zlab["num_key_value_heads"], 64, zlab["head_dim"])
        outs = []
        for ctx in (one, two, three):
            # fp32 matmuls over 7/10/17 rows round differently in the last bits, nothing more
            assert (ctx.k[:, :, :, :17] - one.k[:, :, :, :17]).abs().max() <= 1e-5
            assert (ctx.v[:, :, :, :17] - one.v[:, :, :, :17]).abs().max() <= 1e-5
            n = int(ctx.lengths[0])
            outs.append(drafter(embeds, torch.arange(17, 17 + BLOCK), ctx.k[:, :, :, :n], ctx.v[:, :, :, :n]))
    want = reference_stage(sd, zlab, taps[0], embeds[0], 17, reference_inv_freq(family, zlab))
    for out in outs:
        assert (out[0].double() - want).abs().max() <= 1e-5


def test_context_cache_limits(tiny_targets):
    target = load_target_dir(tiny_targets["qwen3"])
    drafter = make_drafter(target.cfg)
    ctx = drafter.new_context(10_000)
    assert ctx.max_length == target.cfg.max_position_embeddings  # capped like the target's cache
    ctx = drafter.new_context(8)
    with torch.inference_mode():
        k, v = drafter.context_kv(drafter.features(torch.randn(1, 6, 128)), torch.arange(6))
        ctx.append(k, v)
        with pytest.raises(LoopspecError, match="exceeds"):
            ctx.append(k, v)
    assert ctx.lengths[0] == 6  # the refused append changed nothing
    with pytest.raises(ValueError):
        ctx.rollback([7])


def test_grow_keeps_the_drafts_then_trains_the_new_layer(tiny_targets, tmp_path):
    """A deepened drafter drafts exactly as before (new residual branches start at zero), its new layer
    still learns (gradients reach it), and it saves/loads as an ordinary deeper z-lab checkpoint."""
    target = load_target_dir(tiny_targets["llama"])
    shallow = make_drafter(target.cfg, num_layers=1, target_layer_ids=[1, 3])
    shallow.draft_ids = torch.arange(0, 128, 2)
    target.set_taps([1, 3])
    deep = shallow.grow(3)
    assert deep.cfg.num_layers == 3 and shallow.cfg.num_layers == 1 and torch.equal(deep.draft_ids, shallow.draft_ids)
    taps = real_taps(target, 17)
    with torch.inference_mode():
        embeds = target.embed_tokens(block_ids(anchor=9))
    assert torch.equal(run_stage(deep, taps, embeds), run_stage(shallow, taps, embeds))

    deep.train()
    k, v = deep.context_kv(deep.features(taps), torch.arange(17))
    deep(embeds, torch.arange(17, 17 + BLOCK), k, v).pow(2).mean().backward()
    assert deep.layers[2].self_attn.o_proj.weight.grad.abs().max() > 0
    assert deep.layers[2].mlp.down_proj.weight.grad.abs().max() > 0

    deep.save(tmp_path / "deep", dtype=torch.float32)
    loaded = Drafter.load(tmp_path / "deep")
    assert json.loads((tmp_path / "deep" / "config.json").read_text())["num_hidden_layers"] == 3
    assert torch.equal(run_stage(loaded, taps, embeds), run_stage(shallow, taps, embeds))
    with pytest.raises(LoopspecError, match="cannot grow a 3-layer drafter to 2"):
        deep.grow(2)


# --------------------------------------------------------------------------------------------------
# 3. DrafterConfig.for_target defaults


def big_target_cfg(num_layers: int = 30) -> TargetConfig:
    """SmolLM2-135M's shape (only the config; nothing is built)."""
    return TargetConfig(
        family="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=num_layers,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )


def test_for_target_defaults():
    t = big_target_cfg()
    five = DrafterConfig.for_target(t, num_layers=5)
    assert five.target_layer_ids == default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert five.num_taps == 5
    one = DrafterConfig.for_target(t)
    assert one.num_layers == 1 and one.target_layer_ids == [15]
    assert DrafterConfig.for_target(big_target_cfg(36), num_layers=5).target_layer_ids == [1, 9, 17, 25, 33]
    for cfg in (five, one):
        assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
            576,
            1536,
            9,
            3,
            64,
        )
        assert cfg.vocab_size == 49152 and cfg.num_target_layers == 30
        assert cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
        assert cfg.max_position_embeddings == 8192
        assert cfg.block_size == 16 and cfg.mask_token_id is None
    custom = DrafterConfig.for_target(
        t, num_layers=2, target_layer_ids=[3, 29], intermediate_size=256, block_size=4, mask_token_id=49151
    )
    assert custom.target_layer_ids == [3, 29] and custom.intermediate_size == 256
    assert custom.block_size == 4 and custom.mask_token_id == 49151
    assert Drafter(DrafterConfig.for_target(big_target_cfg(6), num_layers=5)).fc.weight.shape == (576, 5 * 576)
    with pytest.raises(LoopspecError, match="at least one layer"):
        DrafterConfig.for_target(t, num_layers=0)
    with pytest.raises(LoopspecError, match="block size"):
        DrafterConfig.for_target(t, block_size=1)


def test_zlab_config_dict_round_trip():
    t = dataclasses.replace(big_target_cfg(), rope_scaling={"rope_type": "linear", "factor": 2.0})
    cfg = DrafterConfig.for_target(t, num_layers=3, block_size=10, mask_token_id=7)
    zlab = json.loads(json.dumps(cfg.to_zlab()))
    assert DrafterConfig.from_checkpoint(zlab) == cfg
    # published configs may omit target_layer_ids: the default formula fills them in
    del zlab["dflash_config"]["target_layer_ids"]
    assert DrafterConfig.from_checkpoint(zlab).target_layer_ids == default_target_layer_ids(30, 3) == [1, 14, 27]
    # transformers 5 writes rope_parameters (with rope_theta inside) instead of rope_theta/rope_scaling
    v5 = {k: v for k, v in cfg.to_zlab().items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0}
    read = DrafterConfig.from_checkpoint(v5)
    assert read.rope_theta == 1_000_000.0 and read.rope_scaling is None


# --------------------------------------------------------------------------------------------------
# 4. DrafterConfig.fit and resolve_mask_token_id


def tiny_target_cfg() -> TargetConfig:
    return TargetConfig(
        family="qwen3",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        qk_norm=True,
    )


def test_fit_accepts_a_matching_drafter():
    t = tiny_target_cfg()
    DrafterConfig.for_target(t, num_layers=2, mask_token_id=MASK).fit(t)
    DrafterConfig.for_target(t, target_layer_ids=[0, 5], mask_token_id=0).fit(t)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": 32}, r"hidden size 32 != target's 64"),
        ({"vocab_size": 256}, r"vocab size 256 != target's 128"),
        ({"target_layer_ids": [1, 6]}, r"tap ids \[6\] out of range .* 6 layers"),
        ({"target_layer_ids": [-1, 3]}, r"tap ids \[-1\] out of range"),
        ({"num_target_layers": 30}, r"built for 30 target layers, target has 6"),
        ({"mask_token_id": None}, r"no mask token id"),
        ({"mask_token_id": 128}, r"mask token id 128 outside the vocabulary"),
    ],
)
def test_fit_refuses(change, message):
    t = tiny_target_cfg()
    drafter = dataclasses.replace(DrafterConfig.for_target(t, num_layers=2, mask_token_id=MASK), **change)
    with pytest.raises(LoopspecError, match="drafter does not fit the target: .*" + message):
        drafter.fit(t)


def test_fit_names_every_problem():
    t = tiny_target_cfg()
    drafter = dataclasses.replace(DrafterConfig.for_target(t, mask_token_id=None), hidden_size=32, vocab_size=64)
    with pytest.raises(LoopspecError) as e:
        drafter.fit(t)
    assert "hidden size" in str(e.value) and "vocab size" in str(e.value) and "mask token" in str(e.value)


def test_resolve_mask_token_id():
    assert resolve_mask_token_id(5, 100, 128) == 5  # the checkpoint's id wins
    assert resolve_mask_token_id(5, None, 128) == 5
    assert resolve_mask_token_id(None, 100, 128) == 100  # first unused embedding row
    assert resolve_mask_token_id(None, 127, 128) == 127
    for tokenizer_len in (128, 130, None):  # no unused row (or unknown): a clear error
        with pytest.raises(LoopspecError, match="mask_token_id"):
            resolve_mask_token_id(None, tokenizer_len, 128)


# --------------------------------------------------------------------------------------------------
# 5. Drafter.load on bad checkpoints


@pytest.fixture
def saved(tmp_path):
    drafter = make_drafter(tiny_target_cfg())
    d = tmp_path / "drafter"
    drafter.save(d, dtype=torch.float32)
    return drafter, d


def test_load_missing_paths(tmp_path, saved):
    with pytest.raises(LoopspecError, match="does not exist"):
        Drafter.load(tmp_path / "nope")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(LoopspecError, match="not a directory"):
        Drafter.load(f)
    _, d = saved
    (d / "config.json").unlink()
    with pytest.raises(LoopspecError, match="missing drafter config"):
        Drafter.load(d)


def test_load_missing_weights(saved):
    _, d = saved
    (d / "model.safetensors").unlink()
    with pytest.raises(LoopspecError, match="missing drafter weights"):
        Drafter.load(d)


@pytest.mark.parametrize("content", [b"\xff\xfe\x00\x81garbage\x00", b'{"architectures": ["DFlashDraftModel"', b""])
def test_load_corrupt_config(saved, content):
    _, d = saved
    (d / "config.json").write_bytes(content)
    with pytest.raises(LoopspecError, match="corrupt drafter config"):
        Drafter.load(d)


def test_load_wrong_architecture(saved):
    _, d = saved
    cfg = json.loads((d / "config.json").read_text())
    for archs in (["Qwen3ForCausalLM"], [], None):
        cfg["architectures"] = archs
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(LoopspecError, match="not a DFlash drafter"):
            Drafter.load(d)


def test_load_config_missing_field(saved):
    _, d = saved
    cfg = json.loads((d / "config.json").read_text())
    del cfg["num_target_layers"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoopspecError, match="lacks 'num_target_layers'"):
        Drafter.load(d)


# Design §8: "missing or corrupt files ... rejected with a clear message". A config.json that is valid
# JSON but not a z-lab config object (or has fields of the wrong type) must give a LoopspecError too,
# not an AttributeError / TypeError / ZeroDivisionError from deep inside the loader.
@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda cfg: [1, 2], id="json-list"),
        pytest.param(lambda cfg: None, id="json-null"),
        pytest.param(lambda cfg: {**cfg, "dflash_config": [MASK]}, id="dflash_config-not-object"),
        pytest.param(lambda cfg: {**cfg, "hidden_size": "64"}, id="hidden_size-string"),
        pytest.param(lambda cfg: {**cfg, "num_attention_heads": 0, "head_dim": None}, id="zero-heads"),
    ],
)
def test_load_malformed_config_values(saved, mutate):
    _, d = saved
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(mutate(cfg)))
    with pytest.raises(LoopspecError):
        Drafter.load(d)


@pytest.mark.parametrize("keep", [0, 100, 5000])
def test_load_truncated_weights(saved, keep):
    _, d = saved
    f = d / "model.safetensors"
    data = f.read_bytes()
    assert len(data) > keep
    f.write_bytes(data[:keep] if keep != 5000 else data[:-keep])
    with pytest.raises(LoopspecError, match="corrupt or unreadable safetensors"):
        Drafter.load(d)


def _rewrite(d, edit):
    from safetensors.torch import load_file, save_file

    state = load_file(str(d / "model.safetensors"))
    edit(state)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.update({"fc.weight": torch.zeros(64, 3 * 64)}), r"size mismatch for fc\.weight"),
        (lambda s: s.update({"layers.1.self_attn.k_proj.weight": torch.zeros(32, 64)}), r"k_proj"),
        (lambda s: s.update({"layers.0.mlp.gate_proj.weight": torch.zeros(50, 64)}), r"gate"),
        (lambda s: s.pop("layers.1.mlp.down_proj.weight"), r"Missing key.*layers\.1\.mlp\.down_proj"),
        (lambda s: s.pop("norm.weight"), r"Missing key.*norm\.weight"),
        (lambda s: s.update({"layers.2.input_layernorm.weight": torch.ones(64)}), r"Unexpected key.*layers\.2"),
    ],
)
def test_load_weights_that_do_not_match_config(saved, edit, message):
    _, d = saved
    _rewrite(d, edit)
    with pytest.raises(LoopspecError, match=r"(?s)drafter weights do not match its config\.json.*" + message):
        Drafter.load(d)


def test_load_ignores_embed_tokens_and_lm_head(saved):
    drafter, d = saved
    _rewrite(
        d, lambda s: s.update({"embed_tokens.weight": torch.randn(128, 64), "lm_head.weight": torch.randn(128, 64)})
    )
    assert {"embed_tokens.weight", "lm_head.weight"} <= file_keys_and_shapes(d / "model.safetensors").keys()
    loaded = Drafter.load(d)
    assert not any("embed" in k or "lm_head" in k for k in loaded.state_dict())
    taps = torch.randn(1, 5, 2 * 64, generator=torch.Generator().manual_seed(2))
    embeds = torch.randn(1, BLOCK, 64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(run_stage(drafter, taps, embeds), run_stage(loaded, taps, embeds))
