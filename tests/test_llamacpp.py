"""llama.cpp: the drafter as a `dflash` GGUF (keys, tensors and values read back with gguf's own reader),
the llamacpp serving bundle, the llama-server command line, and (with a llama-server on PATH) the
shipped drafter really drafting in llama-server on the default target."""

import json
import os
import shlex
import subprocess
from dataclasses import replace

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="needs gguf: pip install gguf (a core dependency)")

from loopspec.convert.bundles import build_bundle  # noqa: E402
from loopspec.engines.llamacpp import (  # noqa: E402
    find_llama_server,
    llama_server_command,
    read_dflash_gguf,
    write_dflash_gguf,
)
from loopspec.errors import LoopspecError  # noqa: E402
from loopspec.model.dflash import Drafter, DrafterConfig  # noqa: E402
from loopspec.weights import file_sha256  # noqa: E402

Q = gguf.GGMLQuantizationType
HIDDEN, VOCAB, TARGET_LAYERS, CONTEXT = 64, 128, 6, 512
NO_SERVER = "no llama-server on PATH (scripts/build_llama_server.sh builds one)"


def tiny_drafter(draft_vocab: int | None = 32, **changes) -> Drafter:
    """A random 2-layer drafter for the tiny target, norms random too so every tensor is told apart."""
    cfg = DrafterConfig(
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        num_target_layers=TARGET_LAYERS,
        target_layer_ids=[1, 3, 4],
        mask_token_id=127,
        block_size=6,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=CONTEXT,
    )
    torch.manual_seed(0)
    model = Drafter(replace(cfg, **changes))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    if draft_vocab is not None:
        model.draft_ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:draft_vocab]
    return model


def write_tiny_target_gguf(path, tied: bool = True) -> dict:
    """A tiny llama GGUF target: metadata, a gpt2-style tokenizer, a Q8_0 token embedding (and an F32
    output head when untied). Returns its lm_head expanded as gguf dequantizes it."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.embedding_length", HIDDEN)
    writer.add_uint32("llama.block_count", TARGET_LAYERS)
    writer.add_uint32("llama.context_length", CONTEXT)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(VOCAB)])
    writer.add_array("tokenizer.ggml.token_type", [1] * VOCAB)
    writer.add_array("tokenizer.ggml.merges", ["t 1", "t 2"])
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_string("tokenizer.chat_template", "{{ messages }}")
    embed = gguf.quants.quantize(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), Q.Q8_0)
    writer.add_tensor("token_embd.weight", embed, raw_dtype=Q.Q8_0)
    head = gguf.quants.dequantize(embed, Q.Q8_0).reshape(VOCAB, HIDDEN)
    if not tied:
        head = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
        writer.add_tensor("output.weight", head)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"path": path, "lm_head": head}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_target_gguf(tmp_path_factory.mktemp("target") / "tiny.Q8_0.gguf")


def tensors_of(path) -> dict[str, tuple[str, np.ndarray]]:
    """{name: (type name, values in PyTorch [out, in] layout)} as gguf's reader gives them."""
    reader = gguf.GGUFReader(str(path))
    return {
        t.name: (t.tensor_type.name, np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist()))))
        for t in reader.tensors
    }


def expected_tensors(model: Drafter) -> dict[str, np.ndarray]:
    """The drafter's weights by llama.cpp dflash name, written out by hand from the z-lab names."""
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    state = {k: v.float().numpy() for k, v in model.zlab_state_dict().items()}
    out = {
        "fc.weight": state["fc.weight"],
        "enc.output_norm.weight": state["hidden_norm.weight"],
        "output_norm.weight": state["norm.weight"],
    }
    for i in range(model.cfg.num_layers):
        for hf, ours in names.items():
            out[f"blk.{i}.{ours}.weight"] = state[f"layers.{i}.{hf}.weight"]
    return out


