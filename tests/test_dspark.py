"""DSpark drafters and DeepSpec's checkpoint format: the Markov and confidence heads against an fp64
reference written here from their definitions (every head type, both block conventions), DeepSpec
checkpoints written in-test under DeepSpec's key names and loaded through `load_pair` and the CLI,
bad checkpoints refused in one line, and greedy decoding with DSpark drafters equal to `ar`."""

import json
from dataclasses import replace

import pytest
import torch

from conftest import accepted_drafts, agreeing_drafter, lively
from loopspec.cli import main
from loopspec.errors import LoopspecError
from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.model.draft_head import draft_stage
from loopspec.model.drafter_kinds import MARKOV_HEAD_TYPES, require_zlab_block
from loopspec.pair import load_pair
from loopspec.runtime.decoder import Decoder, decode_all, draft_round, generate
from loopspec.engines.torch_engine import TorchEngine
from loopspec.settings import DecodingSettings
from loopspec.weights import load_target_dir

RANK, BLOCK, MASK = 8, 5, 127


def dspark_config(
    target_cfg,
    head_type="vanilla",
    anchor_predicts=True,
    rank=RANK,
    confidence=True,
    with_markov=True,
    block_size=BLOCK,
) -> DrafterConfig:
    cfg = DrafterConfig.for_target(target_cfg, num_layers=2, block_size=block_size, mask_token_id=MASK)
    return replace(
        cfg,
        anchor_predicts=anchor_predicts,
        markov_rank=rank,
        markov_head_type=head_type,
        confidence_head=confidence,
        confidence_with_markov=with_markov and confidence and rank > 0,
    )


