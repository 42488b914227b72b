"""loopspec's EAGLE-3 drafter against SpecForge's own model code (`LlamaForCausalLMEagle3` of
specforge/modeling/draft/llama3_eagle.py), on tiny random checkpoints SpecForge's model writes.

SpecForge is not a dependency: point --specforge at a checkout of its source (its `specforge/`
package must import with this environment's torch and transformers). In fp64, for each variant and
seed, a random SpecForge model saves its state dict and config.json; loopspec loads that directory.
SpecForge's training-time-test unroll (its `cache_hidden` attention) then drafts a greedy chain from
every position of a random sequence at once, each position fed its own argmax; loopspec's drafter
drafts the same chains one position at a time with its own KV. Reported: the largest logit
difference and how many drafts agree. The negative control loads the fc_norm checkpoint with the tap
norms left off (what a reader ignoring the switch computes).

SpecForge's snapshot of 2026-08-08 reads `norm_output` as "the logits read the final-normed output"
(default true) and always feeds the pre-norm output back; the switch as vLLM, SGLang and later
SpecForge read it (the next step reads the normed output) is held to an fp64 reference in
tests/test_eagle3.py instead.

    python scripts/eagle3_specforge_parity.py --specforge /path/to/SpecForge --out parity.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

H, VOCAB, DRAFT_VOCAB, POSITIONS, STEPS, HEAD_DIM, KV_HEADS = 64, 300, 120, 12, 4, 16, 2
VARIANTS = {"eagle3": {}, "fc_norm (EAGLE 3.1's tap norms)": {"fc_norm": True}}


def specforge_model(config: dict, seed: int):
    from transformers import LlamaConfig
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    torch.manual_seed(seed)
    model = LlamaForCausalLMEagle3(LlamaConfig(**config), attention_backend="sdpa").double().eval()
    with torch.no_grad():  # lively weights: norms away from 1, a reduced draft vocabulary
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
        keep = torch.sort(torch.randperm(VOCAB)[:DRAFT_VOCAB]).values
        model.d2t.copy_(keep - torch.arange(DRAFT_VOCAB))
        model.t2d.zero_()
        model.t2d[keep] = True
    return model


def specforge_chains(model, tokens, taps):
    """SpecForge's unroll: step j over every position at once → logits [STEPS, P, Vd], drafts [STEPS, P]."""
    from specforge.modeling.draft.llama3_eagle import prepare_decoder_attention_mask

    P = taps.shape[1]
    mask = prepare_decoder_attention_mask(torch.ones(1, P, dtype=torch.bool), (1, P), taps, 0)
    positions, cache = torch.arange(P)[None], [[], []]
    state, ids = model.project_hidden_states(taps), tokens[:, 1:]  # entry p: (token p+1, taps p)
    logits, drafts = [], []
    for _ in range(STEPS):
        out = model.backbone(model.embed_input_ids(ids), state, cache, mask, positions)
        z = model.compute_logits(out)
        ids = z.argmax(-1) + model.d2t[z.argmax(-1)]
        logits.append(z[0])
        drafts.append(ids[0])
        state = out
    return torch.stack(logits), torch.stack(drafts)


def loopspec_chains(drafter, embed, tokens, taps):
    """loopspec's drafter, one position at a time: step 1 over the entries up to p (causal), then its
    own steps with their K/V → logits [STEPS, P, Vd], drafts [STEPS, P]."""
    P = taps.shape[1]
    to_target = drafter.draft_ids
    causal = torch.tril(torch.ones(P, P, dtype=torch.bool))[None, None]
    empty = torch.zeros(1, KV_HEADS, 0, HEAD_DIM, dtype=torch.float64)
    out, keys, values = drafter(embed[tokens[:, 1:]], drafter.fuse(taps), torch.arange(P)[None], empty, empty, causal)
    logits, drafts = torch.zeros(STEPS, P, DRAFT_VOCAB, dtype=torch.float64), torch.zeros(STEPS, P, dtype=torch.long)
    for p in range(P):
        k, v, last = keys[:, :, : p + 1], values[:, :, : p + 1], out[:, p]
        for j in range(STEPS):
            z = drafter.logits(last)[0]
            logits[j, p], drafts[j, p] = z, to_target[z.argmax()]
            if j + 1 < STEPS:
                o, k1, v1 = drafter(
                    embed[drafts[j, p]][None, None],
                    drafter.next_state(last)[:, None],
                    torch.tensor([[p + j + 1]]),
                    k,
                    v,
                    None,
                )
                k, v, last = torch.cat([k, k1], 2), torch.cat([v, v1], 2), o[:, 0]
    return logits, drafts


def compare(variant: str, switches: dict, seed: int, scratch: Path, drop_tap_norms: bool = False) -> dict:
    from safetensors.torch import save_file

    from loopspec.model.eagle3 import Eagle3Drafter

    config = dict(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        hidden_size=H,
        intermediate_size=160,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
        tie_word_embeddings=False,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 4]},
        **switches,
    )
    model = specforge_model(config, seed)
    directory = scratch / f"{variant.split()[0]}-{seed}"
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    drafter = Eagle3Drafter.load(directory, dtype=torch.float64)
    if drop_tap_norms:
        drafter.fc_norm = None
    g = torch.Generator().manual_seed(100 + seed)
    tokens = torch.randint(0, VOCAB, (1, POSITIONS + 1), generator=g)
    taps = torch.randn(1, POSITIONS, 3 * H, generator=g, dtype=torch.float64)
    with torch.no_grad():
        want_logits, want = specforge_chains(model, tokens, taps)
        got_logits, got = loopspec_chains(drafter, model.embed_tokens.weight, tokens, taps)
    return {
        "variant": variant + (" — negative control: tap norms left off" if drop_tap_norms else ""),
        "seed": seed,
        "max_abs_logit": float(want_logits.abs().max()),
        "max_abs_logit_difference": float((got_logits - want_logits).abs().max()),
        "drafts_equal": int((got == want).sum()),
        "drafts": got.numel(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--specforge", required=True, help="a checkout of SpecForge's source")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, args.specforge)
    torch.set_default_dtype(torch.float64)  # SpecForge's masks take the default dtype's range
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for variant, switches in VARIANTS.items():
            for seed in range(args.seeds):
                rows.append(compare(variant, switches, seed, Path(scratch)))
                print(json.dumps(rows[-1]))
        rows.append(
            compare(
                "fc_norm (EAGLE 3.1's tap norms)",
                VARIANTS["fc_norm (EAGLE 3.1's tap norms)"],
                0,
                Path(scratch),
                drop_tap_norms=True,
            )
        )
        print(json.dumps(rows[-1]))
    Path(args.out).write_text(
        json.dumps(
            {
                "specforge": "specforge/modeling/draft/llama3_eagle.py (snapshot 2026-08-08, commit a6b6b023)",
                "dtype": "float64",
                "positions": POSITIONS,
                "steps": STEPS,
                "runs": rows,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
