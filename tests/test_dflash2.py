"""DFlash2 drafters (z-lab's `DFlash2DraftModel` layout): a checkpoint written here under z-lab's tensor
names loads, and its stage equals an fp64 reference written here from the format (grouped dynamic
convolutions around each sublayer, the window, the candidate selector's walk) over the taps of
transformers' own forward of the target — planted bugs make that comparison fail; the published
config and tensor shapes are read as published; bad checkpoints are refused in one line; rows draft
batched what they draft alone; with a drafter trained here, dflash and dloop commit plain decoding's
tokens (greedy, batched, trees, seeded at T = 1); and at T = 1 with the selector's q
(--draft-sampling drafter) the committed tokens follow the target's exact law, while a q that is
not the selector's (not renormalised; the edge left out) is rejected by the same test."""

import json
import pytest
import torch
import torch.nn.functional as F

from conftest import accepted_drafts, batched_greedy_equals_plain, lively, save_tiny_target, save_tiny_tokenizer
from test_distribution import P_FAIL, P_PASS, RUNS, exact_distribution, gof_pvalue, seeds
from test_distribution import MASK as LAW_MASK, PROMPT as LAW_PROMPT, distribution_target
from test_real_q import REAL_Q, N, committed_counts
from loopspec.cli import main
from loopspec.decoding import SamplingParams
from loopspec.engines.torch_engine import TorchEngine
from loopspec.errors import LoopspecError
from loopspec.model import dflash2
from loopspec.model.dflash2 import DFlash2Config, DFlash2Drafter
from loopspec.model.dflash import DrafterConfig
from loopspec.engines.dflash2_export import DFlash2Block
from loopspec.engines.export import block_graph
from loopspec.model.drafter_kinds import require_zlab_block
from loopspec.pair import load_pair
from loopspec.runtime.decoder import Decoder, decode_all, generate
from loopspec.settings import DecodingSettings as Method
from loopspec.weights import load_target_dir

LAYERS, VOCAB, HIDDEN = 6, 128, 64  # the tiny Qwen3 target of conftest: 4 heads, 2 kv heads, head_dim 32
HEADS, KV_HEADS, HEAD_DIM, INTER = 4, 2, 32, 80
TAPS, MASK, BLOCK, DRAFT_LAYERS = [1, 3, 4], 127, 5, 2
PROMPT, ANCHOR = [5, 17, 33, 9, 71, 2, 40, 40, 12, 99], 64
# accepted drafts the identity tests require of the drafter trained here (measured: 124 of 160 greedy
# tokens, dloop 137; 69 of 90 seeded at T = 1; 19 with drafts sampled from q; an untrained one: ~1)
FLOOR_GREEDY, FLOOR_SEEDED, FLOOR_REAL_Q = 100, 50, 10


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = save_tiny_target("qwen3", tmp_path_factory.mktemp("dflash2") / "target", seed=3, num_layers=LAYERS)
    save_tiny_tokenizer(d)
    return d


def dflash2_checkpoint(directory, *, seed=0, drop=(), tensors=None, draft_changes=None, **config_changes):
    """A DFlash2 drafter directory as z-lab writes one (config.json, model.safetensors under z-lab's
    names); `drop` leaves tensors out, `tensors` replaces some → (directory, config, tensors in fp64)."""
    from safetensors.torch import save_file

    draft = {
        "block_size": BLOCK,
        "mask_token_id": MASK,
        "target_layer_ids": TAPS,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 6,
    }
    draft.update(draft_changes or {})
    cfg = {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": DRAFT_LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"},
        "max_position_embeddings": 512,
        "vocab_size": VOCAB,
        "num_target_layers": LAYERS,
        "is_causal": False,
        "use_sliding_window": True,
        "sliding_window": 6,
        "layer_types": ["sliding_attention"] * DRAFT_LAYERS,
        "tie_word_embeddings": False,
        "dtype": "float32",
        "dflash_config": draft,
    }
    cfg.update(config_changes)
    taps, groups = draft["conv_kernel_size"], HIDDEN // draft["conv_group_size"]
    g = torch.Generator().manual_seed(seed)
    w = lambda *shape, s=0.15: torch.randn(*shape, generator=g, dtype=torch.float64) * s  # noqa: E731
    norm = lambda n: 1 + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)  # noqa: E731
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    sd = {
        "fc.weight": w(HIDDEN, len(TAPS) * HIDDEN),
        "hidden_norm.weight": norm(HIDDEN),
        "norm.weight": norm(HIDDEN),
        "candidate_selector.hidden_projection.weight": w(draft["selector_rank"], HIDDEN, s=0.3),
        "candidate_selector.predecessor_codebook": w(VOCAB, draft["selector_rank"], s=1.0),
        "candidate_selector.successor_codebook": w(VOCAB, draft["selector_rank"], s=1.0),
    }
    for i in range(DRAFT_LAYERS):
        p = f"layers.{i}."
        sd.update(
            {
                p + "input_layernorm.weight": norm(HIDDEN),
                p + "post_attention_layernorm.weight": norm(HIDDEN),
                p + "self_attn.q_proj.weight": w(q, HIDDEN),
                p + "self_attn.k_proj.weight": w(kv, HIDDEN),
                p + "self_attn.v_proj.weight": w(kv, HIDDEN),
                p + "self_attn.o_proj.weight": w(HIDDEN, q),
                p + "self_attn.q_norm.weight": norm(HEAD_DIM),
                p + "self_attn.k_norm.weight": norm(HEAD_DIM),
                p + "mlp.gate_proj.weight": w(INTER, HIDDEN),
                p + "mlp.up_proj.weight": w(INTER, HIDDEN),
                p + "mlp.down_proj.weight": w(HIDDEN, INTER),
            }
        )
        for conv in ("attention_conv", "mlp_conv"):
            sd[p + conv + ".base_kernel"] = (
                w(2, taps, HIDDEN, s=0.5) + torch.tensor([1.0] + [0.0] * (taps - 1))[:, None]
            )
            sd[p + conv + ".kernel_projection.weight"] = w(2 * taps * groups, HIDDEN, s=0.3)
    sd.update(tensors or {})
    for name in drop:
        sd.pop(name)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.float().contiguous() for k, v in sd.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory, cfg, {k: v.float().double() for k, v in sd.items()}