def liven_heads(drafter: Drafter, seed: int = 0) -> Drafter:
    """HF's N(0, 0.02) init leaves W2·W1[prev] ≈ 1e-3, too small to move any argmax; at these
    scales the correction reorders the candidates and the gates/state sit away from 0 and 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.startswith(("markov_head.", "confidence_head.")):
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "markov_w" in name else 0.3))
    return drafter


def dspark_drafter(target, seed=0, **kw) -> Drafter:
    torch.manual_seed(seed)
    return liven_heads(Drafter(dspark_config(target.cfg, **kw)), seed).eval()


@pytest.fixture(scope="module")
def target(tiny_targets):
    return lively(load_target_dir(tiny_targets["qwen3"]))


# --------------------------------------------------------------------------------------------------
# the heads against an fp64 reference


def reference_heads(
    sd: dict,
    cfg: DrafterConfig,
    lm_head: torch.Tensor,
    hidden: torch.Tensor,
    anchor: int,
    rows: torch.Tensor | None = None,
) -> tuple[list[int], torch.Tensor, list[float] | None]:
    """One block, position by position in fp64 from the definitions: hidden [k, H] → the greedy
    chain (target ids), the corrected logits [D, V or Vd], and the confidence per drafting position.
    `rows`: the target ids a reduced draft vocabulary drafts over (None: all)."""
    d = {k: v.double() for k, v in sd.items()}
    rows = torch.arange(lm_head.shape[0]) if rows is None else rows
    sig = lambda x: 1.0 / (1.0 + torch.exp(-x))  # noqa: E731
    drafting = hidden.double()[(0 if cfg.anchor_predicts else 1) :]
    prev, state, chain, logits, confidence = anchor, torch.zeros(cfg.markov_rank, dtype=torch.float64), [], [], []
    for h in drafting:
        z = lm_head.double()[rows] @ h
        e = d["markov_head.markov_w1.weight"][prev] if cfg.markov_rank else None
        if cfg.markov_rank:
            if cfg.markov_head_type == "vanilla":
                u = e
            elif cfg.markov_head_type == "gated":
                u = sig(d["markov_head.gate_proj.weight"] @ torch.cat([h, e]) + d["markov_head.gate_proj.bias"]) * e
            else:
                r = cfg.markov_rank
                joint = d["markov_head.joint_proj.weight"] @ torch.cat([state, e, h]) + d["markov_head.joint_proj.bias"]
                gate, cand, out = joint[:r], joint[r : 2 * r], joint[2 * r :]
                state = sig(gate) * state + (1 - sig(gate)) * torch.tanh(cand)
                u = torch.tanh(out)
            z = z + d["markov_head.markov_w2.weight"][rows] @ u
        if cfg.confidence_head:
            x = torch.cat([h, e]) if cfg.confidence_with_markov else h
            confidence.append(float(sig(d["confidence_head.proj.weight"][0] @ x + d["confidence_head.proj.bias"][0])))
        logits.append(z)
        prev = int(rows[z.argmax()])
        chain.append(prev)
    return chain, torch.stack(logits), (confidence if cfg.confidence_head else None)


CASES = [(kind, anchor) for kind in MARKOV_HEAD_TYPES for anchor in (True, False)]


@pytest.mark.parametrize("kind,anchor_predicts", CASES)
def test_markov_and_confidence_match_the_fp64_reference(kind, anchor_predicts, target):
    drafter = dspark_drafter(target, head_type=kind, anchor_predicts=anchor_predicts).double()
    lm_head = target.lm_head.weight.detach().double()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, BLOCK, drafter.cfg.hidden_size, generator=g, dtype=torch.float64)  # [R, k, H]
    anchors = torch.tensor([5, 77, 31])
    drafts, logprobs, confidence = draft_stage(drafter, hidden, anchors, lambda h: h @ lm_head.T, None)
    D = drafter.cfg.drafts_per_block(BLOCK)
    assert drafts.shape[:2] == logprobs.shape[:2] == confidence.shape == (3, D)
    base_chain = (hidden[:, drafter.cfg.first_draft :] @ lm_head.T).argmax(-1)  # [R, D]
    for b in range(3):
        chain, logits, conf = reference_heads(drafter.state_dict(), drafter.cfg, lm_head, hidden[b], int(anchors[b]))
        assert drafts[b, :, 0].tolist() == chain
        want = torch.log_softmax(logits, -1).gather(-1, drafts[b])  # the reference's log-probs of every candidate
        assert torch.allclose(logprobs[b], want, atol=1e-10)
        assert torch.equal(drafts[b], logits.topk(drafts.shape[-1], -1).indices)  # tree ranks: the corrected order
        assert torch.allclose(confidence[b].double(), torch.tensor(conf, dtype=torch.float64), atol=1e-6)
    assert not torch.equal(drafts[:, :, 0], base_chain)  # the correction moved some argmax: a live head


@pytest.mark.parametrize("rank", [RANK, 0])  # beside a Markov head, and alone
def test_confidence_without_the_markov_input(rank, target):
    drafter = dspark_drafter(target, rank=rank, with_markov=False).double()
    assert drafter.confidence_head.proj.weight.shape == (1, drafter.cfg.hidden_size)
    lm_head = target.lm_head.weight.detach().double()
    hidden = torch.randn(
        2, BLOCK, drafter.cfg.hidden_size, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    drafts, _, confidence = draft_stage(drafter, hidden, torch.tensor([3, 4]), lambda h: h @ lm_head.T, None)
    for b in range(2):
        chain, _, conf = reference_heads(drafter.state_dict(), drafter.cfg, lm_head, hidden[b], [3, 4][b])
        assert drafts[b, :, 0].tolist() == chain
        assert torch.allclose(confidence[b].double(), torch.tensor(conf, dtype=torch.float64), atol=1e-6)


def test_reduced_draft_vocabulary_corrects_over_its_rows(target):
    """With a d2t map the bias is W2's draft rows, and the predecessor is the draft's target id."""
    drafter = dspark_drafter(target, head_type="gated").double()
    draft_ids = torch.randperm(128, generator=torch.Generator().manual_seed(3))[:40].sort().values
    lm_head = target.lm_head.weight.detach().double()
    hidden = torch.randn(
        2, BLOCK, drafter.cfg.hidden_size, generator=torch.Generator().manual_seed(4), dtype=torch.float64
    )
    drafts, logprobs, confidence = draft_stage(
        drafter, hidden, torch.tensor([9, 60]), lambda h: h @ lm_head[draft_ids].T, draft_ids
    )
    for b in range(2):
        chain, logits, conf = reference_heads(
            drafter.state_dict(), drafter.cfg, lm_head, hidden[b], [9, 60][b], rows=draft_ids
        )
        assert drafts[b, :, 0].tolist() == chain and set(drafts[b].flatten().tolist()) <= set(draft_ids.tolist())
        assert torch.allclose(logprobs[b], torch.log_softmax(logits, -1).topk(drafts.shape[-1], -1).values, atol=1e-10)
        assert torch.allclose(confidence[b].double(), torch.tensor(conf, dtype=torch.float64), atol=1e-6)


# --------------------------------------------------------------------------------------------------
# DeepSpec checkpoints


def deepspec_checkpoint(
    directory,
    target_dir,
    *,
    layers=2,
    rank=RANK,
    kind="vanilla",
    confidence=True,
    with_markov=True,
    block_size=BLOCK,
    seed=0,
    **config_changes,
):
    """A DeepSpec-format drafter directory: the target's config.json + DeepSpec's fields, and a
    model.safetensors under exactly DeepSpec's key names (frozen embed/lm_head copies included)."""
    from safetensors.torch import save_file

    cfg = json.loads((target_dir / "config.json").read_text())
    cfg.update(
        {
            "architectures": ["Qwen3DSparkModel"],
            "num_hidden_layers": layers,
            "block_size": block_size,
            "num_target_layers": cfg["num_hidden_layers"],
            "target_layer_ids": [1, 3],
            "mask_token_id": MASK,
            "num_anchors": 512,
            "markov_rank": rank,
            "layer_types": ["full_attention"] * layers,
            "enable_confidence_head": confidence,
            "tie_word_embeddings": False,
        }
    )
    if rank:
        cfg["markov_head_type"] = kind
    if confidence:
        cfg["confidence_head_with_markov"] = with_markov
    cfg.update(config_changes)  # the weights follow the config's widths (a drafter made for another target)
    H, V, I = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    g = torch.Generator().manual_seed(seed)
    w = lambda *shape, s=0.1: (torch.randn(*shape, generator=g) * s).to(torch.bfloat16)  # noqa: E731
    norm = lambda n: (1 + 0.2 * torch.randn(n, generator=g)).to(torch.bfloat16)  # noqa: E731
    sd = {
        "embed_tokens.weight": w(V, H),
        "lm_head.weight": w(V, H),
        "norm.weight": norm(H),
        "fc.weight": w(H, 2 * H),
        "hidden_norm.weight": norm(H),
    }
    for i in range(layers):
        p = f"layers.{i}."
        sd.update(
            {
                p + "self_attn.q_proj.weight": w(nq * hd, H),
                p + "self_attn.k_proj.weight": w(nkv * hd, H),
                p + "self_attn.v_proj.weight": w(nkv * hd, H),
                p + "self_attn.o_proj.weight": w(H, nq * hd),
                p + "self_attn.q_norm.weight": norm(hd),
                p + "self_attn.k_norm.weight": norm(hd),
                p + "mlp.gate_proj.weight": w(I, H),
                p + "mlp.up_proj.weight": w(I, H),
                p + "mlp.down_proj.weight": w(H, I),
                p + "input_layernorm.weight": norm(H),
                p + "post_attention_layernorm.weight": norm(H),
            }
        )
    if rank:
        sd.update(
            {"markov_head.markov_w1.weight": w(V, rank, s=1.0), "markov_head.markov_w2.weight": w(V, rank, s=1.0)}
        )
        if kind == "gated":
            sd.update({"markov_head.gate_proj.weight": w(rank, H + rank), "markov_head.gate_proj.bias": w(rank)})
        if kind == "rnn":
            sd.update(
                {"markov_head.joint_proj.weight": w(3 * rank, 2 * rank + H), "markov_head.joint_proj.bias": w(3 * rank)}
            )
    if confidence:
        width = H + (rank if with_markov else 0)
        sd.update({"confidence_head.proj.weight": w(1, width), "confidence_head.proj.bias": w(1)})
    directory.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory, sd


