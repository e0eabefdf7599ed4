"""Where the actors are: their start order, their ZeroMQ mailboxes in the run directory, and the
sockets a replica serves others on (its clients' ROUTER, its KV events' PUB)."""

from __future__ import annotations

import re

import msgspec

ACTORS = ("worker", "block_manager", "scheduler", "engine")  # start order; stop is the reverse
# The Worker's forward thread's own mailbox (StepPlan, Reset); "worker" is its event loop's (Stop)
WORKER_STEPS = "worker_steps"


def kv_events_address(client: str) -> str:
    """Where the replica whose client address is `client` publishes its KV events: beside it, so
    a gateway that knows a replica's client address knows this one too. ipc://PATH: the socket
    file PATH-kv-events; tcp://HOST:PORT: the same host, PORT + 1 (open both in a firewall).
    ValueError for a tcp:// address without a numeric port (there is no port next to '*')."""
    if client.startswith("ipc://"):
        return client + "-kv-events"
    match = re.fullmatch(r"(tcp://(?:\[[^\]]*\]|[^:/]*)):(\d+)", client)
    if match is None or not 0 < int(match.group(2)) < 65535:
        raise ValueError(
            f"no KV events address beside {client!r}: a replica's client address must be "
            "ipc://PATH or tcp://HOST:PORT with a port below 65535 (events go to PORT + 1)"
        )
    return f"{match.group(1)}:{int(match.group(2)) + 1}"


class Addresses(msgspec.Struct, frozen=True):
    """ZeroMQ endpoints: one PULL mailbox per actor and the supervisor, plus the clients' ROUTER
    and the BlockManager's KV events PUB (`kv_events_address` of the client's)."""

    run_dir: str
    client: str

    def mailbox(self, actor: str) -> str:
        return f"ipc://{self.run_dir}/{actor}.sock"

    def kv_events(self) -> str:
        return kv_events_address(self.client)
