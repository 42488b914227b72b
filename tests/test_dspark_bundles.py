"""DSpark drafters in serving bundles: the vLLM bundle in DeepSpec's `Qwen3DSparkModel` layout read back
through loopspec's own loader and drafting what the original in-memory drafter drafts; the llama.cpp
dflash GGUF with the Markov / confidence heads read back with gguf's own reader against the source
weights in the layout llama.cpp's loader declares (src/models/dflash.cpp: markov_w1 {r, n_vocab},
markov_w2 {r, n_vocab_draft}, conf_proj {n_embd + r, 1}); what neither engine runs refused in one line
through the CLI; and (with a llama-server on PATH) a DSpark GGUF really drafting in llama-server."""

import json
import os
import shlex
from dataclasses import replace

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="needs gguf: pip install gguf (a core dependency)")

from conftest import lively  # noqa: E402
from test_dspark import BLOCK, MASK, RANK, dspark_config, liven_heads  # noqa: E402
from test_llamacpp import NO_SERVER, write_tiny_target_gguf  # noqa: E402

from loopspec.cli import main  # noqa: E402
from loopspec.convert.bundles import build_bundle  # noqa: E402
from loopspec.engines.llamacpp import write_dflash_gguf  # noqa: E402
from loopspec.errors import LoopspecError  # noqa: E402
from loopspec.model.dflash import Drafter  # noqa: E402
from loopspec.pair import load_pair  # noqa: E402
from loopspec.engines.torch_engine import TorchEngine  # noqa: E402
from loopspec.weights import load_target_dir, read_safetensors  # noqa: E402

# DeepSpec's key names (its Qwen3DSparkModel parameters, without the embed_tokens / lm_head copies)
BACKBONE_KEYS = ["fc.weight", "hidden_norm.weight", "norm.weight"] + [
    f"layers.{i}.{name}.weight"
    for i in range(2)
    for name in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    )
]
MARKOV_KEYS = ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight"]
CONFIDENCE_KEYS = ["confidence_head.proj.weight", "confidence_head.proj.bias"]


@pytest.fixture(scope="module")
def target(target_dir):
    return lively(load_target_dir(target_dir))


@pytest.fixture(scope="module")
def gguf_target(tmp_path_factory):
    """A tiny GGUF target of the same shape (hidden 64, 128 tokens, 6 layers)."""
    return write_tiny_target_gguf(tmp_path_factory.mktemp("dspark-gguf") / "tiny.gguf")


