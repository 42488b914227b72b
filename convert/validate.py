"""Check an exported artifact directory against the PyTorch reference modules.

1. Per engine and output: the largest absolute error relative to the output's scale
   (max |onnx - ref| / max |ref|) on real inputs, against a tolerance per precision.
2. Greedy decoding of the target on a few prompts: the token sequences must be identical (fp32).
   A DSpark drafter's block engine runs its Markov correction, so its drafts, log-probs and
   confidence are checked against `draft_stage`, the torch engine's own draft-head step.
3. With a drafter: the offline acceptance length τ of both drafters along the reference greedy
   trajectory (one block drafted at every position, accepted prefix + 1); the drop of the exported
   drafter's τ must stay under a limit per precision (quantized drafters lose a little, fp32 none).

The report goes into the manifest (`validation`) and is returned.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from loopspec.engines.manifest import read_manifest
from loopspec.engines.ort_engine import EngineSession, check_precision
from loopspec.engines.specs import (DRAFTER_BLOCK, DRAFTER_CONTEXT, DRAFTER_CONTEXT_HIDDEN, MIN_PRODUCT_ROWS,
                                    TARGET_VERIFY, past_feeds, past_layers, with_room)
from loopspec.errors import LoopspecError
from loopspec.precisions import REGISTRY
from loopspec.model.drafter import Drafter, draft_head_weight, draft_stage
from loopspec.model.target import Target

# per precision: the tolerances of loopspec/precisions.py (those it validates: the ones that have some)
TOLERANCES = {name: p.tolerance for name, p in REGISTRY.items() if p.tolerance}
PROMPT_TEXTS = ("The quick brown fox jumps over the lazy dog because",
                "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                "Explain in two sentences why the sky is blue.")


def relative_error(got: np.ndarray, ref: torch.Tensor) -> float:
    ref = ref.detach().float().numpy()
    if got.shape != ref.shape:
        raise LoopspecError(f"output shape {got.shape} differs from the reference's {ref.shape}")
    if got.dtype.kind in "iu":
        return float(np.mean(got != ref))  # share of differing ids
    scale = max(float(np.abs(ref).max()), 1e-6)
    return float(np.abs(got.astype(np.float32) - ref).max()) / scale


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
        confidence head): the torch engine's draft-head step, a DSpark drafter's heads included."""
        d = self.drafter
        ids = torch.full((1, k), d.cfg.mask_token_id, dtype=torch.long)
        ids[0, 0] = anchor
        hidden = d(self.target.embed_tokens(ids), torch.arange(position, position + k), ctx_k, ctx_v)  # [1, k, H]
        drafts, logprobs, confidence = draft_stage(d, hidden, ids[:, 0], lambda h: F.linear(h, self.head),
                                                   d.draft_ids)  # [1, D, C] each, [1, D]
        return drafts[0], logprobs[0], hidden[0], None if confidence is None else confidence[0]

    @torch.inference_mode()
    def context(self, features: torch.Tensor, start: int, from_taps: bool = True):
        d = self.drafter
        if from_taps:
            features = d.features(features)
        return d.context_kv(features, torch.arange(start, start + features.shape[1]))


