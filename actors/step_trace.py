"""ACTORSERVE_STEP_TRACE=PATH: clock times of each step, for scripts/bench_overhead.py.

Off by default (no file, no cost). The Worker appends one JSON line per step to PATH with its
phases (actors/worker/runner.py); the Scheduler appends one line per event of a step to
PATH.scheduler: {"step": step id, "event": name, "t": time}. Times are time.perf_counter, which
is CLOCK_MONOTONIC on Linux and so comparable across the actor processes. The file is written
through a buffer and closed when the process exits, so tracing adds no write(2) to a step.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from typing import TextIO

ENV = "ACTORSERVE_STEP_TRACE"


def open_trace(suffix: str = "") -> TextIO | None:
    """The trace file for this process (PATH + suffix, flushed at exit), or None when off."""
    path = os.environ.get(ENV)
    if not path:
        return None
    file = open(path + suffix, "a", buffering=1 << 20)
    atexit.register(file.close)
    return file


class EventTrace:
    """One line per (step, event); `mark` costs a None check when tracing is off."""

    def __init__(self, suffix: str):
        self.file = open_trace(suffix)

    def mark(self, step_id: int, event: str) -> None:
        if self.file is not None:
            record = {"step": step_id, "event": event, "t": time.perf_counter()}
            self.file.write(json.dumps(record) + "\n")
