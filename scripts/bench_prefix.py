"""Prefix caching: TTFT of a shared-system-prompt workload with the cache on and off.

One 1024-token system prompt, 64 requests each adding its own short question, all submitted at
once through the real actor processes (demo checkpoint). Prints TTFT p50/p90 and wall time for
both runs and the p50 ratio; `--json PATH` writes {"ttft_speedup": ..., "rows": [...]}.

    python scripts/bench_prefix.py [--model demo] [--requests 64] [--system-tokens 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (  # noqa: E402
    Column,
    ModelShape,
    add_common_flags,
    format_table,
    percentile,
    resolve_model,
)

from actorserve.actors.runtime.config import EngineConfig  # noqa: E402
from actorserve.actors.supervisor.background import BackgroundSupervisor  # noqa: E402
from actorserve.gateway.client import AsyncClient  # noqa: E402
from actorserve.messages.common import SamplingParams  # noqa: E402


def workload(requests: int, system_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(system_tokens)]
    return [
        system + [rng.randrange(3, vocab) for _ in range(rng.randint(8, 48))]
        for _ in range(requests)
    ]


async def measure(address: str, prompts, max_tokens: int) -> tuple[list[float], float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    async with AsyncClient(address, timeout_s=600) as client:
        start = time.perf_counter()

        async def one(prompt) -> float:
            async for _ in client.generate(prompt, params):
                return time.perf_counter() - start  # leaving the loop aborts the rest
            return float("nan")

        ttfts = await asyncio.gather(*[one(p) for p in prompts])
        return list(ttfts), time.perf_counter() - start


def run(model: Path, caching: bool, prompts, max_tokens: int, threads: int | None) -> dict:
    config = EngineConfig(model=str(model), enable_prefix_caching=caching, torch_threads=threads)
    with BackgroundSupervisor(config) as stack:
        address = stack.supervisor.client_address
        asyncio.run(measure(address, [[5] * 32], 1))  # warm-up: shares nothing with the workload
        ttfts, wall = asyncio.run(measure(address, prompts, max_tokens))
    return {
        "prefix_caching": "on" if caching else "off",
        "requests": len(prompts),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=1, help="tokens per request (TTFT)")
    parser.add_argument("--seed", type=int, default=0)
    add_common_flags(parser)
    args = parser.parse_args(argv)
    model = resolve_model(args.model)
    vocab = ModelShape.read(model).vocab
    prompts = workload(args.requests, args.system_tokens, vocab, args.seed)
    rows = [
        run(model, caching, prompts, args.max_tokens, args.threads) for caching in (False, True)
    ]
    speedup = rows[0]["ttft_p50_s"] / rows[1]["ttft_p50_s"]
    for row in rows:
        row["ttft_speedup"] = speedup if row["prefix_caching"] == "on" else 1.0
    print(
        format_table(
            rows,
            [
                Column("prefix_caching", "prefix cache"),
                Column("requests", "requests"),
                Column("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
                Column("ttft_p90_s", "TTFT p90 s", "{:.3f}"),
                Column("wall_s", "wall s", "{:.2f}"),
                Column("ttft_speedup", "p50 speedup", "{:.1f}x"),
            ],
            title=f"\n{args.requests} requests sharing a {args.system_tokens}-token system prompt, "
            f"{model.name}",
        )
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"ttft_speedup": speedup, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
