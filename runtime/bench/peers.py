"""Peers measured in the same run on the same prompts: Hugging Face transformers `generate()` (greedy)
and its assisted generation with prompt lookup (`prompt_lookup_num_tokens`), in this process; and
llama.cpp's `llama-server` over the target's own GGUF, plain and with our drafter as a llama.cpp
DFlash GGUF (`--spec-type draft-dflash`), as child processes on this machine."""

from __future__ import annotations

import json
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loopspec.errors import LoopspecError
from loopspec.weights import TargetSource

HF_METHODS = ("hf", "hf-lookup")
LLAMACPP_METHODS = ("llamacpp", "llamacpp-dflash")
PEER_METHODS = HF_METHODS + LLAMACPP_METHODS
PLAIN_PEER = {"hf-lookup": "hf", "llamacpp-dflash": "llamacpp"}  # the plain decoding each peer must equal
# llama-server configurations tried in order until one loads and decodes a first batch: its defaults,
# then without repacking the weights for the CPU (its AMX repacking crashed at model load on one Intel
# Xeon with AMX, and on another loaded but crashed on the first batch of more than one token)
SERVER_FALLBACKS = ([], ["--no-repack"])
FIRST_BATCH = list(range(1, 9))  # the probe's prompt ids: a batch of several tokens, as every prompt is
PEER_BACKENDS = {
    "hf": "transformers",
    "hf-lookup": "transformers",
    "llamacpp": "llama.cpp",
    "llamacpp-dflash": "llama.cpp",
}


@dataclass
class PeerRun:
    tokens: list[int]
    seconds: float
    stats: object = field(default=None)
    drafted: int = 0  # llama.cpp's own counters: tokens drafted and accepted over the request
    accepted: int = 0


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
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=self.stop,
            pad_token_id=self.stop[0],
            **extra,
        )
        tokens = out[0, len(prompt_ids) :].tolist()  # on the CPU: waits for the device
        return PeerRun(tokens=tokens, seconds=time.perf_counter() - t0)