# --------------------------------------------------------------------------------------------------
# the fp64 reference, from the format's description


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, positions, theta):  # x [heads, T, hd], rotate-half
    # cos / sin in fp32, as transformers' rotary embedding computes them for every dtype
    inv_freq = 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.int64).float() / HEAD_DIM)
    angles = torch.tensor(positions, dtype=torch.float32)[:, None] * inv_freq[None]
    cos, sin = (f(torch.cat([angles, angles], -1)).double() for f in (torch.cos, torch.sin))
    return x * cos + torch.cat([-x[..., HEAD_DIM // 2 :], x[..., : HEAD_DIM // 2]], -1) * sin


def reference_conv(y, base, dynamic, group_size):
    """y [k, H], base [taps, H], dynamic [k, taps, G]: slot t sums taps o over y[t - o] (none before the
    block), each channel scaled by base[o] plus its group's coefficient of slot t."""
    out = torch.zeros_like(y)
    for t in range(y.shape[0]):
        for o in range(base.shape[0]):
            if t - o >= 0:
                out[t] += (base[o] + dynamic[t, o].repeat_interleave(group_size)) * y[t - o]
    return out


def reference_stage(sd, cfg, taps, embed, lm_head, anchor):
    """One DFlash2 stage in fp64 after a prompt whose tapped states are `taps` [N, 3H] → (the walk's
    drafts, each slot's candidates [D, K] and scores [D, K], the final-norm block states [k, H])."""
    draft = cfg["dflash_config"]
    k, gs, theta = draft["block_size"], draft["conv_group_size"], cfg["rope_parameters"]["rope_theta"]
    n_taps, groups = draft["conv_kernel_size"], HIDDEN // gs
    N = taps.shape[0]
    features = rms(taps @ sd["fc.weight"].T, sd["hidden_norm.weight"])  # [N, H]
    x = embed[[anchor] + [MASK] * (k - 1)] * draft.get("input_embedding_scale", 1.0)
    block = list(range(N, N + k))
    key_positions = torch.tensor(list(range(N)) + block)

    def attention(i, h):
        p = f"layers.{i}.self_attn."
        sliding = cfg.get("use_sliding_window") and cfg["layer_types"][i] == "sliding_attention"
        window = cfg["sliding_window"] if sliding else None  # as transformers' Qwen3 config reads them

        def keys(src, positions):
            kk = rms((src @ sd[p + "k_proj.weight"].T).view(-1, KV_HEADS, HEAD_DIM), sd[p + "k_norm.weight"])
            return rope(kk.transpose(0, 1), positions, theta), (src @ sd[p + "v_proj.weight"].T).view(
                -1, KV_HEADS, HEAD_DIM
            ).transpose(0, 1)

        q = rope(
            rms((h @ sd[p + "q_proj.weight"].T).view(k, HEADS, HEAD_DIM), sd[p + "q_norm.weight"]).transpose(0, 1),
            block,
            theta,
        )
        (kc, vc), (kb, vb) = keys(features, list(range(N))), keys(h, block)
        K = torch.cat([kc, kb], 1).repeat_interleave(HEADS // KV_HEADS, 0)
        V = torch.cat([vc, vb], 1).repeat_interleave(HEADS // KV_HEADS, 0)
        seen = torch.ones(k, N + k, dtype=torch.bool)
        if window is not None:
            seen &= (torch.tensor(block)[:, None] - key_positions[None]).abs() < window
        if cfg["is_causal"]:
            seen[:, N:] &= torch.ones(k, k, dtype=torch.bool).tril()
        att = (q @ K.transpose(1, 2) / HEAD_DIM**0.5).masked_fill(~seen, float("-inf")).softmax(-1) @ V
        return att.transpose(0, 1).reshape(k, -1) @ sd[p + "o_proj.weight"].T

    def mlp(i, h):
        p = f"layers.{i}.mlp."
        return (F.silu(h @ sd[p + "gate_proj.weight"].T) * (h @ sd[p + "up_proj.weight"].T)) @ sd[
            p + "down_proj.weight"
        ].T

    for i in range(cfg["num_hidden_layers"]):
        for norm, conv, sublayer in (
            ("input_layernorm", "attention_conv", attention),
            ("post_attention_layernorm", "mlp_conv", mlp),
        ):
            p = f"layers.{i}.{conv}."
            xn = rms(x, sd[f"layers.{i}.{norm}.weight"])
            dynamic = (xn @ sd[p + "kernel_projection.weight"].T).view(k, 2, n_taps, groups)
            h = reference_conv(xn, sd[p + "base_kernel"][0], dynamic[:, 0], gs)
            x = x + reference_conv(sublayer(i, h), sd[p + "base_kernel"][1], dynamic[:, 1], gs)
    final = rms(x, sd["norm.weight"])
    states = final[1:]
    logits = states @ lm_head.T * draft.get("output_multiplier", 1.0)
    if draft.get("final_logit_softcapping"):
        logits = torch.tanh(logits / draft["final_logit_softcapping"]) * draft["final_logit_softcapping"]
    unary, candidates = logits.topk(draft["selector_top_k"], -1)
    u = states @ sd["candidate_selector.hidden_projection.weight"].T
    previous, path, scores = anchor, [], []
    for i in range(k - 1):
        edge = (sd["candidate_selector.predecessor_codebook"][previous] * u[i]) @ sd[
            "candidate_selector.successor_codebook"
        ][candidates[i]].T
        scores.append(unary[i] + edge)
        previous = int(candidates[i, scores[-1].argmax()])
        path.append(previous)
    return path, candidates, torch.stack(scores), final


def hf_forward(target_dir, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float64).eval()
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i + 1][0] for i in TAPS], -1)  # the outputs of layers TAPS
    return taps, hf.get_input_embeddings().weight.detach(), hf.lm_head.weight.detach()


def fp64_pair(target_dir, drafter_dir):
    target = load_target_dir(target_dir, dtype=torch.float64)
    drafter = DFlash2Drafter.load(drafter_dir, dtype=torch.float64)
    drafter.cfg.fit(target.cfg)
    return target, drafter


def stage_against_reference(engine, sd, cfg, target_dir) -> float:
    """The engine's stage after prefilling PROMPT against the reference → the largest difference of its
    block states (inf when the walk, the ranked candidates or their log-probs differ)."""
    taps, embed, lm_head = hf_forward(target_dir, PROMPT)
    engine.prefill(0, PROMPT, want_taps=True)
    drafts, logprobs, hidden = engine.draft([0], [ANCHOR], [len(PROMPT)], BLOCK)
    path, candidates, scores, final = reference_stage(sd, cfg, taps, embed, lm_head, ANCHOR)
    order = scores.sort(dim=-1, descending=True, stable=True).indices[:, : drafts.shape[-1]]
    if drafts[0, :, 0].tolist() != path or not torch.equal(drafts[0], candidates.gather(-1, order)):
        return float("inf")
    want = torch.log_softmax(scores, -1).gather(-1, order)
    # handed over in fp32; and the drafter's norms compute in fp32 even for fp64 inputs (RMSNorm's
    # upcast path, as for every DFlash drafter: tests/test_drafter.py holds them to 1e-5 likewise)
    if not torch.allclose(logprobs[0].double(), want, rtol=1e-5, atol=1e-5):
        return float("inf")
    return float((hidden[0] - final).abs().max())


CONFIGS = {
    "window": ({}, {}),
    "no window": ({"use_sliding_window": False}, {}),
    "causal, 3 taps, scales, softcap": (
        {"is_causal": True},
        {
            "conv_kernel_size": 3,
            "conv_group_size": 8,
            "output_multiplier": 0.4,
            "final_logit_softcapping": 3.0,
            "input_embedding_scale": 1.7,
        },
    ),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_checkpoint_stage_equals_the_fp64_reference(name, target_dir, tmp_path):
    changes, draft_changes = CONFIGS[name]
    directory, cfg, sd = dflash2_checkpoint(tmp_path / "d2", draft_changes=draft_changes, **changes)
    target, drafter = fp64_pair(target_dir, directory)
    assert drafter.cfg.kind.name == "dflash2" and drafter.cfg.drafts_per_block(BLOCK) == BLOCK - 1
    assert stage_against_reference(TorchEngine(target, drafter, max_context=64), sd, cfg, target_dir) <= 1e-5
    # the selector matters here: its walk leaves the head's own argmax somewhere
    taps, embed, lm_head = hf_forward(target_dir, PROMPT)
    path, candidates, _, _ = reference_stage(sd, cfg, taps, embed, lm_head, ANCHOR)
    assert path != candidates[:, 0].tolist()


def test_planted_bugs_fail_the_reference_comparison(target_dir, tmp_path, monkeypatch):
    """The comparison can fail: the convolution centred (looking one slot ahead instead of behind),
    the selector's codebooks swapped (the edge scored from the candidate to the predecessor), or the
    walk conditioned on the head's argmax instead of the token it chose."""
    directory, cfg, sd = dflash2_checkpoint(tmp_path / "d2")
    conv = dflash2.grouped_dynamic_conv

    def centred(x, dynamic, base, group_size):
        return conv(x.flip(1), dynamic.flip(1), base, group_size).flip(1)

    monkeypatch.setattr(dflash2, "grouped_dynamic_conv", centred)
    target, drafter = fp64_pair(target_dir, directory)
    assert stage_against_reference(TorchEngine(target, drafter, max_context=64), sd, cfg, target_dir) > 1e-3
    monkeypatch.undo()
    target, drafter = fp64_pair(target_dir, directory)
    selector = drafter.candidate_selector
    selector.predecessor_codebook, selector.successor_codebook = (
        selector.successor_codebook,
        selector.predecessor_codebook,
    )
    assert stage_against_reference(TorchEngine(target, drafter, max_context=64), sd, cfg, target_dir) > 1e-3
    target, drafter = fp64_pair(target_dir, directory)
    edges = type(drafter.candidate_selector).edges
    monkeypatch.setattr(
        type(drafter.candidate_selector),
        "edges",
        lambda self, previous, projected, candidates: edges(self, candidates[:, 0], projected, candidates),
    )
    assert stage_against_reference(TorchEngine(target, drafter, max_context=64), sd, cfg, target_dir) > 1e-3


def test_the_published_config_and_tensor_shapes():
    """z-lab's published DFlash2 config (its fields as published) makes exactly the published tensors."""
    published = {
        "architectures": ["DFlash2DraftModel"],
        "is_causal": False,
        "head_dim": 128,
        "hidden_size": 6656,
        "intermediate_size": 19968,
        "layer_types": ["sliding_attention"] * 5,
        "max_position_embeddings": 131072,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 5,
        "num_key_value_heads": 8,
        "num_target_layers": 52,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "sliding_window": 2048,
        "use_sliding_window": True,
        "vocab_size": 202048,
        "dflash_config": {
            "block_size": 16,
            "conv_group_size": 16,
            "conv_kernel_size": 2,
            "final_logit_softcapping": 20.0,
            "mask_token_id": 201818,
            "output_multiplier": 0.19611613513818404,
            "selector_rank": 256,
            "selector_top_k": 16,
            "target_layer_ids": [1, 13, 25, 37, 49],
        },
    }
    cfg = DFlash2Config.from_checkpoint(published)
    assert (cfg.block_size, cfg.sliding_window, cfg.final_logit_softcapping, cfg.is_causal) == (16, 2048, 20.0, False)
    assert cfg.kind.title == "DFlash2" and cfg.kind.selector.top_k == 16 and not cfg.kind.plain
    with torch.device("meta"):
        shapes = {n: list(t.shape) for n, t in DFlash2Drafter(cfg).zlab_state_dict().items()}
    assert shapes["layers.4.attention_conv.base_kernel"] == [2, 2, 6656]
    assert shapes["layers.0.mlp_conv.kernel_projection.weight"] == [1664, 6656]
    assert shapes["candidate_selector.hidden_projection.weight"] == [256, 6656]
    assert (
        shapes["candidate_selector.predecessor_codebook"]
        == shapes["candidate_selector.successor_codebook"]
        == [202048, 256]
    )
    assert shapes["fc.weight"] == [6656, 33280] and len(shapes) == 3 + 3 + 5 * 15
    assert DFlash2Config.from_checkpoint(cfg.to_checkpoint()) == cfg


def test_save_writes_zlab_layout_and_round_trips(target_dir, tmp_path):
    from safetensors.torch import load_file

    directory, cfg, sd = dflash2_checkpoint(tmp_path / "src", draft_changes={"output_multiplier": 0.5})
    drafter = DFlash2Drafter.load(directory)
    drafter.save(tmp_path / "out", dtype=torch.float32)
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(saved) == set(sd) and all(torch.equal(saved[n].double(), t) for n, t in sd.items())
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["DFlash2DraftModel"] and written["dflash_config"]["selector_top_k"] == 6
    assert DFlash2Drafter.load(tmp_path / "out").cfg == drafter.cfg


def test_batched_rows_draft_as_each_alone(target_dir, tmp_path):
    """Each row's stage — the walk, and at T > 0 its sampled drafts and q — is what it is alone."""
    directory, _, _ = dflash2_checkpoint(tmp_path / "d2")
    target, drafter = fp64_pair(target_dir, directory)
    prompts, anchors = [PROMPT, [7, 8, 9], PROMPT[:6] + [3, 3]], [64, 11, 90]
    laws = [SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=0.6)]
    alone = []
    for b, (p, a) in enumerate(zip(prompts, anchors)):
        engine = TorchEngine(target, drafter, max_context=64)
        engine.prefill(0, p, want_taps=True)
        alone.append(
            (
                engine.draft([0], [a], [len(p)], BLOCK),
                engine.draft([0], [a], [len(p)], BLOCK, sampling=[(laws[b], torch.Generator().manual_seed(b))]),
            )
        )
    engine = TorchEngine(target, drafter, max_context=64, max_rows=3)
    for b, p in enumerate(prompts):
        engine.prefill(b, p, want_taps=True)
    order = (2, 0, 1)
    rows = dict(
        rows=list(order),
        anchors=[anchors[b] for b in order],
        positions=[len(prompts[b]) for b in order],
        block_size=BLOCK,
    )
    batched = engine.draft(**rows)
    sampled = engine.draft(**rows, sampling=[(laws[b], torch.Generator().manual_seed(b)) for b in order])
    for i, b in enumerate(order):
        assert torch.equal(batched[0][i], alone[b][0][0][0])
        assert torch.allclose(batched[1][i], alone[b][0][1][0], atol=1e-12)
        assert torch.allclose(batched[2][i], alone[b][0][2][0], atol=1e-12)
        assert torch.equal(sampled[0][i], alone[b][1][0][0]) and torch.allclose(sampled.q[i], alone[b][1].q[0])


def test_sampled_q_is_the_selectors_softmax_over_its_candidates(target_dir, tmp_path):
    """At T > 0 the first slot's q is softmax(score / T) over its k candidates (zero elsewhere, summing
    to 1), its score the greedy stage's (the anchor precedes both), and each draft is one of q's."""
    directory, _, _ = dflash2_checkpoint(tmp_path / "d2")
    target, drafter = fp64_pair(target_dir, directory)
    engine = TorchEngine(target, drafter, max_context=64)
    engine.prefill(0, PROMPT, want_taps=True)
    greedy = engine.draft([0], [ANCHOR], [len(PROMPT)], BLOCK)
    T = 0.7
    stage = engine.draft(
        [0],
        [ANCHOR],
        [len(PROMPT)],
        BLOCK,
        sampling=[(SamplingParams(temperature=T), torch.Generator().manual_seed(0))],
    )
    q = stage.q[0]  # [D, V]
    assert torch.allclose(q.sum(-1), torch.ones(BLOCK - 1), atol=1e-6) and bool(((q > 0).sum(-1) == 6).all())
    want = torch.softmax(greedy[1][0, 0].double() / T, -1)
    assert torch.allclose(q[0, greedy[0][0, 0]].double(), want, atol=1e-5)
    assert bool((q.gather(-1, stage[0][0]) > 0).all())
    assert torch.allclose(stage[1][0], q.gather(-1, stage[0][0]).log())


# --------------------------------------------------------------------------------------------------
# bad checkpoints, and what does not take a DFlash2 drafter


def bad_checkpoints(root):
    H = HIDDEN
    d2t = dflash2_checkpoint(root / "h")[0]
    (d2t / "d2t.safetensors").write_bytes((root / "h" / "model.safetensors").read_bytes())
    rankless, cfg, _ = dflash2_checkpoint(root / "g")
    del cfg["dflash_config"]["selector_rank"]
    (rankless / "config.json").write_text(json.dumps(cfg))
    return {
        "no successor codebook": (
            dflash2_checkpoint(root / "a", drop=("candidate_selector.successor_codebook",))[0],
            "lacks candidate_selector.successor_codebook",
        ),
        "no projection": (
            dflash2_checkpoint(root / "b", drop=("candidate_selector.hidden_projection.weight",))[0],
            "lacks candidate_selector.hidden_projection.weight",
        ),
        "three taps in the file": (
            dflash2_checkpoint(root / "c", tensors={"layers.0.attention_conv.base_kernel": torch.zeros(2, 3, H)})[0],
            "size mismatch for layers.0.attention_conv.base_kernel: [2, 3, 64]",
        ),
        "groups of 8 in the file": (
            dflash2_checkpoint(root / "d", tensors={"layers.1.mlp_conv.kernel_projection.weight": torch.zeros(32, H)})[
                0
            ],
            "size mismatch for layers.1.mlp_conv.kernel_projection.weight",
        ),
        "top-k past the vocabulary": (
            dflash2_checkpoint(root / "e", draft_changes={"selector_top_k": 200})[0],
            "selector_top_k 200 is larger than the vocabulary of 128",
        ),
        "group size 24": (
            dflash2_checkpoint(root / "f", draft_changes={"conv_group_size": 24})[0],
            "conv_group_size 24 does not divide hidden_size 64",
        ),
        "no rank": (rankless, "lacks dflash_config.selector_rank"),
        "a d2t map": (d2t, "reduced draft vocabulary"),
        "is_causal a string": (dflash2_checkpoint(root / "i", is_causal="no")[0], "is_causal must be true or false"),
    }


def test_bad_checkpoints_are_refused_in_one_line(target_dir, tmp_path, capsys):
    for name, (directory, words) in bad_checkpoints(tmp_path).items():
        with pytest.raises(LoopspecError) as e:
            load_pair(target_dir, directory)
        assert words in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
        code = main(
            [
                "generate",
                "--prompt",
                "x",
                "--target",
                str(target_dir),
                "--drafter",
                str(directory),
                "--backend",
                "torch",
                "--max-new-tokens",
                "2",
            ]
        )
        lines = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and words in lines[0], (name, lines)


def test_quantization_training_and_cuda_graphs_refuse_it_naming_the_kind(target_dir, tmp_path):
    """The fp32 graphs take it (tests/test_dflash2_onnx.py) and `train --family dflash2` trains it
    (tests/test_train_dflash2.py); quantized drafter graphs, CUDA graphs and the DFlash recipe refuse it
    in one line. (Serving bundles take it where the framework runs DFlash2: tests/test_dflash2_bundles.py.)"""
    from loopspec.convert.bundles import build_bundle

    directory, _, _ = dflash2_checkpoint(tmp_path / "d2")
    pair = load_pair(target_dir, directory)
    kind = pair.drafter.cfg.kind
    assert block_graph(kind) is DFlash2Block  # its block graph exports
    with pytest.raises(
        LoopspecError, match="quantization does not take DFlash2 drafters: their graphs are exported in fp32"
    ):
        require_zlab_block(pair.drafter.cfg, "quantization")
    with pytest.raises(LoopspecError, match="cannot serve this DFlash2 drafter.*DFlashDecodingConfig") as e:
        build_bundle(target_dir, str(directory), tmp_path / "bundle-trtllm", "trtllm")
    assert "\n" not in str(e.value)
    assert kind.training_family == "dflash2" and not kind.trains_loop_aware
    with pytest.raises(LoopspecError, match="DFlash2.*--cuda-graphs"):
        TorchEngine(pair.target, pair.drafter, max_context=64, cuda_graphs=True)
    from loopspec.train.run import prepare_drafter

    with pytest.raises(LoopspecError, match="DFlash2.*trained with --family dflash2, not --family dflash"):
        prepare_drafter(pair, str(target_dir))


# --------------------------------------------------------------------------------------------------
# decoding with a drafter that agrees with the target


def block_loss(drafter, embed, head, tokens, anchors, taps):
    """Every anchor's stage as the engine drafts it (one row each: [anchor, MASK…] over the context
    before the anchor) → cross-entropy of the head's logits at the drafting slots, plus the selector's
    over each slot's candidates with the data's token before the slot as the predecessor."""
    cfg, k, T, A = drafter.cfg, drafter.cfg.block_size, len(tokens), len(anchors)
    ctx_k, ctx_v = drafter.context_kv(drafter.features(taps[None]), torch.arange(T))  # [N, 1, kvh, T, hd]
    slots = torch.arange(T + k)
    mask = ((slots[None] < anchors[:, None]) | (slots[None] >= T))[:, None, None]  # [A, 1, 1, T + k]
    ids = torch.full((A, k), MASK)
    ids[:, 0] = tokens[anchors]
    hidden = drafter(
        F.embedding(ids, embed),
        (anchors[:, None] + torch.arange(k))[:, None],
        ctx_k.expand(-1, A, -1, -1, -1),
        ctx_v.expand(-1, A, -1, -1, -1),
        mask,
    )  # [A, k, H]
    states = hidden[:, 1:]
    at = anchors[:, None] + torch.arange(1, k)  # [A, D]: the token each slot drafts
    valid = at < T
    labels = tokens[at.clamp_max(T - 1)]
    logits = drafter.unary_logits(F.linear(states, head))  # [A, D, V]
    loss = F.cross_entropy(logits[valid], labels[valid])
    unary, candidates = logits.topk(cfg.selector_top_k, -1)
    selector = drafter.candidate_selector
    gated = selector.predecessor_codebook[tokens[(at - 1).clamp_max(T - 1)]] * selector.hidden_projection(states)
    scores = unary + (gated[:, :, None] * selector.successor_codebook[candidates]).sum(-1)  # [A, D, K]
    hit = (candidates == labels[..., None]) & valid[..., None]
    rows = hit.any(-1)
    return loss + F.cross_entropy(scores[rows], hit[rows].float().argmax(-1))


def agreeing_dflash2(target, texts, steps=120, seed=0) -> DFlash2Drafter:
    """A tiny DFlash2 drafter trained here until its stages draft `texts` ((prompt, continuation) pairs
    of `target`): drafts that are accepted, so identity tests compare something."""
    torch.manual_seed(seed)
    base = DrafterConfig.for_target(
        target.cfg,
        num_layers=DRAFT_LAYERS,
        block_size=BLOCK,
        target_layer_ids=TAPS,
        mask_token_id=MASK,
        intermediate_size=INTER,
    )
    cfg = DFlash2Config.over(
        base,
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=6,
        sliding_window=24,
        layer_types=("sliding_attention",) * DRAFT_LAYERS,
    )
    drafter = DFlash2Drafter(cfg)
    target.set_taps(cfg.target_layer_ids)
    embed, head = target.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    data = []
    with torch.no_grad():
        for prompt, continuation in texts:
            tokens = torch.tensor(list(prompt) + list(continuation))
            taps = target(tokens[None], target.new_cache(len(tokens)), want_taps=True).taps[0]
            data.append((tokens, torch.arange(max(len(prompt) - 1, 0), len(tokens) - 1), taps))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        for tokens, anchors, taps in data:
            (block_loss(drafter, embed, head, tokens, anchors, taps) / len(data)).backward()
        optimizer.step()
    return drafter.eval()


def prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 120, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


PROMPTS = prompts(4, seed=7)
T1, SEEDS = SamplingParams(temperature=1.0), (3, 4, 5)


@pytest.fixture(scope="module")
def engine(target_dir):
    """The lively target with a DFlash2 drafter trained on its greedy continuations of PROMPTS and on
    what it samples at T = 1 with SEEDS (so that seeded drafts are accepted too)."""
    target = lively(load_target_dir(target_dir))
    plain = TorchEngine(target, None, max_context=128)
    texts = [(p, generate(plain, p, Method(), max_new_tokens=40).tokens) for p in PROMPTS]
    texts += [
        (p, generate(plain, p, Method(), max_new_tokens=30, params=T1, seed=s).tokens) for s, p in zip(SEEDS, PROMPTS)
    ]
    return TorchEngine(target, agreeing_dflash2(target, texts), max_context=128)


@pytest.mark.parametrize(
    "settings",
    [
        Method("dflash", block_size=BLOCK),
        Method("dflash", block_size=BLOCK, tree_budget=8),
        Method("dloop", block_size=BLOCK, max_stages=3, gate_threshold=-2.0),
        Method("dloop", block_size=BLOCK, max_stages=3, gate_threshold=-2.0, tree_budget=10),
    ],
)
def test_greedy_dflash_and_dloop_commit_plain_decodings_tokens(settings, engine):
    accepted = 0
    for p in PROMPTS:
        ar = generate(engine, p, Method(), max_new_tokens=40)
        spec = generate(engine, p, settings, max_new_tokens=40)
        assert spec.tokens == ar.tokens
        accepted += accepted_drafts([spec])
    assert accepted >= FLOOR_GREEDY, accepted


def test_batched_rows_commit_what_each_commits_alone(engine):
    assert batched_greedy_equals_plain(engine, PROMPTS, Method("dflash", block_size=BLOCK)) >= FLOOR_GREEDY


def test_seeded_walk_at_temperature_one_equals_plain_sampling(engine):
    """T = 1, argmax drafts (the walk): every committed token is drawn from the target as plain
    decoding draws it, in the same order from the same generator."""
    accepted = 0
    for seed, p in zip(SEEDS, PROMPTS):
        ar = generate(engine, p, Method(), max_new_tokens=30, params=T1, seed=seed)
        spec = generate(engine, p, Method("dflash", block_size=BLOCK), max_new_tokens=30, params=T1, seed=seed)
        assert spec.tokens == ar.tokens
        accepted += accepted_drafts([spec])
    assert accepted >= FLOOR_SEEDED, accepted


def test_drafts_sampled_from_the_selectors_q_reproduce_their_seed_batched(engine):
    """--draft-sampling drafter: each slot's draft is drawn from the selector's q with the row's
    generator; a row batched commits what it commits alone, and a greedy row commits ar's tokens."""
    settings = Method("dflash", block_size=BLOCK, draft_sampling="drafter")
    params = [T1, SamplingParams(temperature=0.7, top_p=0.9), SamplingParams()]
    alone = [
        generate(engine, p, settings, max_new_tokens=24, params=q, seed=s) for p, q, s in zip(PROMPTS, params, SEEDS)
    ]
    done = decode_all(
        Decoder(engine.with_rows(3), settings),
        [
            dict(key=i, prompt_ids=p, max_new_tokens=24, params=q, seed=s)
            for i, (p, q, s) in enumerate(zip(PROMPTS, params, SEEDS))
        ],
    )
    assert [done[i].tokens for i in range(3)] == [r.tokens for r in alone]
    assert alone[2].tokens == generate(engine, PROMPTS[2], Method(), max_new_tokens=24).tokens
    assert accepted_drafts(alone) >= FLOOR_REAL_Q, accepted_drafts(alone)


def test_cli_generates_with_a_dflash2_drafter_what_ar_does(target_dir, tmp_path, capsys):
    directory, _, _ = dflash2_checkpoint(tmp_path / "d2")
    base = [
        "generate",
        "--prompt",
        "hello world",
        "--target",
        str(target_dir),
        "--drafter",
        str(directory),
        "--max-new-tokens",
        "12",
        "--backend",
        "torch",
    ]  # on onnxruntime: tests/test_dflash2_onnx.py
    texts = {}
    for method in ("ar", "dflash", "dloop"):
        assert main(base + ["--method", method] + (["--block-size", str(BLOCK)] if method != "ar" else [])) == 0
        texts[method] = capsys.readouterr().out
    assert texts["ar"] == texts["dflash"] == texts["dloop"] and texts["ar"].strip()


# --------------------------------------------------------------------------------------------------
# T = 1 with the selector's q: the target's exact law


@pytest.fixture(scope="module")
def law_target(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a vocabulary-8 model runs fastest on one thread
    yield distribution_target(tmp_path_factory.mktemp("dflash2_law"))
    torch.set_num_threads(threads)


def law_engine(target) -> TorchEngine:
    """The vocabulary-8 target with a DFlash2 drafter whose selector is live (codebooks of scale 1,
    dynamic convolutions on) and keeps 4 of the 8 tokens per slot: q is far from the head's softmax
    and zero on half the vocabulary."""
    torch.manual_seed(4)
    cfg = DFlash2Config.over(
        DrafterConfig.for_target(target.cfg, num_layers=1, block_size=3, mask_token_id=LAW_MASK),
        conv_kernel_size=2,
        conv_group_size=8,
        selector_rank=4,
        selector_top_k=4,
        output_multiplier=0.3,
    )  # a flatter head: its top 4 hold ~85 % of its mass, not 97 %
    drafter = DFlash2Drafter(cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.startswith("candidate_selector.") or "kernel_projection" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "codebook" in name else 0.3))
    return TorchEngine(target, drafter.eval(), max_context=16)


def test_drafts_from_the_selectors_q_commit_the_targets_exact_law(law_target):
    engine = law_engine(law_target)
    counts, first = committed_counts(engine, N, REAL_Q, seeds(31))
    hist = torch.bincount(torch.tensor(first), minlength=3)
    assert int(hist[1:].sum()) > 0.1 * RUNS, hist  # drafts are accepted often enough to matter
    assert gof_pvalue(counts, exact_distribution(law_target, LAW_PROMPT, N, T1), min_cells=60) > P_PASS


def not_renormalised(engine, stage):
    """q of the candidates times the head's mass on them: the selector's law restricted to the top-k
    and left normalised over the whole vocabulary."""
    logits = engine.drafter.unary_logits(engine.context.draft_head(stage[2][:, 1:])).float()  # [R, D, V]
    mass = torch.softmax(logits, -1).topk(engine.drafter_cfg.selector_top_k, -1).values.sum(-1)  # [R, D]
    return stage.q * mass.cpu()[..., None]


def edge_left_out(engine, stage):
    """softmax over each slot's candidates of the head's logits alone: the walk's edge left out of q."""
    logits = engine.drafter.unary_logits(engine.context.draft_head(stage[2][:, 1:])).float()
    unary, candidates = logits.topk(engine.drafter_cfg.selector_top_k, -1)
    return torch.zeros_like(stage.q).scatter_(-1, candidates.cpu(), torch.softmax(unary, -1).cpu())


@pytest.mark.parametrize("wrong_q", [not_renormalised, edge_left_out])
def test_a_q_that_is_not_the_selectors_is_rejected(wrong_q, law_target, monkeypatch):
    """Mutation check of the test above: drafts drawn by the selector's walk, accepted against a q that
    is not the one they were drawn from — the committed tokens leave the target's law."""
    engine = law_engine(law_target)
    real_draft = engine.draft

    def draft_with_wrong_q(rows, anchors, positions, block_size, sampling=None):
        stage = real_draft(rows, anchors, positions, block_size, sampling=sampling)
        if sampling is not None:
            with torch.inference_mode():
                stage.q = wrong_q(engine, stage)
        return stage

    monkeypatch.setattr(engine, "draft", draft_with_wrong_q)
    counts, _ = committed_counts(engine, N, REAL_Q, seeds(31))
    assert gof_pvalue(counts, exact_distribution(law_target, LAW_PROMPT, N, T1), min_cells=60) < P_FAIL
