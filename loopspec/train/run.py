"""The training driver: data → steps → z-lab checkpoints, resumable, with a progress bar and a log."""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from loopspec.errors import LoopspecError
from loopspec.model.dflash2 import DFlash2Drafter
from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.model.dspark import DSparkHeads
from loopspec.model.eagle3 import NUM_TAPS, Eagle3Drafter, fresh_eagle3
from loopspec.model.target import Target, default_target_layer_ids
from loopspec.pair import Pair, mask_token_id
from loopspec.train.campaign import Campaign
from loopspec.train.dflash2_trainer import DFlash2Trainer
from loopspec.train.eagle3_trainer import Eagle3Trainer
from loopspec.train.samples import Sample, read_samples, safe_name
from loopspec.train.config import TrainConfig
from loopspec.train.trainer import DraftVocab, DrafterTrainer, compute_context, lr_at, top_token_vocab
from loopspec.weights import TargetSource, read_safetensors, write_safetensors


TAP_CACHE_KIND = "loopspec-tap-cache"

# Settings `loopspec tune` measured with a drafter's weights; a trained drafter starts without them
# (an --init drafter's setting was measured on weights this run replaces).
TUNED_SETTING_KEYS = ("tuned", "dloop")


def prepare_drafter(
    pair: Pair,
    target_spec: str,
    *,
    num_layers: int | None = None,
    block_size: int | None = None,
    target_layer_ids: list[int] | None = None,
    num_taps: int | None = None,
    mask_token: int | None = None,
    draft_vocab_size: int | None = None,
    data_dir: str | Path | None = None,
    seed: int = 0,
    heads: DSparkHeads | None = None,
    train: TrainConfig | None = None,
) -> tuple[Drafter, DraftVocab | None]:
    """The drafter a run trains: the pair's (--init) one, deepened to num_layers and set to block_size
    where given, else a fresh one for the pair's target (its tap layers, its mask token), with DSpark
    heads added where `heads` asks for them; and its draft vocabulary: the init drafter's d2t, else
    the draft_vocab_size most frequent tokens of data_dir. `train`: the training run's settings, checked
    against the drafter before anything is counted."""
    target = pair.target
    if train is not None:
        train.check_init(pair.drafter is not None)
    if draft_vocab_size is not None and draft_vocab_size > target.cfg.vocab_size:
        raise LoopspecError(
            f"a draft vocabulary of {draft_vocab_size} tokens (--draft-vocab-size) is larger than "
            f"the target's vocabulary of {target.cfg.vocab_size}"
        )
    if block_size is not None and block_size < 2:
        raise LoopspecError(f"block size must be at least 2, got {block_size}")
    family = train.family if train is not None else "dflash"
    if family == "dflash2":
        return prepare_dflash2(
            pair,
            target_spec,
            num_layers=num_layers,
            block_size=block_size,
            target_layer_ids=target_layer_ids,
            num_taps=num_taps,
            mask_token=mask_token,
            draft_vocab_size=draft_vocab_size,
            seed=seed,
            heads=heads,
            train=train,
        )
    if pair.drafter is not None and pair.drafter.cfg.kind.training_family != family:
        kind = pair.drafter.cfg.kind
        raise LoopspecError(
            f"the --init drafter ({kind.title}) is trained with --family {kind.training_family}, not --family {family}"
        )
    if family == "eagle3":
        return prepare_eagle3(
            pair,
            num_layers=num_layers,
            block_size=block_size,
            target_layer_ids=target_layer_ids,
            num_taps=num_taps,
            mask_token=mask_token,
            draft_vocab_size=draft_vocab_size,
            data_dir=data_dir,
            seed=seed,
            heads=heads,
            train=train,
        )
    if pair.drafter is not None:
        drafter = pair.drafter
        if num_layers is not None and num_layers != drafter.cfg.num_layers:
            if num_layers < drafter.cfg.num_layers:
                raise LoopspecError(
                    f"--num-layers {num_layers} is fewer than the --init drafter's "
                    f"{drafter.cfg.num_layers}; a drafter can only be deepened"
                )
            drafter = drafter.grow(num_layers)
        if block_size:
            drafter.cfg.block_size = block_size
        drafter.cfg.extra = {k: v for k, v in drafter.cfg.extra.items() if k not in TUNED_SETTING_KEYS}
    else:
        mask = mask_token_id(mask_token, TargetSource.of(target_spec), pair.tokenizer, target.cfg.vocab_size)
        taps = target_layer_ids or default_target_layer_ids(target.cfg.num_layers, num_taps or num_layers or 1)
        cfg = DrafterConfig.for_target(
            target.cfg,
            num_layers=num_layers or 1,
            block_size=block_size or 16,
            target_layer_ids=taps,
            mask_token_id=mask,
        )
        torch.manual_seed(seed)
        drafter = Drafter(cfg)
    if heads is not None:
        torch.manual_seed(seed)
        drafter = drafter.with_heads(heads)
    drafter.cfg.fit(target.cfg)
    if train is not None:
        train.check_drafter(drafter.cfg)
    draft_vocab = DraftVocab(drafter.draft_ids) if drafter.draft_ids is not None else None
    if draft_vocab_size is not None and draft_vocab is not None:
        raise LoopspecError(
            f"the --init drafter has its own draft vocabulary of {draft_vocab.ids.numel()} tokens "
            "(its d2t map): --draft-vocab-size cannot change it"
        )
    if draft_vocab_size and draft_vocab is None:
        if data_dir is None:
            raise LoopspecError("a draft vocabulary size needs the training data to count tokens in")
        ids = top_token_vocab(
            read_samples(data_dir),
            draft_vocab_size,
            target.cfg.vocab_size,
            always=sorted(set(target.cfg.eos_token_ids)),
        )
        draft_vocab = DraftVocab(ids)
        drafter.cfg.extra = {**drafter.cfg.extra, "draft_vocab_size": int(ids.numel())}
    return drafter, draft_vocab