def engine_errors(ref: Reference, sessions: dict[str, EngineSession], prompt: list[int], block_size: int) -> dict:
    """{engine: {output: relative error}} on the first prompt (prefill of all but 4 tokens, then a
    4-token draft-tree verification over the reference cache, then the drafter engines on the
    reference taps)."""
    target, out = ref.target, {}
    P = max(1, len(prompt) - 4)
    cache = target.new_cache(len(prompt) + 1)
    T = len(prompt) - P
    tree = torch.ones(1, T, T, dtype=torch.bool).tril()  # the verification checks a draft tree:
    tree[:, 2:, 1] = False  # token 2 is token 1's sibling (both children of token 0), token 3 token 2's child
    with torch.inference_mode():
        first = target(torch.tensor([prompt[:P]]), cache, want_taps=ref.drafter is not None)
        second = target(torch.tensor([prompt[P:]]), cache, want_taps=ref.drafter is not None, tree_mask=tree)
    run = sessions[TARGET_VERIFY].run(
        input_ids=np.asarray([prompt[P:]], dtype=np.int64), positions=(P + tree.sum(-1) - 1).numpy(),
        logit_index=np.arange(T, dtype=np.int64), past_lengths=np.asarray([P], dtype=np.int64),
        tree_mask=tree.numpy(), **past_feeds(with_room(cache.k[:, :, :, :P].numpy(), T),
                                             with_room(cache.v[:, :, :, :P].numpy(), T)))
    errors = {"logits": relative_error(run["logits"], second.logits),
              "new_key": relative_error(run["new_key"], cache.k[:, :, :, P:P + T]),
              "new_value": relative_error(run["new_value"], cache.v[:, :, :, P:P + T])}
    if "taps" in run:
        errors["taps"] = relative_error(run["taps"], second.taps)
    out[TARGET_VERIFY] = errors
    if ref.drafter is None:
        return out
    taps = torch.cat([first.taps, second.taps], dim=1)  # [1, len(prompt), n·H]
    ctx_k, ctx_v = ref.context(taps, 0)
    run = sessions[DRAFTER_CONTEXT].run(taps=taps.numpy(), positions=np.arange(len(prompt), dtype=np.int64)[None])
    out[DRAFTER_CONTEXT] = {"context_key": relative_error(run["context_key"], ctx_k),
                            "context_value": relative_error(run["context_value"], ctx_v)}
    drafts, logprobs, hidden, confidence = ref.block(prompt[-1], len(prompt), block_size, ctx_k, ctx_v)
    ids = np.full((1, block_size), ref.drafter.cfg.mask_token_id, dtype=np.int64)
    ids[0, 0] = prompt[-1]
    run = sessions[DRAFTER_BLOCK].run(
        block_ids=ids, positions=np.arange(len(prompt), len(prompt) + block_size, dtype=np.int64)[None],
        context_key=with_room(ctx_k.numpy(), block_size), context_value=with_room(ctx_v.numpy(), block_size),
        context_lengths=np.asarray([ctx_k.shape[3]], dtype=np.int64))
    out[DRAFTER_BLOCK] = {"draft_ids": relative_error(run["draft_ids"][0], drafts),
                          "draft_logprobs": relative_error(run["draft_logprobs"][0], logprobs),
                          "hidden": relative_error(run["hidden"][0], hidden)}
    if confidence is not None:  # a DSpark drafter's acceptance estimates
        out[DRAFTER_BLOCK]["confidence"] = relative_error(run["confidence"][0], confidence)
    start = len(prompt)
    pseudo_k, pseudo_v = ref.context(hidden[None, 1:], start, from_taps=False)
    run = sessions[DRAFTER_CONTEXT_HIDDEN].run(hidden=hidden[None, 1:].numpy(),
                                               positions=np.arange(start, start + block_size - 1, dtype=np.int64)[None])
    out[DRAFTER_CONTEXT_HIDDEN] = {"context_key": relative_error(run["context_key"], pseudo_k),
                                   "context_value": relative_error(run["context_value"], pseudo_v)}
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


def onnx_greedy(session: EngineSession, prompt: list[int], new_tokens: int) -> tuple[list[int], np.ndarray | None]:
    """The same decoding with the exported target_verify, called as the runtime calls it: the prompt
    with the last position's logits, then one token a step with a padding token (MIN_PRODUCT_ROWS)
    and every position's logits (the past grows by concatenation here)."""
    layers, kvh, hd = past_layers(session.spec)
    past_k = np.zeros((layers, 1, kvh, 0, hd), dtype=np.float32)
    past_v = past_k
    ids, tokens, taps = prompt, [], []
    while len(tokens) < new_tokens:
        start, n = past_k.shape[3], len(ids)
        padded = ids + [0] * (MIN_PRODUCT_ROWS - n)  # the padding token sees the chain, nothing sees it
        run = session.run(input_ids=np.asarray([padded], dtype=np.int64),
                          positions=np.arange(start, start + len(padded), dtype=np.int64)[None],
                          logit_index=np.asarray([n - 1] if not tokens else range(len(padded)), dtype=np.int64),
                          past_lengths=np.asarray([start], dtype=np.int64),
                          tree_mask=np.tril(np.ones((1, len(padded), len(padded)), dtype=bool)),
                          **past_feeds(with_room(past_k, len(padded)), with_room(past_v, len(padded))))
        past_k = np.concatenate([past_k, run["new_key"][:, :, :, :n]], axis=3)
        past_v = np.concatenate([past_v, run["new_value"][:, :, :, :n]], axis=3)
        tokens.append(int(run["logits"][0, 0 if tokens else -1].argmax()))
        taps.append(run["taps"][:, :n] if "taps" in run else None)
        ids = [tokens[-1]]
    return tokens, (np.concatenate(taps, axis=1) if taps[0] is not None else None)


