"""Peers measured in the same process on the same prompts: Hugging Face transformers `generate()`
(greedy) and its assisted generation with prompt lookup (`prompt_lookup_num_tokens`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

PEER_METHODS = ("hf", "hf-lookup")


@dataclass
class PeerRun:
    tokens: list[int]
    seconds: float
    stats: object = field(default=None)


class HFPeer:
    """The target loaded by transformers (fp32) on the device loopspec's engine uses."""

    def __init__(self, target_dir, stop_token_ids, num_threads: int | None = None, device: str | torch.device = "cpu"):
        from transformers import AutoModelForCausalLM

        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).to(self.device).eval()
        self.stop = sorted(stop_token_ids)

    @torch.inference_mode()
    def run(self, prompt_ids: list[int], method: str, max_new_tokens: int) -> PeerRun:
        ids = torch.tensor([prompt_ids], device=self.device)
        extra = {"prompt_lookup_num_tokens": 10} if method == "hf-lookup" else {}
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=self.stop, pad_token_id=self.stop[0], **extra)
        tokens = out[0, len(prompt_ids):].tolist()  # on the CPU: waits for the device
        return PeerRun(tokens=tokens, seconds=time.perf_counter() - t0)
