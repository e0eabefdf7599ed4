"""A pytest plugin (registered by conftest.py): at the end of a run, the time each test file took
(set-up, call and tear-down of its tests, module fixtures included), longest first.

The suite has a time budget (scripts/test.sh, which CI runs, must finish in 15 minutes on a
2-core machine); this table says where the time goes, which the slowest single tests do not:
a file's servers start in its fixtures' set-up and stop in the tear-down of its last test.
Session fixtures (the shared gateway) count towards the file that first used them.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

SHOWN = 40  # files in the table: the rest are summed in one line


class FileTimes:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.tests: dict[str, int] = defaultdict(int)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        path = report.nodeid.split("::", 1)[0]
        self.seconds[path] += report.duration
        if report.when == "call" or (report.when == "setup" and report.skipped):
            self.tests[path] += 1

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.seconds:
            return
        total = sum(self.seconds.values())
        ranked = sorted(self.seconds.items(), key=lambda item: -item[1])
        write = terminalreporter.write_line
        terminalreporter.section("time per test file")
        write(f"{'seconds':>8} {'share':>6} {'tests':>5}  file")
        for path, seconds in ranked[:SHOWN]:
            share = seconds / total if total else 0.0
            write(f"{seconds:8.1f} {share:6.1%} {self.tests[path]:5d}  {path}")
        rest = ranked[SHOWN:]
        if rest:
            seconds = sum(s for _, s in rest)
            tests = sum(self.tests[p] for p, _ in rest)
            write(f"{seconds:8.1f} {seconds / total:6.1%} {tests:5d}  ({len(rest)} more files)")
        write(f"{total:8.1f} {1:6.0%} {sum(self.tests.values()):5d}  all")