def verified_greedy(session: EngineSession, prompt: list[int], tokens: list[int]) -> list[int]:
    """The exported target's argmax after the prompt and after each of `tokens`, from ONE forward over
    prompt + tokens: what a verification of those tokens as drafts would accept. Equal to `tokens`
    when verifying agrees with the engine's own plain decoding (which is what lossless means)."""
    layers, kvh, hd = past_layers(session.spec)
    ids = prompt + tokens[:-1]
    room = np.zeros((layers, 1, kvh, len(ids), hd), dtype=np.float32)  # an empty past with room for every token
    run = session.run(input_ids=np.asarray([ids], dtype=np.int64), positions=np.arange(len(ids), dtype=np.int64)[None],
                      logit_index=np.arange(len(prompt) - 1, len(ids), dtype=np.int64),
                      past_lengths=np.zeros(1, dtype=np.int64),
                      tree_mask=np.tril(np.ones((1, len(ids), len(ids)), dtype=bool)), **past_feeds(room, room))
    return run["logits"][0].argmax(-1).tolist()


def offline_tau(draft, sequence: list[int], prompt_len: int) -> list[int]:
    """Tokens committed per anchor (accepted drafts + 1) when drafting one block at every position
    of `sequence` after the prompt: draft(anchor_position) → drafts for the positions after it (k-1
    or k of them, by the drafter's block convention)."""
    committed = []
    for a in range(prompt_len, len(sequence) - 1):
        drafts = draft(a).tolist()
        truth = sequence[a + 1:a + 1 + len(drafts)]
        accepted = 0
        while accepted < len(truth) and drafts[accepted] == truth[accepted]:
            accepted += 1
        committed.append(accepted + 1)
    return committed


def acceptance(ref: Reference, sessions: dict[str, EngineSession], sequence: list[int], taps_ref: torch.Tensor,
               taps_onnx: np.ndarray, prompt_len: int, block_size: int) -> tuple[list[int], list[int]]:
    """Offline τ per anchor of the reference drafter (reference taps) and of the exported drafter
    (exported target's taps through the exported context engine)."""
    n = taps_ref.shape[1]  # positions with taps: all but the last token of `sequence`
    ctx_k, ctx_v = ref.context(taps_ref, 0)
    run = sessions[DRAFTER_CONTEXT].run(taps=taps_onnx, positions=np.arange(n, dtype=np.int64)[None])
    onnx_k, onnx_v = run["context_key"], run["context_value"]

    def draft_ref(a):
        return ref.block(sequence[a], a, block_size, ctx_k[:, :, :, :a], ctx_v[:, :, :, :a])[0][:, 0]  # the chain

    def draft_onnx(a):
        ids = np.full((1, block_size), ref.drafter.cfg.mask_token_id, dtype=np.int64)
        ids[0, 0] = sequence[a]
        out = sessions[DRAFTER_BLOCK].run(block_ids=ids, positions=np.arange(a, a + block_size, dtype=np.int64)[None],
                                          context_key=with_room(onnx_k[:, :, :, :a], block_size),
                                          context_value=with_room(onnx_v[:, :, :, :a], block_size),
                                          context_lengths=np.asarray([a], dtype=np.int64))
        return out["draft_ids"][0][:, 0]  # the chain

    return offline_tau(draft_ref, sequence, prompt_len), offline_tau(draft_onnx, sequence, prompt_len)


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


