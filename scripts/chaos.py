"""Chaos run: a greedy workload while random actors are SIGKILLed or SIGSTOPped.

Prints how many requests completed, how many outputs are identical to a fault-free run of the same
workload, and the recovery time (fault injected -> replacement ready) p50 / max.

    python scripts/chaos.py --model .checkpoints/tiny-llama --requests 48 --faults 6
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import threading
import time

from actorserve.actors.config import EngineConfig
from actorserve.actors.supervisor import BackgroundSupervisor
from actorserve.checkpoints import ensure_checkpoint
from actorserve.gateway.client import AsyncClient, Client, EngineError
from actorserve.messages.common import SamplingParams

VICTIMS = ("worker", "scheduler", "block_manager")


def workload(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 30000) for _ in range(rng.randint(4, 300))] for _ in range(n)]


async def run_workload(address: str, prompts, params: SamplingParams):
    async with AsyncClient(address, timeout_s=300) as client:

        async def one(prompt):
            try:
                return [t async for d in client.generate(prompt, params) for t in d.token_ids]
            except EngineError as exc:
                return exc

        return await asyncio.gather(*[one(p) for p in prompts])


def roster(client: Client) -> dict:
    try:
        return {a.name: a for a in client.health(timeout_s=5).actors}
    except EngineError:
        return {}


def inject_faults(address: str, count: int, gap_s: float, rng: random.Random, log: list):
    """Kill or freeze a random actor, wait for its replacement, `count` times."""
    with Client(address) as client:
        for _ in range(count):
            time.sleep(gap_s * rng.uniform(0.5, 1.5))
            victim = rng.choice(VICTIMS)
            how = rng.choice([signal.SIGKILL, signal.SIGSTOP])
            pid = roster(client)[victim].pid
            started = time.monotonic()
            os.kill(pid, how)
            while True:
                now = roster(client).get(victim)
                if now and now.pid != pid and now.state == "ready":
                    break
                if time.monotonic() - started > 120:
                    raise RuntimeError(f"{victim} did not come back within 120 s")
                time.sleep(0.02)
            # observed: an upper bound (a health reply waits up to 2 s for a dead Scheduler's
            # stats); supervisor: from noticing the death to the replacement ready and reset
            log.append((victim, how.name, time.monotonic() - started, now.last_recovery_s))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the tiny-llama test checkpoint")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--faults", type=int, default=6)
    parser.add_argument("--gap-s", type=float, default=1.5, help="mean time between faults")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = args.model or str(ensure_checkpoint("tiny-llama"))
    config = EngineConfig(model=model, heartbeat_interval_s=0.5, max_restarts=args.faults + 1)
    prompts = workload(args.requests, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    with BackgroundSupervisor(config) as stack:
        address = stack.supervisor.client_address
        reference = asyncio.run(run_workload(address, prompts, params))
        faults: list[tuple[str, str, float, float]] = []
        injector = threading.Thread(
            target=inject_faults,
            args=(address, args.faults, args.gap_s, random.Random(args.seed), faults),
        )
        started = time.monotonic()
        injector.start()
        outputs = asyncio.run(run_workload(address, prompts, params))
        injector.join()
        elapsed = time.monotonic() - started
    completed = sum(not isinstance(o, EngineError) for o in outputs)
    identical = sum(o == r for o, r in zip(outputs, reference))
    recoveries = [supervisor_s for *_, supervisor_s in faults]
    print(f"\n{'faults':<28}{len(faults)}   (recovery: supervisor's measure / observed bound)")
    for victim, how, observed, supervisor_s in faults:
        print(f"  {how:<8} {victim:<16} back in {supervisor_s:6.2f} s / {observed:6.2f} s")
    print(f"{'requests completed':<28}{completed}/{len(prompts)}")
    print(f"{'identical to fault-free':<28}{identical}/{len(prompts)}")
    if recoveries:
        print(
            f"{'recovery p50 / max':<28}{statistics.median(recoveries):.2f} s / "
            f"{max(recoveries):.2f} s"
        )
    print(f"{'workload wall time':<28}{elapsed:.1f} s")
    return 0 if completed == identical == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
