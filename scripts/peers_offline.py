"""One engine's offline API on bench_peers' workloads, in a fresh process of its own interpreter
(actorserve's venv, or vLLM's in .peers/vllm, which has no actorserve): it imports nothing of
the project and reads everything it needs from a JSON file.

    python scripts/peers_offline.py --engine actorserve|vllm --job JOB.json --out RESULT.json

JOB.json: {"model": DIR, "dtype": "float32"|"bfloat16", "threads": N, "quantization":
"int8"|"bf16"|null, "probe": [token ids], "probe_tokens": K, "workloads": [{"prompts": [[ids], ...],
"output_lens": [n, ...]}, ...]}. The engine is built once (start-up: constructor to return),
generates K greedy tokens after the probe prompt (bench_peers compares them with transformers'),
warms up on 4 short prompts sharing no prefix with the workloads, then runs each workload in turn:
every request greedy, ignore_eos, its own max_tokens. RESULT.json: {"startup_s",
"probe_ids", "runs": [{"wall_s", "output_tokens", "short"}, ...]}; `short` counts requests
that came back with fewer tokens than asked.

vLLM's offline LLM starts its engine core in a child process that re-imports the main module:
the `__main__` guard below is what keeps that child from running the job again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

WARM = [[7 + i] * 32 for i in range(4)]


def run_actorserve(job: dict) -> dict:
    from actorserve import LLM, SamplingParams

    settings = dict(torch_threads=job["threads"], dtype=job["dtype"])
    if job.get("quantization"):
        settings["quantization"] = job["quantization"]

    def params(n: int):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    start = time.perf_counter()
    with LLM(job["model"], **settings) as llm:
        startup = time.perf_counter() - start
        probe = llm.generate([job["probe"]], params(job["probe_tokens"]), use_tqdm=False)
        llm.generate(WARM, params(8), use_tqdm=False)
        runs = []
        for w in job["workloads"]:
            t0 = time.perf_counter()
            outs = llm.generate(w["prompts"], [params(n) for n in w["output_lens"]], use_tqdm=False)
            wall = time.perf_counter() - t0
            runs.append(_run(wall, [len(o.token_ids) for o in outs], w["output_lens"]))
    return {"startup_s": startup, "probe_ids": list(probe[0].token_ids), "runs": runs}


def run_vllm(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    def params(n: int):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def prompts(ids: list[list[int]]):
        return [TokensPrompt(prompt_token_ids=p) for p in ids]

    start = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"], seed=0)
    startup = time.perf_counter() - start
    probe = llm.generate(prompts([job["probe"]]), params(job["probe_tokens"]), use_tqdm=False)
    llm.generate(prompts(WARM), params(8), use_tqdm=False)
    runs = []
    for w in job["workloads"]:
        t0 = time.perf_counter()
        outs = llm.generate(
            prompts(w["prompts"]), [params(n) for n in w["output_lens"]], use_tqdm=False
        )
        wall = time.perf_counter() - t0
        runs.append(_run(wall, [len(o.outputs[0].token_ids) for o in outs], w["output_lens"]))
    return {
        "startup_s": startup,
        "probe_ids": list(probe[0].outputs[0].token_ids),
        "runs": runs,
    }


def _run(wall: float, got: list[int], asked: list[int]) -> dict:
    return {
        "wall_s": wall,
        "output_tokens": sum(got),
        "short": sum(1 for g, a in zip(got, asked) if g < a),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["actorserve", "vllm"], required=True)
    parser.add_argument("--job", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    job = json.loads(args.job.read_text())
    result = (run_actorserve if args.engine == "actorserve" else run_vllm)(job)
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
