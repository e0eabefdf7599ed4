"""Data-parallel routing: KV-event routing and prefix affinity against round robin.

Two replicas (`actorserve serve --data-parallel-size 2`, one torch thread each) behind one
gateway, started once per policy (`--route-policy kv_events`, `prefix`, then `round_robin`),
requests sent `--concurrency` at a time through the OpenAI streaming endpoint (POST
/v1/completions, stream=true; scripts/serving_load.py's GatewayDoor). Two workloads:

    shared  `--system-prompts` system prompts of `--system-blocks` (4-8) KV blocks each, every
            request one of them plus its own user suffix, in a shuffled order
    chat    `--conversations` multi-turn chats, `--concurrency` at a time, each turn sent when
            the one before it ended: a common system prompt (2 blocks), then every turn's
            prompt is the previous prompt, a reply (`--output-len` tokens, made up: the model's
            own would be random-weight noise anyway) and a new user message, so each
            conversation's prefix grows

Per policy: TTFT p50/p90, output tokens/s, and the prefix-cache hit rate (the replicas' hit
tokens over their looked-up tokens, from /health, over the run); then each policy over round
robin; and the step costs each replica measured (/metrics), which kv_events prices in.

Prefix affinity sends every request of one system prompt (or conversation) to one replica, by a
hash of its first blocks; kv_events sends it where it is predicted to add the least latency
(its own to its last token and the steps its rows slow), from what the replicas' KV events say
they cache of it, their queues, the rows decoding there and their measured step costs;
round robin sends each prompt to both, so both compute it (and each holds every prompt's blocks,
half the room each).

    python scripts/bench_dp_routing.py [--model llama-350m] [--workload shared|chat]
                                       [--num-requests 96] [--concurrency 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
from bench_serving import Server  # noqa: E402
from serving_load import GatewayDoor, Record, run_point, summarize  # noqa: E402

POLICIES = ("kv_events", "prefix", "round_robin")
BLOCK_SIZE = 16
TERMS = ("step", "prefill_token", "decode_row")  # actorserve_replica_step_cost_seconds{term}
HEALTH_INTERVAL_S = 0.5  # /health repeats its answer this long: the counters wait it out


class DataParallelServer(Server):
    """`actorserve serve --data-parallel-size 2` with one routing policy, on a free port."""

    def __init__(self, model_dir: Path, policy: str, extra: list[str], timeout_s: float = 600.0):
        flags = [
            "--data-parallel-size", "2", "--block-size", str(BLOCK_SIZE), "--route-policy",
            policy, "--health-interval-s", str(HEALTH_INTERVAL_S), *extra,
        ]  # fmt: skip
        super().__init__(model_dir, 1, timeout_s, flags)

    def prefix_tokens(self) -> tuple[int, int]:
        """(hit, looked up) prompt tokens of the prefix caches, summed over the replicas."""
        time.sleep(HEALTH_INTERVAL_S + 0.1)  # an answer from after the last request
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=30) as reply:
            engine = json.loads(reply.read()).get("engine", {})
        return engine.get("prefix_hit_tokens", 0), engine.get("prefix_query_tokens", 0)

    def step_costs(self) -> dict[str, dict[str, float]]:
        """Each replica's fit of its step time, as the gateway last heard it (/metrics
        actorserve_replica_step_cost_seconds): {replica: {term: seconds}}."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as reply:
            text = reply.read().decode()
        pattern = (
            r'actorserve_replica_step_cost_seconds\{model_name="[^"]*",replica="(\d+)",'
            r'term="(\w+)"\} (\S+)'
        )
        costs: dict[str, dict[str, float]] = {}
        for match in re.finditer(pattern, text):
            costs.setdefault(match.group(1), {})[match.group(2)] = float(match.group(3))
        return costs


def shared_prefix_workload(
    num_requests: int,
    system_prompts: int,
    system_blocks: tuple[int, int],
    vocab: int,
    output_len: int,
    seed: int,
) -> list[bc.Request]:
    """Each request: one of `system_prompts` prompts of `system_blocks` (min, max) full blocks,
    then 8-40 tokens of its own; the system prompts in turn, the order shuffled (arrivals
    interleave them)."""
    rng = random.Random(seed)
    systems = [
        [rng.randrange(5, vocab) for _ in range(rng.randint(*system_blocks) * BLOCK_SIZE)]
        for _ in range(system_prompts)
    ]
    requests = []
    for i in range(num_requests):
        suffix = [rng.randrange(5, vocab) for _ in range(rng.randint(8, 40))]
        requests.append(bc.Request(systems[i % system_prompts] + suffix, output_len))
    rng.shuffle(requests)
    return requests


def chat_workload(
    conversations: int,
    turns: int,
    user_tokens: tuple[int, int],
    vocab: int,
    output_len: int,
    seed: int,
) -> list[list[bc.Request]]:
    """Each conversation's turns, in order: turn t's prompt is turn t-1's, a reply of
    `output_len` tokens and a user message of `user_tokens` (min, max) tokens."""
    rng = random.Random(seed)
    system = [rng.randrange(5, vocab) for _ in range(2 * BLOCK_SIZE)]
    chats = []
    for _ in range(conversations):
        prompt = system + [rng.randrange(5, vocab) for _ in range(rng.randint(*user_tokens))]
        chat = [bc.Request(list(prompt), output_len)]
        for _ in range(turns - 1):
            prompt += [rng.randrange(5, vocab) for _ in range(output_len)]  # the reply
            prompt += [rng.randrange(5, vocab) for _ in range(rng.randint(*user_tokens))]
            chat.append(bc.Request(list(prompt), output_len))
        chats.append(chat)
    return chats