@pytest.mark.parametrize("kind", MARKOV_HEAD_TYPES)
def test_deepspec_dspark_checkpoint_loads_and_round_trips(kind, target_dir, tmp_path):
    src, sd = deepspec_checkpoint(tmp_path / "dspark", target_dir, kind=kind)
    pair = load_pair(target_dir, src)
    d = pair.drafter
    assert (d.cfg.anchor_predicts, d.cfg.markov_rank, d.cfg.markov_head_type) == (True, RANK, kind)
    assert (d.cfg.block_size, d.cfg.mask_token_id, d.cfg.target_layer_ids) == (BLOCK, MASK, [1, 3])
    assert d.cfg.confidence_head and d.cfg.confidence_with_markov and d.cfg.drafts_per_block(BLOCK) == BLOCK
    state = d.state_dict()
    for name, t in sd.items():  # every head tensor and backbone tensor lands under its own name
        if name.startswith(("markov_head.", "confidence_head.", "fc.", "layers.0.self_attn.q_proj")):
            assert torch.equal(state[name], t.float()), name
    assert torch.equal(
        state["layers.1.mlp.gate_up_proj.weight"],
        torch.cat([sd["layers.1.mlp.gate_proj.weight"], sd["layers.1.mlp.up_proj.weight"]]).float(),
    )
    d.save(tmp_path / "ours", dtype=torch.float32)
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["architectures"] == ["Qwen3DSparkModel"]  # a z-lab name would make readers draft off by one
    assert (written["mask_token_id"], written["target_layer_ids"], written["markov_rank"]) == (MASK, [1, 3], RANK)
    assert (written["markov_head_type"], written["enable_confidence_head"], written["confidence_head_with_markov"]) == (
        kind,
        True,
        True,
    )
    back = Drafter.load(tmp_path / "ours")
    assert back.cfg == d.cfg
    assert all(torch.equal(back.state_dict()[k], v) for k, v in state.items())


