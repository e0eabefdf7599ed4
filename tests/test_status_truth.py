"""Status tells the truth through a restart: from the moment the supervisor notices a death,
the SDK's health, `actorserve status` and the gateway's /ready say that actor is restarting
(the dead PID, how it ended, for how long), with ages computed when each is asked; once the
replacement is Ready they say ready, with its PID and one restart more."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import time

import msgspec
import pytest
from gateway_support import GatewayServer, call

from actorserve.cli import main as cli
from actorserve.messages.control import ActorStatus

HEARTBEAT_S = 0.5
HEALTH_INTERVAL_S = 0.1  # /ready may repeat an answer this long
POLL_S = 0.2
NOTICE_S = 1.0  # a death noticed (the supervisor polls every 50 ms) and told the Engine


@pytest.fixture(scope="module")
def server(llama_dir):
    server = GatewayServer(
        llama_dir,
        "--heartbeat-interval-s",
        str(HEARTBEAT_S),
        "--health-interval-s",
        str(HEALTH_INTERVAL_S),
        "--health-timeout-s",
        "5",
        "--max-model-len",
        "512",
    )
    yield server
    assert server.stop() == 0


class Sample(msgspec.Struct):
    """One poll: the SDK's view of the worker and of every actor, `actorserve status`'s exit
    code and worker line, /ready's status; `at`: when the SDK's answer came."""

    at: float
    worker: ActorStatus
    actors: list[ActorStatus]
    ok: bool
    status_rc: int
    status_line: str
    ready: int


def status_command(server) -> tuple[int, str]:
    """`actorserve status --address ...` (in this process): its exit code and worker line."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["status", "--address", server.address, "--timeout-s", "10"])
    worker = next(line for line in out.getvalue().splitlines() if line.startswith("worker "))
    return rc, worker


def poll(server) -> Sample:
    health = server.client.health(timeout_s=10)
    at = time.monotonic()
    worker = next(a for a in health.actors if a.name == "worker")
    rc, line = status_command(server)
    ready = call(server, "GET", "/ready").status
    return Sample(at, worker, health.actors, health.ok, rc, line, ready)


def test_a_killed_worker_is_restarting_with_its_pid_and_signal_until_its_replacement_is_ready(
    server,
):
    assert server.client.health().ok
    before = poll(server)
    assert before.worker.state == "ready" and before.worker.restarts == 0
    assert before.status_rc == 0 and before.ready == 200
    dead = before.worker.pid

    os.kill(dead, signal.SIGKILL)
    killed = time.monotonic()
    samples: list[Sample] = []
    deadline = killed + 120
    while time.monotonic() < deadline:
        sample = poll(server)
        samples.append(sample)
        if sample.worker.state == "ready" and sample.worker.pid != dead and sample.ready == 200:
            break
        time.sleep(POLL_S)
    else:
        raise AssertionError(f"the worker was not back within 120 s: {samples[-1]}")

    restarting = [s for s in samples if s.worker.state == "restarting"]
    assert len(restarting) >= 3, [s.worker for s in samples]  # the restart takes seconds
    # noticed at once (the supervisor polls every 50 ms): no later poll says the dead is ready
    stale = [s for s in samples if s.worker.state == "ready" and s.worker.pid == dead]
    assert all(s.at - killed < NOTICE_S for s in stale), stale
    for s in restarting:
        assert s.worker.pid == dead and s.worker.exit_code == -signal.SIGKILL
        assert s.worker.restarts == 1  # counted from the death on
        assert not s.ok
        assert s.worker.state_age_s <= s.at - killed
    # `actorserve status` is asked after the SDK's answer, so the last restarting poll's may
    # already see the replacement; every earlier one's is confirmed by the next poll's answer
    for s in restarting[:-1]:
        assert s.status_rc == 1
        assert "restarting" in s.status_line and str(dead) in s.status_line
        assert "signal 9 (SIGKILL)" in s.status_line
    # ages are computed when asked, not frozen at the last roster's send
    ages = [s.worker.heartbeat_age_s for s in restarting]
    assert ages == sorted(ages) and len(set(ages)) == len(ages), ages
    since = [s.worker.state_age_s for s in restarting]
    assert since == sorted(since) and len(set(since)) == len(since), since
    for s in restarting:  # the others go on beating meanwhile, and it shows
        for actor in s.actors:
            if actor.name != "worker":
                assert actor.state == "ready" and actor.heartbeat_age_s < 4 * HEARTBEAT_S, actor
    # /ready: 503 while the worker is down (asked after the SDK's answer, which the next
    # poll's confirms; and once the answer of an interval ago has expired)
    during = [s for s in restarting[:-1] if s.at - restarting[0].at > HEALTH_INTERVAL_S + POLL_S]
    assert during and all(s.ready == 503 for s in during), [(s.at, s.ready) for s in restarting]

    after = samples[-1]
    assert after.worker.state == "ready" and after.worker.pid != dead
    assert after.worker.restarts == 1 and after.worker.exit_code == -signal.SIGKILL
    assert after.ok and after.ready == 200
    assert wait_for_status_rc(server, 0)


def wait_for_status_rc(server, rc: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if status_command(server)[0] == rc:
            return True
        time.sleep(POLL_S)
    return False


def test_status_of_a_stack_at_rest_exits_0_with_every_actor_ready(server):
    rc, line = status_command(server)
    assert rc == 0 and " ready " in line
    reply = server.client.health()
    assert reply.ok and all(a.state == "ready" for a in reply.actors)
    assert all(a.heartbeat_age_s < 4 * HEARTBEAT_S for a in reply.actors)
