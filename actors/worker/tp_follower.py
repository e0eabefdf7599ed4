"""A follower rank (1..N-1) of a tensor-parallel Worker group: started by rank 0, the Worker
actor (tp_group.py), as `python -m actorserve.actors.worker.tp_follower SPEC_FILE`.

Inbox: rank 0's broadcast (torch.distributed) of every message of the Worker's steps mailbox:
StepPlan, CompileGrammar, Reset, Stop, in rank 0's order; handled as rank 0 handles them
(step_handler.py).
Outbox: nothing: rank 0 alone answers the Scheduler and the supervisor (the supervisor knows
only rank 0, which watches this process in its stead).
Owns: its shard of the model and of the KV cache, its copy of the persistent batch and of the
compiled grammars.
Dies when: Stop (exit 0); rank 0 dies (PR_SET_PDEATHSIG: SIGKILL) or a collective fails (rank 0
gone, or silent past the group's collective timeout); rank 0 kills it (SIGKILL), having found
it stopped (its liveness stamps, tp_liveness.py, older than tp_follower_timeout_s); its own
step fails (then GROUP_BROKEN: the group restarts). SIGTERM and SIGINT are ignored: stopping is
rank 0's call, as an actor's is its supervisor's (a signal sent to the whole process group
reaches this process too, and the supervisor drains before it stops anything).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import msgspec

from ..runtime.actor import configure_logging
from .tp_group import GROUP_BROKEN, FollowerSpec, die_with_parent
from .tp_liveness import LivenessBoard, Stamper


def follower_config(spec: FollowerSpec):
    """Rank 0's config, with this rank's step trace beside rank 0's (PATH.rankR), not in it."""
    trace = spec.config.step_trace
    return msgspec.structs.replace(
        spec.config, step_trace=None if trace is None else f"{trace}.rank{spec.rank}"
    )


def main(spec_file: str) -> None:
    configure_logging()
    spec = msgspec.json.decode(Path(spec_file).read_bytes(), type=FollowerSpec)
    Path(spec_file).unlink(missing_ok=True)
    die_with_parent(spec.parent_pid)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log = logging.getLogger(f"worker.rank{spec.rank}")

    import torch

    from .step_handler import StepHandler
    from .worker import build_rank

    rank = build_rank(follower_config(spec), spec.rank, spec.init_file)
    handler = StepHandler(rank.runner, rank.config, rank.tp, replies=None)
    rank.tp.serve_with_timeout(rank.config.tp_follower_timeout_s)
    board = LivenessBoard(spec.liveness_file, spec.size)
    stamper = Stamper(board, spec.rank, rank.config.tp_follower_timeout_s, handler.count)
    stamper.start()
    log.info("rank %d of %d ready", spec.rank, spec.size)
    try:
        with torch.inference_mode():
            while handler.handle(rank.tp.broadcast_bytes(None)):
                pass
    except Exception:  # the broadcast failed: rank 0 is gone (or going)
        log.exception("rank %d: the group's broadcast failed; exiting", spec.rank)
        os._exit(GROUP_BROKEN)
    stamper.stop()
    board.close()
    rank.runner.grammars.close()
    rank.tp.close()
    log.info("rank %d stopped", spec.rank)


if __name__ == "__main__":
    main(sys.argv[1])