class LlamaServerPeer:
    """llama.cpp's `llama-server` on the target's GGUF: plain (`llamacpp`) and, given a drafter GGUF,
    DFlash (`llamacpp-dflash`), one server each, started once and stopped by `close`. A request sends
    the prompt as token ids (the same chat-templated ids loopspec decodes) with greedy sampling and
    no prompt cache, so its wall time includes prefill like loopspec's; τ comes from the server's own
    counters (draft_n_accepted)."""

    def __init__(
        self,
        binary: str | Path,
        target_gguf: Path,
        drafter_gguf: Path | None,
        draft_max: int | None,
        num_threads: int | None,
        context: int,
        start_timeout_s: float = 120.0,
        spec: str = "draft-dflash",
    ):
        """`spec`: llama-server's --spec-type for the drafter (engines/llamacpp.py `spec_type`)."""
        from loopspec.engines.llamacpp import llama_server_command

        self.servers: dict[str, tuple[subprocess.Popen, str]] = {}
        self.settings: dict[str, list[str]] = {}
        self.failed: dict[str, str] = {}  # method → why no configuration of its server started
        self.logs: dict[str, object] = {}  # the servers log every request: to files, never to an unread pipe
        try:
            for method in LLAMACPP_METHODS:
                if method == "llamacpp-dflash" and drafter_gguf is None:
                    continue
                failures = []
                for extra in SERVER_FALLBACKS:
                    port = free_port()
                    # one request at a time, on as many threads as loopspec's engines use
                    command = (
                        llama_server_command(
                            binary,
                            target_gguf,
                            threads=num_threads or torch.get_num_threads(),
                            context=context,
                            port=port,
                            slots=1,
                            **(
                                {"drafter_gguf": drafter_gguf, "draft_max": draft_max, "spec": spec}
                                if method == "llamacpp-dflash"
                                else {}
                            ),
                        )
                        + extra
                    )
                    why = self._start(method, command, f"http://127.0.0.1:{port}", start_timeout_s)
                    if why is None:
                        break
                    failures.append(f"{' '.join(extra) or 'its defaults'}: {why}")
                else:
                    self.failed[method] = "llama-server did not start with " + "; nor with ".join(failures)
        except BaseException:
            self.close()
            raise

    def _start(self, method: str, command: list[str], url: str, timeout_s: float) -> str | None:
        """Start `command` for `method` and wait until it answers /health → None, or why it did not
        (its exit code and last log lines, or the timeout; the process is stopped)."""
        log = tempfile.TemporaryFile(mode="w+")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout_s
        why = f"not ready after {timeout_s:.0f} s"
        while time.monotonic() < deadline:
            if process.poll() is not None:
                log.seek(0)
                tail = " | ".join(log.read().strip().splitlines()[-2:])
                why = f"exited with code {process.returncode} at load ({tail or 'no output'})"
                break
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as response:
                    ready = response.status == 200
            except (urllib.error.URLError, OSError):
                ready = False  # still loading the model
            if ready:
                why = self._first_batch(process, url, log)
                if why is None:
                    self.servers[method], self.logs[method] = (process, url), log
                    self.settings[method] = [str(c) for c in command]
                    return None
                break
            time.sleep(0.2)
        stop(process)
        log.close()
        return why

    @staticmethod
    def _first_batch(process: subprocess.Popen, url: str, log) -> str | None:
        """A loaded server decodes one token after a prompt of several → None, or why it did not."""
        body = json.dumps({"prompt": FIRST_BATCH, "n_predict": 1, "temperature": 0.0, "cache_prompt": False})
        request = urllib.request.Request(
            url + "/completion", data=body.encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                response.read()
            return None
        except (urllib.error.URLError, OSError) as e:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                return f"loaded but failed its first batch of {len(FIRST_BATCH)} tokens ({e})"
            log.seek(0)
            tail = " | ".join(log.read().strip().splitlines()[-2:])
            return (
                f"loaded but exited with code {process.returncode} on its first batch of {len(FIRST_BATCH)} "
                f"tokens ({tail or 'no output'})"
            )

    def run(self, prompt_ids: list[int], method: str, max_new_tokens: int) -> PeerRun:
        if method not in self.servers:
            raise LoopspecError(f"no llama-server runs {method}")
        _, url = self.servers[method]
        body = json.dumps(
            {
                "prompt": prompt_ids,
                "n_predict": max_new_tokens,
                "temperature": 0.0,
                "top_k": 1,
                "cache_prompt": False,
                "return_tokens": True,
                "stream": False,
            }
        ).encode()
        request = urllib.request.Request(url + "/completion", data=body, headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            reply = json.loads(response.read())
        seconds = time.perf_counter() - t0
        timings = reply.get("timings", {})
        return PeerRun(
            tokens=list(reply.get("tokens", [])),
            seconds=seconds,
            drafted=int(timings.get("draft_n", 0)),
            accepted=int(timings.get("draft_n_accepted", 0)),
        )

    def close(self) -> None:
        for process, _ in self.servers.values():
            stop(process)
        for log in self.logs.values():
            log.close()
        self.servers, self.logs = {}, {}


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llamacpp_peer(
    pipe,
    target: TargetSource | str,
    llama_server: str | None,
    dflash_block: int | None,
    num_threads: int | None,
    context: int,
):
    """(LlamaServerPeer, None), or (None, why the llama.cpp rows are skipped): it needs a llama-server
    binary (`llama_server`, else one on PATH) and the target (EngineChoice.target: a TargetSource, or
    the unread name beside artifacts) as a GGUF; with `dflash_block`, the
    pair's drafter is written once as a llama.cpp dflash GGUF into the cache and drafts its drafts per
    block a round (dflash_block - 1; dflash_block for a DSpark drafter of DeepSpec's convention)."""
    from loopspec.engines.llamacpp import cached_drafter_gguf, find_llama_server, spec_type

    binary = find_llama_server(llama_server)
    if binary is None:
        return None, "no llama-server on PATH (build one with scripts/build_llama_server.sh, pass --llama-server)"
    try:
        gguf = TargetSource.of(target).gguf
    except LoopspecError:
        gguf = None
    if gguf is None:
        return None, f"llama.cpp runs the target as a GGUF, and {target} is not one"
    drafter_gguf, draft_max, spec = None, None, "draft-dflash"
    if dflash_block is not None:
        if pipe.drafter is None:
            return None, "llamacpp-dflash needs the drafter's weights (run without --onnx-dir)"
        drafter_gguf = cached_drafter_gguf(pipe.drafter, pipe.drafter_dir, gguf)
        # a DSpark drafter runs as draft-dspark, drafting every block position in DeepSpec's convention
        draft_max, spec = pipe.drafter.cfg.drafts_per_block(dflash_block), spec_type(pipe.drafter.cfg)
    peer = LlamaServerPeer(binary, gguf, drafter_gguf, draft_max, num_threads, context, spec=spec)
    return peer, None
