"""Check an exported artifact directory against the PyTorch reference modules, through the engine
the runtime runs on it: `artifact_engine("onnxruntime", dir)`, driven by the Engine protocol's calls
(prefill, verify, target_rollback, append_context, append_pseudo_context, context_rollback, draft), the
code `loopspec generate --onnx-dir` runs, so what passes here is what decodes there.

1. Per engine and output: the largest absolute error relative to the output's scale
   (max |engine - ref| / max |ref|) on real inputs, against a tolerance per precision. target_verify:
   a prefill, then a draft-tree verification (its logits and taps as `verify` returns them, its new
   K/V as the engine stored them in its KV cache), the reference verifying over the prefix the
   engine stored. The drafter's engines get the reference's features (`append_context` of the
   reference taps, `append_pseudo_context` of the reference block's hidden states) and are read back
   from the engine's context cache; the block engine (`draft`, a DSpark drafter's Markov correction
   and confidence included) is checked against the drafter's own draft step (`stage_drafts`: the
   draft head, or a DFlash2 drafter's selector walk), as the torch engine runs it, on the context the
   engine holds: each figure is its own graph's error.
2. Greedy decoding of the target on a few prompts, as `ar` drives the engine: the token sequences
   must be identical (fp32), and one verification of them must give them back.
3. With a drafter: the offline acceptance length τ of both drafters along the reference greedy
   trajectory (one block drafted at every position, accepted prefix + 1; the engine drafts on the
   context its own decoding appended, rolled back to each anchor); the drop of the exported
   drafter's τ must stay under a limit per precision (quantized drafters lose a little, fp32 none).

An EAGLE-3 drafter's two graphs are checked against the torch engine's EAGLE-3 path instead
(convert/eagle3_validate.py): the same report, the same limits.

The report goes into the manifest (`validation`) and is returned.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from loopspec.convert.eagle3_validate import eagle3_acceptance, eagle3_engine_errors
from loopspec.engines.backends import artifact_engine
from loopspec.engines.manifest import read_manifest
from loopspec.engines.protocol import Engine
from loopspec.engines.specs import DRAFTER_BLOCK, DRAFTER_CONTEXT, DRAFTER_CONTEXT_HIDDEN, TARGET_STEP, TARGET_VERIFY
from loopspec.errors import LoopspecError
from loopspec.precisions import REGISTRY
from loopspec.model.dflash import Drafter
from loopspec.model.draft_head import draft_head_weight
from loopspec.model.kv_cache import KVCache
from loopspec.model.target import Target

# per precision: the tolerances of loopspec/precisions.py (those it validates: the ones that have some)
TOLERANCES = {name: p.tolerance for name, p in REGISTRY.items() if p.tolerance}
PROMPT_TEXTS = (
    "The quick brown fox jumps over the lazy dog because",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Explain in two sentences why the sky is blue.",
)


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().cpu(), ref.detach().cpu()
    if got.shape != ref.shape:
        raise LoopspecError(f"output shape {tuple(got.shape)} differs from the reference's {tuple(ref.shape)}")
    if not got.is_floating_point():
        return float((got != ref).float().mean())  # share of differing ids
    ref = ref.float()
    scale = max(float(ref.abs().max()), 1e-6)
    return float((got.float() - ref).abs().max()) / scale


def stored(cache: KVCache, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row 0's K/V in slots start..end-1 of one of the engine's caches. Every engine keeps its
    target KV cache and its block drafter context as `KVCache`s (`cache`, `context.kv`; engines/protocol.py);
    the protocol returns no K/V, and these are what the next call attends over."""
    return cache.k[:, :1, :, start:end].clone(), cache.v[:, :1, :, start:end].clone()


class Reference:
    """The PyTorch reference modules, driven as the engines are (the runtime is not imported here)."""

    def __init__(self, target: Target, drafter: Drafter | None):
        self.target, self.drafter = target.eval(), drafter.eval() if drafter is not None else None
        if drafter is not None:
            target.set_taps(drafter.cfg.target_layer_ids)
            self.head = draft_head_weight(target.lm_head.weight, drafter.draft_ids)

    @torch.inference_mode()
    def block(self, anchor: int, position: int, k: int, ctx_k, ctx_v):
        """One stage → drafts [D, C], log-probs [D, C], hidden [k, H], confidence [D] (None without a
        confidence head): the torch engine's draft-head step, a DSpark drafter's heads or a DFlash2
        drafter's selector walk included."""
        d = self.drafter
        ids = torch.full((1, k), d.cfg.mask_token_id, dtype=torch.long)
        ids[0, 0] = anchor
        hidden = d(self.target.embed_tokens(ids), torch.arange(position, position + k), ctx_k, ctx_v)  # [1, k, H]
        # the drafter's own draft step: the draft head (DSpark's heads), or a DFlash2 drafter's selector walk
        stage = d.stage_drafts(hidden, ids[:, 0], lambda h: F.linear(h, self.head), d.draft_ids)  # [1, D, C] each
        return stage[0][0], stage[1][0], hidden[0], None if stage.confidence is None else stage.confidence[0]

    @torch.inference_mode()
    def context(self, features: torch.Tensor, start: int, from_taps: bool = True):
        d = self.drafter
        if from_taps:
            features = d.features(features)
        return d.context_kv(features, torch.arange(start, start + features.shape[1]))