def test_deepspec_dflash_checkpoint_has_the_anchor_convention_and_no_heads(target_dir, tmp_path):
    src, _ = deepspec_checkpoint(tmp_path / "dflash", target_dir, rank=0, confidence=False, block_size=7)
    d = load_pair(target_dir, src).drafter
    assert d.cfg.anchor_predicts and not d.cfg.is_dspark and d.markov_head is None and d.confidence_head is None
    assert d.cfg.drafts_per_block(7) == 7
    with pytest.raises(LoopspecError, match="DeepSpec DFlash"):
        require_zlab_block(d.cfg, "quantization")


KIND_CASES = {  # (config changes) → (name, title, block convention, drafts of a block of 8, heads, graph outputs)
    "z-lab dflash": ({}, ("dflash", "z-lab DFlash", "z-lab", 7, (), ())),
    "deepspec dflash": ({"anchor_predicts": True}, ("dflash", "DeepSpec DFlash", "deepspec", 8, (), ())),
    "deepspec dspark": (
        {"anchor_predicts": True, "markov_rank": 4, "confidence_head": True, "confidence_with_markov": True},
        (
            "dspark",
            "DSpark (vanilla Markov head of rank 4, confidence head; DeepSpec's block convention)",
            "deepspec",
            8,
            ("markov_head", "confidence_head"),
            ("confidence",),
        ),
    ),
    "z-lab gated": (
        {"markov_rank": 2, "markov_head_type": "gated"},
        ("dspark", "DSpark (gated Markov head of rank 2; z-lab's block convention)", "z-lab", 7, ("markov_head",), ()),
    ),
    "confidence only": (
        {"anchor_predicts": True, "confidence_head": True},
        (
            "dspark",
            "DSpark (confidence head; DeepSpec's block convention)",
            "deepspec",
            8,
            ("confidence_head",),
            ("confidence",),
        ),
    ),
}
# which serving framework takes which kind (a refusal's words), as the frameworks' sources say
SERVED = {
    "z-lab dflash": {"trtllm": None, "vllm": None, "sglang": None, "llamacpp": None},
    "deepspec dflash": {
        "trtllm": None,
        "vllm": "always builds a Markov head",
        "sglang": "requires a Markov head",
        "llamacpp": "only with a Markov head",
    },
    "deepspec dspark": {"trtllm": None, "vllm": None, "sglang": None, "llamacpp": None},
    "z-lab gated": {
        "trtllm": "one position off",
        "vllm": "one position off",
        "sglang": "one position off",
        "llamacpp": "vanilla Markov head only",
    },
    "confidence only": {
        "trtllm": None,
        "vllm": "always builds a Markov head",
        "sglang": "requires a Markov head",
        "llamacpp": "only beside a Markov head",
    },
}


