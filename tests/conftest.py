from pathlib import Path

import pytest
import torch

FAMILIES = ["llama", "qwen2", "qwen3"]


def tiny_hf_config(
    family: str,
    vocab_size: int = 128,
    num_layers: int = 6,
    tie: bool | None = None,
    rope_scaling: dict | None = None,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
):
    """A tiny random transformers config of the given family (GQA, 2 kv heads)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        eos_token_id=2,
        bos_token_id=1,
    )
    if family == "llama":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        }
        cfg = LlamaConfig(
            **common, rope_parameters=rope_scaling or rope, tie_word_embeddings=True if tie is None else tie
        )
    elif family == "qwen2":
        cfg = Qwen2Config(**common, tie_word_embeddings=False if tie is None else tie)
    else:
        cfg = Qwen3Config(**common, head_dim=32, tie_word_embeddings=False if tie is None else tie)
    return cfg


def save_tiny_target(family: str, directory: Path, seed: int = 0, **kw) -> Path:
    """Build a random transformers model of `family`, save it as an HF checkpoint directory."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(family, **kw)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random norms so that q/k-norm and layer norms are really exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "bias" in name:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def tiny_targets(tmp_path_factory):
    """{family: checkpoint dir} for one tiny random target of every supported family."""
    root = tmp_path_factory.mktemp("targets")
    return {f: save_tiny_target(f, root / f, seed=i) for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="session")
def target_dir(tiny_targets, tmp_path_factory):
    """The qwen3 tiny target with a tokenizer (the CLI, load_pair and bundles need one)."""
    d = tmp_path_factory.mktemp("qwen3-with-tokenizer")
    for f in tiny_targets["qwen3"].iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    save_tiny_tokenizer(d)
    return d


def save_tiny_tokenizer(directory: Path, vocab_size: int = 128) -> None:
    """A character-level tokenizer (ids 0..2 special, then printable characters) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    chars = [chr(c) for c in range(32, 127)][: vocab_size - len(specials) - 1]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(str(directory))


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A tiny llama target dir with a tokenizer, and a matching random z-lab drafter dir."""
    from loopspec.model.dflash import Drafter, DrafterConfig
    from loopspec.weights import load_target_dir

    root = tmp_path_factory.mktemp("pair")
    target_dir = save_tiny_target("llama", root / "target", seed=5)
    save_tiny_tokenizer(target_dir)
    target = load_target_dir(target_dir)
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=6, mask_token_id=127)
    Drafter(cfg).save(root / "drafter", dtype=torch.float32)
    return target_dir, root / "drafter"


def lively(target, scale: float = 8.0):
    """Random tiny targets repeat one token forever; with every matrix scaled up their greedy
    continuations depend on the context (10-30 distinct tokens in 40), so a row reading another
    row's KV or context would show."""
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return target


def save_trained_like_drafter(
    target_dir: Path, drafter_dir: Path, out_dir: Path, strength: float = 3.0, rank: int = 2, rounds: int = 3
) -> Path:
    """A copy of a random drafter whose every matrix also carries the dominant directions of its own
    inputs, saved to `out_dir`.

    Why: FP8 rounds each input and weight to 3 mantissa bits. In a random matrix product the signal
    and the rounding errors are both sums of incoherent terms, so every product loses ≈ 5 % of its
    output's scale and two in a row miss FP8's 5 % validation tolerance. Trained weights are aligned
    with their inputs, whose energy sits in a few directions: the signal then adds up coherently and
    the rounding errors do not. Each matrix gets a low-rank term along its top input directions, met
    while the drafter drafts as decoding does (context features, blocks, DLoop's pseudo-context);
    since every term changes the other matrices' inputs, the directions are found again from the
    random weights for a few rounds. Everything else about the drafter stays random."""
    from loopspec.convert.quantize import DEFAULT_CALIB_PROMPTS, calibration_sequences, run_drafter_as_decoding
    from loopspec.model.dflash import Drafter
    from loopspec.weights import load_target_dir, load_tokenizer

    target = load_target_dir(target_dir)
    drafter = Drafter.load(drafter_dir).float().eval()
    sequences = calibration_sequences(target, load_tokenizer(target_dir), list(DEFAULT_CALIB_PROMPTS), 2, new_tokens=24)
    target.set_taps(drafter.cfg.target_layer_ids)
    linears = [m for m in drafter.modules() if isinstance(m, torch.nn.Linear)]  # (the lm_head is the target's)
    random_weights = [m.weight.detach().clone() for m in linears]
    outputs = [
        torch.randn(m.weight.shape[0], rank, generator=torch.Generator().manual_seed(11 + i))
        for i, m in enumerate(linears)
    ]
    for _ in range(rounds):
        seen = {id(m): [] for m in linears}
        hooks = [
            m.register_forward_hook(lambda m, args, out: seen[id(m)].append(args[0].reshape(-1, args[0].shape[-1])))
            for m in linears
        ]
        run_drafter_as_decoding(drafter, target, sequences)
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for linear, weight, out in zip(linears, random_weights, outputs):
                _, values, vh = torch.linalg.svd(torch.cat(seen[id(linear)]), full_matrices=False)
                term = sum(
                    float(values[i] / values[0]) * torch.outer(out[:, i] / out[:, i].norm(), vh[i]) for i in range(rank)
                )
                linear.weight.copy_(weight + strength * weight.norm() / 4 * term)
    drafter.save(out_dir, dtype=torch.float32)
    return out_dir


