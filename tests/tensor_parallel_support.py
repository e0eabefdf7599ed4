"""Tensor-parallel ranks for the tests, as real processes on gloo, one torch thread each.

    python tests/tensor_parallel_support.py JOB.json

joins rank `job.rank` of a group of `job.size` (through `job.init_file`), loads its shard of the
checkpoint, and writes to `job.out` (safetensors: no pickle) the logits of `logits_prompts`,
prefilled in two chunks through a paged cache, and the tokens a ModelRunner samples for
`runner_requests` under a scheduler's plans (chunked prefill, a recompute preemption), with
`num_kv_blocks` blocks of KV cache. `run_ranks` starts the processes and reads rank 0's result
and every rank's tokens; `run_in_process` runs the same job on a single device.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import msgspec
import torch

from actorserve.actors.runtime.config import EngineConfig
from actorserve.actors.runtime.config_resolution import resolve_device, resolve_model
from actorserve.actors.worker.kv_cache import KVCache
from actorserve.actors.worker.loader import load_model
from actorserve.actors.worker.runner import ModelRunner
from actorserve.actors.worker.tensor_parallel import TensorParallel
from actorserve.kernels import attention_ops
from actorserve.messages.common import SamplingParams
from actorserve.messages.step import NewRequest, RunningUpdate, StepPlan

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # model_support, when run as a script

from model_support import PagedCache  # noqa: E402

BLOCK_SIZE = 16
RANK_TIMEOUT_S = 300


class RunnerRequest(msgspec.Struct, frozen=True):
    request_id: str
    prompt: list[int]
    params: SamplingParams


class RankJob(msgspec.Struct, frozen=True, kw_only=True):
    """`chunk`: the prefill chunk (tokens per step); `preempt`: the request preempted (and
    re-sent whole, prompt + its tokens, on new blocks) once it has `preempt_after` tokens."""

    model_dir: str
    rank: int = 0
    size: int = 1
    init_file: str = ""
    out: str = ""
    logits_prompts: list[list[int]] = []
    runner_requests: list[RunnerRequest] = []
    max_tokens: int = 8
    chunk: int = 13
    preempt: str | None = None
    preempt_after: int = 3
    num_kv_blocks: int = 64


class RankResult(msgspec.Struct, frozen=True):
    logits: list[torch.Tensor]
    tokens: dict[str, list[int]]


def run_job(job: RankJob, tp: TensorParallel) -> RankResult:
    """The job on this rank of `tp` (a single device when tp.size is 1)."""
    device = torch.device("cpu")
    ops = attention_ops(device, "auto", c_kernels=False)  # the Worker's, without a fast path
    model, shape = load_model(job.model_dir, device, torch.float32, ops, tp=tp)
    with torch.inference_mode():
        logits = paged_logits(model, shape, job.logits_prompts, job.chunk)
    tokens = runner_tokens(job, model, shape, tp) if job.runner_requests else {}
    return RankResult(logits, tokens)


def paged_logits(model, shape, prompts: list[list[int]], chunk: int) -> list[torch.Tensor]:
    """Each prompt's logits [len, vocab], its prefill cut into chunks of `chunk` tokens, every
    prompt in each step."""
    cache = PagedCache(model, shape, num_blocks=64)
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    for start in range(0, max(map(len, prompts), default=0), chunk):
        step = {i: p[start : start + chunk] for i, p in enumerate(prompts) if start < len(p)}
        for i, logits in cache.step(step).items():
            got[i].append(logits)
    return [torch.cat(parts) for parts in got]


def runner_tokens(job: RankJob, model, shape, tp: TensorParallel) -> dict[str, list[int]]:
    config = resolve_model(
        EngineConfig(model=job.model_dir, device="cpu", torch_threads=1, cpu_fast_path=False)
    )
    config = msgspec.structs.replace(config, num_kv_blocks=job.num_kv_blocks, num_cpu_blocks=0)
    config = resolve_device(config, "cpu")
    kv = KVCache(
        shape.num_layers, job.num_kv_blocks, 0, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim,
        torch.float32, torch.device("cpu"),
    )  # fmt: skip
    runner = ModelRunner(config, model, kv, torch.device("cpu"), None, tp)
    return Schedule(job).run(runner)


class Schedule:
    """A scheduler's part: every request prefilled in chunks of `job.chunk` tokens (all of
    them in each step), then decoded to `job.max_tokens`; `job.preempt` is removed once it has
    `job.preempt_after` tokens and re-sent whole the next step (recompute)."""

    def __init__(self, job: RankJob) -> None:
        self.job = job
        self.pool = list(range(job.num_kv_blocks))
        random.Random(0).shuffle(self.pool)
        self.requests = {r.request_id: r for r in job.runner_requests}
        self.out: dict[str, list[int]] = {rid: [] for rid in self.requests}
        self.computed: dict[str, int | None] = dict.fromkeys(self.requests)  # None: not sent

    def _blocks(self, request: RunnerRequest) -> list[int]:
        count = -(-(len(request.prompt) + self.job.max_tokens) // BLOCK_SIZE)
        taken, self.pool = self.pool[:count], self.pool[count:]
        return taken

    def plan(self, step_id: int, removed: list[str]) -> tuple[StepPlan, dict[str, int]]:
        running, new, counts = [], [], {}
        for rid, request in self.requests.items():
            tokens = request.prompt + self.out[rid]
            if len(self.out[rid]) >= self.job.max_tokens:
                continue
            done = self.computed[rid] or 0
            counts[rid] = count = min(self.job.chunk, len(tokens) - done)
            if self.computed[rid] is None:
                blocks = self._blocks(request)
                prompt_len = len(request.prompt)
                new.append(NewRequest(rid, tokens, prompt_len, blocks, count, request.params))
                self.computed[rid] = 0
            else:
                running.append(RunningUpdate(rid, [], count))
        return StepPlan(0, step_id, removed, running, new), counts

    def run(self, runner: ModelRunner) -> dict[str, list[int]]:
        step_id, removed, preempted = 0, [], False
        while any(len(out) < self.job.max_tokens for out in self.out.values()):
            step_id += 1
            plan, counts = self.plan(step_id, removed)
            result = runner.execute(plan)
            assert result.error is None, result.error
            for rid, count in counts.items():
                self.computed[rid] += count
            for rid, token in zip(result.request_ids, result.token_ids, strict=True):
                self.out[rid].append(token)
            removed = []
            victim = self.job.preempt
            if victim and not preempted and len(self.out[victim]) >= self.job.preempt_after:
                removed, preempted = [victim], True
                self.computed[victim] = None
        return self.out


def run_in_process(job: RankJob) -> RankResult:
    return run_job(job, TensorParallel.single())


def run_ranks(job: RankJob, size: int, workdir: Path) -> list[RankResult]:
    """Every rank's result, from `size` processes on gloo (one torch thread each)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    init_file = workdir / "tp_init"
    procs, outs = [], []
    for rank in range(size):
        out = workdir / f"rank{rank}.safetensors"
        rank_job = msgspec.structs.replace(
            job, rank=rank, size=size, init_file=str(init_file), out=str(out)
        )
        path = workdir / f"rank{rank}.json"
        path.write_bytes(msgspec.json.encode(rank_job))
        procs.append(subprocess.Popen([sys.executable, __file__, str(path)], env=env))
        outs.append(out)
    try:
        codes = [proc.wait(timeout=RANK_TIMEOUT_S) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert codes == [0] * size, f"rank exit codes {codes}"
    return [read_result(out) for out in outs]


def write_result(result: RankResult, path: str) -> None:
    from safetensors.torch import save_file

    tensors = {f"logits{i}": t.contiguous() for i, t in enumerate(result.logits)}
    metadata = {"tokens": msgspec.json.encode(result.tokens).decode()}
    save_file(tensors, path, metadata=metadata)


def read_result(path: Path) -> RankResult:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        tokens = msgspec.json.decode(f.metadata()["tokens"], type=dict[str, list[int]])
        logits = [f.get_tensor(f"logits{i}") for i in range(len(f.keys()))]
    return RankResult(logits, tokens)


def main(job_path: str) -> None:
    job = msgspec.json.decode(Path(job_path).read_bytes(), type=RankJob)
    torch.set_num_threads(1)
    tp = TensorParallel.join(job.rank, job.size, job.init_file, torch.device("cpu"))
    try:
        write_result(run_job(job, tp), job.out)
    finally:
        tp.close()


if __name__ == "__main__":
    main(sys.argv[1])