@pytest.mark.parametrize("case", KIND_CASES)
def test_a_drafters_kind_states_what_other_layers_ask(case, target):
    from loopspec.convert.bundles import FRAMEWORKS
    from loopspec.model.drafter_kinds import DRAFTER_KINDS

    changes, (name, title, convention, drafts, heads, outputs) = KIND_CASES[case]
    cfg = replace(DrafterConfig.for_target(target.cfg, block_size=8, mask_token_id=MASK), **changes)
    kind = cfg.kind
    assert (kind.name, kind.title, kind.convention.name, kind.drafts_per_block(8)) == (name, title, convention, drafts)
    assert kind.family == DRAFTER_KINDS[name].family and cfg.drafts_per_block(8) == drafts
    assert cfg.first_draft == kind.convention.first_draft == 8 - drafts
    assert kind.heads == heads and kind.unrolled_draft_head == bool(heads)
    assert {n for n, _ in Drafter(cfg).named_children()} >= set(heads)  # the heads are the modules it carries
    assert kind.added_graph_outputs == outputs and kind.estimates_acceptance == bool(outputs)
    assert kind.trains_loop_aware == ("markov_head" not in heads)
    assert kind.plain == (case == "z-lab dflash")
    for framework, words in SERVED[case].items():
        why = FRAMEWORKS[framework].refuses(kind)
        assert (why is None) if words is None else (words in why), (framework, why)


def bad_checkpoints(root, target_dir):
    """name → (directory, what its one error line must say)."""
    cases = {
        "hidden size": (deepspec_checkpoint(root / "wide", target_dir, hidden_size=96)[0], "hidden size 96"),
        "vocab": (deepspec_checkpoint(root / "vocab", target_dir, vocab_size=200)[0], "vocab size 200"),
        "tap out of range": (
            deepspec_checkpoint(root / "taps", target_dir, target_layer_ids=[-1, 3])[0],
            "tap ids [-1] out of range",
        ),
        "unknown head": (
            deepspec_checkpoint(root / "head", target_dir, markov_head_type="lstm")[0],
            "unknown markov_head_type 'lstm'",
        ),
        "bad rank": (deepspec_checkpoint(root / "rank", target_dir, markov_rank=-2)[0], "markov_rank"),
        "head weights missing": (
            deepspec_checkpoint(root / "missing", target_dir, kind="vanilla", markov_head_type="gated")[0],
            "markov_head.gate_proj",
        ),
        "rank mismatch": (
            deepspec_checkpoint(root / "rank16", target_dir, markov_rank=16)[0],
            "markov_head.markov_w1.weight",
        ),
    }
    return cases