def original(target, seed=0, draft_vocab=None, **kw) -> Drafter:
    """The in-memory drafter every check compares against (norms random too, heads live)."""
    torch.manual_seed(seed)
    model = liven_heads(Drafter(dspark_config(target.cfg, **kw)), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    if draft_vocab:
        model.draft_ids = torch.randperm(128, generator=torch.Generator().manual_seed(seed + 1))[:draft_vocab]
    return model.eval()


def saved(model: Drafter, directory) -> str:
    model.save(directory, dtype=torch.float32)
    return str(directory)


def launch_argv(path) -> list[str]:
    text = path.read_text().replace("\\\n", " ")
    return shlex.split(next(line for line in text.splitlines() if line.startswith("exec ")))[1:]


def one_stage(target, drafter, prompts, anchors):
    """A stage's drafts and confidence for each prompt, through the torch engine."""
    engine = TorchEngine(target, drafter, max_context=64, max_rows=len(prompts))
    for b, p in enumerate(prompts):
        engine.prefill(b, p, want_taps=True)
    stage = engine.draft(list(range(len(prompts))), anchors, [len(p) for p in prompts], drafter.cfg.block_size)
    return stage[0], stage.confidence


def cli_error(argv, capsys) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("loopspec: error: "), err
    return lines[0]


# --------------------------------------------------------------------------------------------------
# vLLM: DeepSpec's layout


@pytest.mark.parametrize("confidence,with_markov", [(True, True), (True, False), (False, False)])
def test_vllm_bundle_is_deepspec_layout_and_drafts_as_the_original(
    confidence, with_markov, target_dir, target, tmp_path
):
    model = original(target, confidence=confidence, with_markov=with_markov)
    out = tmp_path / "bundle"
    manifest = build_bundle(str(target_dir), saved(model, tmp_path / "src"), out, "all", dtype="float32")
    assert manifest["engines"] == ["trtllm", "vllm", "sglang"]  # 'all': every HF engine runs these heads
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert {
        k: cfg[k]
        for k in (
            "block_size",
            "mask_token_id",
            "target_layer_ids",
            "markov_rank",
            "markov_head_type",
            "enable_confidence_head",
            "tie_word_embeddings",
        )
    } == {
        "block_size": BLOCK,
        "mask_token_id": MASK,
        "target_layer_ids": model.cfg.target_layer_ids,
        "markov_rank": RANK,
        "markov_head_type": "vanilla",
        "enable_confidence_head": confidence,
        "tie_word_embeddings": False,
    }
    assert cfg.get("confidence_head_with_markov") == (with_markov if confidence else None)
    weights = read_safetensors(out / "drafter" / "model.safetensors")
    assert sorted(weights) == sorted(BACKBONE_KEYS + MARKOV_KEYS + (CONFIDENCE_KEYS if confidence else []))
    source = model.state_dict()
    for name in (
        MARKOV_KEYS + (CONFIDENCE_KEYS if confidence else []) + ["fc.weight", "layers.1.self_attn.q_proj.weight"]
    ):
        assert torch.equal(weights[name], source[name]), name

    spec = launch_argv(out / "vllm" / "launch.sh")
    spec = json.loads(spec[spec.index("--speculative-config") + 1])
    adaptive = {"enable_adaptive_verification": True} if confidence else {}  # sized by the confidence head
    assert spec == {"method": "dspark", "model": "./drafter", "num_speculative_tokens": BLOCK, **adaptive}  # k drafts
    assert manifest["vllm"] == {"method": "dspark", "num_speculative_tokens": BLOCK, **adaptive}
    assert (manifest["block_convention"], manifest["drafts_per_block"]) == ("deepspec", BLOCK)
    readme = (out / "README.md").read_text()
    assert "Block convention: DeepSpec's" in readme and "anchor+i+1" in readme
    # confidence-scheduled verification: never written (its tables are the engines' own measurements, TensorRT-LLM's
    # sealed with a fingerprint of the live engine); with a confidence head the README names the fields and why
    trtllm = (out / "trtllm" / "extra_llm_api_options.yaml").read_text()
    assert "confidence" not in trtllm and "ragged" not in trtllm
    assert not any("dspark-sps" in a or "confidence-sts" in a for a in launch_argv(out / "sglang" / "launch.sh"))
    named = (
        "`confidence_sps_table_path`",
        "`confidence_sps_live_fingerprint_path`",
        "`schema_version: 2`",
        "`engine_fingerprint`",
        "`confidence_admission_receipt_path`",
        "`--speculative-dspark-sps-table-path`",
        "`--speculative-dspark-confidence-sts-path`",
        "times loopspec's engine",
    )
    assert all((words in readme) == confidence for words in named), [w for w in named if (w in readme) != confidence]

    back = load_pair(out / "target", out / "drafter").drafter  # loopspec's own loader, through the bundle's target
    assert back.cfg == model.cfg
    assert all(torch.equal(back.state_dict()[k], v) for k, v in source.items())
    prompts, anchors = [[5, 9, 13, 40, 3, 77], [8, 8, 30, 2]], [11, 12]
    with torch.inference_mode():
        (want, want_conf), (got, got_conf) = (
            one_stage(target, model, prompts, anchors),
            one_stage(target, back, prompts, anchors),
        )
    assert got.shape[1] == BLOCK and torch.equal(got, want)
    assert (got_conf is None) == (not confidence) and (got_conf is None or torch.equal(got_conf, want_conf))


def test_vllm_reduced_vocabulary_carries_the_markov_rows(target_dir, target, tmp_path):
    model = original(target, draft_vocab=40)
    out = tmp_path / "bundle"
    manifest = build_bundle(str(target_dir), saved(model, tmp_path / "src"), out, "vllm", dtype="float32")
    assert manifest["draft_vocab"] == {"vllm": 40}
    reduced = out / "vllm" / "drafter"
    assert json.loads((reduced / "config.json").read_text())["draft_vocab_size"] == 40
    ids = model.draft_ids
    w = read_safetensors(reduced / "model.safetensors")
    assert torch.equal(
        w["markov_head.markov_w2.weight"], model.markov_head.markov_w2.weight[ids]
    )  # bias over the draft rows
    assert torch.equal(w["markov_head.markov_w1.weight"], model.markov_head.markov_w1.weight)  # indexed by target ids
    assert torch.equal(read_safetensors(reduced / "d2t.safetensors")["d2t"], ids - torch.arange(40))
    full = read_safetensors(out / "drafter" / "model.safetensors")  # drafter/ stays full-vocabulary
    assert torch.equal(full["markov_head.markov_w2.weight"], model.markov_head.markov_w2.weight)


def test_engines_that_cannot_run_a_drafter_are_refused_in_one_line(target_dir, target, gguf_target, tmp_path, capsys):
    saved(original(target), tmp_path / "deepspec")
    zlab = saved(original(target, anchor_predicts=False), tmp_path / "zlab")
    gated = saved(original(target, head_type="gated"), tmp_path / "gated")
    rnn = saved(original(target, head_type="rnn"), tmp_path / "rnn")
    plain_conf = saved(original(target, with_markov=False), tmp_path / "plain-conf")
    deepspec_dflash = saved(original(target, rank=0, confidence=False), tmp_path / "deepspec-dflash")
    hf, gg = str(target_dir), str(gguf_target["path"])
    cases = [  # (engine, target, drafter, words in the one line)
        ("vllm", hf, zlab, "one position off"),
        ("vllm", hf, gated, "vanilla one only"),
        ("vllm", hf, deepspec_dflash, "always builds a Markov head"),
        ("trtllm", hf, zlab, "one position off"),
        ("trtllm", hf, gated, "vanilla Markov head only"),
        ("sglang", hf, zlab, "one position off"),
        ("sglang", hf, deepspec_dflash, "requires a Markov head"),
        ("llamacpp", gg, rnn, "vanilla Markov head only"),
        ("llamacpp", gg, plain_conf, "[h ; W1[prev]]"),
        ("llamacpp", gg, deepspec_dflash, "only with a Markov head"),
        ("all", hf, zlab, "engines that can: llama.cpp"),  # none of the HF target's engines runs it
    ]
    for engine, tgt, drafter, words in cases:
        out = tmp_path / f"out-{engine}"
        line = cli_error(
            ["convert", "bundle", "--framework", engine, "--target", tgt, "--drafter", drafter, "--out", str(out)],
            capsys,
        )
        assert words in line, (engine, drafter, line)
        assert not out.exists()
    line = cli_error(
        ["convert", "bundle", "--framework", "vllm", "--target", hf, "--drafter", zlab, "--out", str(tmp_path / "x")],
        capsys,
    )
    assert "engines that can: llama.cpp" in line  # the refusal names where it can go
    with pytest.raises(LoopspecError, match="vanilla Markov head only"):
        write_dflash_gguf(Drafter.load(gated), gguf_target["path"], tmp_path / "gated.gguf")
    assert not (tmp_path / "gated.gguf").exists()


# --------------------------------------------------------------------------------------------------
# llama.cpp: the dflash GGUF with the heads


def gguf_tensors(path) -> dict:
    """{name: (ggml ne as stored, type name, values in PyTorch [out, in] layout)}."""
    reader = gguf.GGUFReader(str(path))
    return {
        t.name: (t.shape.tolist(), t.tensor_type.name, np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist()))))
        for t in reader.tensors
    }


