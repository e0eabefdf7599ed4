"""Liveness of a tensor-parallel group's followers, as rank 0 sees it (EngineConfig
tp_follower_timeout_s, "the bound").

A stopped follower (SIGSTOP, a frozen VM, a debugger) stops answering collectives but does not
exit, so no process watch notices it: rank 0's forward thread waits in its next collective, its
event loop goes on sending heartbeats, and every stream hangs. Each follower therefore stamps
(CLOCK_MONOTONIC, messages handled) into a slot of its own of a small shared file in the run
directory (`LivenessBoard`), from a thread of its own (`Stamper`) every quarter of the bound, and
a thread of rank 0 (`FollowerWatchdog`; rank 0's forward thread may be the one blocked) kills
the group and exits rank 0 with FOLLOWER_STALLED once a stamp is older than the bound: the
supervisor restarts the Worker, with it a new group, and the journal replays the streams.

The stamp says that the follower's process runs, not that its step advances: a step has no
bound (a long prefill on CPU takes many seconds on every rank alike). A follower whose process
runs but whose main thread hangs keeps stamping; the group's collectives time out on it
instead (tensor_parallel.py: twice the bound, once the group serves).
"""

from __future__ import annotations

import logging
import mmap
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("worker")

# Exit code of rank 0 when a follower stopped stamping: EX_TEMPFAIL, distinct from GROUP_BROKEN
# (a follower that exited, a failed collective) in the supervisor's log.
FOLLOWER_STALLED = 75
SLOT = struct.Struct("<qq")  # monotonic ns of the stamp (0: none yet), messages handled


def stamp_period_s(bound_s: float) -> float:
    """How often a follower stamps (and rank 0 looks): four stamps fit in the bound."""
    return bound_s / 4


class LivenessBoard:
    """The shared file: one SLOT per rank (rank 0's unused), each written by its rank alone.
    An aligned 8-byte store is not torn on the platforms torch serves on, so no lock."""

    def __init__(self, path: str, size: int, create: bool = False):
        self.path = path
        if create:
            Path(path).write_bytes(bytes(SLOT.size * size))
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), SLOT.size * size)

    def stamp(self, rank: int, handled: int) -> None:
        SLOT.pack_into(self._map, rank * SLOT.size, time.monotonic_ns(), handled)

    def read(self, rank: int) -> tuple[float | None, int]:
        """(the rank's last stamp in time.monotonic() seconds, None before the first; the
        messages it had handled then)."""
        stamped_ns, handled = SLOT.unpack_from(self._map, rank * SLOT.size)
        return (stamped_ns / 1e9 if stamped_ns else None), handled

    def close(self, unlink: bool = False) -> None:
        self._map.close()
        if unlink:
            Path(self.path).unlink(missing_ok=True)


class Stamper:
    """A follower's stamping thread (a daemon: it ends with the process)."""

    def __init__(self, board: LivenessBoard, rank: int, bound_s: float, handled: Callable[[], int]):
        self.board, self.rank, self.handled = board, rank, handled
        self.period_s = stamp_period_s(bound_s)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="liveness-stamp")

    def start(self) -> Stamper:
        self.board.stamp(self.rank, self.handled())
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.board.stamp(self.rank, self.handled())

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()


class FollowerWatchdog:
    """Rank 0's thread that reads the followers' stamps. `pids`: rank r's at index r - 1;
    `handled`: rank 0's own count, for the log; `stopping`: set once the group stops, when a
    follower's silence is expected (join the thread then, before the board closes);
    `condemn()`: kill the group and exit, never returns."""

    def __init__(
        self,
        board: LivenessBoard,
        pids: list[int],
        bound_s: float,
        handled: Callable[[], int],
        stopping: threading.Event,
        condemn: Callable[[], None],
    ):
        self.board, self.pids, self.bound_s = board, pids, bound_s
        self.handled, self.stopping, self.condemn = handled, stopping, condemn
        self.period_s = stamp_period_s(bound_s)
        self.thread = threading.Thread(target=self._run, daemon=True, name="liveness-watch")
        # the watch's start, and the earliest a follower's silence counts from (`_run`)
        self.started = self.since = time.monotonic()

    def start(self) -> FollowerWatchdog:
        self.started = self.since = time.monotonic()
        self.thread.start()
        return self

    def _run(self) -> None:
        # A follower's silence counts from `since` at the earliest: the start of the watch (it
        # may not have stamped yet), or this thread's own late wake-up. When this thread slept
        # far past its period the whole machine stalled (swap, a suspended VM), the followers
        # with it: that is no follower's fault, so each gets a whole bound again.
        last = self.since
        while not self.stopping.wait(self.period_s):
            now = time.monotonic()
            if now - last > self.period_s + self.bound_s / 2:
                self.since = now
            last = now
            self.condemn_if_silent(now, self.since)

    def condemn_if_silent(self, now: float, since: float) -> None:
        """Condemn the group (never returns) when a follower has not stamped for longer than
        the bound, counted from `since` at the earliest; else return."""
        for rank in range(1, len(self.pids) + 1):
            stamped, handled = self.board.read(rank)
            silent_s = now - max(stamped or since, since)
            if silent_s > self.bound_s and not self.stopping.is_set():
                log.error(
                    "tensor-parallel rank %d (pid %d) made no progress for %.1f s (bound "
                    "tp_follower_timeout_s %.1f s; it had handled %d messages, rank 0 %d): "
                    "killing the group and exiting (code %d), so that the supervisor "
                    "restarts it",
                    rank, self.pids[rank - 1], silent_s, self.bound_s, handled,
                    self.handled(), FOLLOWER_STALLED,
                )  # fmt: skip
                self.condemn()