def validate_onnx(onnx_dir: str | Path, target: Target, drafter: Drafter | None, precision: str = "fp32",
                  new_tokens: int = 16, num_threads: int | None = None) -> dict:
    """Validate every engine in `onnx_dir` against `target`/`drafter` (the reference modules it was
    exported from); return the report and store it in the manifest as `validation`."""
    if precision not in TOLERANCES:
        raise LoopspecError(f"unknown precision {precision!r} (known: {', '.join(TOLERANCES)})")
    onnx_dir = Path(onnx_dir)
    manifest = read_manifest(onnx_dir)
    if manifest.precision != precision:
        raise LoopspecError(f"{onnx_dir} holds {manifest.precision} engines, not {precision}")
    check_precision(precision, str(onnx_dir))
    if manifest.has_drafter != (drafter is not None):
        raise LoopspecError(f"{onnx_dir} {'has' if manifest.has_drafter else 'has no'} drafter engines but "
                            f"{'a' if drafter is not None else 'no'} reference drafter was given")
    t0 = time.perf_counter()
    limits = TOLERANCES[precision]
    sessions = {name: EngineSession(manifest.path(name), manifest.spec(name), num_threads) for name in manifest.engines}
    ref = Reference(target, drafter)
    prompts, prompt_source = validation_prompts(onnx_dir, target.cfg.vocab_size)
    block_size = drafter.cfg.block_size if drafter is not None else 1

    errors = engine_errors(ref, sessions, prompts[0], block_size)
    report = {"precision": precision, "tolerance": limits, "prompts": len(prompts), "prompt_source": prompt_source,
              "new_tokens": new_tokens, "engines": {}}
    for engine, outputs in errors.items():
        # draft ids may differ where two logits tie within the tolerance; the τ check covers them
        worst = max(v for k, v in outputs.items() if k != "draft_ids")
        tolerance = limits.get("target" if engine == TARGET_VERIFY else "drafter", limits["relative"])
        report["engines"][engine] = {"errors": outputs, "tolerance": tolerance,
                                     "passed": tolerance is None or worst <= tolerance}

    identical, agreeing, taus_ref, taus_onnx = True, [], [], []
    for prompt in prompts:
        ref_tokens, ref_taps = reference_greedy(target, prompt, new_tokens)
        onnx_tokens, onnx_taps = onnx_greedy(sessions[TARGET_VERIFY], prompt, new_tokens)
        identical &= ref_tokens == onnx_tokens
        verified = verified_greedy(sessions[TARGET_VERIFY], prompt, onnx_tokens)
        agreeing += [a == b for a, b in zip(verified, onnx_tokens)]
        if drafter is not None:
            a, b = acceptance(ref, sessions, prompt + ref_tokens, ref_taps, onnx_taps, len(prompt), block_size)
            taus_ref += a
            taus_onnx += b
    report["greedy_identical"] = identical
    report["verify_equals_plain"] = all(agreeing)
    report["verify_plain_agreement"] = round(float(np.mean(agreeing)), 4)  # share of positions
    passed = (all(e["passed"] for e in report["engines"].values()) and (identical or not limits["greedy"])
              and (all(agreeing) or not limits["verify_equals_plain"]))
    if drafter is not None:
        tau_ref, tau_onnx = np.mean(taus_ref), np.mean(taus_onnx)
        drop = (tau_ref - tau_onnx) / tau_ref
        report["acceptance"] = {"tau_reference": round(float(tau_ref), 4), "tau_onnx": round(float(tau_onnx), 4),
                                "relative_drop": round(float(drop), 4), "anchors": len(taus_ref),
                                "passed": bool(limits["tau_drop"] is None or drop <= limits["tau_drop"])}
        passed &= report["acceptance"]["passed"]
    report["passed"] = bool(passed)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    manifest.data["validation"] = report
    manifest.save()
    return report


def format_report(report: dict) -> str:
    lines = [f"validation ({report['precision']}, tolerance {report['tolerance']['relative']:g} relative): "
             f"{'PASSED' if report['passed'] else 'FAILED'} in {report['seconds']} s"]
    for engine, r in report["engines"].items():
        errs = ", ".join(f"{k} {v:.1e}" for k, v in r["errors"].items())
        limit = f" (limit {r['tolerance']:g})" if r.get("tolerance") != report["tolerance"]["relative"] else ""
        lines.append(f"  {engine:<24}{'ok ' if r['passed'] else 'BAD'} {errs}{limit}")
    lines.append(f"  greedy decoding of {report['prompts']} prompts × {report['new_tokens']} tokens: "
                 f"{'identical' if report['greedy_identical'] else 'DIFFERENT'} to PyTorch; one verification "
                 f"of them {'equals' if report['verify_equals_plain'] else 'differs from'} the engine's plain decoding "
                 f"({report['verify_plain_agreement']:.0%} of positions agree)")
    if "acceptance" in report:
        a = report["acceptance"]
        lines.append(f"  offline tau over {a['anchors']} anchors: PyTorch {a['tau_reference']:.3f}, "
                     f"ONNX {a['tau_onnx']:.3f} (drop {a['relative_drop']:+.1%}, "
                     f"limit {'none' if report['tolerance']['tau_drop'] is None else format(report['tolerance']['tau_drop'], '.0%')})")
    return "\n".join(lines)