def gguf_keys(path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


@pytest.mark.parametrize("anchor_predicts", [True, False])
def test_gguf_carries_the_heads_in_llamacpps_layout(anchor_predicts, target, gguf_target, tmp_path):
    model = original(target, anchor_predicts=anchor_predicts)
    path = write_dflash_gguf(model, gguf_target["path"], tmp_path / "dspark.gguf")
    keys = gguf_keys(path)
    assert keys["general.architecture"] == "dflash"  # the pinned llama.cpp's DSpark is dflash + the Markov tensors
    assert keys["dflash.sample_from_anchor"] is anchor_predicts and keys["dflash.has_confidence_head"] is True
    assert keys["dflash.block_size"] == BLOCK and keys["dflash.target_layers"] == [
        i + 1 for i in model.cfg.target_layer_ids
    ]
    assert keys["tokenizer.ggml.mask_token_id"] == MASK and keys["general.name"] == "tiny DSpark drafter"
    t = gguf_tensors(path)
    H, V = model.cfg.hidden_size, model.cfg.vocab_size
    expected = {
        "markov_w1.weight": ([RANK, V], model.markov_head.markov_w1.weight),  # ggml {r, n_vocab}
        "markov_w2.weight": ([RANK, V], model.markov_head.markov_w2.weight),
        "conf_proj.weight": ([H + RANK, 1], model.confidence_head.proj.weight),  # ggml {n_embd + r, 1}
        "conf_proj.bias": ([1], model.confidence_head.proj.bias),
    }
    for name, (ne, weight) in expected.items():
        shape, kind, values = t[name]
        assert shape == ne and kind == "F32", name
        assert np.array_equal(values, weight.detach().numpy()), name
    assert "token_embd.weight" not in t and "output.weight" not in t  # the target's are shared


def test_gguf_reduced_vocabulary_markov_rows_and_f16(target, gguf_target, tmp_path):
    model = original(target, draft_vocab=32, confidence=False)
    path = write_dflash_gguf(model, gguf_target["path"], tmp_path / "d.gguf", dtype="f16")
    t, keys = gguf_tensors(path), gguf_keys(path)
    ids = model.draft_ids.numpy()
    shape, kind, values = t["markov_w2.weight"]
    assert shape == [RANK, 32] and kind == "F16"  # {r, n_vocab_draft}
    assert np.array_equal(values, model.markov_head.markov_w2.weight.detach().numpy()[ids].astype(np.float16))
    assert t["markov_w1.weight"][0] == [RANK, 128] and np.array_equal(t["d2t"][2], ids)
    assert keys["dflash.has_confidence_head"] is False and "conf_proj.weight" not in t


@pytest.mark.parametrize("anchor_predicts,draft_max", [(True, BLOCK), (False, BLOCK - 1)])
def test_llamacpp_bundle_runs_draft_dspark(anchor_predicts, draft_max, target, gguf_target, tmp_path):
    model = original(target, anchor_predicts=anchor_predicts)
    out = tmp_path / "bundle"
    manifest = build_bundle(str(gguf_target["path"]), saved(model, tmp_path / "src"), out, "llamacpp")
    assert manifest["engines"] == ["llamacpp"] and manifest["drafts_per_block"] == draft_max
    argv = launch_argv(out / "llamacpp" / "launch.sh")
    assert argv[argv.index("--spec-type") + 1] == "draft-dspark"
    assert argv[argv.index("--spec-draft-n-max") + 1] == str(draft_max)
    assert manifest["llamacpp"]["spec_type"] == "draft-dspark" and manifest["llamacpp"]["draft_max"] == draft_max
    t = gguf_tensors(out / "llamacpp" / "drafter.gguf")
    assert np.array_equal(t["markov_w1.weight"][2], model.markov_head.markov_w1.weight.detach().numpy())
    readme = (out / "README.md").read_text()
    assert f"--spec-type draft-dspark --spec-draft-n-max {draft_max}" in readme and "markov_w1" in readme


# --------------------------------------------------------------------------------------------------
# end to end: a DSpark GGUF drafting in llama-server on the default target


@pytest.mark.e2e
def test_dspark_gguf_drafts_in_llama_server(tmp_path):
    """A random DSpark drafter for the default target: its drafts are mostly rejected, so what is asserted
    is that llama-server loads the file as draft-dspark, drafts with it, and completes the request."""
    from loopspec.engines.llamacpp import find_llama_server, spec_type

    binary = find_llama_server()
    if binary is None:
        pytest.skip(reason=NO_SERVER)
    from loopspec.model.families import target_config
    from loopspec.runtime.bench.peers import LlamaServerPeer
    from loopspec.weights import load_tokenizer, resolve_target_dir, target_gguf_path

    target_dir = resolve_target_dir("default")
    tcfg = target_config(json.loads((target_dir / "config.json").read_text()))
    model = original_for(tcfg)
    drafter_gguf = write_dflash_gguf(model, target_gguf_path("default"), tmp_path / "dspark.gguf")
    peer = LlamaServerPeer(
        binary,
        target_gguf_path("default"),
        drafter_gguf,
        BLOCK,
        min(2, os.cpu_count() or 1),
        context=2048,
        spec=spec_type(model.cfg),
    )
    try:
        ids = load_tokenizer(target_dir).apply_chat_template(
            [{"role": "user", "content": "Count to ten."}], add_generation_prompt=True
        )
        ids = [int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)]
        run = peer.run(ids, "llamacpp-dflash", 16)
        assert len(run.tokens) == 16 and run.drafted > 0, run
    finally:
        peer.close()


def original_for(target_cfg) -> Drafter:
    """A random DeepSpec-convention DSpark drafter (vanilla head, confidence head) for `target_cfg`."""
    from loopspec.model.dflash import DrafterConfig

    cfg = DrafterConfig.for_target(target_cfg, num_layers=1, block_size=BLOCK, mask_token_id=target_cfg.vocab_size - 1)
    torch.manual_seed(0)
    return Drafter(
        replace(cfg, anchor_predicts=True, markov_rank=RANK, confidence_head=True, confidence_with_markov=True)
    ).eval()