async def run_chats(door, chats: list[list[bc.Request]], concurrency: int) -> list[Record]:
    """`concurrency` conversations at a time, the turns of each one after another."""
    records: list[Record] = []
    queue = iter(chats)

    async def worker() -> None:
        for chat in queue:
            for request in chat:
                record = Record()
                records.append(record)
                try:
                    await door.send(request, record)
                except Exception as exc:  # noqa: BLE001 - reported per request
                    record.error = f"{type(exc).__name__}: {exc}"
                    record.end = time.perf_counter()

    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return records


async def drive(port: int, workload, concurrency: int, chats: bool = False) -> dict:
    door = GatewayDoor("127.0.0.1", port)
    await door.open()
    try:
        if chats:
            return summarize(await run_chats(door, workload, concurrency))
        return summarize(await run_point(door, workload, None, concurrency, seed=0))
    finally:
        await door.close()


def measure(model_dir: Path, policy: str, args, workload) -> dict:
    server = DataParallelServer(model_dir, policy, args.serve_flags)
    try:
        warm = [bc.Request([7 + i] * 4, 2) for i in range(4)]  # first steps, no shared blocks
        asyncio.run(drive(server.port, warm, 2))
        hits_before, queried_before = server.prefix_tokens()
        chats = args.workload == "chat"
        row = asyncio.run(drive(server.port, workload, args.concurrency, chats))
        hits, queried = server.prefix_tokens()
        step_costs = server.step_costs()
    finally:
        server.stop()
    looked_up = queried - queried_before
    row["prefix_hit_rate"] = (hits - hits_before) / looked_up if looked_up else float("nan")
    return {"policy": policy, **row, "step_costs": step_costs}


def cost_note(row: dict) -> str:
    """The replicas' step costs at the end of a policy's run, in ms."""
    replicas = []
    for replica, costs in sorted(row["step_costs"].items()):
        step, token, decode = (costs.get(t, 0.0) * 1e3 for t in TERMS)
        replicas.append(
            f"replica {replica}: step {step:.2f}, prefill token {token:.3f}, decode row "
            f"{decode:.3f}"
        )
    return f"{row['policy']} step costs (ms): " + ("; ".join(replicas) or "none reported")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-350m", help="a checkpoint kind or directory")
    parser.add_argument("--workload", choices=("shared", "chat"), default="shared")
    parser.add_argument("--policies", type=lambda t: t.split(","), default=list(POLICIES))
    parser.add_argument("--conversations", type=int, default=16, help="chat: conversations")
    parser.add_argument("--turns", type=int, default=6, help="chat: turns per conversation")
    parser.add_argument(
        "--user-tokens",
        type=int,
        nargs=2,
        default=[16, 48],
        metavar=("MIN", "MAX"),
        help="chat: tokens of each user message",
    )
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument(
        "--system-blocks",
        type=int,
        nargs=2,
        default=[4, 8],
        metavar=("MIN", "MAX"),
        help="length of each system prompt, in KV blocks",
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the rows here")
    parser.add_argument(
        "--serve-flags",
        type=lambda text: text.split(),
        default=[],
        help="more `actorserve serve` flags, space-separated (e.g. '--max-model-len 1024')",
    )
    args = parser.parse_args()
    model_dir = bc.resolve_model(args.model)
    vocab = bc.ModelShape.read(model_dir).vocab
    if args.workload == "chat":
        workload = chat_workload(
            args.conversations,
            args.turns,
            tuple(args.user_tokens),
            vocab,
            args.output_len,
            args.seed,
        )
        what = (
            f"{args.conversations} chats of {args.turns} turns (user messages of "
            f"{args.user_tokens[0]}-{args.user_tokens[1]} tokens)"
        )
    else:
        workload = shared_prefix_workload(
            args.num_requests,
            args.system_prompts,
            tuple(args.system_blocks),
            vocab,
            args.output_len,
            args.seed,
        )
        what = (
            f"{args.num_requests} requests over {args.system_prompts} system prompts of "
            f"{args.system_blocks[0]}-{args.system_blocks[1]} blocks"
        )
    rows = [measure(model_dir, policy, args, workload) for policy in args.policies]
    failed = sum(row["failed"] for row in rows)
    base = next((row for row in rows if row["policy"] == "round_robin"), None)
    ratios = []
    for row in rows if base is not None else []:
        if row is base:
            continue
        ratios.append(
            {
                "policy": f"{row['policy']} / round_robin",
                **{
                    key: row[key] / base[key]
                    for key in ("ttft_p50_ms", "ttft_p90_ms", "output_throughput")
                },
            }
        )
    columns = [
        bc.Column("policy", "policy"),
        bc.Column("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"),
        bc.Column("ttft_p90_ms", "TTFT p90 ms", "{:.1f}"),
        bc.Column("output_throughput", "output tok/s", "{:.1f}"),
        bc.Column("prefix_hit_rate", "prefix hit rate", "{:.1%}"),
        bc.Column("failed", "failed"),
    ]
    title = (
        f"DP routing, 2 replicas x 1 thread, {bc.model_label(args.model)}: {what}, concurrency "
        f"{args.concurrency}, {args.output_len} output tokens, serve flags "
        f"{' '.join(args.serve_flags) or '-'}\n{bc.machine_line(1)}\n"
    )
    notes = [
        "(ratio rows: each policy over round robin; TTFT under 1 is its gain)",
        *(cost_note(row) for row in rows),
    ]
    print(bc.format_table([*rows, *ratios], columns, title, notes))
    bc.write_json(args.json, [*rows, *ratios])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
