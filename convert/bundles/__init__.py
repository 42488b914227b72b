"""Serving bundles: TensorRT-LLM, vLLM and SGLang serve the target with the DFlash drafter in the z-lab
format they all load; llama.cpp serves a GGUF target with the drafter as a llama.cpp `dflash` GGUF.
A DSpark drafter (Markov / confidence heads) goes to the frameworks that run its heads: TensorRT-LLM
(`decoding_type: DSpark`), vLLM (method `dspark`) and SGLang (`DSPARK`), all reading DeepSpec's
`Qwen3DSparkModel` layout, and llama.cpp (the dflash GGUF with the heads, draft-dspark). A DFlash2
drafter (z-lab's `DFlash2DraftModel`) goes to vLLM (method `dflash`) and SGLang (`DFLASH`), which pick
their DFlash2 model from its architecture, and to llama.cpp through llama.cpp's own converter.

A bundle directory holds
  drafter/    z-lab config.json + model.safetensors, full draft vocabulary (what every framework reads);
              for a DSpark drafter DeepSpec's config.json and key names instead (what TensorRT-LLM,
              vLLM and SGLang read as a DSpark drafter)
  target/     Hugging Face checkpoint (config.json, *.safetensors, tokenizer files), optionally
              modelopt-quantized (FP8 / NVFP4)
  trtllm/     extra_llm_api_options.yaml + launch.sh      (only the frameworks asked for)
  vllm/       launch.sh (+ drafter/: the drafter with its reduced draft vocabulary, when it has one)
  sglang/     launch.sh
  llamacpp/   target.gguf (a copy of the target GGUF), drafter.gguf, launch.sh (an EAGLE-3 or DFlash2
              drafter: its checkpoint, the target's config and tokenizer, and convert.sh, which
              writes drafter.gguf with llama.cpp's own converter at the first launch)
  README.md   what each framework uses, how to launch, the support matrix
  manifest.json  sha256 of every file, source hashes, tool versions

drafter/ and target/ are written only when a framework that reads them is asked for; a llama.cpp-only
bundle holds llamacpp/ (with the README and manifest) alone.

Launch scripts cd into the bundle root and use relative paths (`./target`, `./drafter`), so a bundle
can be copied to the serving machine as it is. DLoop runs only in loopspec's own runtime.

One module per serving framework holds its record (`ServingFramework`: what target it serves, its
launch files, its README lines, its row of the support matrix) with the facts about that framework
it relies on, among them which drafter kinds it takes and why it refuses the rest (its `kind_refusal`);
`FRAMEWORKS` lists them.
"""

from __future__ import annotations

import json
from pathlib import Path

from loopspec.convert.bundles.common import (
    DTYPES,
    GGUF_TARGET,
    HF_TARGET,
    BundleParts,
    LaunchSettings,
    ServingFramework,
    drafts_in_steps,
    manifest,
    readme,
)
from loopspec.convert.bundles.common import support_matrix_markdown as _support_matrix
from loopspec.convert.bundles.hf_checkpoint import write_hf_checkpoint
from loopspec.convert.bundles.llamacpp import LLAMACPP
from loopspec.convert.bundles.sglang import SGLANG
from loopspec.convert.bundles.trtllm import TRTLLM
from loopspec.convert.bundles.vllm import VLLM
from loopspec.defaults import DEFAULT_DRAFTER_DIR, DEFAULT_TARGET_MASK_TOKEN_ID
from loopspec.engines.llamacpp import gguf_target_info
from loopspec.engines.staging import check_out_dir, staged_dir
from loopspec.errors import LoopspecError
from loopspec.pair import resolve_mask_token_id
from loopspec.model.drafter_kinds import DrafterKind
from loopspec.model.drafters import load_drafter
from loopspec.model.families import target_config
from loopspec.precisions import precision_names
from loopspec.settings import DecodingSettings, resolve_settings
from loopspec.weights import TargetSource, file_sha256, load_tokenizer, read_json, target_fingerprint

