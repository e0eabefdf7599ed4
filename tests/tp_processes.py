"""A served tensor-parallel group's processes, as the tests find them in /proc, and streams
with a fault injected into them mid-way."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from actorserve.gateway.client import AsyncClient
from actorserve.messages.common import SamplingParams
from support import EngineServer

FOLLOWER_MODULE = "actorserve.actors.worker.tp_follower"


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None


def is_alive(pid: int) -> bool:
    """Running, or stopped (a zombie no reaper collected counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children_of(pid: int) -> list[int]:
    return [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and parent_of(int(entry.name)) == pid
    ]


def process_tree(pid: int) -> list[int]:
    """`pid` and every descendant of it, as of now."""
    tree, index = [pid], 0
    while index < len(tree):
        tree.extend(children_of(tree[index]))
        index += 1
    return tree


def followers_of(worker_pid: int) -> list[int]:
    """The follower ranks' processes: children of the Worker running tp_follower."""
    found = []
    for pid in children_of(worker_pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if FOLLOWER_MODULE in command:
            found.append(pid)
    return found


def worker_status(server: EngineServer):
    return next(a for a in server.client.health().actors if a.name == "worker")


def group_pids(server: EngineServer) -> tuple[int, list[int]]:
    """(rank 0's pid, the followers' pids) once the Worker is ready with its follower."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        worker = worker_status(server)
        followers = followers_of(worker.pid) if worker.state == "ready" else []
        if len(followers) == 1:
            return worker.pid, followers
        time.sleep(0.1)
    raise AssertionError("no ready Worker with one follower rank within 60 s")


def streams_with_fault(
    address: str, prompts, params: SamplingParams, fault, after_tokens: int = 60
):
    """Stream every prompt at once; call `fault()` (on a thread: the streams go on meanwhile)
    once `after_tokens` tokens have arrived -> [(token ids, finish reason)] in prompt order."""

    async def run():
        received = 0
        faulted = False
        async with AsyncClient(address, timeout_s=120) as client:

            async def one(prompt):
                nonlocal received, faulted
                ids = []
                async for delta in client.generate(prompt, params):
                    ids.extend(delta.token_ids)
                    received += len(delta.token_ids)
                    if received >= after_tokens and not faulted:
                        faulted = True
                        await asyncio.to_thread(fault)
                return ids, delta.finish_reason.value

            return await asyncio.gather(*[one(p) for p in prompts])

    return asyncio.run(run())
