"""The EAGLE-3 part of an artifact's validation (convert/validate.py): its two graphs (engines/eagle3_specs.py)
checked against the torch engine's EAGLE-3 path (engines/eagle3_context.py), the PyTorch reference,
through the Engine protocol's calls on both engines.

- `eagle3_fuse`: the reference taps appended to the artifact engine's context, against fc of them;
- `eagle3_step`: a stage drafted by both engines on the same context (the fused states the artifact
  engine holds, given to the torch engine as they are), then DLoop's later stage on the same
  pseudo-context: drafts (share of differing ids), log-probs and the states fed back;
- offline τ: both drafters' chains at every anchor of the reference greedy trajectory, each on the
  context its own engine decoded.
"""

from __future__ import annotations

import torch

from loopspec.engines.backends import torch_engine
from loopspec.engines.eagle3_specs import EAGLE3_FUSE, EAGLE3_STEP
from loopspec.engines.protocol import Engine


def _stage_errors(got, want, relative_error) -> dict:
    return {
        "draft_ids": relative_error(got[0], want[0]),
        "draft_logprobs": relative_error(got[1], want[1]),
        "state": relative_error(got[2], want[2]),
    }


def eagle3_engine_errors(target, drafter, engine: Engine, prompt: list[int], block_size: int, relative_error) -> dict:
    """{graph: {output: relative error}} of the EAGLE-3 graphs in row 0 of `engine` on `prompt` (its
    last token the anchor); both contexts are emptied after."""
    reference = torch_engine(target, drafter, engine.max_context)
    n = len(prompt) - 1
    with torch.inference_mode():
        taps = target(torch.tensor([prompt[:n]]), target.new_cache(n), want_taps=True).taps  # [1, n, 3·H]
        fused = drafter.fuse(taps)
    for e in (engine, reference):
        e.prefill(0, prompt[:n], want_taps=False)  # the tokens of the context's entries
        e.context_rollback([0], [0])
    engine.append_context(taps, [n])
    states = engine.context.states[:1, :n].clone()  # what the artifact engine keeps
    out = {EAGLE3_FUSE: {"states": relative_error(states, fused)}}
    reference.append_pseudo_context([0], states)  # the same states, no fc: each figure is its own graph's error
    got = engine.draft([0], [prompt[-1]], [n], block_size)
    want = reference.draft([0], [prompt[-1]], [n], block_size)
    errors = _stage_errors(got, want, relative_error)
    # DLoop's later stage: the stage's own states as context, from its last draft
    later = want[2][:, 1:]
    for e in (engine, reference):
        e.append_pseudo_context([0], later)
    anchor, position = int(want[0][0, -1, 0]), n + later.shape[1]
    got = engine.draft([0], [anchor], [position], block_size)
    want = reference.draft([0], [anchor], [position], block_size)
    errors |= {f"later_stage_{name}": value for name, value in _stage_errors(got, want, relative_error).items()}
    out[EAGLE3_STEP] = errors
    engine.context_rollback([0], [0])
    return out


def eagle3_acceptance(
    target, drafter, engine: Engine, sequence: list[int], prompt_len: int, block_size: int, offline_tau
) -> tuple[list[int], list[int]]:
    """Offline τ per anchor of the torch engine's EAGLE-3 drafter (on its own context of `sequence`) and
    of the artifact engine's, on the context row 0 holds after its own greedy decoding of it, both
    rolled back to each anchor, last first."""
    reference = torch_engine(target, drafter, engine.max_context)
    reference.prefill(0, sequence[:-1], want_taps=True)
    chains = []
    for e in (reference, engine):
        chain = {}
        for a in reversed(range(prompt_len, len(sequence) - 1)):
            e.context_rollback([0], [a])
            chain[a] = e.draft([0], [sequence[a]], [a], block_size)[0][0][:, 0]  # the chain
        chains.append(offline_tau(chain.__getitem__, sequence, prompt_len))
    return chains[0], chains[1]
