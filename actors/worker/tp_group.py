"""A tensor-parallel Worker group: rank 0 (the Worker actor the supervisor starts) and the
follower ranks 1..N-1 it starts as its own child processes (tp_follower.py).

Every rank runs the same steps: rank 0's forward thread broadcasts the raw bytes of each message
it reads from its steps mailbox (StepPlan, CompileGrammar, Reset, Stop) before it handles them,
and each follower handles the same bytes with the same code (step_handler.py); only rank 0
answers. The broadcast goes through torch.distributed (TensorParallel.broadcast_bytes), not a
ZeroMQ PUB socket: it is one ordered stream with the model's own collectives, so a follower can
never see a plan before the collectives of the step before it are done (no second ordering to
keep in step), and a dead peer surfaces as an error in that collective rather than as a plan
that never arrives.

The group lives and dies as one: a follower that exits while rank 0 serves makes rank 0 exit at
once (`FollowerGroup` watches the child processes), and so does one that stops stamping its
liveness for longer than tp_follower_timeout_s (tp_liveness.py: a stopped process exits nothing),
after rank 0 SIGKILLs every follower; the supervisor restarts the Worker and with it a new group,
the journal resuming every request as after any Worker restart. Rank 0 dying takes the followers
with it (PR_SET_PDEATHSIG, and their next collective fails). Each group joins through a
rendezvous file of its own in the run directory (named by rank 0's pid: a restarted group never
meets a stale file), so no port is opened; its liveness file is named the same way.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec

from ..runtime.config import EngineConfig
from .tp_liveness import FOLLOWER_STALLED, FollowerWatchdog, LivenessBoard

log = logging.getLogger("worker")

# Exit code of a rank whose group is broken (a peer died, or its own step failed mid-group):
# EX_OSERR, distinct from a read loop's EX_SOFTWARE in the supervisor's log.
GROUP_BROKEN = 71
FOLLOWER_MODULE = f"{__package__}.tp_follower"


class FollowerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a follower rank is started with (a JSON file in the run directory: no pickle)."""

    rank: int
    size: int
    init_file: str  # the group's rendezvous (TensorParallel.join)
    liveness_file: str  # the group's LivenessBoard, where the follower stamps its slot
    parent_pid: int  # rank 0's: the follower exits once it is not its parent any more
    config: EngineConfig  # rank 0's, unresolved: each rank resolves it for its own device


def rank_device(config: EngineConfig, rank: int = 0):
    """The torch device rank `rank` serves on: `device`, where auto is cuda if there is one; in
    a group on CUDA, the device list's rank-th from the one named (cuda:r from cuda)."""
    import torch

    if config.device != "auto":
        device = torch.device(config.device)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" or config.tensor_parallel_size == 1:
        return device
    index = (device.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size {config.tensor_parallel_size} from {device} needs cuda:{index},"
            f" but {torch.cuda.device_count()} CUDA devices are visible"
        )
    return torch.device("cuda", index)


def join_group(config: EngineConfig, rank: int, init_file: str):
    """This rank's TensorParallel (a single one, no group, when tensor_parallel_size is 1)."""
    import torch

    from .tensor_parallel import TensorParallel

    if config.tensor_parallel_size == 1:
        return TensorParallel.single()
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator binds the current device
    return TensorParallel.join(rank, config.tensor_parallel_size, init_file, device)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent (rank 0) dies; exit now if it already did. A
    follower holds nothing that outlives its group, so it needs no orderly stop then."""
    if not _kill_on_parent_death():
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    if os.getppid() != parent_pid:  # it died before the prctl
        os._exit(GROUP_BROKEN)


def _kill_on_parent_death() -> bool:
    """PR_SET_PDEATHSIG with SIGKILL (Linux); False where it cannot be set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL) == 0
    except OSError:
        return False


