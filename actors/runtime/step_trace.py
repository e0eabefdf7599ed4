"""EngineConfig.step_trace = PATH: clock times of each step, for scripts/bench_overhead.py.

Off by default (no file, no cost). The Worker records one JSON line per step to PATH with its
phases (actors/worker/runner.py); the Scheduler one line per event of a step to PATH.scheduler:
{"step": step id, "event": name, "t": time}. Times are time.perf_counter, which is
CLOCK_MONOTONIC on Linux and so comparable across the actor processes. Records are kept in
memory and written when the process exits, so tracing costs a step no encoding and no write.
"""

from __future__ import annotations

import atexit
import json
import time


class StepTrace:
    """Records for this process's trace file (PATH + suffix), written at exit."""

    def __init__(self, path: str):
        self.path = path
        self.records: list[dict] = []
        atexit.register(self.write)

    def record(self, record: dict) -> None:
        self.records.append(record)

    def write(self) -> None:
        with open(self.path, "a") as file:
            file.writelines(json.dumps(record) + "\n" for record in self.records)
        self.records.clear()


def open_trace(path: str | None, suffix: str = "") -> StepTrace | None:
    """This process's trace (PATH + suffix), or None when tracing is off (no path)."""
    return StepTrace(path + suffix) if path else None


class EventTrace:
    """One record per (step, event); `mark` costs a None check when tracing is off."""

    def __init__(self, path: str | None, suffix: str):
        self.trace = open_trace(path, suffix)

    def mark(self, step_id: int, event: str) -> None:
        if self.trace is not None:
            self.trace.record({"step": step_id, "event": event, "t": time.perf_counter()})
