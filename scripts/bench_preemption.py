"""Preemption under memory pressure: victim policies (fewest computed tokens first vs last
admitted) and modes (recompute vs swap), on one seeded workload through the real processes.

Prints preemptions, swaps, tokens of KV thrown away and recomputed, wall time and output
throughput per configuration; `--json PATH` writes the rows.

    python scripts/bench_preemption.py [--model demo] [--requests 48] [--num-kv-blocks 96]
"""

from __future__ import annotations

import argparse
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
    resolve_model,
    write_json,
)

from actorserve.messages.common import SamplingParams  # noqa: E402
from actorserve.offline import LLM  # noqa: E402

CONFIGS = [
    ("recompute", "fewest_computed"),
    ("recompute", "last_admitted"),
    ("swap", "fewest_computed"),
    ("swap", "last_admitted"),
]


def workload(n: int, seed: int, vocab: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(32, 256))] for _ in range(n)]
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(32, 256))
        for _ in range(n)
    ]
    return prompts, params


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--num-kv-blocks", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    add_common_flags(parser)
    args = parser.parse_args(argv)
    model = resolve_model(args.model)
    prompts, params = workload(args.requests, args.seed, ModelShape.read(model).vocab)
    rows, reference = [], None
    for mode, victim in CONFIGS:
        with LLM(
            model,
            num_kv_blocks=args.num_kv_blocks,
            max_model_len=args.num_kv_blocks * 16,
            preemption_mode=mode,
            preemption_victim=victim,
            enable_prefix_caching=False,
            torch_threads=args.threads,
        ) as llm:
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - started
            stats = llm.health().stats
        tokens = [o.token_ids for o in outputs]
        reference = reference or tokens
        generated = sum(len(t) for t in tokens)
        rows.append(
            {
                "mode": mode,
                "victim": victim,
                "preemptions": stats.num_preemptions,
                "swaps": stats.num_swaps,
                "recomputed_tokens": stats.num_recomputed_tokens,
                "wall_s": wall,
                "output_tok_s": generated / wall,
                "same_output": tokens == reference,
            }
        )
    print(
        format_table(
            rows,
            [
                Column("mode", "mode"),
                Column("victim", "victim"),
                Column("preemptions", "preemptions"),
                Column("swaps", "swaps"),
                Column("recomputed_tokens", "KV tokens recomputed"),
                Column("wall_s", "wall s", "{:.2f}"),
                Column("output_tok_s", "output tok/s", "{:.0f}"),
                Column("same_output", "same output"),
            ],
            title=f"\n{args.requests} greedy requests, {args.num_kv_blocks} KV blocks of 16 "
            f"tokens, {model.name}",
        )
    )
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