def tokenizer_keys(path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


# --------------------------------------------------------------------------------------------------
# the GGUF file


def test_keys_tensors_and_values_read_back(target, tmp_path):
    model = tiny_drafter()
    path = write_dflash_gguf(model, target["path"], tmp_path / "drafter.gguf")
    assert path == tmp_path / "drafter.gguf" and sorted(p.name for p in tmp_path.iterdir()) == ["drafter.gguf"]
    keys = read_dflash_gguf(path)["keys"]
    expected_keys = {
        "general.architecture": "dflash",
        "general.file_type": 0,
        "dflash.block_count": 2,
        "dflash.context_length": CONTEXT,
        "dflash.embedding_length": HIDDEN,
        "dflash.feed_forward_length": 96,
        "dflash.attention.head_count": 4,
        "dflash.attention.head_count_kv": 2,
        "dflash.attention.key_length": 16,
        "dflash.attention.value_length": 16,
        "dflash.rope.freq_base": 10000.0,
        "dflash.block_size": 6,
        "dflash.target_layers": [2, 4, 5],  # HF hidden_states indices: taps + 1
        "tokenizer.ggml.mask_token_id": 127,
    }
    assert {k: keys[k] for k in expected_keys} == expected_keys
    assert keys["dflash.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert keys["general.name"] == "tiny.Q8_0 DFlash drafter"
    # the target's tokenizer, key for key, plus the drafter's mask token
    assert {k: v for k, v in keys.items() if k.startswith("tokenizer.")} == {
        **tokenizer_keys(target["path"]),
        "tokenizer.ggml.mask_token_id": 127,
    }

    tensors = tensors_of(path)
    weights = expected_tensors(model)
    assert set(tensors) == set(weights) | {"output.weight", "d2t"}  # no token_embd: the target's is shared
    for name, w in weights.items():
        kind, values = tensors[name]
        assert kind == "F32" and values.shape == w.shape, name
        assert np.array_equal(values, w), name
    ids = model.draft_ids.numpy()
    kind, d2t = tensors["d2t"]
    assert kind == "I64" and np.array_equal(d2t, ids)  # absolute target ids, not z-lab offsets
    kind, head = tensors["output.weight"]
    assert kind == "F32" and np.array_equal(head, target["lm_head"][ids])  # the draft's own head of Vd rows
    assert read_dflash_gguf(path)["tensors"]["output.weight"] == ((32, HIDDEN), "F32")


def test_untied_target_gives_its_output_rows(tmp_path):
    untied = write_tiny_target_gguf(tmp_path / "untied.gguf", tied=False)
    model = tiny_drafter()
    path = write_dflash_gguf(model, untied["path"], tmp_path / "drafter.gguf")
    assert np.array_equal(tensors_of(path)["output.weight"][1], untied["lm_head"][model.draft_ids.numpy()])


def test_full_vocabulary_drafter_shares_the_target_head(target, tmp_path):
    path = write_dflash_gguf(tiny_drafter(draft_vocab=None), target["path"], tmp_path / "full.gguf")
    names = set(tensors_of(path))
    assert "d2t" not in names and "output.weight" not in names and "token_embd.weight" not in names
    assert "fc.weight" in names


def test_f16_keeps_norms_in_f32(target, tmp_path):
    model = tiny_drafter()
    path = write_dflash_gguf(model, target["path"], tmp_path / "drafter.f16.gguf", dtype="f16")
    assert read_dflash_gguf(path)["keys"]["general.file_type"] == 1
    tensors = tensors_of(path)
    for name, w in expected_tensors(model).items():
        kind, values = tensors[name]
        if w.ndim == 1:
            assert kind == "F32" and np.array_equal(values, w), name
        else:
            assert kind == "F16" and np.array_equal(values, w.astype(np.float16)), name
    assert tensors["output.weight"][0] == "F16" and tensors["d2t"][0] == "I64"


@pytest.mark.parametrize(
    "problem, drafter, match",
    [
        ("hidden size", lambda: tiny_drafter(hidden_size=32, intermediate_size=48), "hidden size 32 != target's 64"),
        ("tap out of range", lambda: tiny_drafter(target_layer_ids=[1, 6]), r"tap ids \[6\] out of range"),
        ("target depth", lambda: tiny_drafter(num_target_layers=8), "built for 8 target layers, target has 6"),
        ("no mask token", lambda: tiny_drafter(mask_token_id=None), "no mask token id"),
        ("vocab", lambda: tiny_drafter(draft_vocab=None, vocab_size=256), "vocab size 256 != target's 128"),
    ],
)
def test_a_drafter_that_does_not_fit_is_refused_and_nothing_written(target, tmp_path, problem, drafter, match):
    with pytest.raises(LoopspecError, match=match):
        write_dflash_gguf(drafter(), target["path"], tmp_path / "drafter.gguf")
    assert list(tmp_path.iterdir()) == []


def test_bad_paths_and_dtype(target, tmp_path):
    model = tiny_drafter()
    with pytest.raises(LoopspecError, match="does not exist"):
        write_dflash_gguf(model, target["path"], tmp_path / "missing" / "drafter.gguf")
    with pytest.raises(LoopspecError, match="target GGUF file does not exist"):
        write_dflash_gguf(model, tmp_path / "none.gguf", tmp_path / "drafter.gguf")
    (tmp_path / "garbage.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(LoopspecError, match="cannot read target GGUF"):
        write_dflash_gguf(model, tmp_path / "garbage.gguf", tmp_path / "drafter.gguf")
    with pytest.raises(LoopspecError, match="unknown GGUF dtype 'bf16'"):
        write_dflash_gguf(model, target["path"], tmp_path / "drafter.gguf", dtype="bf16")
    with pytest.raises(LoopspecError, match="not a DFlash drafter GGUF"):
        read_dflash_gguf(target["path"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbage.gguf"]


def test_a_failed_write_leaves_no_file_and_keeps_the_old_one(target, tmp_path, monkeypatch):
    import loopspec.engines.llamacpp as llamacpp

    out = tmp_path / "drafter.gguf"
    out.write_bytes(b"previous")

    def broken(reader, writer):
        raise OSError("disk full")

    monkeypatch.setattr(llamacpp, "_copy_tokenizer", broken)
    with pytest.raises(OSError, match="disk full"):
        write_dflash_gguf(tiny_drafter(), target["path"], out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter.gguf"] and out.read_bytes() == b"previous"


# --------------------------------------------------------------------------------------------------
# llama-server's command line and binary


def test_llama_server_command_plain_and_dflash():
    plain = llama_server_command("/bin/llama-server", "t.gguf", port=9000)
    assert plain == ["/bin/llama-server", "-m", "t.gguf", "--host", "127.0.0.1", "--port", "9000"]
    spec = llama_server_command(
        "llama-server", "t.gguf", drafter_gguf="d.gguf", draft_max=7, threads=2, context=2048, host="0.0.0.0", port=8081
    )
    assert spec == [
        "llama-server",
        "-m",
        "t.gguf",
        "--host",
        "0.0.0.0",
        "--port",
        "8081",
        "-t",
        "2",
        "-c",
        "2048",
        "-md",
        "d.gguf",
        "--spec-type",
        "draft-dflash",
        "--spec-draft-n-max",
        "7",
    ]
    with pytest.raises(LoopspecError, match="draft_max needs a drafter"):
        llama_server_command("llama-server", "t.gguf", draft_max=3)


def test_find_llama_server(tmp_path, monkeypatch):
    with pytest.raises(LoopspecError, match="does not exist or is not executable"):
        find_llama_server(tmp_path / "nope")
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    with pytest.raises(LoopspecError, match="not executable"):
        find_llama_server(binary)
    binary.chmod(0o755)
    assert find_llama_server(binary) == binary
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_llama_server() is None
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_llama_server() == binary
    assert find_llama_server("llama-server") == binary  # a bare name is looked up on PATH, as a shell would
    with pytest.raises(LoopspecError, match="does not exist or is not executable"):
        find_llama_server("llama-server-nope")


# --------------------------------------------------------------------------------------------------
# the bundle


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("drafter")
    tiny_drafter().save(directory, dtype=torch.float32)
    return directory


def launch_argv(path):
    text = path.read_text().replace("\\\n", " ")
    return shlex.split(next(l for l in text.splitlines() if l.startswith("exec ")))[1:]


def test_llamacpp_bundle(target, drafter_dir, tmp_path):
    out = tmp_path / "bundle"
    manifest = build_bundle(str(target["path"]), str(drafter_dir), out, "llamacpp", threads=3)
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert on_disk == {
        "llamacpp/target.gguf",
        "llamacpp/drafter.gguf",
        "llamacpp/launch.sh",
        "README.md",
        "manifest.json",
    }  # no HF target/ or z-lab drafter/: llama.cpp reads neither
    assert manifest["engines"] == ["llamacpp"] and manifest["precision"] == "gguf"
    assert manifest["draft_vocab"] == {"llamacpp": 32}
    assert manifest["llamacpp"] == {
        "target": "llamacpp/target.gguf",
        "drafter": "llamacpp/drafter.gguf",
        "drafter_dtype": "f32",
        "spec_type": "draft-dflash",
        "draft_max": 5,
    }
    assert manifest["max_context"] == CONTEXT and manifest["served_model_name"] == "tiny.Q8_0"
    assert manifest["sources"]["target_gguf"] == str(target["path"])
    assert set(manifest["files"]) == on_disk - {"manifest.json"}
    assert all(file_sha256(out / rel) == sha for rel, sha in manifest["files"].items())
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert file_sha256(out / "llamacpp" / "target.gguf") == file_sha256(target["path"])

    model = Drafter.load(drafter_dir)
    tensors = tensors_of(out / "llamacpp" / "drafter.gguf")
    assert np.array_equal(tensors["d2t"][1], model.draft_ids.numpy())
    assert np.array_equal(tensors["fc.weight"][1], model.fc.weight.detach().numpy())

    script = out / "llamacpp" / "launch.sh"
    assert script.stat().st_mode & 0o111 and subprocess.run(["sh", "-n", str(script)]).returncode == 0
    argv = launch_argv(script)
    assert argv == [
        "$LLAMA_SERVER",
        "-m",
        "./llamacpp/target.gguf",
        "--host",
        "$HOST",
        "--port",
        "$PORT",
        "-t",
        "$THREADS",
        "-c",
        str(CONTEXT),
        "-md",
        "./llamacpp/drafter.gguf",
        "--spec-type",
        "draft-dflash",
        "--spec-draft-n-max",
        "5",
        "--alias",
        "tiny.Q8_0",
        "$@",
    ]
    readme = (out / "README.md").read_text()
    assert "sh llamacpp/launch.sh" in readme and "--spec-draft-n-max 5" in readme


def test_launch_script_runs_llama_server_from_the_bundle_root(target, drafter_dir, tmp_path):
    """The script with a stand-in llama-server that prints where it runs and what it was given."""
    out = tmp_path / "bundle"
    build_bundle(str(target["path"]), str(drafter_dir), out, "llamacpp")
    fake = tmp_path / "bin" / "llama-server"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\npwd\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}", "PORT": "9123"}
    env.pop("THREADS", None)
    env.pop("LLAMA_SERVER", None)
    run = subprocess.run(
        ["sh", str(out / "llamacpp" / "launch.sh"), "--verbose"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == str(out)
    args = lines[1:]
    assert args[args.index("--port") + 1] == "9123" and args[args.index("--host") + 1] == "127.0.0.1"
    assert int(args[args.index("-t") + 1]) >= 1  # all cores by default
    assert args[args.index("-md") + 1] == "./llamacpp/drafter.gguf" and args[-1] == "--verbose"
    env["LLAMA_SERVER"] = "/nonexistent/llama-server"
    run = subprocess.run(["sh", str(out / "llamacpp" / "launch.sh")], capture_output=True, text=True, env=env)
    assert run.returncode == 127 and "/nonexistent/llama-server" in run.stderr


def test_llamacpp_bundle_bad_inputs(tiny_pair, target, drafter_dir, tmp_path):
    target_dir, hf_drafter = tiny_pair
    with pytest.raises(LoopspecError, match="llama.cpp serves a GGUF target.*convert_hf_to_gguf"):
        build_bundle(str(target_dir), str(hf_drafter), tmp_path / "a", "llamacpp")
    with pytest.raises(LoopspecError, match="--tp and --precision apply to"):
        build_bundle(str(target["path"]), str(drafter_dir), tmp_path / "b", "llamacpp", tp=2)
    maskless = tmp_path / "maskless"
    tiny_drafter(mask_token_id=None).save(maskless, dtype=torch.float32)
    with pytest.raises(LoopspecError, match="no mask_token_id.*--mask-token-id"):
        build_bundle(str(target["path"]), str(maskless), tmp_path / "c", "llamacpp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["maskless"]


# --------------------------------------------------------------------------------------------------
# end to end: the shipped drafter in llama-server on the default target


@pytest.fixture(scope="module")
def default_peer(tmp_path_factory):
    """llama-server on the default target GGUF, plain and drafting with the shipped drafter written as
    a dflash GGUF: the runtime's own peer (runtime/bench/peers.py), as `bench` runs it."""
    binary = find_llama_server()
    if binary is None:
        pytest.skip(reason=NO_SERVER)
    from loopspec.defaults import DEFAULT_DRAFTER_DIR
    from loopspec.runtime.bench.peers import LlamaServerPeer
    from loopspec.weights import target_gguf_path

    target_gguf = target_gguf_path("default")
    drafter = Drafter.load(DEFAULT_DRAFTER_DIR)
    drafter_gguf = write_dflash_gguf(drafter, target_gguf, tmp_path_factory.mktemp("llamacpp-e2e") / "drafter.gguf")
    peer = LlamaServerPeer(
        binary, target_gguf, drafter_gguf, drafter.cfg.block_size - 1, min(2, os.cpu_count() or 1), context=2048
    )
    try:
        yield peer
    finally:
        peer.close()
    assert not peer.servers  # stopped


@pytest.mark.e2e
def test_shipped_drafter_drafts_in_llama_server(default_peer):
    """llama.cpp's DFlash verification is not bound to reproduce its own plain decoding (its
    multi-token batches may round differently, docs/benchmarks.md), so what is asserted is what holds:
    both runs complete, the drafter's file is read and used, and each is reproducible; whether the two
    outputs agree is reported."""
    from loopspec.weights import load_tokenizer, resolve_target_dir

    tokenizer = load_tokenizer(resolve_target_dir("default"))
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
        add_generation_prompt=True,
    )
    ids = [int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)]
    ref, spec = default_peer.run(ids, "llamacpp", 16), default_peer.run(ids, "llamacpp-dflash", 16)
    assert len(ref.tokens) == 16 and len(spec.tokens) == 16
    assert ref.drafted == 0
    # the drafter is really used, and its drafts are accepted: the file is read as written
    assert spec.drafted > 0 and spec.accepted > 0, spec
    # greedy, one request at a time: a second run of each gives the same tokens
    assert default_peer.run(ids, "llamacpp", 16).tokens == ref.tokens
    assert default_peer.run(ids, "llamacpp-dflash", 16).tokens == spec.tokens
    same = next((i for i, (a, b) in enumerate(zip(ref.tokens, spec.tokens)) if a != b), 16)
    print(
        f"llama-server DFlash on the default pair: drafted {spec.drafted}, accepted {spec.accepted} over 16 "
        f"tokens; its output equals its plain output for the first {same} of 16 tokens"
    )
