"""Worker actor: owns the device, the model, the paged KV cache and (on CUDA) its streams; with
tensor_parallel_size N, rank 0 of a group of N ranks (tp_group.py), which it starts and stops.

Inbox: StepPlan, CompileGrammar, Reset (Scheduler), read by the forward thread from its own
mailbox (WORKER_STEPS), and broadcast to the follower ranks before it handles them; Stop, on the
event loop's. Plans of another epoch than the last Reset's are dropped.
Outbox: StepResult, GrammarReady -> Scheduler; Ready (with num_kv_blocks, the smallest rank's,
and its device type), Heartbeat -> supervisor. The followers answer nothing.
Owns: model weights (its shard), KV cache tensors, the persistent batch (runner.py), the compiled
grammars and their compile thread (grammar_cache.py); the follower processes (tp_follower.py),
their liveness file and the watchdog thread that reads it (tp_liveness.py).
Dies when: Stop (the followers get it too, and are waited for), or its supervisor goes away (then
by SIGTERM). A follower that exits makes it exit at once (GROUP_BROKEN), for a restart of the
whole group; so does a collective of the serving group that times out (2 x
tp_follower_timeout_s: a peer that runs but never arrives). A follower whose liveness stamps are
older than tp_follower_timeout_s (stopped: it exits nothing) makes it SIGKILL every follower and
exit (FOLLOWER_STALLED, tp_liveness.py), for the same restart. A failing step is answered with
StepResult.error, and the Worker keeps serving (in a group it exits instead: step_handler.py).

The forward runs on a thread of its own so the event loop keeps sending heartbeats meanwhile
(which is why a stalled follower needs a watchdog of its own: the heartbeats go on while the
forward thread waits for it in a collective). In a group, an idle forward thread broadcasts an
empty message (a tick) every quarter of tp_follower_timeout_s, so that the followers' wait for
the next message stays within the collective timeout.
That thread reads the plans (and Resets, in order with them) from its own socket, decodes them
and sends each StepResult itself: when the Scheduler planned step N+1 while step N ran, the plan
is already queued and the next forward starts at once. No plan wakes the event loop, whose
thread would otherwise take a core and the GIL from the forward in the middle of a step.
While no message waits, that thread faults in the CPU KV cache's pages, a chunk at a time
(kv_cache.py `KVCache.prefault`, `kv_cache_prefault`): a plan that arrives meanwhile waits for
one chunk at most, and the steps do not pay for first touches.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from ...kernels import attention_ops, elementwise_ops
from ...messages.codec import WorkerInbox, encode
from ...messages.control import Ready, Stop
from ...messages.step import StepResult
from ...messages.structured import GrammarReady
from ..runtime.actor import Actor, actor_main
from ..runtime.addresses import WORKER_STEPS
from ..runtime.config import EngineConfig
from ..runtime.config_resolution import resolve_device
from .step_handler import StepHandler
from .tp_group import FollowerGroup, join_group, rank_device
from .tp_liveness import stamp_period_s

if TYPE_CHECKING:
    from .runner import ModelRunner
    from .tensor_parallel import TensorParallel


def build_runner(cfg: EngineConfig, tp: TensorParallel | None = None):
    """Load the model (this rank's shard of it, with `tp`), allocate the KV cache (sizing.py:
    `num_kv_blocks`, else as many blocks as the memory budget holds) and the swap space, hand
    both to the CPU fast path where it serves, make the ModelRunner: what the Worker serves
    with (scripts/bench_step.py measures the same one). The runner gets `cfg` resolved for its
    device (config_resolution.resolve_device) and with the quantization it serves (under dtype
    auto perhaps bf16, by a measurement: dtypes.auto_quantization)."""
    import msgspec
    import torch

    from ...kernels.cpu.bf16_weight_rule import measure_model
    from ...kernels.cpu.fast_path import CpuFastPath
    from ..runtime.model_config import ModelConfig
    from . import dtypes
    from .kv_cache import KVCache
    from .loader import load_model
    from .runner import ModelRunner
    from .sizing import device_kv_blocks, swap_blocks
    from .tensor_parallel import TensorParallel

    tp = tp or TensorParallel.single()
    device = rank_device(cfg, tp.rank)
    cfg = resolve_device(cfg, device.type)
    facts = ModelConfig.from_dir(cfg.model)
    stored = facts.dtype  # config.json's dtype (or torch_dtype)
    huge = cfg.transparent_huge_pages
    auto = dtypes.auto_quantization(cfg, stored, device, lambda: measure_model(facts, huge))
    cfg = msgspec.structs.replace(cfg, quantization=auto.quantization)
    dtype, dtype_reason = dtypes.model_dtype(cfg.dtype, stored, device, cfg.quantization)
    kv_dtype, kv_reason = dtypes.kv_cache_dtype(cfg.kv_cache_dtype, dtype)
    fast_path = CpuFastPath.create(cfg, device)  # None: plain torch (off, not CPU, no compiler)
    if cfg.quantization != "none" and fast_path is None:
        raise ValueError(
            f"quantization must be none where the CPU fast path cannot serve (here: {device}, "
            f"the log says why), got {cfg.quantization}"
        )
    ops = attention_ops(device, cfg.attention_backend, c_kernels=fast_path is not None)
    if ops.name == "triton" and kv_dtype != dtype:
        raise ValueError(
            f"kv_cache_dtype must be the model's dtype ({dtype}) with the triton attention "
            f"backend, got {kv_dtype}"
        )
    elementwise = elementwise_ops(ops) if fast_path is None else fast_path.elementwise
    model, shape = load_model(cfg.model, device, dtype, ops, elementwise, tp=tp)
    if device.type == "cuda" and ops.name == "triton":  # no request waits for a compile
        from ...kernels.triton_warm_up import warm_up_triton

        warm_up_triton(shape, cfg.block_size, dtype, device)
    layout = (shape.num_layers, cfg.block_size, shape.num_kv_heads, shape.head_dim)
    num_blocks = device_kv_blocks(cfg, model, layout, kv_dtype, device)
    num_cpu_blocks = swap_blocks(
        cfg, device.type, num_blocks, KVCache.block_bytes(*layout, kv_dtype)
    )
    kv = KVCache(
        shape.num_layers, num_blocks, num_cpu_blocks, cfg.block_size, shape.num_kv_heads,
        shape.head_dim, kv_dtype, device, None if fast_path is None else fast_path.zeros,
    )  # fmt: skip
    if fast_path is not None:
        fast_path.prepare(model, kv.layers)
    log = logging.getLogger(Worker.name)
    if auto.reason is not None:
        log.info("quantization %s (%s)", cfg.quantization, auto.reason)
    log.info("dtype %s (%s); KV cache %s (%s)", dtype, dtype_reason, kv_dtype, kv_reason)
    log.info(
        "model %s on %s (%s, %d threads, attention %s, CPU fast path %s): %d KV blocks of %d "
        "tokens", cfg.model, device, dtype, torch.get_num_threads(), ops.name,
        "on" if fast_path is not None else "off", num_blocks, cfg.block_size,
    )  # fmt: skip
    runner = ModelRunner(cfg, model, kv, device, fast_path, tp=tp)
    if device.type == "cuda":  # compiled and captured before the first request, not during it
        runner.sampler.warm_up(shape.vocab_size)
        sizes = runner.capture_decode_graphs()  # [] with enforce_eager
        log.info("decode CUDA graphs for batch sizes %s", sizes or "none (enforce_eager)")
    return runner


@dataclass
class Rank:
    """One rank of a Worker group, built: its config (resolved for its device), its
    collectives, its runner, and the KV block counts every rank of the group can hold."""

    config: EngineConfig
    tp: TensorParallel
    runner: ModelRunner
    num_kv_blocks: int
    num_cpu_blocks: int


def build_rank(config: EngineConfig, rank: int, init_file: str) -> Rank:
    """Resolve the config for the rank's device, set its torch threads, join the group, build
    the runner, agree on the block counts (the smallest rank's). Every rank runs this, so the
    group's collectives (the loading's, the profiling step's, the block counts') come in the
    same order on each."""
    import torch

    config = resolve_device(config, rank_device(config, rank).type)
    torch.set_num_threads(config.torch_threads)
    tp = join_group(config, rank, init_file)
    runner = build_runner(config, tp)
    num_kv_blocks = tp.min_int(runner.kv.num_blocks)
    num_cpu_blocks = tp.min_int(runner.kv.num_cpu_blocks)
    return Rank(config, tp, runner, num_kv_blocks, num_cpu_blocks)


class Worker(Actor):
    name = "worker"
    inbox = WorkerInbox

    async def setup(self) -> None:
        # Every torch computation of this process runs on the one "forward" thread, the loading
        # included. Were the event loop's thread to run OpenMP work too, it would keep an OpenMP
        # team of its own; with more OpenMP threads than cores, libgomp stops spin-waiting between
        # parallel regions, and every op then pays a futex wake-up.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self.loop = asyncio.get_running_loop()
        self.group = None  # the follower ranks, started from this (the main) thread
        if self.config.tensor_parallel_size > 1:
            self.group = FollowerGroup.spawn(self.config)
        init_file = "" if self.group is None else self.group.init_file
        self.rank = await self.loop.run_in_executor(
            self.executor, build_rank, self.config, 0, init_file
        )
        self.config, self.runner = self.rank.config, self.rank.runner
        steps = self.ctx.socket(zmq.PULL)  # handed to the forward thread, which alone uses it
        steps.setsockopt(zmq.RCVHWM, 0)
        steps.bind(self.addresses.mailbox(WORKER_STEPS))
        self.forward = self.loop.run_in_executor(self.executor, self._forward_loop, steps)
        self.forward.add_done_callback(self._forward_ended)

    def ready(self) -> Ready:
        return Ready(
            actor=self.name,
            pid=os.getpid(),
            num_kv_blocks=self.rank.num_kv_blocks,
            num_cpu_blocks=self.rank.num_cpu_blocks,
            device=self.runner.device.type,
        )

    def _forward_loop(self, steps: zmq.Socket) -> None:
        """The forward thread, until a Stop on its mailbox: broadcast each message to the
        follower ranks (nothing without a group), then handle it (step_handler.py), sending
        each StepResult on this thread's own socket to the Scheduler."""
        import torch

        results = self._connect("scheduler")
        exit_group = self.group.exit_broken if self.group is not None else None
        handler = StepHandler(
            self.runner, self.config, self.rank.tp, LeaderReplies(self, results), exit_group
        )
        broadcast = self.rank.tp.broadcast_bytes
        receive = steps.recv
        if self.group is None and self.config.kv_cache_prefault:
            # (not in a group: its idle ticks keep the followers' collectives in time)
            receive = IdleWork(self.runner.kv.prefault(), steps).receive
        if self.group is not None:
            bound_s = self.config.tp_follower_timeout_s
            self.rank.tp.serve_with_timeout(bound_s)
            self.group.watch_liveness(bound_s, handler.count)
            tick_ms = max(1, round(stamp_period_s(bound_s) * 1000))

            def receive() -> bytes:  # the next message, or an idle tick (no bytes)
                return steps.recv() if steps.poll(tick_ms) else b""

        try:
            with torch.inference_mode():  # entered once, not once a step (runner.execute)
                while handler.handle(broadcast(receive())):
                    pass
        except Exception:
            if self.group is None:
                raise  # _forward_ended stops the Worker
            # a follower gone mid-broadcast: exit as the follower watch would, for a restart
            self.group.exit_broken()
        finally:
            results.close()
            steps.close(linger=0)

    def _forward_ended(self, future: asyncio.Future) -> None:
        """A forward thread that died (not by teardown's Stop) stops the Worker: the supervisor
        then restarts it, where it would otherwise sit deaf to every plan."""
        if not future.cancelled() and future.exception() is not None:
            self.log.error("the forward thread failed", exc_info=future.exception())
            self.request_stop()

    async def teardown(self) -> None:
        stop_sent = not self.forward.done()
        if self.group is not None:
            self.group.stopping()  # before the Stop: the followers' exits are expected now
        if stop_sent:
            self.send(WORKER_STEPS, Stop(reason="teardown"))  # after any plan already queued
        await asyncio.wait([self.forward])
        if self.group is not None:
            # followers that got no Stop (the forward thread failed) wait for none: killed
            timeout_s = self.config.stop_timeout_s / 2 if stop_sent else 0.0
            await asyncio.to_thread(self.group.wait, timeout_s)
        await self.loop.run_in_executor(self.executor, self.rank.tp.close)
        self.executor.shutdown(wait=True)
        self.runner.grammars.close()


class IdleWork:
    """A socket's receive that runs `work`'s next chunk (an iterator whose every item is one)
    while no message waits, until `work` is exhausted: a message waits one chunk at most."""

    def __init__(self, work: Iterator[object], socket: zmq.Socket):
        self.work: Iterator[object] | None = work
        self.socket = socket

    def receive(self) -> bytes:
        while self.work is not None and not self.socket.poll(0):
            if next(self.work, _DONE) is _DONE:
                self.work = None
        return self.socket.recv()


_DONE = object()


class LeaderReplies:
    """Rank 0's answers (step_handler.Replies): StepResults on the forward thread's socket, the
    rest through the event loop (the compile thread answers GrammarReady)."""

    def __init__(self, worker: Worker, results: zmq.Socket):
        self.worker = worker
        self.results = results

    def step_result(self, result: StepResult) -> None:
        self.results.send(encode(result), copy=False)

    def grammar_ready(self, ready: GrammarReady) -> None:
        self.worker.loop.call_soon_threadsafe(self.worker.send, "scheduler", ready)

    def error(self, message: str) -> None:
        self.worker.loop.call_soon_threadsafe(self.worker.report_error, message)


if __name__ == "__main__":
    actor_main(Worker, sys.argv[1])