def engine_errors(ref: Reference, engine: Engine, prompt: list[int], block_size: int) -> dict:
    """{engine: {output: relative error}} on the first prompt, in row 0 of `engine` (a prefill of all
    but 4 tokens, then a 4-token draft-tree verification, the reference verifying over the same
    prefix; then the drafter's engines on the reference taps)."""
    target, out = ref.target, {}
    P = max(1, len(prompt) - 4)
    T = len(prompt) - P
    tree = torch.ones(1, T, T, dtype=torch.bool).tril()  # the verification checks a draft tree:
    tree[:, 2:, 1] = False  # token 2 is token 1's sibling (both children of token 0), token 3 token 2's child
    tree = None if engine.chains_only else tree  # an engine that verifies chains only: a chain
    engine.prefill(0, prompt[:P], want_taps=False)
    # the reference verifies over the prefix the engine stored: the figures are the verification's own
    # error, not the prefill's carried along (a quantized target's prefix differs from fp32's)
    cache = target.new_cache(len(prompt) + 1)
    cache.append(*stored(engine.cache, 0, P))
    with torch.inference_mode():
        first = target(torch.tensor([prompt[:P]]), target.new_cache(P), want_taps=ref.drafter is not None)
        second = target(torch.tensor([prompt[P:]]), cache, want_taps=ref.drafter is not None, tree_mask=tree)
    logits, taps = engine.verify([prompt[P:]], want_taps=ref.drafter is not None, tree_masks=tree)
    new_key, new_value = stored(engine.cache, P, P + T)
    errors = {
        "logits": relative_error(logits[:, :T], second.logits),  # a lone token runs with a padding token
        "new_key": relative_error(new_key, cache.k[:, :, :, P : P + T]),
        "new_value": relative_error(new_value, cache.v[:, :, :, P : P + T]),
    }
    if taps is not None:
        errors["taps"] = relative_error(taps[:, :T], second.taps)
    out[engine.target_graph] = errors
    if ref.drafter is None or ref.drafter.cfg.kind.chain:  # an EAGLE-3 drafter's graphs: convert/eagle3_validate.py
        return out
    taps = torch.cat([first.taps, second.taps], dim=1)  # [1, len(prompt), n·H]
    n = taps.shape[1]
    ctx_k, ctx_v = ref.context(taps, 0)
    engine.context_rollback([0], [0])
    engine.append_context(taps, [n])
    got_k, got_v = stored(engine.context.kv, 0, n)
    out[DRAFTER_CONTEXT] = {"context_key": relative_error(got_k, ctx_k), "context_value": relative_error(got_v, ctx_v)}
    # the reference block on the context the engine holds: the block engine's own error
    drafts, logprobs, hidden, confidence = ref.block(prompt[-1], n, block_size, got_k, got_v)
    stage = engine.draft([0], [prompt[-1]], [n], block_size)
    got_drafts, got_logprobs, got_hidden = stage
    out[DRAFTER_BLOCK] = {
        "draft_ids": relative_error(got_drafts[0], drafts),
        "draft_logprobs": relative_error(got_logprobs[0], logprobs),
        "hidden": relative_error(got_hidden[0], hidden),
    }
    if confidence is not None:  # a DSpark drafter's acceptance estimates
        out[DRAFTER_BLOCK]["confidence"] = relative_error(stage.confidence[0], confidence)
    pseudo_k, pseudo_v = ref.context(hidden[None, 1:], n, from_taps=False)
    engine.append_pseudo_context([0], hidden[None, 1:])
    got_k, got_v = stored(engine.context.kv, n, n + block_size - 1)
    out[DRAFTER_CONTEXT_HIDDEN] = {
        "context_key": relative_error(got_k, pseudo_k),
        "context_value": relative_error(got_v, pseudo_v),
    }
    return out


@torch.inference_mode()
def reference_greedy(target: Target, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor | None]:
    """Plain greedy decoding of the reference target → (new tokens, taps of every position but the last)."""
    cache = target.new_cache(len(prompt) + new_tokens)
    out = target(torch.tensor([prompt]), cache, last_logits_only=True)
    tokens, taps = [int(out.logits[0, -1].argmax())], [out.taps]
    while len(tokens) < new_tokens:
        out = target(torch.tensor([[tokens[-1]]]), cache)
        tokens.append(int(out.logits[0, -1].argmax()))
        taps.append(out.taps)
    return tokens, (torch.cat(taps, dim=1) if taps[0] is not None else None)


