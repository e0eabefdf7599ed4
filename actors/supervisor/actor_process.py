"""A supervised process: how the supervisor starts one (an actor or another child), what it knows
of it (readiness, heartbeats, errors), and its restart budget (which survives the process).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections import deque

import msgspec

from ...messages.control import Ready, RosterEntry

MODULES = {
    "engine": "actorserve.actors.engine.engine",
    "scheduler": "actorserve.actors.scheduler.scheduler",
    "block_manager": "actorserve.actors.block_manager.block_manager",
    "worker": "actorserve.actors.worker.worker",
}


class Child(msgspec.Struct, frozen=True):
    """A supervised process beside the four actors: `python -m MODULE ARGS...`, inheriting
    `pass_fds` (a listening socket it serves on, the same across its restarts)."""

    name: str
    module: str
    args: list[str] = []
    pass_fds: tuple[int, ...] = ()


def restart_delay(recent_deaths: int) -> float:
    """Exponential backoff: a process that keeps dying is restarted ever more slowly."""
    return min(0.05 * 2**recent_deaths, 5.0)


class Death(msgspec.Struct, frozen=True):
    """A process's death as the supervisor noticed it (times: its time.monotonic())."""

    pid: int
    exit_code: int  # Popen's returncode: -N when signal N killed it
    noticed_at: float
    last_beat: float


class ActorProcess:
    """One actor's current process and its history (restarts survive the process). From the
    moment its death is noticed until the replacement is Ready and the step state reset, it
    is `restarting`, shown with the dead process's PID and exit code."""

    def __init__(self, name: str, process: subprocess.Popen, previous: ActorProcess | None = None):
        self.name = name
        self.process = process
        self.ready: Ready | None = None
        self.started_at = self.last_beat = time.monotonic()
        self.ready_at = 0.0
        self.exited_at: float | None = None  # when a status first found it gone
        self.errors = 0
        self.restarting = previous.restarting if previous else False
        self.death: Death | None = previous.death if previous else None
        self.restart_times: deque[float] = previous.restart_times if previous else deque()
        self.restarts = previous.restarts if previous else 0
        self.last_recovery_s = previous.last_recovery_s if previous else 0.0

    @classmethod
    def spawn(
        cls,
        name: str,
        command: list[str],
        pass_fds: tuple[int, ...] = (),
        previous: ActorProcess | None = None,
        omp_spin_count: int | None = None,
    ) -> ActorProcess:
        """Start `python -m COMMAND...`, its output on our stderr. `omp_spin_count`: the
        Worker's (EngineConfig.omp_spin_count), handed to libgomp, which reads it only from
        its environment and only when it starts."""
        env = dict(os.environ)
        if name != "worker":  # only the Worker computes with torch; the others keep one thread
            env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        elif omp_spin_count is not None:
            env["GOMP_SPINCOUNT"] = str(omp_spin_count)
        process = subprocess.Popen(
            [sys.executable, "-m", *command],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr,
            pass_fds=pass_fds,
        )
        return cls(name, process, previous)

    def recent_deaths(self, now: float, window_s: float) -> int:
        """Deaths (restarts) within the last `window_s`, forgetting older ones."""
        while self.restart_times and now - self.restart_times[0] > window_s:
            self.restart_times.popleft()
        return len(self.restart_times)

    async def wait_exit(self, timeout: float) -> bool:
        """True once the process has exited; False if it still runs after `timeout`."""
        deadline = time.monotonic() + timeout
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def died(self, exit_code: int, noticed_at: float) -> None:
        """Its death is noticed: restarting (one restart more) from now until `recovered`."""
        self.death = Death(self.process.pid, exit_code, noticed_at, self.last_beat)
        self.restarting = True
        self.restarts += 1

    def recovered(self, seconds: float) -> None:
        self.restarting = False
        self.last_recovery_s = seconds

    def entry(self) -> RosterEntry:
        """Its line of the roster, as of now."""
        code = self.process.poll()
        pid, beat = self.process.pid, self.last_beat
        exit_code = self.death.exit_code if self.death else None
        if self.restarting:
            state, since = "restarting", self.death.noticed_at
            pid, beat = self.death.pid, self.death.last_beat
        elif code is not None:
            state, exit_code = "exited", code
            since = self.exited_at = self.exited_at or time.monotonic()
        elif self.ready:
            state, since = "ready", self.ready_at
        else:
            state, since = "starting", self.started_at
        return RosterEntry(
            self.name,
            pid,
            state,
            beat,
            since,
            self.restarts,
            self.last_recovery_s,
            self.errors,
            exit_code,
        )