def prepare_eagle3(
    pair: Pair,
    *,
    num_layers,
    block_size,
    target_layer_ids,
    num_taps,
    mask_token,
    draft_vocab_size,
    data_dir,
    seed,
    heads,
    train: TrainConfig,
) -> tuple[Eagle3Drafter, DraftVocab | None]:
    """prepare_drafter's EAGLE-3 branch: the --init EAGLE-3 drafter (its block size set where given),
    else a fresh one on the target's taps (vLLM's default, or the three of --tap-layers) whose lm_head
    starts as the target's rows of the draft vocabulary (the draft_vocab_size most frequent response
    tokens of data_dir, SpecForge's d2t / t2d; without a size, the whole vocabulary)."""
    target = pair.target
    for given, flag, why in (
        (num_layers not in (None, 1), "--num-layers", "an EAGLE-3 drafter has one layer"),
        (num_taps not in (None, NUM_TAPS), "--num-taps", f"EAGLE-3 fuses {NUM_TAPS} taps"),
        (mask_token is not None, "--mask-token-id", "an EAGLE-3 stage fills no block with a mask"),
        (
            heads is not None,
            "--markov-rank / --markov-head / --confidence-head",
            "DSpark's heads ride on a DFlash drafter",
        ),
    ):
        if given:
            raise LoopspecError(f"{flag} does not apply to EAGLE-3 training (--family eagle3): {why}")
    if target_layer_ids is not None and (len(target_layer_ids) != NUM_TAPS or len(set(target_layer_ids)) != NUM_TAPS):
        raise LoopspecError(
            f"--tap-layers {','.join(map(str, target_layer_ids))}: EAGLE-3 fuses exactly {NUM_TAPS} "
            "distinct target layers (low, middle, high)"
        )
    if pair.drafter is not None:
        drafter = pair.drafter
        if target_layer_ids is not None and sorted(target_layer_ids) != drafter.cfg.target_layer_ids:
            raise LoopspecError(f"--tap-layers cannot change the --init drafter's taps {drafter.cfg.target_layer_ids}")
        if draft_vocab_size is not None:
            raise LoopspecError(
                f"the --init drafter has its own draft vocabulary of {drafter.cfg.draft_vocab_size} "
                "tokens (its d2t map): --draft-vocab-size cannot change it"
            )
        if block_size:
            drafter.cfg.block_size = block_size
        drafter.cfg.extra = {k: v for k, v in drafter.cfg.extra.items() if k not in TUNED_SETTING_KEYS}
        train.check_drafter(drafter.cfg)
        return drafter, DraftVocab(drafter.draft_ids) if drafter.draft_ids is not None else None
    ids = None
    if draft_vocab_size is not None and draft_vocab_size < target.cfg.vocab_size:
        if data_dir is None:
            raise LoopspecError("a draft vocabulary size needs the training data to count tokens in")
        ids = top_token_vocab(
            read_samples(data_dir),
            draft_vocab_size,
            target.cfg.vocab_size,
            always=sorted(set(target.cfg.eos_token_ids)),
        )
    torch.manual_seed(seed)
    drafter = fresh_eagle3(
        target.cfg,
        block_size=block_size or 8,
        draft_ids=ids,
        target_layer_ids=sorted(target_layer_ids) if target_layer_ids else None,
    )
    with torch.no_grad():  # the drafter's own lm_head starts as the target's rows of its draft vocabulary
        head = target.lm_head.weight
        drafter.lm_head.weight.copy_(head if ids is None else head[ids])
    train.check_drafter(drafter.cfg)
    return drafter, DraftVocab(ids) if ids is not None else None