# every serving framework a bundle can target, in the order bundles list them
FRAMEWORKS: dict[str, ServingFramework] = {f.name: f for f in (TRTLLM, VLLM, SGLANG, LLAMACPP)}
PRECISIONS = precision_names(weights=("modelopt",))  # quantized checkpoints a bundle can carry
DEFAULT_MAX_CONTEXT = 4096  # tokens per request (prompt + output), capped at the target's own maximum
SETTING_KNOBS = ("block_size", "tree_budget")  # the decoding knobs a bundle's engines take (an EAGLE-3 drafter's)

HF_ONLY_OPTIONS = (
    "--tp and --precision apply to TensorRT-LLM, vLLM and SGLang; llama.cpp serves the target GGUF "
    "as it is, in one process"
)
NEEDS_GGUF = (
    "{title} serves a GGUF target, and {target} is a checkpoint directory: pass --target "
    "default or a .gguf file (llama.cpp's convert_hf_to_gguf.py makes one from a Hugging Face "
    "checkpoint), or leave {name} out of --engine"
)


def support_matrix_markdown() -> str:
    """Which framework supports what (README and docs/serving.md print it)."""
    return _support_matrix(list(FRAMEWORKS.values()))


def build_bundle(
    target: str | Path | TargetSource,
    drafter: str,
    out_dir: str | Path,
    frameworks: str | list[str],
    *,
    precision: str | None = None,
    tp: int = 1,
    dtype: str = "bfloat16",
    mask_token_id: int | None = None,
    max_batch_size: int = 8,
    max_context: int | None = None,
    calib_prompts: str | None = None,
    calib_size: int | None = None,
    threads: int | None = None,
    setting: dict | None = None,
) -> dict:
    """Write a serving bundle for `frameworks` (names, comma-separated or a list, or 'all') into
    `out_dir`; returns its manifest. `threads` is the llama.cpp launch's default -t (None: all cores).
    `setting`: the decoding knobs an EAGLE-3 drafter's engines draft with ({"block_size": k,
    "tree_budget": n}, as --block-size / --tree-budget give them; one not given, or None, comes from
    the drafter's stored setting, else its block size and the chain); a block drafter drafts its block."""
    source = TargetSource.of(target)
    every = frameworks == "all" or frameworks == ["all"]
    names = parse_frameworks(frameworks, gguf_target=source.gguf is not None)
    if precision is not None and precision not in PRECISIONS:
        raise LoopspecError(f"unknown precision {precision!r} (choose from {', '.join(PRECISIONS)})")
    if dtype not in DTYPES:
        raise LoopspecError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if max_batch_size < 1:
        raise LoopspecError(f"max batch size must be >= 1, got {max_batch_size}")
    for name in names:
        if FRAMEWORKS[name].target == GGUF_TARGET and source.gguf is None:
            raise LoopspecError(NEEDS_GGUF.format(title=FRAMEWORKS[name].title, target=target, name=name))
    _check_hf_only_options(names, tp, precision)
    if threads is not None and threads < 1:
        raise LoopspecError(f"threads must be >= 1, got {threads}")
    out = check_out_dir(out_dir, "manifest.json", "a bundle")

    drafter_dir = _resolve_drafter(drafter, source)
    model = load_drafter(drafter_dir)
    cfg = model.cfg
    drafting = drafting_setting(cfg, setting)
    chosen = [FRAMEWORKS[name] for name in frameworks_for(cfg.kind, names, every, drafting.tree_budget)]
    _check_hf_only_options([f.name for f in chosen], tp, precision)
    hf = any(f.target == HF_TARGET for f in chosen)
    target_dir = target_cfg = None
    # an EAGLE-3 drafter's taps and fit are the checkpoint's, for any framework; llama.cpp's converter reads it
    if hf or drafts_in_steps(cfg.kind) or any(f.reads_checkpoint and f.reads_checkpoint(cfg.kind) for f in chosen):
        target_dir = source.checkpoint_dir()
        target_cfg = target_config(read_json(target_dir / "config.json", "target config"))
        positions, vocab_size = target_cfg.max_position_embeddings, target_cfg.vocab_size
    else:  # GGUF frameworks alone read nothing but the GGUF
        info = gguf_target_info(source.gguf)
        positions, vocab_size = info["context_length"] or DEFAULT_MAX_CONTEXT, info["vocab_size"]
    max_context = resolve_max_context(max_context, positions)
    if cfg.kind.masks_block and cfg.mask_token_id is None:
        if mask_token_id is None and source.is_default:
            mask_token_id = DEFAULT_TARGET_MASK_TOKEN_ID
        # a GGUF's tokenizer names every row of its vocabulary: no unused row to take
        tokenizer_len = len(load_tokenizer(target_dir)) if hf else vocab_size
        cfg.mask_token_id = resolve_mask_token_id(mask_token_id, tokenizer_len, vocab_size)
    if target_cfg is not None:
        cfg.fit(target_cfg)  # an EAGLE-3 drafter without pinned taps gets the engines' default ones
    if hf:
        check_tp(tp, target_cfg.num_heads, target_cfg.num_kv_heads, "target")
        check_tp(tp, cfg.num_heads, cfg.num_kv_heads, "drafter")

    # the reduced draft vocabulary (d2t), None when the drafter has none
    vocab = None if model.draft_ids is None else int(model.draft_ids.numel())
    s = LaunchSettings(
        name=source.display_name,
        tp=tp,
        block_size=drafting.block_size,
        drafts=cfg.kind.drafts_per_block(drafting.block_size),
        mask_token_id=cfg.mask_token_id,
        target_layer_ids=list(cfg.target_layer_ids),
        precision=precision,
        max_batch_size=max_batch_size,
        max_context=max_context,
        drafter=cfg,
        draft_vocab=vocab,
        threads=threads,
        tree_budget=drafting.tree_budget,
    )
    fingerprint = target_fingerprint(target_dir) if hf else file_sha256(source.gguf, limit_bytes=16 << 20)
    sources = {
        "target": str(source),
        "target_fingerprint": fingerprint,
        "drafter": str(drafter_dir),
        "drafter_files": {p.name: file_sha256(p) for p in sorted(drafter_dir.glob("*")) if p.is_file()},
    }
    if source.gguf is not None:
        sources["target_gguf"] = str(source.gguf)
    parts = BundleParts(
        drafter=model,
        drafter_dir=drafter_dir,
        source=source,
        target_dir=target_dir,
        target_cfg=target_cfg,
        dtype=dtype,
        precision=precision,
        calib_prompts=calib_prompts,
        calib_size=calib_size,
    )

    with staged_dir(out) as tmp:
        for framework in chosen:  # first: their own parts (the GGUFs) fail fast, before a quantization
            if framework.write_parts:
                framework.write_parts(parts, tmp)
        if hf:
            write_hf_checkpoint(parts, tmp)
        for framework in chosen:
            for rel, text in framework.launch_files(s).items():
                path = tmp / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                if path.suffix == ".sh":
                    path.chmod(0o755)
        # a GGUF-only bundle serves the target GGUF in its own quantization
        label = dtype if hf else "gguf"
        (tmp / "README.md").write_text(readme(chosen, s, label, sources, support_matrix_markdown()))
        bundle_manifest = manifest(tmp, chosen, s, label, sources)
        (tmp / "manifest.json").write_text(json.dumps(bundle_manifest, indent=2) + "\n")
    return bundle_manifest