def engine_greedy(engine: Engine, prompt: list[int], new_tokens: int) -> list[int]:
    """The same decoding by the engine in row 0, as `ar` runs it: a prefill, then one token a step
    (the engine pads a lone token); with a drafter, every position's taps but the last token's
    go to the drafter context, as decoding appends them."""
    want_taps = engine.has_drafter
    tokens = [int(engine.prefill(0, prompt, want_taps).argmax())]
    while len(tokens) < new_tokens:
        logits, taps = engine.verify([[tokens[-1]]], want_taps)
        if want_taps:
            engine.append_context(taps, [1])
        tokens.append(int(logits[0, 0].argmax()))
    return tokens


def verified_greedy(engine: Engine, prompt: list[int], tokens: list[int]) -> list[int]:
    """The engine's argmax after the prompt and after each of `tokens`, from ONE verification of
    prompt + tokens in row 0, emptied first: what a verification of those tokens as drafts would
    accept. Equal to `tokens` when verifying agrees with the engine's own plain decoding (which is
    what lossless means). The drafter context is left as it was."""
    engine.target_rollback([0])
    logits, _ = engine.verify([prompt + tokens[:-1]], want_taps=False)
    return logits[0, len(prompt) - 1 :].argmax(-1).tolist()


def offline_tau(draft, sequence: list[int], prompt_len: int) -> list[int]:
    """Tokens committed per anchor (accepted drafts + 1) when drafting one block at every position
    of `sequence` after the prompt: draft(anchor_position) → drafts for the positions after it (k-1
    or k of them, by the drafter's block convention)."""
    committed = []
    for a in range(prompt_len, len(sequence) - 1):
        drafts = draft(a).tolist()
        truth = sequence[a + 1 : a + 1 + len(drafts)]
        accepted = 0
        while accepted < len(truth) and drafts[accepted] == truth[accepted]:
            accepted += 1
        committed.append(accepted + 1)
    return committed


def acceptance(
    ref: Reference, engine: Engine, sequence: list[int], taps_ref: torch.Tensor, prompt_len: int, block_size: int
) -> tuple[list[int], list[int]]:
    """Offline τ per anchor of the reference drafter (reference taps) and of the engine's drafter, on
    the context row 0 holds after `engine_greedy` (the engine's own taps through its context engine),
    rolled back to each anchor, last first."""
    ctx_k, ctx_v = ref.context(taps_ref, 0)

    def draft_ref(a):
        return ref.block(sequence[a], a, block_size, ctx_k[:, :, :, :a], ctx_v[:, :, :, :a])[0][:, 0]  # the chain

    chains = {}
    for a in reversed(range(prompt_len, len(sequence) - 1)):
        engine.context_rollback([0], [a])
        chains[a] = engine.draft([0], [sequence[a]], [a], block_size)[0][0][:, 0]  # the chain
    return offline_tau(draft_ref, sequence, prompt_len), offline_tau(chains.__getitem__, sequence, prompt_len)


def validation_prompts(onnx_dir: Path, vocab_size: int) -> tuple[list[list[int]], str]:
    """A few real prompts through the artifact's own tokenizer; seeded random ids when it has none."""
    tokenizer_dir = onnx_dir / "target"
    if any((tokenizer_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from loopspec.weights import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_dir)
        prompts = [[t for t in tokenizer.encode(text) if t < vocab_size] for text in PROMPT_TEXTS]
        if all(len(p) >= 2 for p in prompts):
            return prompts, "tokenizer"
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (12 + 4 * i,), generator=g).tolist() for i in range(3)], "random ids"