def prepare_dflash2(
    pair: Pair,
    target_spec: str,
    *,
    num_layers,
    block_size,
    target_layer_ids,
    num_taps,
    mask_token,
    draft_vocab_size,
    seed,
    heads,
    train: TrainConfig,
) -> tuple[DFlash2Drafter, None]:
    """prepare_drafter's DFlash2 branch: the --init DFlash2 drafter (its block size set where given); else
    the DFlash drafter prepare_drafter would train (the --init z-lab DFlash one, deepened where asked, or
    a fresh one) made a DFlash2 drafter that drafts as it does (`DFlash2Drafter.from_dflash`: identity
    convolutions, a selector whose edges start at zero, z-lab's published sizes)."""
    for given, flag, why in (
        (
            heads is not None,
            "--markov-rank / --markov-head / --confidence-head",
            "a DFlash2 drafter's draft step is its candidate selector, not DSpark heads",
        ),
        (
            draft_vocab_size is not None,
            "--draft-vocab-size",
            "its selector ranks the target head's top-k over the whole vocabulary",
        ),
    ):
        if given:
            raise LoopspecError(f"{flag} does not apply to DFlash2 training (--family dflash2): {why}")
    init = pair.drafter
    if init is not None and init.cfg.kind.training_family == "dflash2":
        drafter = init
        if num_layers is not None and num_layers != drafter.cfg.num_layers:
            drafter = drafter.grow(num_layers)  # refused in one line
        if block_size:
            drafter.cfg.block_size = block_size
        drafter.cfg.extra = {k: v for k, v in drafter.cfg.extra.items() if k not in TUNED_SETTING_KEYS}
    else:
        if init is not None and not init.cfg.kind.plain:
            raise LoopspecError(
                f"--family dflash2 starts from a fresh drafter, a z-lab DFlash drafter or a DFlash2 "
                f"drafter (--init), not this {init.cfg.kind.title} drafter"
            )
        base, _ = prepare_drafter(
            pair,
            target_spec,
            num_layers=num_layers,
            block_size=block_size,
            target_layer_ids=target_layer_ids,
            num_taps=num_taps,
            mask_token=mask_token,
            seed=seed,
        )
        torch.manual_seed(seed)  # the selector's fresh codebooks, the same on every run of these flags
        drafter = DFlash2Drafter.from_dflash(base)
    drafter.cfg.fit(pair.target.cfg)
    train.check_drafter(drafter.cfg)
    return drafter, None