# --------------------------------------------------------------------------------------------------
# inputs


def parse_frameworks(text: str | list[str], gguf_target: bool = True) -> list[str]:
    """'trtllm', 'vllm,sglang' or 'all' → framework names in a fixed order. 'all' is every framework
    that can serve the target: those serving a GGUF only when the target is a GGUF file (`gguf_target`)."""
    names = text if isinstance(text, list) else [t.strip() for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return [f.name for f in FRAMEWORKS.values() if gguf_target or f.target == HF_TARGET]
    unknown = [n for n in names if n not in FRAMEWORKS]
    if unknown or not names:
        raise LoopspecError(
            f"unknown engine {', '.join(unknown) or repr(text)} (choose from {', '.join(FRAMEWORKS)} or all)"
        )
    return [name for name in FRAMEWORKS if name in names]


def frameworks_for(kind: DrafterKind, names: list[str], every: bool, tree_budget: int = 0) -> list[str]:
    """The frameworks of `names` that serve a drafter of this kind (with a draft tree of `tree_budget`
    nodes, 0: the chain): with `every` ('all'), those that can; otherwise all of them, or a one-line
    refusal naming the first that cannot and why."""
    usable = [n for n in names if FRAMEWORKS[n].refuses(kind, tree_budget) is None]
    if every and usable:
        return usable
    for name in names:
        why = FRAMEWORKS[name].refuses(kind, tree_budget)
        if why:
            able = [f.title for f in FRAMEWORKS.values() if f.refuses(kind, tree_budget) is None]
            what = f"this {kind.title} drafter" + (f" with a draft tree ({tree_budget} nodes)" if tree_budget else "")
            raise LoopspecError(
                f"{FRAMEWORKS[name].title} cannot serve {what}: {why}"
                + (f" (engines that can: {', '.join(able)})" if able else "")
            )
    return names


def drafting_setting(cfg, setting: dict | None) -> DecodingSettings:
    """The block size and tree budget the engines draft with: a block drafter's own block as a chain (a
    setting given for one is refused); an EAGLE-3 drafter's from `setting`, else its stored setting, else
    its block size and the chain (loopspec.settings.resolve_settings, method dflash: one stage)."""
    given = {k: v for k, v in (setting or {}).items() if v is not None}
    unknown = sorted(set(given) - set(SETTING_KNOBS))
    if unknown:
        raise LoopspecError(f"a bundle takes {' and '.join(SETTING_KNOBS)} from the decoding setting, not {unknown[0]}")
    if not drafts_in_steps(cfg.kind):
        if given:
            raise LoopspecError(
                f"--block-size and --tree-budget set an EAGLE-3 drafter's chain or tree; the engines "
                f"run this {cfg.kind.title} drafter's trained block of {cfg.block_size} as a chain"
            )
        return DecodingSettings("dflash", block_size=cfg.block_size)
    if given.get("block_size", 2) < 2:
        raise LoopspecError(
            f"an EAGLE-3 bundle drafts at least one token per verification: block size must be >= 2, "
            f"got {given['block_size']}"
        )
    return resolve_settings("dflash", cfg, **given)


def _check_hf_only_options(names: list[str], tp: int, precision: str | None) -> None:
    if not any(FRAMEWORKS[n].target == HF_TARGET for n in names) and (tp != 1 or precision is not None):
        raise LoopspecError(HF_ONLY_OPTIONS)


def check_tp(tp: int, heads: int, kv_heads: int, what: str) -> None:
    """Attention heads are split across GPUs; K/V heads are split or replicated evenly."""
    if tp < 1:
        raise LoopspecError(f"--tp must be >= 1, got {tp}")
    if heads % tp or (kv_heads % tp and tp % kv_heads):
        raise LoopspecError(
            f"tensor parallel size {tp} does not split the {what}'s {heads} attention heads / "
            f"{kv_heads} K/V heads evenly"
        )


def resolve_max_context(max_context: int | None, limit: int) -> int:
    """The frameworks' per-request token limit: the given one, else DEFAULT_MAX_CONTEXT within the
    target's `limit` positions."""
    if max_context is None:
        return min(DEFAULT_MAX_CONTEXT, limit)
    if max_context < 1 or max_context > limit:
        raise LoopspecError(f"max context must be between 1 and the target's {limit} positions, got {max_context}")
    return max_context


def _resolve_drafter(drafter: str, source: TargetSource) -> Path:
    if drafter == "default":
        if not source.is_default or not DEFAULT_DRAFTER_DIR.is_dir():
            raise LoopspecError(
                "a bundle needs a trained drafter: pass --drafter DIR (the shipped one fits only --target default)"
            )
        return DEFAULT_DRAFTER_DIR
    return Path(drafter)