def validate_onnx(
    onnx_dir: str | Path,
    target: Target,
    drafter: Drafter | None,
    precision: str = "fp32",
    new_tokens: int = 16,
    num_threads: int | None = None,
) -> dict:
    """Validate every engine in `onnx_dir` against `target`/`drafter` (the reference modules it was
    exported from); return the report and store it in the manifest as `validation`."""
    if precision not in TOLERANCES:
        raise LoopspecError(f"unknown precision {precision!r} (known: {', '.join(TOLERANCES)})")
    onnx_dir = Path(onnx_dir)
    manifest = read_manifest(onnx_dir, verify=False)  # the engine below verifies every file's hash
    if manifest.precision != precision:
        raise LoopspecError(f"{onnx_dir} holds {manifest.precision} engines, not {precision}")
    t0 = time.perf_counter()
    # refuses what ONNX Runtime cannot run here (NVFP4), as `generate --onnx-dir` does
    engine = artifact_engine("onnxruntime", onnx_dir, num_threads=num_threads)
    if engine.has_drafter != (drafter is not None):
        raise LoopspecError(
            f"{onnx_dir} {'has' if engine.has_drafter else 'has no'} drafter engines but "
            f"{'a' if drafter is not None else 'no'} reference drafter was given"
        )
    limits = TOLERANCES[precision]
    ref = Reference(target, drafter)
    prompts, prompt_source = validation_prompts(onnx_dir, target.cfg.vocab_size)
    block_size = drafter.cfg.block_size if drafter is not None else 1

    chain = drafter is not None and drafter.cfg.kind.chain
    errors = engine_errors(ref, engine, prompts[0], block_size)
    if chain:
        errors |= eagle3_engine_errors(target, drafter, engine, prompts[0], block_size, relative_error)
    report = {
        "precision": precision,
        "tolerance": limits,
        "prompts": len(prompts),
        "prompt_source": prompt_source,
        "new_tokens": new_tokens,
        "engines": {},
    }
    for name, outputs in errors.items():
        # draft ids may differ where two logits tie within the tolerance; the τ check covers them
        worst = max(v for k, v in outputs.items() if k != "draft_ids")
        tolerance = limits.get("target" if name in (TARGET_VERIFY, TARGET_STEP) else "drafter", limits["relative"])
        report["engines"][name] = {
            "errors": outputs,
            "tolerance": tolerance,
            "passed": tolerance is None or worst <= tolerance,
        }

    identical, agreeing, taus_ref, taus_onnx = True, [], [], []
    for prompt in prompts:
        ref_tokens, ref_taps = reference_greedy(target, prompt, new_tokens)
        tokens = engine_greedy(engine, prompt, new_tokens)
        identical &= ref_tokens == tokens
        verified = verified_greedy(engine, prompt, tokens)
        agreeing += [a == b for a, b in zip(verified, tokens)]
        if drafter is not None:
            if chain:
                a, b = eagle3_acceptance(
                    target, drafter, engine, prompt + ref_tokens, len(prompt), block_size, offline_tau
                )
            else:
                a, b = acceptance(ref, engine, prompt + ref_tokens, ref_taps, len(prompt), block_size)
            taus_ref += a
            taus_onnx += b
    report["greedy_identical"] = identical
    report["verify_equals_plain"] = all(agreeing)
    report["verify_plain_agreement"] = round(float(np.mean(agreeing)), 4)  # share of positions
    passed = (
        all(e["passed"] for e in report["engines"].values())
        and (identical or not limits["greedy"])
        and (all(agreeing) or not limits["verify_equals_plain"])
    )
    if drafter is not None:
        tau_ref, tau_onnx = np.mean(taus_ref), np.mean(taus_onnx)
        drop = (tau_ref - tau_onnx) / tau_ref
        report["acceptance"] = {
            "tau_reference": round(float(tau_ref), 4),
            "tau_onnx": round(float(tau_onnx), 4),
            "relative_drop": round(float(drop), 4),
            "anchors": len(taus_ref),
            "passed": bool(limits["tau_drop"] is None or drop <= limits["tau_drop"]),
        }
        passed &= report["acceptance"]["passed"]
    report["passed"] = bool(passed)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    manifest.data["validation"] = report
    manifest.save()
    return report


def format_report(report: dict) -> str:
    lines = [
        f"validation ({report['precision']}, tolerance {report['tolerance']['relative']:g} relative): "
        f"{'PASSED' if report['passed'] else 'FAILED'} in {report['seconds']} s"
    ]
    for engine, r in report["engines"].items():
        errs = ", ".join(f"{k} {v:.1e}" for k, v in r["errors"].items())
        limit = f" (limit {r['tolerance']:g})" if r.get("tolerance") != report["tolerance"]["relative"] else ""
        lines.append(f"  {engine:<24}{'ok ' if r['passed'] else 'BAD'} {errs}{limit}")
    lines.append(
        f"  greedy decoding of {report['prompts']} prompts × {report['new_tokens']} tokens: "
        f"{'identical' if report['greedy_identical'] else 'DIFFERENT'} to PyTorch; one verification "
        f"of them {'equals' if report['verify_equals_plain'] else 'differs from'} the engine's plain decoding "
        f"({report['verify_plain_agreement']:.0%} of positions agree)"
    )
    if "acceptance" in report:
        a = report["acceptance"]
        tau_drop = report["tolerance"]["tau_drop"]
        lines.append(
            f"  offline tau over {a['anchors']} anchors: PyTorch {a['tau_reference']:.3f}, "
            f"ONNX {a['tau_onnx']:.3f} (drop {a['relative_drop']:+.1%}, "
            f"limit {'none' if tau_drop is None else format(tau_drop, '.0%')})"
        )
    return "\n".join(lines)
