"""What a structured output costs: a schema's first compile, and a constrained row per step.

    python scripts/bench_structured.py [--model tiny-llama-dir] [--rows 1 8 32] [--steps 200]

In this process, with the Worker's own pieces and no other actor: the xgrammar compile of a few
specs against the model's tokenizer (a fresh compiler each time: what the Worker's compile
thread pays the first time it sees a schema; then the cached lookup), and the sampling part of a
step over `rows` rows of random logits, unconstrained (the sampler alone) and constrained (every
row's grammar mask filled and applied, the sampler, each matcher advanced: what
StepSampler.sample adds for structured rows). The model's forward is the same for both and left out:
the difference per row is what a structured request adds to a step. Matchers that reach the end
of their grammar are reset between steps, outside the timed part.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402

NAME = {"type": "string", "pattern": "^[a-z]{1,8}$"}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": NAME,
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": NAME, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": NAME, "zip": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "color", "tags", "address"],
}


def specs():
    from actorserve.messages.structured import StructuredKind, StructuredOutput

    return {
        "json_schema (nested, enums, arrays)": StructuredOutput(
            StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA)
        ),
        "json_object": StructuredOutput(StructuredKind.JSON_OBJECT),
        "regex": StructuredOutput(StructuredKind.REGEX, r"[A-Z]{2}-\d{3}( [a-z]{1,5}){1,3}"),
        "choice (4)": StructuredOutput(
            StructuredKind.CHOICE, choices=("yes", "no", "maybe", "never")
        ),
    }


def compile_rows(model_dir: Path, vocab_size: int, eos: list[int], repeats: int) -> list[dict]:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from actorserve.actors.runtime import grammars
    from actorserve.actors.worker.grammar_cache import GrammarCache

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos)
    rows = [{"what": "tokenizer info (once per Worker)", "ms": 1e3 * (time.perf_counter() - start)}]
    cache = GrammarCache(str(model_dir), vocab_size, eos, 8)
    for name, spec in specs().items():
        times = []
        for _ in range(repeats):
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            start = time.perf_counter()
            grammars.compile(compiler, spec)
            times.append(time.perf_counter() - start)
        cache.request(spec).result()  # compiled once by the cache's own thread
        start = time.perf_counter()
        cache.request(spec).result()
        cached = time.perf_counter() - start
        rows.append({"what": f"first compile: {name}", "ms": 1e3 * statistics.median(times)})
        rows.append({"what": f"cached lookup: {name}", "ms": 1e3 * cached})
    cache.close()
    return rows


def median_ms(step, bound, steps: int) -> float:
    """Median milliseconds of `step`, the matchers that ended reset before each (untimed)."""
    samples = []
    for _ in range(steps):
        for row in bound:
            if not row.grammar.live:
                row.grammar.matcher.reset()
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return 1e3 * statistics.median(samples)


def step_rows(model_dir, vocab_size, eos, num_rows: list[int], steps: int) -> list[dict]:
    import torch

    from actorserve.actors.worker.grammar_cache import GrammarCache
    from actorserve.actors.worker.grammar_masks import advance_grammars, mask_grammar_rows
    from actorserve.actors.worker.grammar_state import GrammarState
    from actorserve.actors.worker.sample_row import SampleRow
    from actorserve.actors.worker.sampler import Sampler
    from actorserve.messages.common import SamplingParams

    spec = specs()["json_schema (nested, enums, arrays)"]
    cache = GrammarCache(str(model_dir), vocab_size, eos, 8)
    compiled = cache.request(spec).result()
    sampler = Sampler(0)
    torch.manual_seed(0)
    out = []
    for temperature in (0.0, 1.0):
        for n in num_rows:
            base = torch.randn(n, vocab_size)
            plain = SamplingParams(temperature=temperature, max_tokens=10**6)
            structured = SamplingParams(temperature=temperature, max_tokens=10**6, structured=spec)
            free = [SampleRow(plain, 1, 0, eos) for _ in range(n)]
            bound = [SampleRow(structured, 1, 0, eos) for _ in range(n)]
            for row in bound:
                row.grammar = GrammarState(compiled, [])

            def unconstrained(base=base, free=free):
                sampler(base.clone(), free)

            def constrained(base=base, bound=bound):
                logits = base.clone()
                picked = mask_grammar_rows(logits, bound)
                advance_grammars(bound, sampler(logits, bound), picked)

            times = {
                "free": median_ms(unconstrained, bound, steps),
                "bound": median_ms(constrained, bound, steps),
            }
            out.append(
                {
                    "sampling": "greedy" if temperature == 0 else "temperature 1",
                    "rows": n,
                    "free_ms": times["free"],
                    "bound_ms": times["bound"],
                    "per_row_ms": (times["bound"] - times["free"]) / n,
                }
            )
    cache.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="checkpoint kind or directory")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--compile-repeats", type=int, default=3)
    bc.add_common_flags(parser)
    args = parser.parse_args()
    import torch

    from actorserve.actors.runtime.model_config import ModelFacts

    torch.set_num_threads(args.threads or bc.default_threads())
    model_dir = bc.resolve_model(args.model)
    facts = ModelFacts.read(model_dir)
    vocab, eos = facts.vocab_size, facts.eos_token_ids
    print(bc.machine_line(torch.get_num_threads()))
    compiles = compile_rows(model_dir, vocab, eos, args.compile_repeats)
    print(
        bc.format_table(
            compiles,
            [bc.Column("what", "what"), bc.Column("ms", "ms", "{:.3f}")],
            f"\nGrammar compile, {bc.model_label(args.model)} (vocabulary {vocab})",
        )
    )
    steps = step_rows(model_dir, vocab, eos, args.rows, args.steps)
    print(
        bc.format_table(
            steps,
            [
                bc.Column("sampling", "sampling"),
                bc.Column("rows", "rows"),
                bc.Column("free_ms", "unconstrained ms/step", "{:.3f}"),
                bc.Column("bound_ms", "constrained ms/step", "{:.3f}"),
                bc.Column("per_row_ms", "extra ms per constrained row", "{:.3f}"),
            ],
            "\nSampling part of a step (median of steps; the forward is the same for both)",
        )
    )
    bc.write_json(args.json, compiles + steps)


if __name__ == "__main__":
    main()
