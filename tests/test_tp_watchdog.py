"""Rank 0's watch over its tensor-parallel followers (actors/worker/tp_liveness.py), without
processes: a follower whose stamp is older than the bound is condemned; a late wake-up of the
watchdog (the machine stalled) gives every follower a whole bound again; and a failed collective
asks from the start of the watch, so that a follower stalled for the bound is named as the cause
however late the watchdog woke (tp_group.py `exit_broken`)."""

from __future__ import annotations

import threading
import time

import pytest

from actorserve.actors.worker.tp_liveness import FollowerWatchdog, LivenessBoard

BOUND_S = 3.0


class Condemned(Exception):
    """What the fake condemn() raises: the real one never returns."""


def condemn() -> None:
    raise Condemned


@pytest.fixture
def watch(tmp_path):
    board = LivenessBoard(str(tmp_path / "live"), 2, create=True)
    watchdog = FollowerWatchdog(board, [4242], BOUND_S, lambda: 0, threading.Event(), condemn)
    watchdog.started = watchdog.since = time.monotonic() - 10.0  # watching for 10 s
    yield board, watchdog
    board.close()


def test_a_follower_that_stamped_within_the_bound_is_left_alone(watch):
    board, watchdog = watch
    board.stamp(1, handled=7)
    watchdog.condemn_if_silent(time.monotonic() + BOUND_S - 0.5, watchdog.since)


def test_a_follower_silent_for_longer_than_the_bound_is_condemned(watch):
    board, watchdog = watch
    board.stamp(1, handled=7)
    with pytest.raises(Condemned):
        watchdog.condemn_if_silent(time.monotonic() + BOUND_S + 0.5, watchdog.since)


def test_a_late_wake_up_gives_a_whole_bound_again_but_not_to_a_failed_collective(watch):
    board, watchdog = watch
    board.stamp(1, handled=7)
    now = time.monotonic() + BOUND_S + 0.5  # silent for longer than the bound
    watchdog.since = now - 1.0  # the watchdog woke late a second ago
    watchdog.condemn_if_silent(now, watchdog.since)  # its own check waits
    with pytest.raises(Condemned):  # a collective that failed meanwhile names the follower
        watchdog.condemn_if_silent(now, watchdog.started)


def test_a_group_that_is_stopping_condemns_nobody(watch):
    board, watchdog = watch
    watchdog.stopping.set()
    watchdog.condemn_if_silent(time.monotonic() + 100.0, watchdog.started)  # never stamped
