"""The message round trip over ipc:// (bench_overhead.py's second part).

A StepPlan of N requests is encoded, sent, decoded by the other process, answered with the
StepResult of N tokens, decoded. Three pairings of the two ends:

- `engine`: as the engine pairs them: the sender on uvloop with the actors' LoopSocket (the
  Scheduler), the other end a plain blocking zmq read on a thread of its own (the Worker's
  forward thread);
- `asyncio`: both ends on uvloop with LoopSocket (every other actor's mailbox);
- `blocking`: plain blocking zmq calls on both ends (the transport and codec alone).

Then a raw socketpair ping-pong, the operating system's own floor between two processes, and
the engine pairing and the floor again with both processes on one CPU: the difference is what
waking a process on the other CPU costs. In a VM that is an inter-processor interrupt and, when
the other virtual CPU idles halted, a trip through the hypervisor to wake it; how long a guest
polls before it halts (cpuidle-haltpoll's `guest_halt_poll_ns`) is printed in the machine line.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_common as bc

WARMUP = 50  # round trips before the measured ones
MODES = {  # pairing -> its label in the table
    "engine": "Scheduler's LoopSocket <-> forward thread",
    "asyncio": "LoopSocket both ends",
    "blocking": "blocking zmq both ends",
}

COLUMNS = [
    bc.Column("message", "round trip (-> StepResult back)"),
    bc.Column("bytes", "plan bytes", "{:d}"),
    bc.Column("p50_us", "p50 us", "{:.0f}"),
    bc.Column("p99_us", "p99 us", "{:.0f}"),
    bc.Column("mean_us", "mean us", "{:.0f}"),
]


def plans(n: int, prompt_len: int):
    """The plans measured (empty; delta: N RunningUpdates, the steady state; full: N
    NewRequests with prompts of `prompt_len`) and the StepResult of N tokens that answers them."""
    from actorserve.messages.common import SamplingParams
    from actorserve.messages.step import NewRequest, RunningUpdate, StepPlan, StepResult

    ids = [f"req-{i:032x}" for i in range(n)]  # the Engine's ids are uuid-sized
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    delta = StepPlan(7, 1, [], [RunningUpdate(r, [], 1) for r in ids], [])
    full = StepPlan(
        7,
        1,
        [],
        [],
        [
            NewRequest(r, list(range(1000, 1000 + prompt_len)), prompt_len,
                       list(range(i * 32, i * 32 + prompt_len // 16 + 1)), prompt_len, params)
            for i, r in enumerate(ids)
        ],
    )  # fmt: skip
    result = StepResult(7, 1, ids, list(range(n)), forward_s=0.01)
    return {"empty": StepPlan(7, 1, [], [], []), "delta": delta, "full": full}, result


def echo_main(inbox: str, outbox: str, n: int, prompt_len: int, mode: str) -> None:
    """The Worker's side: decode each StepPlan with the Worker's decoder, answer a StepResult
    (an empty one to the empty plan)."""
    import zmq

    from actorserve.actors.runtime.actor import LoopSocket
    from actorserve.messages.codec import Decoder, WorkerStepsInbox, encode

    _, result = plans(n, prompt_len)
    empty_result = type(result)(7, 1, [], [])
    decoder = Decoder(WorkerStepsInbox)

    def answer(data: bytes) -> bytes:
        plan = decoder.decode(data)
        return encode(result if (plan.running or plan.new) else empty_result)

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(inbox)
    push.connect(outbox)
    if mode == "asyncio":

        async def serve() -> None:
            mailbox = LoopSocket(pull)
            while (data := await mailbox.receive()) != b"stop":
                push.send(answer(data), copy=False)
            mailbox.close()

        run_loop(serve())
    else:  # the Worker's forward thread reads its plans so
        while (data := pull.recv(copy=False).bytes) != b"stop":
            push.send(answer(data), copy=False)
    pull.close(0)
    push.close(0)
    ctx.term()


def run_loop(coro) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


ONE_CPU = ", one CPU"  # the label of the rows measured with both processes on one CPU


@contextlib.contextmanager
def on_one_cpu():
    """Pin this process (and what it starts meanwhile: the echo process, zmq's I/O threads) to
    its first allowed CPU while the block runs; yields False where it cannot pin."""
    if not hasattr(os, "sched_setaffinity"):
        yield False
        return
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        yield True
    finally:
        os.sched_setaffinity(0, allowed)


def round_trips(
    n: int, prompt_len: int, iterations: int, mode: str, names: tuple[str, ...], where: str
) -> list[dict]:
    """One row per plan of `names` in pairing `mode` (MODES); `where`: "" or ONE_CPU."""
    import zmq

    from actorserve.actors.runtime.actor import LoopSocket
    from actorserve.messages.codec import Decoder, SchedulerInbox, encode

    measured = {name: plan for name, plan in plans(n, prompt_len)[0].items() if name in names}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="actorserve-ipc-") as tmp:
        inbox, outbox = f"ipc://{tmp}/worker.sock", f"ipc://{tmp}/scheduler.sock"
        echo_command = [sys.executable, str(Path(__file__).resolve()), "--echo-server"]
        echo_command += [inbox, outbox, str(n), str(prompt_len), mode]
        echo = None

        async def measure() -> None:
            nonlocal echo
            blocking = mode == "blocking"
            ctx = zmq.Context()
            pull = ctx.socket(zmq.PULL)
            pull.bind(outbox)
            mailbox = LoopSocket(pull)
            echo = subprocess.Popen(echo_command)
            push = ctx.socket(zmq.PUSH)
            push.connect(inbox)
            decoder = Decoder(SchedulerInbox)
            for name, plan in measured.items():
                samples = []
                size = len(encode(plan))
                for i in range(iterations + WARMUP):
                    start = time.perf_counter()
                    push.send(encode(plan), copy=False)
                    data = pull.recv() if blocking else await mailbox.receive()
                    reply = decoder.decode(data)
                    elapsed = time.perf_counter() - start
                    assert reply.step_id == 1
                    if i >= WARMUP:
                        samples.append(elapsed)
                label = f"StepPlan {name}" + ("" if name == "empty" else f", {n} reqs")
                message = f"{label} ({MODES[mode]}{where})"
                rows.append(latency_row(message, mode, size, samples, where))
            push.send(b"stop")
            mailbox.close()
            push.close(linger=1000)
            ctx.term()

        try:
            run_loop(measure())
        finally:
            if echo is not None:
                try:
                    echo.wait(10)
                except subprocess.TimeoutExpired:
                    echo.kill()
    return rows


ECHO_ON_FD = """
import socket, sys
s = socket.socket(fileno=int(sys.argv[1]))
while (data := s.recv(65536)) != b"stop":
    s.sendall(data)
"""


def socketpair_floor(iterations: int, where: str) -> dict:
    """The operating system's floor: an 18-byte ping-pong over a Unix socketpair between two
    processes, no ZeroMQ and no codec (two cross-process wake-ups per round trip)."""
    import socket

    ours, theirs = socket.socketpair()
    echo = subprocess.Popen(
        [sys.executable, "-c", ECHO_ON_FD, str(theirs.fileno())], pass_fds=[theirs.fileno()]
    )
    theirs.close()
    samples = []
    try:
        for i in range(iterations + WARMUP):
            start = time.perf_counter()
            ours.sendall(b"x" * 18)
            ours.recv(65536)
            if i >= WARMUP:
                samples.append(time.perf_counter() - start)
        ours.sendall(b"stop")
    finally:
        ours.close()
        echo.wait(10)
    label = f"18 bytes over a socketpair (OS floor, no zmq{where})"
    return latency_row(label, "socketpair", 18, samples, where)


def latency_row(message: str, mode: str, size: int, samples: list[float], where: str) -> dict:
    """One row of the ipc table from round-trip times in seconds (warm-up already left out)."""
    return {
        "table": "ipc",
        "message": message,
        "mode": mode,
        "one_cpu": bool(where),
        "bytes": size,
        "p50_us": bc.percentile(samples, 50) * 1e6,
        "p99_us": bc.percentile(samples, 99) * 1e6,
        "mean_us": statistics.fmean(samples) * 1e6,
        "iterations": len(samples),
    }


def ipc_table(n: int, iterations: int, prompt_len: int = 256) -> list[dict]:
    """Every row of the table, in the order printed: the engine pairing's delta plan first (the
    issue's figure: a StepPlan of N requests as the Scheduler sends it to the Worker)."""
    rows = round_trips(n, prompt_len, iterations, "engine", ("delta",), "")
    rows += round_trips(n, prompt_len, iterations, "asyncio", ("empty", "delta", "full"), "")
    rows += round_trips(n, prompt_len, iterations, "blocking", ("empty", "delta"), "")
    rows.append(socketpair_floor(iterations, ""))
    with on_one_cpu() as pinned:
        if pinned:
            rows += round_trips(n, prompt_len, iterations, "engine", ("delta",), ONE_CPU)
            rows.append(socketpair_floor(iterations, ONE_CPU))
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] != ["--echo-server"]:
        sys.exit("run by bench_overhead.py: python scripts/bench_overhead.py --skip-steps")
    inbox, outbox, n, prompt_len, mode = sys.argv[2:7]
    echo_main(inbox, outbox, int(n), int(prompt_len), mode)