def generated_texts_on_both_backends(target_dir, drafter_dir, onnx_dir, capsys, max_new_tokens: int) -> dict:
    """`loopspec generate` of `ar` and `dloop` on the torch backend and on a converted ONNX directory →
    {method: [torch text, onnxruntime text]}."""
    from loopspec.cli import main

    texts = {}
    for backend in (
        ["--backend", "torch", "--target", str(target_dir), "--drafter", str(drafter_dir)],
        ["--backend", "onnxruntime", "--onnx-dir", str(onnx_dir)],
    ):
        for method in ("ar", "dloop"):
            argv = ["generate", "--prompt", "abc", "--method", method, "--max-new-tokens", str(max_new_tokens)]
            assert main(argv + backend) == 0
            texts.setdefault(method, []).append(capsys.readouterr().out)
    return texts


def greedy_continuations(engine, prompt_list, new_tokens: int) -> list[list[int]]:
    """What `engine`'s target continues each prompt with in plain decoding: prompt + new tokens."""
    from loopspec.runtime.decoder import generate

    return [list(p) + generate(engine, list(p), max_new_tokens=new_tokens).tokens for p in prompt_list]


@torch.no_grad()
def target_greedy(target, prompt, new_tokens: int) -> list[int]:
    """prompt + what `target`'s own forward continues it with greedily (the module itself: an engine
    would pack its linears in place)."""
    cache = target.new_cache(len(prompt) + new_tokens)
    tokens = list(prompt)
    step = torch.tensor([tokens])
    for _ in range(new_tokens):
        tokens.append(int(target(step, cache, last_logits_only=True).logits[0, -1].argmax()))
        step = torch.tensor([tokens[-1:]])
    return tokens


def agreeing_drafter(
    target, prompt_list, cfg, *, new_tokens: int = 40, steps: int = 80, seed: int = 0, also_engines=(), also_texts=()
):
    """A tiny drafter of `cfg` (a DrafterConfig) trained in-test until it drafts what `target`
    continues `prompt_list` with greedily — the module itself, and each of `also_engines` (e.g. an int8
    export, whose roundings take other tokens at places, and differently on other CPUs): it overfits
    those continuations. An identity or batch-invariance test of speculative decoding needs drafts
    that are accepted: a random drafter's never are, and then every method commits only plain
    decoding's bonus tokens. `also_texts`: more (prompt, continuation) pairs to overfit (e.g. what
    constrained decoding continues with)."""
    import random

    from loopspec.model.dflash import Drafter
    from loopspec.train.trainer import DrafterTrainer, TrainConfig

    torch.manual_seed(seed)
    drafter = Drafter(cfg)
    sequences = {}
    for prompt in prompt_list:
        sequences[tuple(target_greedy(target, prompt, new_tokens))] = len(prompt)
    for engine in also_engines:
        for prompt, sequence in zip(prompt_list, greedy_continuations(engine, prompt_list, new_tokens)):
            sequences[tuple(sequence)] = len(prompt)
    for prompt, continuation in also_texts:
        sequences[tuple(prompt) + tuple(continuation)] = len(prompt)
    trainer = DrafterTrainer(target, drafter, TrainConfig(anchors=512))
    data = []
    for sequence, prompt_length in sequences.items():
        tokens = torch.tensor(sequence)
        # anchors from the prompt's last token on: every round's block, the first one included
        loss_mask = torch.arange(len(sequence)) >= prompt_length - 1
        data.append((tokens, loss_mask, trainer.target_pass(tokens, False)[0]))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    rng = random.Random(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        for tokens, loss_mask, taps in data:
            loss, _ = trainer.sequence_loss(tokens, loss_mask, taps, rng)
            (loss / len(data)).backward()
        optimizer.step()
    return drafter.eval()


def accepted_drafts(results) -> int:
    """The drafts the target accepted over GenerationResults (or decoder rows): Σ of their stats'
    accepted_per_round."""
    return sum(sum(r.stats.accepted_per_round) for r in results)


def repeating_prompts(engine, prompts, new_tokens: int = 20) -> list[list[int]]:
    """Each prompt, what the target continues it with greedily, then the prompt again: text whose
    suffix index has something to draft."""
    from loopspec.runtime.decoder import generate
    from loopspec.settings import DecodingSettings

    return [p + generate(engine, p, DecodingSettings(), max_new_tokens=new_tokens).tokens + p for p in prompts]


def batched_greedy_equals_plain(engine, prompts, settings, new_tokens: int = 40) -> int:
    """Greedy: the prompts' rows batched through one Decoder with `settings` commit what plain decoding
    commits for each alone (asserted; the plain texts differ and vary) → the drafts accepted."""
    from loopspec.runtime.decoder import Decoder, decode_all, generate
    from loopspec.settings import DecodingSettings

    refs = [generate(engine, p, DecodingSettings(), max_new_tokens=new_tokens).tokens for p in prompts]
    assert len({tuple(r) for r in refs}) == len(prompts) and min(len(set(r)) for r in refs) >= 3
    done = decode_all(
        Decoder(engine.with_rows(len(prompts)), settings),
        [dict(key=i, prompt_ids=p, max_new_tokens=new_tokens) for i, p in enumerate(prompts)],
    )
    assert [done[i].tokens for i in range(len(prompts))] == refs
    return accepted_drafts(done.values())
