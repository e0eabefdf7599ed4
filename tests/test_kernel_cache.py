"""The CPU kernels' library cache (kernels/cpu/build.py): a start finds its library and loads
it without compiling, and a build keeps the libraries that other checkouts or versions sharing
the cache use, so a restarted Worker never waits for a compile another build forced."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from actorserve.kernels.cpu import build


def age(path, seconds_ago: float) -> None:
    when = os.path.getmtime(path) - seconds_ago
    os.utime(path, (when, when))


def test_prune_keeps_the_most_recently_used_libraries(tmp_path):
    libraries = [tmp_path / f"cpu_kernels-{i:016x}.so" for i in range(7)]
    for i, path in enumerate(libraries):
        path.write_bytes(b"")
        age(path, 1000 * (i + 1))  # libraries[0] is the most recent
    (tmp_path / "unrelated.txt").write_text("kept")
    build.prune(tmp_path, keep=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*(p.name for p in libraries[:4]), "unrelated.txt"]
    )


def test_a_cached_library_is_loaded_without_compiling_and_others_are_left(tmp_path, monkeypatch):
    ours = build.build()  # the shared cache's (compiled here only if no test compiled it yet)
    if ours is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    cached = tmp_path / ours.name
    shutil.copyfile(ours, cached)
    other = tmp_path / "cpu_kernels-0123456789abcdef.so"  # another checkout's
    other.write_bytes(b"")
    age(cached, 3600)
    before = os.path.getmtime(cached)
    commands = []
    real_run = subprocess.run

    def run(command, *args, **kwargs):
        commands.append(command)
        return real_run(command, *args, **kwargs)

    monkeypatch.setattr(build.subprocess, "run", run)
    assert build.build() == cached
    assert all("-shared" not in command for command in commands)  # `cc --version` only
    assert os.path.getmtime(cached) > before  # marked used: a later prune keeps it
    assert other.exists()
