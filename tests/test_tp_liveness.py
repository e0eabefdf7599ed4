"""Liveness of a tensor-parallel group (issue 37): a follower rank that stops (SIGSTOP: it exits
nothing, and rank 0's heartbeats go on) is found within tp_follower_timeout_s, the group is
killed and restarted, every stream completes as in a fault-free run, every KV block comes back,
and no process of the server's tree is left once it stops, the stopped follower included. An
idle group outlives its collective timeout (rank 0's idle ticks)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from actorserve.actors.worker.tp_liveness import FOLLOWER_STALLED
from actorserve.messages.common import SamplingParams
from support import EngineServer, generate_concurrently, prompts_of_lengths, smallest_greedy_margin
from tp_processes import group_pids, is_alive, process_tree, streams_with_fault, worker_status

BOUND_S = 3.0  # tp_follower_timeout_s; the serving group's collectives time out at twice it
RESTART_S = 30.0  # a generous allowance for a group's restart (two processes load the model)
GROUP = (
    *("--tensor-parallel-size", "2", "--torch-threads", "1"),
    *("--tp-follower-timeout-s", str(BOUND_S)),
    *("--heartbeat-interval-s", "0.5", "--max-restarts", "10"),
    *("--num-kv-blocks", "48", "--max-model-len", "768", "--max-num-batched-tokens", "64"),
)
STREAMED = SamplingParams(temperature=0.0, max_tokens=48)
LENGTHS = [12, 20, 33, 44, 50, 63, 70, 88]


@pytest.fixture(scope="module")
def group(llama_dir):
    """One group of two ranks; the last test stops it (and checks what is left)."""
    server = EngineServer(llama_dir, *GROUP)
    yield server
    if server.proc.poll() is None:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def prompts(llama_dir):
    """Prompts whose every greedy step has a clear winner: a resumed stream recomputes its
    prefix in another order, which may flip a near tie (smallest_greedy_margin's rule)."""
    chosen = prompts_of_lengths(llama_dir, LENGTHS)
    for prompt in chosen:
        assert smallest_greedy_margin(llama_dir, prompt, STREAMED.max_tokens) > 1e-3
    return chosen


@pytest.mark.slow
def test_an_idle_group_outlives_its_collective_timeout(group, prompts):
    """The follower waits in a broadcast for the next message: without rank 0's idle ticks it
    would time out there after 2 x BOUND_S, and the group would restart."""
    before = worker_status(group)
    time.sleep(2 * BOUND_S + 3.0)
    after = worker_status(group)
    assert (after.pid, after.restarts, after.state) == (before.pid, before.restarts, "ready")
    ((_, ids, last),) = generate_concurrently(group.address, prompts[:1], STREAMED)
    assert len(ids) == STREAMED.max_tokens and last.finish_reason.value == "length"


@pytest.mark.slow
def test_a_stopped_follower_is_killed_within_the_bound_and_the_streams_complete_identical(
    group, prompts
):
    fault_free = streams_with_fault(group.address, prompts, STREAMED, lambda: None)
    restarts = worker_status(group).restarts
    worker, (follower,) = group_pids(group)
    restarted_after: list[float] = []

    def stop_the_follower() -> None:
        """SIGSTOP the follower, then wait for the new group to be ready."""
        os.kill(follower, signal.SIGSTOP)
        stopped_at = time.monotonic()
        deadline = stopped_at + BOUND_S + RESTART_S
        while time.monotonic() < deadline:
            status = worker_status(group)
            if status.restarts == restarts + 1 and status.state == "ready":
                restarted_after.append(time.monotonic() - stopped_at)
                return
            time.sleep(0.1)

    results = streams_with_fault(group.address, prompts, STREAMED, stop_the_follower)
    assert restarted_after, f"no Worker ready again within {BOUND_S + RESTART_S} s of SIGSTOP"
    assert results == fault_free
    status = worker_status(group)
    assert status.restarts == restarts + 1
    assert status.exit_code == FOLLOWER_STALLED  # rank 0's own exit, not the heartbeat kill's
    assert f"tensor-parallel rank 1 (pid {follower}) made no progress" in group.log()
    assert not is_alive(follower) and not is_alive(worker)  # SIGKILL ends a stopped process
    stats = group.wait_blocks_free()
    assert stats.blocks_free == stats.blocks_total

    tree = process_tree(group.proc.pid)
    new_worker, (new_follower,) = group_pids(group)
    assert {new_worker, new_follower} <= set(tree)
    assert group.stop() == 0
    assert [pid for pid in [*tree, worker, follower] if is_alive(pid)] == []
