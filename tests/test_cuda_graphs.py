"""CUDA graphs for the torch backend.

On the CPU: the static-shape forwards that the graphs capture (padding to a bucket, the whole static
cache behind a position mask) equal the eager forwards, and asking for CUDA graphs without a GPU is a
clear error. On a GPU (marked `gpu`): graph replay equals eager and greedy output equals plain
decoding."""

import pytest
import torch

from conftest import FAMILIES
from loopspec.cli import main
from loopspec.errors import LoopspecError
from loopspec.model.drafter import Drafter, DrafterConfig
from loopspec.model.target import attention_mask
from loopspec.runtime.cuda_graphs import drafter_block_static, key_bucket, target_verify_static
from loopspec.runtime.decoder import generate
from loopspec.runtime.torch_engine import TorchEngine
from loopspec.settings import DecodingSettings
from loopspec.tree import DraftTree, tree_masks
from loopspec.weights import load_target_dir

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_drafter(target, block_size=6, seed=0):
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(target.cfg, num_layers=2, block_size=block_size, mask_token_id=127)
    return Drafter(cfg).eval()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@torch.inference_mode()
def test_padded_static_verify_equals_eager(family, tree, tiny_targets):
    target = load_target_dir(tiny_targets[family])
    target.set_taps([1, 4])
    prompt = torch.randint(0, 120, (1, 9), generator=torch.Generator().manual_seed(1))
    verify = torch.randint(0, 120, (1, 5), generator=torch.Generator().manual_seed(2))
    eager_cache, static_cache = target.new_cache(256), target.new_cache(256)
    for cache in (eager_cache, static_cache):
        target(prompt, cache)
    static_cache.k[:, :, :, 9:] = 7.0  # stale slots past the length must stay invisible
    static_cache.v[:, :, :, 9:] = -3.0
    tree_mask = None
    if tree:  # tokens 1 and 2 are siblings under token 0; 3 is 2's child, 4 is 1's
        tree_mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0],
                                  [1, 1, 0, 0, 1]], dtype=torch.bool)[None]
    eager = target(verify, eager_cache, tree_mask=tree_mask)
    bucket = 8  # 5 real tokens + 3 padding tokens continuing the chain after them (as the runner pads)
    ids = torch.cat([verify, torch.zeros(1, bucket - 5, dtype=torch.long)], dim=1)
    padded = torch.ones(bucket, bucket, dtype=torch.bool).tril()
    if tree:
        padded[:5, :5] = tree_mask[0]
    positions = 9 + padded.sum(-1)[None] - 1
    keys = key_bucket(9 + bucket, static_cache.max_length)
    assert keys == 64  # a window of the 256-slot cache
    mask = attention_mask(torch.tensor([9]), bucket, keys, padded[None])[0]
    static = target_verify_static(target, static_cache, ids, positions, torch.arange(9, 9 + bucket), mask,
                                  want_taps=True)
    torch.testing.assert_close(static.logits[:, :5], eager.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(static.taps[:, :5], eager.taps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(static_cache.k[:, :, :, :14], eager_cache.k[:, :, :, :14], rtol=1e-5, atol=1e-6)
    assert static_cache.lengths[0] == 9  # the static forward never moves the length; the runner does


@torch.inference_mode()
def test_static_drafter_block_equals_eager(tiny_targets):
    target = load_target_dir(tiny_targets["qwen3"])
    drafter = random_drafter(target)
    context = drafter.new_context(256)
    taps = torch.randn(1, 11, drafter.cfg.num_taps * drafter.cfg.hidden_size)
    context.append(*drafter.context_kv(drafter.features(taps), torch.arange(11)))
    context.k[:, :, :, 11:] = 5.0  # junk past the context length
    k, position = 6, 11
    ids = torch.full((1, k), 127)
    ids[0, 0] = 42
    positions = torch.arange(position, position + k)
    hidden = drafter(target.embed_tokens(ids), positions, context.k[:, :, :, :11], context.v[:, :, :, :11])
    logits = target.lm_head(hidden[0, 1:])
    for keys in (None, key_bucket(11, context.max_length)):  # the whole buffer, a 64-slot window
        drafts, logprobs, static_hidden = drafter_block_static(drafter, target.embed_tokens, target.lm_head, context,
                                                               ids, positions, torch.tensor(11), None, keys)
        assert torch.equal(drafts, logits.topk(drafts.shape[1], -1).indices)  # [k-1, C]: rank 0 the argmax
        torch.testing.assert_close(logprobs, logits.log_softmax(-1).topk(drafts.shape[1], -1).values, rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(static_hidden, hidden[0], rtol=1e-5, atol=1e-5)


def test_key_buckets():
    assert [key_bucket(n, 8192) for n in (0, 1, 64, 65, 300, 4097)] == [64, 64, 64, 128, 512, 8192]
    assert key_bucket(300, 256) == 256 and key_bucket(10, 40) == 40  # never past the buffer


def test_cuda_graphs_on_cpu_is_a_clear_error(tiny_targets, tiny_pair, capsys):
    target = load_target_dir(tiny_targets["llama"])
    with pytest.raises(LoopspecError, match="CUDA graphs need a CUDA device"):
        TorchEngine(target, random_drafter(target), max_context=64, cuda_graphs=True)
    target_dir, drafter_dir = tiny_pair
    argv = ["generate", "--target", str(target_dir), "--drafter", str(drafter_dir), "--prompt", "hi",
            "--max-new-tokens", "4"]
    assert main(argv + ["--cuda-graphs"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("loopspec: error: CUDA graphs need a CUDA device") and "\n" not in err
    if not torch.cuda.is_available():
        assert main(argv + ["--device", "cuda"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
    assert main(argv + ["--device", "tpu"]) == 2
    assert "device" in capsys.readouterr().err
    assert main(argv + ["--no-cuda-graphs"]) == 0  # the CPU default still runs


# --------------------------------------------------------------------------------------------------
# on a GPU


def gpu_engines(tiny_targets, family, block_size=6):
    target = load_target_dir(tiny_targets[family]).cuda()
    drafter = random_drafter(target, block_size).cuda()
    eager = TorchEngine(target, drafter, max_context=256)
    graphs = TorchEngine(target, drafter, max_context=256, cuda_graphs=True)
    return eager, graphs


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_replay_equals_eager(family, tiny_targets):
    eager, graphs = gpu_engines(tiny_targets, family)
    prompt = list(range(3, 20))
    for engine in (eager, graphs):
        engine.prefill(0, prompt, want_taps=True)
    for step, tokens in enumerate(([5], [6, 7, 8], [9] * 6, [10, 11])):
        (el, et), (gl, gt) = eager.verify([tokens], want_taps=True), graphs.verify([tokens], want_taps=True)
        assert el.device.type == gl.device.type == "cpu" and gt.device.type == "cuda"
        torch.testing.assert_close(gl, el, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gt, et, rtol=1e-4, atol=1e-4)
        for engine, taps in ((eager, et), (graphs, gt)):
            engine.append_context(taps, [len(tokens)])
        position = int(eager.cache.lengths[0])
        (ed, ep, eh), (gd, gp, gh) = (e.draft([0], [tokens[-1]], [position], 6) for e in (eager, graphs))
        assert torch.equal(gd, ed), step
        torch.testing.assert_close(gp, ep, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gh, eh, rtol=1e-4, atol=1e-4)
    assert {key[0] for key in graphs.graphs.graphs} == {"verify", "block"}
    # a draft tree replays in the bucket of its node count with its mask
    tree = DraftTree.root(3)
    a = tree.add(0, 4)
    tree.add(0, 5)
    tree.add(a, 6)
    mask = tree_masks([tree], len(tree))
    (el, _), (gl, _) = (e.verify([tree.tokens], want_taps=True, tree_masks=mask) for e in (eager, graphs))
    torch.testing.assert_close(gl, el, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_with_graphs(family, tiny_targets):
    eager, graphs = gpu_engines(tiny_targets, family)
    prompt = torch.randint(0, 120, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    ar = generate(eager, prompt, max_new_tokens=48)
    for engine in (eager, graphs):
        assert generate(engine, prompt, max_new_tokens=48).tokens == ar.tokens
        assert generate(engine, prompt, DecodingSettings("dflash", 6), max_new_tokens=48).tokens == ar.tokens
        dloop = generate(engine, prompt, DecodingSettings("dloop", 6, 3, -1e9), max_new_tokens=48)
        assert dloop.tokens == ar.tokens
        trees = DecodingSettings("dloop", 6, 3, -1e9, tree_budget=20, suffix=True)  # tree masks as graph inputs
        assert generate(engine, prompt, trees, max_new_tokens=48).tokens == ar.tokens
