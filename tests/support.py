"""Test helpers: Hugging Face's greedy output as the oracle, prompts of chosen token lengths."""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from actorserve.gateway.blocking_client import Client
from actorserve.gateway.client import AsyncClient
from actorserve.messages.common import SamplingParams

PROMPT_LENGTHS = [1, 2, 5, 9, 16, 17, 31, 48, 64, 100, 128, 129, 200, 313, 431, 500]
# The KV cache of a test server that sizes none of its own (--num-kv-blocks,
# --kv-cache-memory-gb): a quarter of the 1 GiB default holds 64k tokens or more of every test
# checkpoint, far more than any test's requests, and the Worker zeroes a quarter of the memory at
# every start (several servers live at once in a run: the shared gateway's beside each module's).
TEST_KV_CACHE_GB = "0.25"


@functools.cache
def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@functools.cache
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Transformers' greedy continuation (stops at EOS like the engine), fp32 on CPU."""
    return list(_hf_greedy(model_dir, tuple(prompt_ids), max_new_tokens))


@functools.cache
def _hf_greedy(model_dir: Path, prompt_ids: tuple[int, ...], max_new_tokens: int):
    out = hf_generate(hf_model(model_dir), prompt_ids, max_new_tokens)
    return tuple(out[0, len(prompt_ids) :].tolist())


def smallest_greedy_margin(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> float:
    """The smallest gap between the top two logits over transformers' greedy continuation.

    A test that compares greedy outputs computed in different orders (a prefill of prompt +
    output after a restart or a preemption against decodes one token at a time) needs prompts
    whose every step has a clear winner: a gap within float32 rounding may pick either."""
    out = hf_generate(
        hf_model(model_dir), prompt_ids, max_new_tokens, output_scores=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    return min(float(s[0].topk(2).values.diff().abs()) for s in out.scores)


def hf_generate(model, prompt_ids, max_new_tokens: int, **options):
    """`model.generate` greedy on one unpadded prompt (on the model's device); `options` go to
    generate as they are."""
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    with torch.inference_mode():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=0,
            **options,
        )


def prompts_of_lengths(model_dir: Path, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    """Token-id prompts of exactly these lengths, cut from a long tokenized text."""
    import inspect

    text = inspect.getsource(asyncio.base_events)
    ids = tokenizer(model_dir).encode(text)
    return [ids[i * 37 % 1000 : i * 37 % 1000 + n] for i, n in enumerate(lengths)]


async def _collect(client: AsyncClient, prompt, params: SamplingParams):
    text, ids, last = [], [], None
    async for last in client.generate(prompt, params):
        text.append(last.text)
        ids.extend(last.token_ids)
    return "".join(text), ids, last


def tied_columns() -> tuple[torch.Tensor, torch.Tensor]:
    """An LM head weight [3000, 256] whose columns 3, 700 and 2999 are the same weight row (the
    last in the second thread's half of the columns), and 5 hidden rows pointing along it: each
    row's maximum is there three times, exactly, and greedy sampling must give column 3 (the
    first), as torch's max(dim=-1) does."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(3000, 256, generator=gen) / 16
    weight[700] = weight[2999] = weight[3]
    hidden = weight[3].repeat(5, 1) * 50 + torch.randn(5, 256, generator=gen) * 0.01
    return weight, hidden


def raw_exchange(address: str, data: bytes, timeout_s: float = 30.0):
    """Send raw bytes on a fresh DEALER socket; decode the one reply the engine sends."""
    import zmq

    from actorserve.messages.client import EngineToClient
    from actorserve.messages.codec import Decoder

    ctx = zmq.Context()
    socket = ctx.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    try:
        socket.connect(address)
        socket.send(data)
        return Decoder(EngineToClient).decode(socket.recv())
    finally:
        socket.close()
        ctx.term()


def generate_concurrently(address: str, prompts, params: SamplingParams):
    """Submit every prompt at once through the SDK; [(text, token ids, last delta)] in order."""

    async def run():
        async with AsyncClient(address, timeout_s=120) as client:
            return await asyncio.gather(*[_collect(client, p, params) for p in prompts])

    return asyncio.run(run())


class EngineServer:
    """`actorserve serve` in a subprocess: the supervisor and its four actor processes
    (`new_session`: in a process group of their own, which a test may signal as a whole)."""

    def __init__(
        self,
        model: Path,
        *flags: str,
        ready_timeout_s: float = 180.0,
        env: dict[str, str] | None = None,
        new_session: bool = False,
        address: str | None = None,
        client_options: dict | None = None,
    ):
        """`address`: the SDK address (default ipc:// in a fresh directory); `client_options`:
        the SDK's keyword arguments for it (CurveZMQ keys)."""
        self.run_dir = tempfile.mkdtemp(prefix="actorserve-test-")
        self.address = address or f"ipc://{self.run_dir}/engine.sock"
        cmd = [
            sys.executable,
            "-m",
            "actorserve.cli",
            "serve",
            "--model",
            str(model),
            "--address",
            self.address,
            "--torch-threads",
            "2",
            "--port",
            "0",
            *flags,
        ]
        if not {"--num-kv-blocks", "--kv-cache-memory-gb"} & {f.split("=")[0] for f in flags}:
            cmd += ["--kv-cache-memory-gb", TEST_KV_CACHE_GB]
        self.log_path = Path(self.run_dir) / "serve.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=new_session,
        )
        line = self._read_line(ready_timeout_s)
        if "serving" not in line:
            self.proc.kill()
            raise RuntimeError(f"engine did not start: {line!r}\n{self.log_path.read_text()}")
        self.client = Client(self.address, timeout_s=120, **(client_options or {}))

    def _read_line(self, timeout_s: float) -> str:
        result = [""]
        reader = threading.Thread(target=lambda: result.__setitem__(0, self.proc.stdout.readline()))
        reader.start()
        reader.join(timeout_s)
        return result[0]

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_blocks_free(self, timeout_s: float = 10.0):
        """Health stats once every KV block is back in the pool (or the last seen on timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.client.health().stats
            if stats.blocks_free == stats.blocks_total or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def stop(self) -> int:
        self.client.close()
        return stop_server(self.proc, self._log, self.run_dir)


def pids_with_command_line(*parts: bytes) -> list[int]:
    """The processes whose command line (NUL-separated, as /proc shows it) holds every part."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if all(part in cmdline for part in parts):
                pids.append(int(entry.name))
    return pids


def stop_server(proc: subprocess.Popen, log, run_dir: str) -> int:
    """SIGTERM `actorserve serve`, SIGKILL it if still running after 60 s; its exit code. Then
    close its log and remove its run directory."""
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    log.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    return code