def test_bad_deepspec_checkpoints_give_one_clear_line(target_dir, tmp_path, capsys):
    for name, (directory, words) in bad_checkpoints(tmp_path, target_dir).items():
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
        err = capsys.readouterr().err
        lines = [line for line in err.strip().splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and words in lines[0], (name, err)


def test_cli_generates_with_a_deepspec_drafter_what_ar_does(target_dir, tmp_path, capsys, monkeypatch):
    src, _ = deepspec_checkpoint(tmp_path / "dspark", target_dir, kind="rnn")
    base = [
        "generate",
        "--prompt",
        "hello world",
        "--target",
        str(target_dir),
        "--drafter",
        str(src),
        "--backend",
        "torch",
        "--max-new-tokens",
        "16",
    ]
    texts = {}
    for extra in (["--method", "ar"], ["--method", "dflash"], ["--method", "dloop", "--tree-budget", "8"]):
        assert main(base + extra) == 0
        out = capsys.readouterr()
        texts[extra[1]] = out.out
        assert "tau" in out.err
    assert len(set(texts.values())) == 1 and texts["ar"].strip()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the first-use ONNX export goes there
    assert main(base + ["--method", "dflash", "--backend", "onnxruntime"]) == 0  # the heads run in the ONNX graph
    assert capsys.readouterr().out == texts["ar"]


# --------------------------------------------------------------------------------------------------
# drafting and greedy identity


def test_engine_stage_drafts_every_block_position_and_exposes_confidence(target):
    drafter = dspark_drafter(target, head_type="rnn")
    engine = TorchEngine(target, drafter, max_context=100, max_rows=2)
    prompts = [[5, 9, 13, 40, 3, 77], [8, 8, 30]]
    for b, p in enumerate(prompts):
        engine.prefill(b, p, want_taps=True)
    settings = DecodingSettings("dflash", block_size=BLOCK)
    out = draft_round(engine, settings, [11, 12], [len(p) for p in prompts], [BLOCK, BLOCK])
    stage = engine.draft([0, 1], [11, 12], [len(p) for p in prompts], BLOCK)
    drafts, logprobs, hidden = stage
    assert drafts.shape[:2] == (2, BLOCK) and hidden.shape[:2] == (2, BLOCK)  # anchor + 4 masks → 5 drafts
    with torch.inference_mode():  # the engine's hidden states are inference tensors
        want, _, conf = draft_stage(drafter, hidden, torch.tensor([11, 12]), engine.context.draft_head, None)
    assert torch.equal(drafts, want) and torch.equal(stage.confidence, conf)
    for b in range(2):
        assert out[b].candidates.shape[0] == BLOCK and torch.equal(out[b].candidates, drafts[b])
        assert torch.equal(out[b].confidence, conf[b]) and ((conf[b] > 0) & (conf[b] < 1)).all()


def repeating_prompt(seed: int) -> list[int]:
    line = torch.randint(3, 120, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    return line + [5] + line + [6] + line[:3]


SETTINGS = {
    "dflash chain": DecodingSettings("dflash", block_size=BLOCK),
    "dflash tree": DecodingSettings("dflash", block_size=BLOCK, tree_budget=12),
    "dloop chain": DecodingSettings("dloop", block_size=BLOCK, max_stages=3, gate_threshold=-1e9),
    "dloop tree+suffix": DecodingSettings(
        "dloop", block_size=BLOCK, max_stages=3, gate_threshold=-1e9, tree_budget=20, suffix=True
    ),
}


REPEATING_PROMPTS = [repeating_prompt(s) for s in range(3)]


@pytest.fixture(scope="module")
def agreeing_dspark(target):
    """(head type, anchor_predicts) → a DSpark drafter trained to draft the target's continuations of
    REPEATING_PROMPTS (trained once per kind, when first asked)."""
    trained = {}

    def drafter(kind: str, anchor_predicts: bool) -> Drafter:
        if (kind, anchor_predicts) not in trained:
            cfg = dspark_config(target.cfg, head_type=kind, anchor_predicts=anchor_predicts)
            trained[kind, anchor_predicts] = agreeing_drafter(target, REPEATING_PROMPTS, cfg)
        return trained[kind, anchor_predicts]

    return drafter


@pytest.mark.parametrize("kind,anchor_predicts", [("vanilla", True), ("gated", True), ("rnn", True), ("rnn", False)])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_dspark_decoding_equals_ar(kind, anchor_predicts, name, target, agreeing_dspark):
    drafter = agreeing_dspark(kind, anchor_predicts)
    engine = TorchEngine(target, drafter, max_context=200)
    settings, ps = SETTINGS[name], REPEATING_PROMPTS
    refs = [generate(engine, p, max_new_tokens=30).tokens for p in ps]
    outs = [generate(engine, p, settings, max_new_tokens=30) for p in ps]
    assert [o.tokens for o in outs] == refs
    assert accepted_drafts(outs) >= 30, accepted_drafts(outs)  # of 90 tokens (measured 68 to 76)
    drafted = max(n for o in outs for n in o.stats.nodes_per_round)
    per_stage = BLOCK - 1 + anchor_predicts  # drafts a stage makes: k in DeepSpec's convention, k-1 in z-lab's
    if settings.tree_budget:  # the trees branched: a round verified more nodes than its stages' chain
        assert any(
            nodes > stages * per_stage
            for o in outs
            for nodes, stages in zip(o.stats.nodes_per_round, o.stats.stages_per_round)
        )
    else:  # a chain verifies every draft the stages made: k a stage in DeepSpec's convention, k-1 in z-lab's
        assert drafted == settings.drafts_with(drafter.cfg) == settings.max_stages * (BLOCK - 1 + anchor_predicts)
    done = decode_all(
        Decoder(engine.with_rows(3), settings), [dict(key=i, prompt_ids=p, max_new_tokens=30) for i, p in enumerate(ps)]
    )
    assert [done[i].tokens for i in range(3)] == refs  # batched rows too


def test_static_runner_drafts_what_the_eager_engine_drafts(target):
    """The CUDA graphs' static drafter block (run on the CPU without the capture) runs the same heads:
    greedy decoding through it equals ar, batched, and its stages went through the static block."""
    from test_cuda_graphs import StaticEngine

    drafter = dspark_drafter(target, head_type="rnn")
    eager = TorchEngine(target, drafter, max_context=160)
    static = StaticEngine(target, drafter, max_context=160)
    ps = [repeating_prompt(s) for s in range(3)]
    refs = [generate(eager, p, max_new_tokens=24).tokens for p in ps]
    for settings in (SETTINGS["dflash tree"], SETTINGS["dloop chain"]):
        batch = static.with_rows(3)  # its own caches and runner
        done = decode_all(
            Decoder(batch, settings), [dict(key=i, prompt_ids=p, max_new_tokens=24) for i, p in enumerate(ps)]
        )
        assert [done[i].tokens for i in range(3)] == refs
        assert any(key[0] == "block" for key in batch.graphs.keys)
    engines = (eager.with_rows(2), static.with_rows(2))
    for b, p in enumerate(ps[:2]):  # one stage: the same drafts, log-probs and confidence as the eager engine
        for engine in engines:
            engine.prefill(b, p, want_taps=True)
    (ed, ep, _), (sd, sp, _) = stages = [e.draft([0, 1], [7, 8], [len(p) for p in ps[:2]], BLOCK) for e in engines]
    assert torch.equal(ed, sd) and torch.allclose(ep, sp, atol=1e-5)
    assert torch.allclose(stages[0].confidence, stages[1].confidence, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# DLoop over DSpark: the confidence head as the gate


def test_gate_scores_against_hand_computed_values():
    from loopspec.runtime.proposal import gate_score

    logprobs = torch.tensor([[-0.1, -3.0], [-0.4, -2.0], [-0.25, -5.0]])  # [D, C]
    confidence = torch.tensor([0.9, 0.5, 0.8])
    assert gate_score("logprob", logprobs, confidence) == pytest.approx(-0.75)
    assert gate_score("confidence", logprobs, confidence) == pytest.approx(float(torch.log(torch.tensor(0.36))))


@pytest.mark.parametrize("anchor_predicts", [True, False], ids=["deepspec", "zlab"])
def test_confidence_gate_adds_a_stage_exactly_when_the_estimates_say_so(anchor_predicts, target):
    """Each stage of a round is followed by another iff the summed log of its confidence estimates is >=
    the threshold (an oracle from the estimates the round returns), the threshold sits where both
    happen, and greedy decoding under that gate equals ar, batched and alone."""
    drafter = dspark_drafter(target, head_type="gated", anchor_predicts=anchor_predicts)
    engine = TorchEngine(target, drafter, max_context=300)
    ps = [repeating_prompt(s) for s in range(4)]
    probe = DecodingSettings("dloop", block_size=BLOCK, max_stages=4, gate_threshold=-1e9, gate="confidence")
    scores = []
    for p in ps:  # the first stage's scores at each prompt's end place a threshold between them
        engine.prefill(0, p[:-1], want_taps=True)
        (drafted,) = draft_round(engine, replace(probe, max_stages=1), [p[-1]], [len(p) - 1], [100])
        scores.append(float(torch.log(drafted.confidence).sum()))
    threshold = sorted(scores)[len(scores) // 2]
    settings = replace(probe, gate_threshold=threshold)
    opened = closed = 0
    for p in ps:
        engine.prefill(0, p[:-1], want_taps=True)
        (drafted,) = draft_round(engine, settings, [p[-1]], [len(p) - 1], [100])
        ends = torch.tensor(drafted.stage_sizes).cumsum(0).tolist()
        for s, end in enumerate(ends):
            start = end - drafted.stage_sizes[s]
            wants_more = float(torch.log(drafted.confidence[start:end]).sum()) >= threshold
            if s + 1 < len(ends):
                assert wants_more
                opened += 1
            elif s + 1 < settings.max_stages:
                assert not wants_more
                closed += 1
    assert opened and closed  # both sides of the gate were exercised
    refs = [generate(engine, p, max_new_tokens=30).tokens for p in ps]
    assert [generate(engine, p, settings, max_new_tokens=30).tokens for p in ps] == refs
    done = decode_all(
        Decoder(engine.with_rows(4), settings), [dict(key=i, prompt_ids=p, max_new_tokens=30) for i, p in enumerate(ps)]
    )
    assert [done[i].tokens for i in range(4)] == refs


def test_confidence_gate_is_refused_where_it_cannot_apply(target, target_dir, tmp_path, capsys):
    plain = dspark_drafter(target, confidence=False)
    with pytest.raises(LoopspecError, match="needs a drafter with a confidence head"):
        Decoder(TorchEngine(target, plain, max_context=64), DecodingSettings("dloop", BLOCK, 2, gate="confidence"))
    with pytest.raises(LoopspecError, match="needs dloop"):
        DecodingSettings("dflash", BLOCK, gate="confidence")
    with pytest.raises(LoopspecError, match="unknown gate"):
        DecodingSettings("dloop", BLOCK, 2, gate="entropy")
    drafter_dir, _ = deepspec_checkpoint(tmp_path / "no-confidence", target_dir, confidence=False)
    for bad, says in (
        (["--gate", "entropy", "--method", "dloop"], "unknown gate 'entropy'"),
        (["--gate", "confidence", "--method", "dflash"], "needs dloop"),
        (["--gate", "confidence", "--method", "dloop"], "needs a drafter with a confidence head"),
    ):
        assert (
            main(
                [
                    "generate",
                    "--target",
                    str(target_dir),
                    "--drafter",
                    str(drafter_dir),
                    "--backend",
                    "torch",
                    "--prompt",
                    "hi",
                    "--max-new-tokens",
                    "4",
                ]
                + bad
            )
            == 2
        )
        err = capsys.readouterr().err.strip()
        assert err.startswith("loopspec: error:") and says in err and "\n" not in err, err
