"""CUDA graphs for the torch backend.

On the CPU: the static-shape forwards that the graphs capture (rows padded to a bucket, the static
cache behind a mask) equal the eager forwards; the StaticRunner — the graphs' plans and forwards
without the capture — decodes batches, chains and trees exactly as plain decoding does; and the same
identity check fails when a bug is planted in its slot, row, window or length logic (it has power).
Asking for CUDA graphs without a GPU is a clear error. On a GPU (marked `gpu`): replay equals eager
for batched rows and trees, and batched greedy output equals plain decoding on lively targets."""

import pytest
import torch

from conftest import FAMILIES, lively
from loopspec.cli import main
from loopspec.errors import LoopspecError
from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.engines import cuda_graphs
from loopspec.engines.cuda_graphs import (
    StaticRunner,
    drafter_block_static,
    key_bucket,
    plan_block,
    plan_verify,
    target_verify_static,
)
from loopspec.runtime.decoder import Decoder, decode_all, generate
from loopspec.engines.torch_engine import TorchEngine
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
    """Two rows at different lengths, 5 and 3 real tokens padded to the bucket of 8: each row's real
    tokens equal the eager forward of that row alone, and the K/V they store too."""
    target = load_target_dir(tiny_targets[family])
    target.set_taps([1, 4])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 120, (1, n), generator=g) for n in (9, 14)]
    new = [torch.randint(0, 120, (5,), generator=g).tolist(), torch.randint(0, 120, (3,), generator=g).tolist()]
    tree_masks = None
    if tree:  # row 0: tokens 1 and 2 are siblings under token 0, 3 is 2's child, 4 is 1's; row 1: 1, 2 siblings
        tree_masks = torch.zeros(2, 5, 5, dtype=torch.bool)
        tree_masks[0] = torch.tensor(
            [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 0, 0, 1]], dtype=torch.bool
        )
        tree_masks[1, :3, :3] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    static_cache = target.new_cache(256, rows=2)
    eager = []
    for b, prompt in enumerate(prompts):
        target(prompt, static_cache, first_row=b)
        cache = target.new_cache(256)
        target(prompt, cache)
        n = len(new[b])
        out = target(torch.tensor([new[b]]), cache, tree_mask=tree_masks[b : b + 1, :n, :n] if tree else None)
        eager.append((out, cache))
    static_cache.k[:, 0, :, 9:] = 7.0  # stale slots past each row's length must stay invisible
    static_cache.v[:, 1, :, 14:] = -3.0
    plan = plan_verify([9, 14], new, static_cache.max_length, tree_masks)
    assert (plan.bucket, plan.keys, plan.lengths) == (8, 64, [14, 17])  # a window of the 256-slot cache
    static = target_verify_static(
        target,
        static_cache,
        plan.ids,
        plan.positions,
        plan.slots,
        plan.row_index,
        plan.token_index,
        plan.mask,
        want_taps=True,
    )
    for b, (out, cache) in enumerate(eager):
        n, length = len(new[b]), plan.lengths[b]
        torch.testing.assert_close(static.logits[b, :n], out.logits[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(static.taps[b, :n], out.taps[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(static_cache.k[:, b, :, :length], cache.k[:, 0, :, :length], rtol=1e-5, atol=1e-5)
    assert static_cache.lengths.tolist() == [9, 14]  # the static forward never moves lengths; the runner does


@torch.inference_mode()
def test_static_drafter_block_equals_eager(tiny_targets):
    """Two rows with contexts of 11 and 7 slots (junk past each) draft one block each."""
    target = load_target_dir(tiny_targets["qwen3"])
    drafter = random_drafter(target)
    context = drafter.new_context(256, rows=2)
    taps = torch.randn(2, 11, drafter.cfg.num_taps * drafter.cfg.hidden_size)
    context.append(*drafter.context_kv(drafter.features(taps), torch.arange(11)), [0, 1], [11, 7])
    context.k[:, 0, :, 11:] = 5.0
    context.k[:, 1, :, 7:] = -5.0
    k = 6
    plan = plan_block([11, 7], [42, 17], [11, 7], k, 127, context.max_length)
    for keys in (None, plan.keys):  # the whole buffer, a 64-slot window
        drafts, logprobs, static_hidden = drafter_block_static(
            drafter,
            target.embed_tokens,
            target.lm_head,
            context,
            plan.ids,
            plan.positions,
            plan.context_lengths,
            None,
            keys,
        )
        for b, length in enumerate((11, 7)):
            ids = plan.ids[b : b + 1]
            hidden = drafter(
                target.embed_tokens(ids),
                plan.positions[b],
                context.k[:, b : b + 1, :, :length],
                context.v[:, b : b + 1, :, :length],
            )
            logits = target.lm_head(hidden[0, 1:])
            assert torch.equal(drafts[b], logits.topk(drafts.shape[2], -1).indices)  # rank 0 the argmax
            torch.testing.assert_close(
                logprobs[b], logits.log_softmax(-1).topk(drafts.shape[2], -1).values, rtol=1e-5, atol=1e-5
            )
            torch.testing.assert_close(static_hidden[b], hidden[0], rtol=1e-5, atol=1e-5)


def test_key_buckets():
    assert [key_bucket(n, 8192) for n in (0, 1, 64, 65, 300, 4097)] == [64, 64, 64, 128, 512, 8192]
    assert key_bucket(300, 256) == 256 and key_bucket(10, 40) == 40  # never past the buffer


def test_cuda_graphs_on_cpu_is_a_clear_error(tiny_targets, tiny_pair, capsys):
    target = load_target_dir(tiny_targets["llama"])
    with pytest.raises(LoopspecError, match="CUDA graphs need a CUDA device"):
        TorchEngine(target, random_drafter(target), max_context=64, cuda_graphs=True)
    target_dir, drafter_dir = tiny_pair
    argv = [
        "generate",
        "--target",
        str(target_dir),
        "--drafter",
        str(drafter_dir),
        "--prompt",
        "hi",
        "--max-new-tokens",
        "4",
    ]
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
# the identity check, on the CPU through the StaticRunner, and its power

IDENTITY_METHODS = {
    "ar": DecodingSettings(),
    "dflash": DecodingSettings("dflash", 6),
    "dloop": DecodingSettings("dloop", 6, 3, -1e9),
    "tree": DecodingSettings("dloop", 6, 3, -1e9, tree_budget=20, suffix=True),
}
NEW_TOKENS = 24
MIN_DISTINCT = 8  # lively targets: a constant output would hide a row reading the wrong slots


def identity_prompts(n: int = 4, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 120, (int(torch.randint(8, 30, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def plain_decoding(engine, prompts) -> list[list[int]]:
    """Each prompt alone, eagerly, without drafts: the reference every method must reproduce."""
    refs = [generate(engine, p, DecodingSettings(), max_new_tokens=NEW_TOKENS).tokens for p in prompts]
    assert min(len(set(r)) for r in refs) >= MIN_DISTINCT, [len(set(r)) for r in refs]  # varied, so the check bites
    return refs


def batched_outputs(engine, prompts, method) -> list[list[int]]:
    decoder = Decoder(engine if engine.max_rows == len(prompts) else engine.with_rows(len(prompts)), method)
    done = decode_all(decoder, [dict(key=i, prompt_ids=p, max_new_tokens=NEW_TOKENS) for i, p in enumerate(prompts)])
    return [done[i].tokens for i in range(len(prompts))]


def identity_mismatches(engine, prompts, refs, methods=IDENTITY_METHODS) -> list[str]:
    """The methods whose batched greedy output differs from plain decoding (or fails) on this engine."""
    out = []
    for name, method in methods.items():
        try:
            if batched_outputs(engine, prompts, method) != refs:
                out.append(name)
        except (LoopspecError, RuntimeError, IndexError) as e:  # a planted bug may also break a shape
            out.append(f"{name} ({type(e).__name__})")
    return out


class RecordingRunner(StaticRunner):
    """The StaticRunner, recording which buckets its calls used (to show batches and trees went through it)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.keys: set[tuple] = set()

    def run(self, key, forward, values):
        self.keys.add(key)
        return super().run(key, forward, values)


class StaticEngine(TorchEngine):
    """A TorchEngine whose bucketed calls go through a StaticRunner (class attribute `runner`): on the
    CPU, the graphs' plans and static forwards without the capture."""

    runner = RecordingRunner

    def __init__(self, target, drafter, max_context):
        super().__init__(target, drafter, max_context, cuda_graphs=True)  # cuda_graphs: use the runner

    def static_runner(self):
        return self.runner(self)


@pytest.fixture(scope="module")
def lively_pair(tiny_targets):
    """(target, drafter, prompts, plain decoding of each prompt alone)."""
    target = lively(load_target_dir(tiny_targets["qwen3"]))
    drafter = random_drafter(target)
    prompts = identity_prompts()
    return target, drafter, prompts, plain_decoding(TorchEngine(target, drafter, max_context=160), prompts)


@torch.inference_mode()
def test_static_runner_decodes_batches_and_trees_as_plain_decoding(lively_pair):
    target, drafter, prompts, refs = lively_pair
    static = StaticEngine(target, drafter, 160).with_rows(len(prompts))
    assert identity_mismatches(static, prompts, refs) == []
    keys = static.graphs.keys
    assert {key[1] for key in keys if key[0] == "verify"} >= {4}  # four rows verified in one bucketed call
    assert {key[1] for key in keys if key[0] == "block"} >= {4}
    assert max(key[2] for key in keys if key[0] == "verify") >= 16  # tree buckets (20-node budget)


def stale_slot(starts, tokens, max_length, tree_masks=None):
    plan = plan_verify(starts, tokens, max_length, tree_masks)
    return plan and plan._replace(slots=plan.slots + 1)  # K/V one slot late: a query reads a stale slot


def off_by_one_row(starts, tokens, max_length, tree_masks=None):
    plan = plan_verify(starts, tokens, max_length, tree_masks)
    return plan and plan._replace(row_index=(plan.row_index + 1) % len(tokens))  # row b's K/V into row b+1


def mask_one_slot_late(starts, tokens, max_length, tree_masks=None):
    plan = plan_verify(starts, tokens, max_length, tree_masks)
    if plan is None:
        return None
    tree = torch.ones(plan.bucket, plan.bucket, dtype=torch.bool).tril().repeat(len(tokens), 1, 1)
    late = cuda_graphs.attention_mask(torch.tensor(starts) + 1, plan.bucket, plan.keys, tree)
    return plan._replace(mask=late)  # each token sees the slot after its own: the next token's K/V


@pytest.mark.parametrize("bug", [stale_slot, off_by_one_row, mask_one_slot_late])
@torch.inference_mode()
def test_the_identity_check_catches_a_planted_bug(bug, lively_pair):
    """The same check as above, with one bug planted in the bucket plan the CUDA graphs replay: it fails."""
    target, drafter, prompts, refs = lively_pair

    class Mutant(RecordingRunner):
        plan_verify = staticmethod(bug)

    class MutantEngine(StaticEngine):
        runner = Mutant

    caught = identity_mismatches(
        MutantEngine(target, drafter, 160), prompts, refs, {"dflash": IDENTITY_METHODS["dflash"]}
    )
    assert caught, f"{bug.__name__} went unnoticed"


# --------------------------------------------------------------------------------------------------
# on a GPU


def gpu_engines(target, drafter):
    target, drafter = target.cuda(), drafter.cuda()
    eager = TorchEngine(target, drafter, max_context=256)
    graphs = TorchEngine(target, drafter, max_context=256, cuda_graphs=True)
    return eager, graphs


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_replay_equals_eager(family, tiny_targets):
    """Two rows at different lengths, ragged chains, then draft trees: every replay equals eager."""
    target = lively(load_target_dir(tiny_targets[family]))
    eager, graphs = (e.with_rows(2) for e in gpu_engines(target, random_drafter(target)))
    prompts = identity_prompts(2, seed=7)
    for engine in (eager, graphs):
        for row, prompt in enumerate(prompts):
            engine.prefill(row, prompt, want_taps=True)
    for step, tokens in enumerate(([[5], [6]], [[6, 7, 8], [9]], [[9] * 6, [10] * 5], [[10, 11], [12, 13]])):
        (el, et), (gl, gt) = eager.verify(tokens, want_taps=True), graphs.verify(tokens, want_taps=True)
        assert el.device.type == gl.device.type == "cpu" and gt.device.type == "cuda"
        for b, t in enumerate(tokens):  # the real tokens of each row (padding positions are junk)
            torch.testing.assert_close(gl[b, : len(t)], el[b, : len(t)], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(gt[b, : len(t)], et[b, : len(t)], rtol=1e-4, atol=1e-4)
        for engine, taps in ((eager, et), (graphs, gt)):
            engine.append_context(taps, [len(t) for t in tokens])
        positions = eager.cache.lengths[:2].tolist()
        anchors = [t[-1] for t in tokens]
        (ed, ep, eh), (gd, gp, gh) = (e.draft([0, 1], anchors, positions, 6) for e in (eager, graphs))
        assert torch.equal(gd, ed), step
        torch.testing.assert_close(gp, ep, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gh, eh, rtol=1e-4, atol=1e-4)
    assert {(key[0], key[1]) for key in graphs.graphs.graphs} == {("verify", 2), ("block", 2)}
    # draft trees, one per row, replay in the bucket of the larger node count with their masks
    trees = []
    for root in (3, 4):
        tree = DraftTree.root(root)
        a = tree.add(0, 4)
        tree.add(0, 5)
        tree.add(a, 6)
        trees.append(tree)
    trees[1].add(0, 7)
    masks = tree_masks(trees, max(len(t) for t in trees))
    (el, _), (gl, _) = (e.verify([t.tokens for t in trees], want_taps=True, tree_masks=masks) for e in (eager, graphs))
    for b, t in enumerate(trees):
        torch.testing.assert_close(gl[b, : len(t)], el[b, : len(t)], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_greedy_identity_with_graphs(family, tiny_targets):
    """Lively targets (varied output, asserted), four rows at once: ar, dflash, dloop and dloop with
    trees + suffix through CUDA graphs commit exactly what plain decoding commits for each alone."""
    target = lively(load_target_dir(tiny_targets[family]))
    eager, graphs = gpu_engines(target, random_drafter(target))
    prompts = identity_prompts()
    refs = plain_decoding(eager, prompts)
    assert identity_mismatches(graphs, prompts, refs) == []
    assert identity_mismatches(eager, prompts, refs) == []