class TapSource:
    """Taps from the data directory's cache when it matches the drafter's layers; else from a tap cache
    directory (`--tap-cache`: computed online once, fp16, read back in later epochs and later runs on
    the same data); else computed online every time."""

    def __init__(self, data_dir: Path, trainer: DrafterTrainer, need_logits: bool, tap_cache: Path | None = None):
        manifest = (
            json.loads((data_dir / "manifest.json").read_text()) if (data_dir / "manifest.json").is_file() else {}
        )
        cached = (manifest.get("settings") or {}).get("tap_layer_ids")
        self.cached = cached == trainer.drafter.cfg.target_layer_ids and not need_logits
        self.dir, self.trainer, self.need_logits = data_dir / "taps", trainer, need_logits
        self.tap_cache = None
        if tap_cache is not None and not self.cached:
            if need_logits:
                raise LoopspecError(
                    "--tap-cache keeps taps only; forward KL (--kl-weight), total variation (--tv-weight) "
                    "and the soft confidence label (--confidence-label tv) need the target's logits at "
                    "every step, so they compute both online: drop one of the two"
                )
            self.tap_cache = Path(tap_cache)
            self._claim(self.tap_cache, manifest.get("target_sha256"), trainer.drafter.cfg.target_layer_ids)

    @staticmethod
    def _claim(directory: Path, target_hash: str | None, layers: list[int]) -> None:
        """A tap cache holds one target's taps of one set of layers: refuse to mix another's in."""
        mine = {"kind": TAP_CACHE_KIND, "target_sha256": target_hash, "tap_layer_ids": list(layers), "dtype": "float16"}
        path = directory / "manifest.json"
        if path.is_file():
            try:
                theirs = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise LoopspecError(f"{path} is corrupt (not a tap cache manifest)") from None
            if theirs != mine:
                raise LoopspecError(
                    f"{directory} holds taps of another target or layers "
                    f"({theirs.get('tap_layer_ids')} there, {list(layers)} here); use a new --tap-cache"
                )
            return
        if directory.is_dir() and any(directory.iterdir()):
            raise LoopspecError(f"{directory} is not empty and not a tap cache; use a new --tap-cache")
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(mine, indent=2) + "\n")

    def __call__(self, sample: Sample, tokens: torch.Tensor):
        if self.cached:
            path = self.dir / f"{safe_name(sample.id)}.safetensors"
            if path.is_file():
                return read_safetensors(path)["taps"].float(), None
        if self.tap_cache is None:
            return self.trainer.target_pass(tokens, self.need_logits)
        path = self.tap_cache / f"{safe_name(sample.id)}.safetensors"
        if path.is_file():
            kept = read_safetensors(path)
            # taps are those of exactly these tokens (a sample id of other data, or a longer max_len,
            # recomputes): the file keeps the tokens it was computed from
            if "tokens" in kept and torch.equal(kept["tokens"].long(), tokens):
                return kept["taps"].float(), None
        taps = self.trainer.target_pass(tokens, False)[0][: tokens.numel() - 1].to(torch.float16)
        partial = path.with_suffix(".partial")  # a kill mid-write leaves no half file under the real name
        write_safetensors({"taps": taps, "tokens": tokens.to(torch.int32)}, partial)
        partial.replace(path)
        return taps.float(), None  # the first epoch sees the fp16 taps the later ones read back


# each training family's trainer: its loss, held-out τ and taps (TrainConfig checks the family once)
TRAINERS = {"dflash": DrafterTrainer, "eagle3": Eagle3Trainer, "dflash2": DFlash2Trainer}
HELDOUT_TOP_KS = (2, 4)  # the held-out τ of draft trees holding each position's top 2 / top 4


@dataclass
class HeldOutPrompts:
    """Prompts the user holds out of training (--heldout-prompts), on which the run measures the
    drafter's chain τ at step 0 and every `every` steps: `measure(drafter)` decodes `prompts` (token
    ids; `names` says where each came from, "file:line") as the runtime does and returns
    {"tau": ..., "block_size": ...}. The caller hands it in: training code does not import the runtime."""

    prompts: list[list[int]]
    names: list[str]
    measure: Callable[[Drafter], dict]
    every: int

    def check_held_out(self, train_set: list[Sample]) -> None:
        """Refuse held-out prompts the run trains on: their τ would measure memory, not drafting."""
        trained = {tuple(s.tokens[: s.prompt_len]) for s in train_set}
        seen = [name for name, ids in zip(self.names, self.prompts) if tuple(ids) in trained]
        if seen:
            raise LoopspecError(
                f"{len(seen)} of the {len(self.prompts)} held-out prompts (--heldout-prompts) are prompts "
                f"the run trains on (the first: {seen[0]}); hold out prompts the data does not hold"
            )

    def row(self, drafter: Drafter) -> dict:
        """The log row's keys of one measurement."""
        measured = self.measure(drafter)
        return {"heldout_chain_tau": measured["tau"], "heldout_chain_block": measured["block_size"]}


