from pathlib import Path

import pytest
import torch

FAMILIES = ["llama", "qwen2", "qwen3"]


def tiny_hf_config(family: str, vocab_size: int = 128, num_layers: int = 6, tie: bool | None = None,
                   rope_scaling: dict | None = None, hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2):
    """A tiny random transformers config of the given family (GQA, 2 kv heads)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=96, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, max_position_embeddings=512,
                  rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1)
    if family == "llama":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 10000.0}
        cfg = LlamaConfig(**common, rope_parameters=rope_scaling or rope,
                          tie_word_embeddings=True if tie is None else tie)
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
    from loopspec.model.drafter import Drafter, DrafterConfig
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
