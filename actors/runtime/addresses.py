"""Where the actors are: their start order and their ZeroMQ mailboxes in the run directory."""

from __future__ import annotations

import msgspec

ACTORS = ("worker", "block_manager", "scheduler", "engine")  # start order; stop is the reverse
# The Worker's forward thread's own mailbox (StepPlan, Reset); "worker" is its event loop's (Stop)
WORKER_STEPS = "worker_steps"


class Addresses(msgspec.Struct, frozen=True):
    """ZeroMQ endpoints: one PULL mailbox per actor and the supervisor, plus the clients' ROUTER."""

    run_dir: str
    client: str

    def mailbox(self, actor: str) -> str:
        return f"ipc://{self.run_dir}/{actor}.sock"