def heldout_split(samples: list, eval_samples: int, rng: random.Random) -> tuple[list, list]:
    """(held out, train): a seeded shuffle, then min(eval_samples, a tenth of the data, at least 1)
    samples held out. The split depends on the data, so compare held-out τ across runs on the same data."""
    order = list(range(len(samples)))
    rng.shuffle(order)
    n_eval = min(eval_samples, max(1, len(samples) // 10))
    return [samples[i] for i in order[:n_eval]], [samples[i] for i in order[n_eval:]]


def train_drafter(
    *,
    data_dir: str | Path,
    target: Target,
    drafter: Drafter,
    out_dir: str | Path,
    cfg: TrainConfig,
    draft_vocab: DraftVocab | None = None,
    resume: bool = True,
    progress: bool = True,
    max_steps: int | None = None,
    max_seconds: float | None = None,
    stop_after_steps: int | None = None,
    tap_cache: str | Path | None = None,
    heldout: HeldOutPrompts | None = None,
    campaign: Campaign | None = None,
) -> dict:
    """max_steps shortens the schedule; stop_after_steps and max_seconds stop (and save) early on the
    unchanged schedule, so a re-run resumes the same trajectory from the checkpoint. `heldout`: chain τ
    on held-out prompts, logged beside the split's expected τ; `campaign`: the campaign file this run
    keeps its record in (written at its start, at every checkpoint and at its end)."""
    from tqdm import tqdm

    data_dir, out_dir = Path(data_dir), Path(out_dir)
    samples = [s for s in read_samples(data_dir) if len(s.tokens) - s.prompt_len >= 2]
    if len(samples) < 2:
        raise LoopspecError(f"{data_dir} has too few usable samples ({len(samples)})")
    rng = random.Random(cfg.seed)
    eval_set, train_set = heldout_split(samples, cfg.eval_samples, rng)
    if heldout is not None:
        heldout.check_held_out(train_set)
    steps_per_epoch = max(1, len(train_set) // cfg.batch_sequences)
    total_steps = max(1, int(cfg.epochs * steps_per_epoch))
    if max_steps is not None:
        total_steps = min(total_steps, max_steps)

    torch.manual_seed(cfg.seed)
    if draft_vocab is not None:
        drafter.draft_ids = draft_vocab.ids  # every save writes its d2t map
    compute_context(cfg)  # an unknown compute dtype fails here, before any work
    trainer = TRAINERS[cfg.family](target, drafter, cfg, draft_vocab)
    taps = TapSource(
        data_dir,
        trainer,
        need_logits=cfg.needs_target_logits,
        tap_cache=Path(tap_cache) if tap_cache is not None else None,
    )
    if cfg.heads_only:  # (a drafter without heads is refused by the trainer: TrainConfig.check_drafter)
        heads = drafter.cfg.kind.heads
        for name, p in drafter.named_parameters():  # the backbone's drafts stay the init's
            p.requires_grad_(name.split(".")[0] in heads)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    state_path = out_dir / "checkpoint" / "train_state.pt"
    log_path = out_dir / "train_log.jsonl"
    step, elapsed = 0, 0.0
    if resume and state_path.is_file():
        try:
            state = torch.load(state_path, weights_only=False)
        except Exception as e:  # truncated or foreign file: say which, keep it for inspection
            raise LoopspecError(f"cannot resume from {state_path}: {e} (move it away to start over)") from None
        drafter.load_state_dict(state["drafter"])
        optimizer.load_state_dict(state["optimizer"])
        step, elapsed = state["step"], state.get("elapsed", 0.0)
        rng.setstate(state["rng"])
    out_dir.mkdir(parents=True, exist_ok=True)
    if log_path.is_file():  # rows of steps after the checkpoint (a run stopped between saves) are redone
        rows = [line for line in log_path.read_text().splitlines() if line.strip()]
        log_path.write_text(
            "".join(line + "\n" for line in rows if json.loads(line).get("step", 0) <= step) if step else ""
        )
    step_from = step
    if campaign is not None:
        campaign.begin(data_dir=data_dir, out_dir=out_dir, step=step, total_steps=total_steps, config=asdict(cfg))

    def curve() -> list[dict]:
        """This run's held-out τ rows of the log: its step-0 row when it started fresh, then its own steps."""
        points = []
        for line in log_path.read_text().splitlines() if log_path.is_file() else []:
            row = json.loads(line)
            mine = row["step"] > step_from or row["step"] == step_from == 0
            if mine and any(k.startswith("heldout_") for k in row):
                points.append({k: v for k, v in row.items() if k == "step" or k.startswith("heldout_")})
        return points

    def evaluate() -> dict:
        """{"heldout_tau": ..., "heldout_tau_top2": ..., "heldout_tau_top4": ...} (see expected_tau)"""
        drafter.eval()
        sums, count = {}, 0
        for s in eval_set:
            tokens = torch.tensor(s.tokens[: cfg.max_len])
            mask = torch.tensor(s.loss_mask[: cfg.max_len])
            t, _ = taps(s, tokens)
            one, c = trainer.expected_tau(tokens, mask, t, top_ks=HELDOUT_TOP_KS)
            sums = {k: sums.get(k, 0.0) + v for k, v in one.items()}
            count += c
        drafter.train()
        return {("heldout_tau" if k == "tau" else f"heldout_tau_top{k}"): v / max(count, 1) for k, v in sums.items()}

    def save(final: bool = False) -> None:
        ck = out_dir / "checkpoint"
        ck.mkdir(parents=True, exist_ok=True)
        drafter.save(ck, dtype=torch.float32)
        torch.save(
            {
                "drafter": drafter.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "elapsed": elapsed,
                "rng": rng.getstate(),
                "config": asdict(cfg),
            },
            state_path,
        )
        if campaign is not None:  # the record says what the checkpoint holds: a killed run resumes from it
            campaign.update(step=step, curve=curve())

    if step == 0:  # where the run starts (an --init drafter's held-out τ, before any step)
        first = {"step": 0, **evaluate(), **(heldout.row(drafter) if heldout is not None else {}), "elapsed_s": 0.0}
        with open(log_path, "a") as f:
            f.write(json.dumps(first) + "\n")
    drafter.train()
    bar = tqdm(total=total_steps, initial=step, desc="training drafter", disable=not progress)
    t_start = time.time() - elapsed
    last = {}
    cursor = step * cfg.batch_sequences
    while step < total_steps:
        lr = lr_at(step, total_steps, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss_total, correct, labels, used, brier, tv, selector = 0.0, 0, 0, 0, None, None, {}
        for _ in range(cfg.batch_sequences):
            s = train_set[cursor % len(train_set)]
            cursor += 1
            tokens = torch.tensor(s.tokens[: cfg.max_len])
            mask = torch.tensor(s.loss_mask[: cfg.max_len])
            t, logits = taps(s, tokens)
            with compute_context(cfg):
                if cfg.loop_stages > 0:
                    loss, st = trainer.loop_sequence_loss(tokens, mask, t, rng)
                else:
                    loss, st = trainer.sequence_loss(tokens, mask, t, rng, logits)
            if loss is None:
                continue
            (loss / cfg.batch_sequences).backward()
            loss_total += loss.item()
            correct += st["correct"]
            labels += st["labels"]
            if "confidence_brier" in st:
                brier = (brier or 0.0) + st["confidence_brier"]
            if "tv_sum" in st:
                tv = (tv or 0.0) + st["tv_sum"]
            for key in ("selector_slots", "selector_covered", "selector_correct"):
                if key in st:
                    selector[key] = selector.get(key, 0) + st[key]
            used += 1
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.clip))
        optimizer.step()
        step += 1
        elapsed = time.time() - t_start
        last = {
            "step": step,
            "loss": loss_total / max(used, 1),
            "acc": correct / max(labels, 1),
            "lr": lr,
            "grad_norm": grad_norm,
            "elapsed_s": round(elapsed, 1),
        }
        if brier is not None:  # the confidence head's Brier score on this step's drafts
            last["confidence_brier"] = brier / max(labels, 1)
        if tv is not None:  # the drafts' mean total variation to the target (1 - it: sampled acceptance)
            last["tv"] = tv / max(labels, 1)
        if selector:  # a DFlash2 selector: the share of slots whose data token is a candidate, its teacher-forced pick
            slots = max(selector["selector_slots"], 1)
            last["selector_coverage"] = selector["selector_covered"] / slots
            last["selector_acc"] = selector["selector_correct"] / slots
        if step % cfg.eval_every == 0 or step == total_steps:
            last.update(evaluate())
        if heldout is not None and (step % heldout.every == 0 or step == total_steps):
            last.update(heldout.row(drafter))
        with open(log_path, "a") as f:
            f.write(json.dumps(last) + "\n")
        bar.update(1)
        bar.set_postfix(
            loss=f"{last['loss']:.3f}",
            acc=f"{last['acc']:.2f}",
            **({"tau": f"{last['heldout_tau']:.2f}"} if "heldout_tau" in last else {}),
        )
        if step % cfg.save_every == 0:
            save()
        if (max_seconds is not None and elapsed > max_seconds) or (stop_after_steps and step >= stop_after_steps):
            break
    bar.close()
    save()
    drafter.cfg.extra = {
        **drafter.cfg.extra,
        "training": {"steps": step, "wall_s": round(elapsed, 1), "samples": len(train_set), "config": asdict(cfg)},
    }
    drafter.save(out_dir, dtype=torch.bfloat16)
    if campaign is not None:  # finished: the drafter it names is written
        campaign.update(step=step, curve=curve(), finished=True)
    return last
