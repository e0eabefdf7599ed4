"""Supervision: actors that die or hang are replaced and every stream completes unchanged;
past the restart budget the engine stops with errors; SIGTERM drains; supervisord brings a killed
`actorserve serve` back. (The Engine's death through HTTP and with seeded sampling:
test_engine_death.py.)"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import zmq

from actorserve.actors.runtime.addresses import WORKER_STEPS
from actorserve.actors.runtime.config import EngineConfig
from actorserve.actors.supervisor.background import BackgroundSupervisor
from actorserve.cli import main as cli
from actorserve.gateway.blocking_client import Client
from actorserve.gateway.client import AsyncClient
from actorserve.gateway.errors import EngineError
from actorserve.messages.blocks import AllocateStep, BlockNeed
from actorserve.messages.codec import encode
from actorserve.messages.common import SamplingParams
from actorserve.messages.step import NewRequest, StepPlan
from support import EngineServer, generate_concurrently, hf_greedy, prompts_of_lengths

MAX_TOKENS = 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def actor_pid(server: EngineServer, name: str) -> int | None:
    """The actor's PID in the supervisor's roster (None while no health reply comes)."""
    try:
        actors = server.client.health().actors
    except EngineError:
        return None
    return next((a.pid for a in actors if a.name == name), None)


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def run_streams_with_fault(address: str, prompts, fault, after_tokens: int = 60):
    """Stream every prompt at once; call `fault()` once `after_tokens` tokens have arrived."""

    async def run():
        received = 0
        faulted = asyncio.Event()

        async with AsyncClient(address, timeout_s=120) as client:

            async def one(prompt):
                nonlocal received
                ids = []
                async for delta in client.generate(prompt, GREEDY):
                    ids.extend(delta.token_ids)
                    received += len(delta.token_ids)
                    if received >= after_tokens and not faulted.is_set():
                        faulted.set()
                        await asyncio.to_thread(fault)
                return ids, delta.finish_reason

            return await asyncio.gather(*[one(p) for p in prompts])

    return asyncio.run(run())


@pytest.fixture(scope="module")
def engine(llama_dir):
    server = EngineServer(llama_dir, "--heartbeat-interval-s", "0.5", "--max-restarts", "10")
    yield server
    assert server.stop() == 0


def process_environment(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)


def test_the_worker_spins_omp_spin_count_and_the_other_actors_keep_one_thread(engine):
    worker = process_environment(actor_pid(engine, "worker"))
    assert worker["GOMP_SPINCOUNT"] == str(EngineConfig(model="m").omp_spin_count)
    assert "OMP_NUM_THREADS" not in worker or worker["OMP_NUM_THREADS"] != "1"
    for name in ("scheduler", "block_manager", "engine"):
        assert process_environment(actor_pid(engine, name))["OMP_NUM_THREADS"] == "1", name


@pytest.mark.parametrize("victim", ["worker", "scheduler", "block_manager", "engine"])
def test_sigkill_mid_stream_loses_nothing_and_output_equals_fault_free(llama_dir, engine, victim):
    prompts = prompts_of_lengths(llama_dir)
    before = {a.name: a for a in engine.client.health().actors}
    results = run_streams_with_fault(
        engine.address, prompts, lambda: os.kill(actor_pid(engine, victim), signal.SIGKILL)
    )
    for prompt, (ids, reason) in zip(prompts, results):
        assert ids == hf_greedy(llama_dir, prompt, MAX_TOKENS), f"{len(prompt)}-token prompt"
        assert reason.value in ("stop", "length")
    after = {a.name: a for a in engine.client.health().actors}
    assert after[victim].restarts == before[victim].restarts + 1
    assert after[victim].pid != before[victim].pid and after[victim].state == "ready"


def test_whole_completions_held_by_a_killed_scheduler_are_recomputed_and_equal_fault_free(
    llama_dir, engine
):
    prompts = prompts_of_lengths(llama_dir, [5, 60, 120, 200, 31, 300])
    params = SamplingParams(temperature=0.0, max_tokens=256)  # long enough to be cut short
    before = {a.name: a for a in engine.client.health().actors}

    async def run():
        async with AsyncClient(engine.address, timeout_s=120) as client:
            tasks = [asyncio.create_task(client.complete_all(p, params)) for p in prompts]
            await asyncio.sleep(0.05)  # while they run (the six take about a third of a second)
            done_before = sum(task.done() for task in tasks)
            await asyncio.to_thread(os.kill, actor_pid(engine, "scheduler"), signal.SIGKILL)
            return done_before, await asyncio.gather(*tasks)

    done_before, results = asyncio.run(run())
    assert done_before < len(prompts)  # the Scheduler held their tokens when it died
    for prompt, (whole,) in zip(prompts, results):
        assert whole.token_ids == hf_greedy(llama_dir, prompt, 256)
    after = {a.name: a for a in engine.client.health().actors}
    assert after["scheduler"].restarts == before["scheduler"].restarts + 1


def send_to_mailbox(supervisor, actor: str, data: bytes) -> None:
    socket = zmq.Context.instance().socket(zmq.PUSH)
    socket.connect(supervisor.config.addresses.mailbox(actor))
    socket.send(data)
    socket.close(linger=1000)


def test_a_message_an_actor_cannot_take_is_reported_and_nothing_is_restarted(llama_dir, capfd):
    config = EngineConfig(model=str(llama_dir), torch_threads=2, heartbeat_interval_s=0.2)
    with BackgroundSupervisor(config) as stack:
        supervisor = stack.supervisor
        send_to_mailbox(supervisor, "scheduler", b"not msgpack")

        def errors() -> int:
            return next(s.errors for s in supervisor.statuses() if s.name == "scheduler")

        wait_until(lambda: errors() == 1, 10, "the Scheduler's ActorError")
        time.sleep(1.0)  # five heartbeat intervals: a supervisor deaf to them kills actors
        assert all(s.restarts == 0 and s.state == "ready" for s in supervisor.statuses())
        time.sleep(0.3)  # the next roster reaches the Engine, which health replies read
        assert cli.main(["status", "--address", supervisor.client_address]) == 0
        (row,) = [line for line in capfd.readouterr().out.splitlines() if "scheduler" in line]
        assert row.split()[-1] == "1"  # the errors column
        prompt = prompts_of_lengths(llama_dir, [20])[0]
        ((_, ids, _),) = generate_concurrently(supervisor.client_address, [prompt], GREEDY)
        assert ids == hf_greedy(llama_dir, prompt, MAX_TOKENS)


def test_a_failed_allocation_restarts_the_block_manager_and_no_request_is_lost(llama_dir):
    config = EngineConfig(model=str(llama_dir), torch_threads=2, heartbeat_interval_s=0.2)
    prompts = prompts_of_lengths(llama_dir, [5, 60, 120, 200])
    params = SamplingParams(temperature=0.0, max_tokens=256)
    with BackgroundSupervisor(config) as stack:
        supervisor = stack.supervisor

        async def run():
            async with AsyncClient(supervisor.client_address, timeout_s=120) as client:
                tasks = [asyncio.create_task(client.complete_all(p, params)) for p in prompts]
                await asyncio.sleep(0.05)  # while they run (a quarter of a second in all)
                # blocks for a running request the BlockManager never heard of: the pool raises
                ghost = AllocateStep(0, 999, [BlockNeed("ghost", 5, 1, False, [])], 0)
                send_to_mailbox(supervisor, "block_manager", encode(ghost))
                return await asyncio.gather(*tasks)

        results = asyncio.run(run())

        def block_manager():
            return next(s for s in supervisor.statuses() if s.name == "block_manager")

        wait_until(lambda: block_manager().restarts == 1, 10, "the BlockManager's restart")
        wait_until(lambda: block_manager().state == "ready", 10, "the BlockManager ready again")
    for prompt, (whole,) in zip(prompts, results):
        assert whole.token_ids == hf_greedy(llama_dir, prompt, 256)


def test_a_step_that_fails_in_the_worker_is_answered_and_the_worker_serves_on(llama_dir, capfd):
    config = EngineConfig(model=str(llama_dir), torch_threads=2, heartbeat_interval_s=0.2)
    with BackgroundSupervisor(config) as stack:
        supervisor = stack.supervisor
        send_to_mailbox(supervisor, WORKER_STEPS, b"not msgpack")  # reported, then skipped
        wait_until(
            lambda: next(s.errors for s in supervisor.statuses() if s.name == "worker") == 1,
            10,
            "the Worker's ActorError",
        )
        # 40 tokens to compute in one block of 16: the step's input preparation raises
        ghost = NewRequest("ghost", [1] * 40, 40, [0], 40, SamplingParams(max_tokens=1))
        send_to_mailbox(supervisor, WORKER_STEPS, encode(StepPlan(0, 999, [], [], [ghost])))
        logged: list[str] = []

        def failed() -> bool:
            logged.append(capfd.readouterr().err)
            return "step 999 failed" in "".join(logged)

        wait_until(failed, 10, "the Worker's failed step in its log")
        prompt = prompts_of_lengths(llama_dir, [20])[0]
        ((_, ids, _),) = generate_concurrently(supervisor.client_address, [prompt], GREEDY)
        assert ids == hf_greedy(llama_dir, prompt, MAX_TOKENS)
        assert all(s.restarts == 0 and s.state == "ready" for s in supervisor.statuses())


def test_a_sigstopped_worker_is_killed_within_three_heartbeats_and_streams_complete(
    llama_dir, engine
):
    prompts = prompts_of_lengths(llama_dir)[:8]
    old_pid = actor_pid(engine, "worker")
    stopped_at = []

    def freeze():
        stopped_at.append(time.monotonic())
        os.kill(old_pid, signal.SIGSTOP)

    results = run_streams_with_fault(engine.address, prompts, freeze)
    for prompt, (ids, _) in zip(prompts, results):
        assert ids == hf_greedy(llama_dir, prompt, MAX_TOKENS)
    assert not Path(f"/proc/{old_pid}").exists() or "Z" in Path(f"/proc/{old_pid}/stat").read_text()
    worker = next(a for a in engine.client.health().actors if a.name == "worker")
    # Killed after 3 missed beats of 0.5 s (+ one monitor tick); the rest is the restart itself.
    assert worker.pid != old_pid and worker.last_recovery_s > 0
    log = engine.log()
    assert "sent no heartbeat" in log


def test_past_the_restart_budget_the_engine_stops_nonzero_and_clients_get_errors(llama_dir):
    server = EngineServer(llama_dir, "--max-restarts", "2", "--restart-window-s", "60")
    try:
        for _ in range(2):
            pid = actor_pid(server, "scheduler")
            os.kill(pid, signal.SIGKILL)
            wait_until(
                lambda p=pid: actor_pid(server, "scheduler") not in (p, None), 30, "a new scheduler"
            )
        with Client(server.address, liveness_timeout_s=3) as client:
            stream = client.generate("x", SamplingParams(max_tokens=2000, ignore_eos=True))
            next(stream)
            os.kill(actor_pid(server, "scheduler"), signal.SIGKILL)
            with pytest.raises(EngineError):
                for _ in stream:
                    pass
        assert server.proc.wait(60) != 0
        assert "restart budget" in server.log()
    finally:
        server.stop()


def test_sigterm_finishes_in_flight_streams_refuses_new_ones_and_exits_zero(llama_dir):
    server = EngineServer(llama_dir)
    prompts = prompts_of_lengths(llama_dir, [20, 60, 100])
    # Long enough that the three streams are still running when the new request arrives (0.5 s
    # in: a few hundred steps), and still running after it.
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def run():
        async with AsyncClient(server.address, timeout_s=60) as client:

            async def one(prompt):
                return [t async for d in client.generate(prompt, params) for t in d.token_ids]

            streams = [asyncio.create_task(one(p)) for p in prompts]
            await asyncio.sleep(0.3)
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            with pytest.raises(EngineError, match="shutting down") as refused:
                await one(prompts[0])
            return await asyncio.gather(*streams), refused.value.code

    try:
        outputs, code = asyncio.run(run())
        assert [len(o) for o in outputs] == [500] * 3 and code == "unavailable"
        assert server.proc.wait(60) == 0
    finally:
        server.stop()


def test_sigterm_to_the_whole_process_group_drains_as_sigterm_to_the_supervisor(llama_dir):
    """`timeout`, `kill -- -PGID` and systemd's default stop signal every process at once: the
    actors leave it to their supervisor, which drains the stream in flight (no actor quits
    early and none is restarted) and exits 0."""
    server = EngineServer(llama_dir, new_session=True)
    prompt = prompts_of_lengths(llama_dir, [40])[0]
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)

    async def run():
        async with AsyncClient(server.address, timeout_s=60) as client:
            stream = client.generate(prompt, params)
            tokens = list((await anext(stream)).token_ids)
            os.killpg(server.proc.pid, signal.SIGTERM)
            async for delta in stream:
                tokens += delta.token_ids
            return tokens

    try:
        tokens = asyncio.run(run())
        assert len(tokens) == 300
        assert server.proc.wait(60) == 0
        assert "restarting" not in server.log() and "exited with code" not in server.log()
    finally:
        server.stop()


@pytest.mark.slow
def test_supervisord_restarts_a_killed_serve_process(llama_dir):
    run = Path(tempfile.mkdtemp(prefix="actorserve-supervisord-"))
    address = f"ipc://{run}/engine.sock"
    conf = run / "supervisord.conf"
    conf.write_text(
        textwrap.dedent(f"""
        [supervisord]
        nodaemon=true
        logfile={run}/supervisord.log
        pidfile={run}/supervisord.pid
        [unix_http_server]
        file={run}/supervisor.sock
        [rpcinterface:supervisor]
        supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface
        [program:actorserve]
        command={sys.executable} -m actorserve.cli serve --model {llama_dir} --address {address}
        autorestart=true
        startsecs=1
        stopsignal=TERM
        stopwaitsecs=30
        redirect_stderr=true
        stdout_logfile={run}/actorserve.log
    """)
    )
    supervisord = subprocess.Popen(
        [str(Path(sys.executable).parent / "supervisord"), "-c", str(conf)]
    )
    try:
        with Client(address, liveness_timeout_s=5) as client:
            first = wait_until(lambda: _health_or_none(client), 120, "first start")
            old = {a.pid for a in first.actors}
            os.kill(_parent(first.actors[0].pid), signal.SIGKILL)
            # only the new serve's Engine names other actors: the old one, stopping on the
            # kernel's SIGTERM, can still answer health with the old actors (whose parent is no
            # longer the killed serve) while it no longer serves requests
            wait_until(
                lambda: (h := _health_or_none(client)) and old.isdisjoint(a.pid for a in h.actors),
                120,
                "supervisord to restart actorserve serve",
            )
            done = client.complete("import os", SamplingParams(max_tokens=4))
            assert done.completion_tokens == 4
    finally:
        supervisord.send_signal(signal.SIGTERM)
        supervisord.wait(60)
        shutil.rmtree(run, ignore_errors=True)


def _health_or_none(client: Client):
    try:
        health = client.health(timeout_s=1.0)
    except EngineError:
        return None
    return health if health.ok else None


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])
