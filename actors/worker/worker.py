"""Worker actor: owns the device, the model, the paged KV cache and (on CUDA) its streams.

Inbox: StepPlan, CompileGrammar, Reset (Scheduler), read by the forward thread from its own
mailbox (WORKER_STEPS); Stop, on the event loop's. Plans of another epoch than the last Reset's
are dropped.
Outbox: StepResult, GrammarReady -> Scheduler; Ready (with num_kv_blocks and its device type),
Heartbeat -> supervisor.
Owns: model weights, KV cache tensors, the persistent batch (runner.py), the compiled grammars
and their compile thread (grammar_cache.py).
Dies when: Stop, or its supervisor goes away (then by SIGTERM). A failing step is answered with
StepResult.error, and the Worker keeps serving.

The forward runs on a thread of its own so the event loop keeps sending heartbeats meanwhile.
That thread reads the plans (and Resets, in order with them) from its own socket, decodes them
and sends each StepResult itself: when the Scheduler planned step N+1 while step N ran, the plan
is already queued and the next forward starts at once. No plan wakes the event loop, whose
thread would otherwise take a core and the GIL from the forward in the middle of a step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import zmq

from ...kernels import attention_ops, elementwise_ops
from ...messages.codec import DecodeError, Decoder, WorkerInbox, WorkerStepsInbox, encode
from ...messages.control import Ready, Reset, Stop
from ...messages.step import StepPlan, StepResult
from ...messages.structured import CompileGrammar, GrammarReady
from ..config import WORKER_STEPS, EngineConfig
from ..runtime import Actor, actor_main


def worker_device(cfg: EngineConfig):
    """The torch device the Worker serves on: `device`, where auto is cuda if there is one."""
    import torch

    if cfg.device != "auto":
        return torch.device(cfg.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build_runner(cfg: EngineConfig):
    """Load the model, allocate the KV cache (sizing.py: `num_kv_blocks`, else as many blocks as
    the memory budget holds) and the swap space, hand both to the CPU fast path where it serves,
    make the ModelRunner: what the Worker serves with (scripts/bench_step.py measures the same
    one). The runner gets `cfg` resolved for its device (EngineConfig.resolve_device)."""
    import torch

    from ...kernels.cpu.fast_path import CpuFastPath
    from ..model_config import ModelConfig
    from . import dtypes
    from .kv_cache import KVCache
    from .loader import load_model
    from .runner import ModelRunner
    from .sizing import device_kv_blocks, swap_blocks

    device = worker_device(cfg)
    cfg = cfg.resolve_device(device.type)
    stored = ModelConfig.from_dir(cfg.model).dtype  # config.json's dtype (or torch_dtype)
    dtype, dtype_reason = dtypes.model_dtype(cfg.dtype, stored, device)
    kv_dtype, kv_reason = dtypes.kv_cache_dtype(cfg.kv_cache_dtype, dtype)
    fast_path = CpuFastPath.create(cfg, device)  # None: plain torch (off, not CPU, no compiler)
    ops = attention_ops(device, cfg.attention_backend, c_kernels=fast_path is not None)
    if ops.name == "triton" and kv_dtype != dtype:
        raise ValueError(
            f"kv_cache_dtype must be the model's dtype ({dtype}) with the triton attention "
            f"backend, got {kv_dtype}"
        )
    elementwise = elementwise_ops(ops) if fast_path is None else fast_path.elementwise
    model, shape = load_model(cfg.model, device, dtype, ops, elementwise)
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
    log.info("dtype %s (%s); KV cache %s (%s)", dtype, dtype_reason, kv_dtype, kv_reason)
    log.info(
        "model %s on %s (%s, %d threads, attention %s, CPU fast path %s): %d KV blocks of %d "
        "tokens", cfg.model, device, dtype, torch.get_num_threads(), ops.name,
        "on" if fast_path is not None else "off", num_blocks, cfg.block_size,
    )  # fmt: skip
    runner = ModelRunner(cfg, model, kv, device, fast_path)
    if device.type == "cuda":  # compiled and captured before the first request, not during it
        runner.sampler.warm_up(shape.vocab_size)
        sizes = runner.capture_decode_graphs()  # [] with enforce_eager
        log.info("decode CUDA graphs for batch sizes %s", sizes or "none (enforce_eager)")
    return runner


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
        await self.loop.run_in_executor(self.executor, self._build)
        steps = self.ctx.socket(zmq.PULL)  # handed to the forward thread, which alone uses it
        steps.setsockopt(zmq.RCVHWM, 0)
        steps.bind(self.addresses.mailbox(WORKER_STEPS))
        self.forward = self.loop.run_in_executor(self.executor, self._forward_loop, steps)
        self.forward.add_done_callback(self._forward_ended)

    def _build(self) -> None:
        """Resolve the config for the device, set the torch threads, then build the runner (on
        the forward thread)."""
        import torch

        self.config = self.config.resolve_device(worker_device(self.config).type)
        torch.set_num_threads(self.config.torch_threads)
        self.runner = build_runner(self.config)
        self.epoch = self.config.epoch

    def ready(self) -> Ready:
        return Ready(
            actor=self.name,
            pid=os.getpid(),
            num_kv_blocks=self.runner.kv.num_blocks,
            num_cpu_blocks=self.runner.kv.num_cpu_blocks,
            device=self.runner.device.type,
        )

    def _forward_loop(self, steps: zmq.Socket) -> None:
        """The forward thread, until a Stop on its mailbox: run each plan of the current epoch
        in order and send its StepResult (on this thread's own socket to the Scheduler)."""
        import torch

        results = self._connect("scheduler")
        try:
            with torch.inference_mode():  # entered once, not once a step (runner.execute)
                self._run_steps(steps, results)
        finally:
            results.close()
            steps.close(linger=0)

    def _run_steps(self, steps: zmq.Socket, results: zmq.Socket) -> None:
        decoder: Decoder[StepPlan | CompileGrammar | Reset | Stop] = Decoder(WorkerStepsInbox)
        while True:
            data = steps.recv()
            try:
                item = decoder.decode(data)
            except DecodeError as exc:
                self.loop.call_soon_threadsafe(
                    self.report_error, f"could not decode a {len(data)}-byte step: {exc}"
                )
                continue
            if isinstance(item, Stop):
                return
            if isinstance(item, CompileGrammar):
                self._compile_grammar(item)
                continue
            if isinstance(item, Reset):
                self.epoch = item.epoch
                self.runner.forget_all()
            elif item.epoch == self.epoch:
                self._crash_if_faulty(item)
                result = self._execute(item)
                if item.running or item.new:
                    results.send(encode(result), copy=False)

    def _compile_grammar(self, message: CompileGrammar) -> None:
        """Start the compile on the compile thread; the event loop answers when it is done."""
        epoch, spec = message.epoch, message.spec

        def answer(error: str | None) -> None:
            ready = GrammarReady(epoch, spec, error)
            self.loop.call_soon_threadsafe(self.send, "scheduler", ready)

        self.runner.grammars.when_compiled(spec, answer)

    def _crash_if_faulty(self, plan: StepPlan) -> None:
        """The tests' poison request (EngineConfig.fault_crash_on_token_id): a new request whose
        tokens hold that id kills this process at once, as a crash in native code would."""
        token = self.config.fault_crash_on_token_id
        if token is not None and any(token in new.token_ids for new in plan.new):
            self.log.error("fault_crash_on_token_id %d: crashing, as configured", token)
            os._exit(70)

    def _forward_ended(self, future: asyncio.Future) -> None:
        """A forward thread that died (not by teardown's Stop) stops the Worker: the supervisor
        then restarts it, where it would otherwise sit deaf to every plan."""
        if not future.cancelled() and future.exception() is not None:
            self.log.error("the forward thread failed", exc_info=future.exception())
            self.request_stop()

    def _execute(self, plan: StepPlan) -> StepResult:
        try:
            return self.runner.execute(plan)
        except Exception as exc:
            self.log.exception("step %d failed", plan.step_id)
            for rid in [u.request_id for u in plan.running] + [n.request_id for n in plan.new]:
                self.runner.forget(rid)
            return StepResult(
                plan.epoch, plan.step_id, [], [], error=f"{type(exc).__name__}: {exc}"
            )

    async def teardown(self) -> None:
        if not self.forward.done():
            self.send(WORKER_STEPS, Stop(reason="teardown"))  # after any plan already queued
        await asyncio.wait([self.forward])
        self.executor.shutdown(wait=True)
        self.runner.grammars.close()


if __name__ == "__main__":
    actor_main(Worker, sys.argv[1])
