"""The learning-rate / batch sweep behind scripts/train_demo.py's defaults: short fixed-time runs.

    python scripts/sweep_demo.py [--seconds 110] [--runs 8x1e-3,8x2e-3,...]

Each run trains the same seeded model (train_demo's shape and corpus) for the same wall-clock
time, its schedule (warm-up, cosine decay) following the clock, so a bigger batch gets fewer
steps; then it measures the held-out-by-hash loss on SWEEP_WINDOWS windows. Nothing is saved.
One torch thread, one run at a time: the machine is shared.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import train_demo  # noqa: E402

SWEEP_WINDOWS = 24
DEFAULT_RUNS = "8x1e-3,8x2e-3,8x4e-3,4x2e-3,16x4e-3"


def main(argv: list[str] | None = None) -> int:
    parser = train_demo.parser()
    parser.add_argument("--seconds", type=float, default=110.0, help="wall clock per run")
    parser.add_argument("--runs", default=DEFAULT_RUNS, help="BATCHxLR,... ")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the machine's other cores belong to others
    torch.use_deterministic_algorithms(True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer_dir, data, held, _ = train_demo.prepare(args.work, args.vocab)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    windows = torch.from_numpy(held[: SWEEP_WINDOWS * args.seq_len].astype(np.int64))
    rows = []
    for run in args.runs.split(","):
        batch, lr = run.split("x")
        args.batch, args.lr, args.out, args.steps = int(batch), float(lr), None, 10**9
        torch.manual_seed(args.seed)
        config = train_demo.model_config(args, tokenizer)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        result = train_demo.train(args, model, tokenizer_dir, data, seconds=args.seconds)
        loss, count = train_demo.mean_loss(model, windows, args.seq_len)
        row = {"batch": args.batch, "lr": args.lr, **result}
        row["held_out_loss"] = round(loss / count, 3)
        row["held_out_perplexity"] = round(math.exp(loss / count), 1)
        rows.append(row)
        print("SWEEP " + json.dumps(row), flush=True)
    print("| batch | peak lr | steps | tokens | train loss (last 10) | held-out loss | ppl |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        tokens = r["steps"] * r["batch"] * args.seq_len
        print(
            f"| {r['batch']} | {r['lr']:g} | {r['steps']} | {tokens:,} | {r['final_train_loss']} "
            f"| {r['held_out_loss']} | {r['held_out_perplexity']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