def _watch_parent(parent_pid: int) -> None:
    """Where there is no PR_SET_PDEATHSIG: poll for the parent's death."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(GROUP_BROKEN)


class FollowerGroup:
    """Rank 0's view of its followers: their processes, and the threads that wait on them."""

    def __init__(self, init_file: str, processes: list[subprocess.Popen], liveness: LivenessBoard):
        self.init_file = init_file
        self.processes = processes
        self.liveness = liveness
        self.watchdog: FollowerWatchdog | None = None
        self._stopping = threading.Event()
        self._condemning = threading.Lock()  # held by the one thread that condemns the group

    @classmethod
    def spawn(cls, config: EngineConfig) -> FollowerGroup:
        """Start ranks 1..N-1 (call it on the thread that lives as long as the process: a
        follower's PR_SET_PDEATHSIG fires when the thread that started it ends) and watch them
        from now on, so that one that dies while the group loads fails the start at once."""
        run_dir = Path(config.addresses.run_dir)
        init_file = str(run_dir / f"tp-{os.getpid()}.init")
        size = config.tensor_parallel_size
        liveness = LivenessBoard(str(run_dir / f"tp-{os.getpid()}.live"), size, create=True)
        processes = []
        for rank in range(1, size):
            spec = FollowerSpec(rank, size, init_file, liveness.path, os.getpid(), config)
            spec_file = run_dir / f"tp-{os.getpid()}-rank{rank}.json"
            spec_file.write_bytes(msgspec.json.encode(spec))
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", FOLLOWER_MODULE, str(spec_file)],
                    stdin=subprocess.DEVNULL,
                    stdout=sys.stderr,  # the supervisor's stdout is for its own lines
                )
            )
        group = cls(init_file, processes, liveness)
        for rank, process in enumerate(processes, start=1):
            threading.Thread(
                target=group._watch, args=(rank, process), daemon=True, name=f"rank{rank}-watch"
            ).start()
        log.info(
            "tensor parallel: %d ranks, followers %s",
            config.tensor_parallel_size,
            ", ".join(f"rank {r}={p.pid}" for r, p in enumerate(processes, start=1)),
        )
        return group

    def _watch(self, rank: int, process: subprocess.Popen) -> None:
        """Wait for the follower's exit; unless the group is stopping, end this process now: a
        group short of a rank cannot run another step, and an exit is what the supervisor
        answers with a restart of the whole group."""
        code = process.wait()
        if self._stopping.is_set():
            return
        log.error(
            "tensor-parallel rank %d (pid %d) exited with code %s: exiting, so that the "
            "supervisor restarts the whole group",
            rank,
            process.pid,
            code,
        )
        os._exit(GROUP_BROKEN)

    def watch_liveness(self, bound_s: float, handled) -> None:
        """From now on (the group is built: every follower stamps), a follower silent for
        longer than `bound_s` ends this process (`condemn`). `handled`: rank 0's message
        count, for the log."""
        pids = [process.pid for process in self.processes]
        self.watchdog = FollowerWatchdog(
            self.liveness, pids, bound_s, handled, self._stopping, self.condemn
        ).start()

    def condemn(self) -> None:
        """End the group for a restart, a follower being stalled: SIGKILL every follower (the
        only signal a stopped process does not defer) and reap them, so that none outlives
        this process, then exit with FOLLOWER_STALLED. Called from the watchdog's thread (or
        the forward thread's `exit_broken`), never returns: a second caller waits for the
        first's exit. No teardown: the forward thread may be stuck in a collective."""
        if not self._condemning.acquire(blocking=False):
            threading.Event().wait()
        self._stopping.set()  # the followers' exits are this thread's doing: no GROUP_BROKEN
        for process in self.processes:
            process.kill()
        for process in self.processes:
            try:
                process.wait(5.0)
            except subprocess.TimeoutExpired:
                log.error("tensor-parallel follower pid %d outlived SIGKILL", process.pid)
        logging.shutdown()
        os._exit(FOLLOWER_STALLED)

    def exit_broken(self) -> None:
        """The forward thread's end when a step or a collective failed: exit GROUP_BROKEN, for
        a restart; unless a follower is stalled, or condemn() is killing the followers (which
        fails the collective too): then the exit is condemn()'s (FOLLOWER_STALLED), which says
        why. A stalled follower's collective times out after twice the bound, and the
        watchdog, whose own wake-ups a loaded machine may delay past the bound, may not have
        acted yet: a follower silent for the bound since the watch began is condemned here.
        Never returns."""
        if not self._condemning.locked() and self.watchdog is not None:
            self.watchdog.condemn_if_silent(time.monotonic(), self.watchdog.started)
        if not self._condemning.locked():
            log.exception("the group's step failed: exiting, so the group restarts")
            os._exit(GROUP_BROKEN)
        threading.Event().wait()

    def stopping(self) -> None:
        """From now on a follower's exit is expected (call it before the Stop goes out)."""
        self._stopping.set()

    def wait(self, timeout_s: float) -> None:
        """Wait for the followers to exit (after Stop); SIGKILL those still running after
        `timeout_s`, so that none outlives the Worker."""
        self.stopping()
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel follower pid %d did not stop: killing it", process.pid)
                process.kill()
                process.wait()
        Path(self.init_file).unlink(missing_ok=True)
        if self.watchdog is not None:
            self.watchdog.thread.join()  # it reads the board until it sees `stopping`
        self.liveness.close(unlink=True)
