"""Parts b and e of scripts/gpu_check.py, through the real engine (the offline LLM: supervisor and
four actor processes).

b. The engine's greedy bf16 output against transformers in bf16 on the same checkpoint, by the
   logprobs-close criterion of tests/test_bf16_matches_transformers.py (its own code, with
   transformers on the GPU where there is one).
e. nano-vllm's bench workload (bench.py there: 256 sequences, prompts of 100..1024 random ids
   below 10000, outputs of 100..1024 tokens with ignore_eos at temperature 0.6, Python's random
   seeded 0) through LLM.generate: output tokens/s, and its share of the floor (scripts/floor.py
   on the measured copy bandwidth and bf16 GEMM rate).
"""

from __future__ import annotations

import random
import sys
import threading
import time
from pathlib import Path

import bench_common as bc
from floor import engine_floor

TESTS = Path(__file__).resolve().parent.parent / "tests"


def nano_vllm_workload(
    num_seqs: int, lengths: tuple[int, int], seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """nano-vllm bench.py's draws, in its order: every prompt (a length, then its ids), then
    every output length."""
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, 10000) for _ in range(rng.randint(*lengths))] for _ in range(num_seqs)
    ]
    outputs = [rng.randint(*lengths) for _ in range(num_seqs)]
    return prompts, outputs


def served_config(llm) -> dict:
    """What the engine resolved: its KV blocks (sized from gpu_memory_utilization on CUDA) and
    the device defaults."""
    config = llm._stack.supervisor.config
    return {
        "checkpoint": Path(config.model).name,
        "num_kv_blocks": config.num_kv_blocks,
        "num_cpu_blocks": config.num_cpu_blocks,
        "block_size": config.block_size,
        "max_num_seqs": config.max_num_seqs,
        "torch_threads": config.torch_threads,
        "gpu_memory_utilization": config.gpu_memory_utilization,
    }


def free_device_cache() -> None:
    """Give this process's cached CUDA blocks back, so that the next engine's Worker, which
    counts them as memory outside its torch, sizes its cache without them."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def logprobs_close(
    model_dir: Path, device: str, engine_settings: dict, lengths: list[int] | None = None
) -> dict:
    """Part b on one checkpoint, a prompt of each of `lengths` tokens (default: the test's) ->
    each prompt's identical prefix (an AssertionError, with the prompt and position, where the
    criterion fails)."""
    from actorserve.offline import LLM

    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    import test_bf16_matches_transformers as criterion

    start = time.perf_counter()
    try:
        with LLM(str(model_dir), **engine_settings) as llm:
            started = time.perf_counter() - start
            lengths = lengths or criterion.PROMPT_LENGTHS
            prefixes = criterion.identical_prefix(model_dir, llm, device, lengths)
            served = served_config(llm)
    finally:
        criterion.hf_bf16.cache_clear()
        free_device_cache()
    return {
        **served,
        "passed": True,
        "identical_prefixes": prefixes,
        "mean_identical_prefix": sum(prefixes) / len(prefixes),
        "of_tokens": criterion.MAX_TOKENS,
        "engine_start_s": started,
        "checkpoint_s": time.perf_counter() - start,
    }


def e2e_workload(
    model_dir: Path,
    num_seqs: int,
    lengths: tuple[int, int],
    engine_settings: dict,
    bandwidth: float,
    flop_s: float,
    timeout_s: float,
) -> dict:
    """Part e -> output tokens/s and its share of the floor's; an error after `timeout_s`."""
    from actorserve.messages.common import SamplingParams
    from actorserve.offline import LLM

    prompts, outputs = nano_vllm_workload(num_seqs, lengths)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in outputs]
    shape = bc.ModelShape.read(model_dir)
    value_bytes = 2 if shape.dtype == "bfloat16" else 4
    workload = [bc.Request(p, n) for p, n in zip(prompts, outputs)]
    floor = engine_floor(shape, workload, flop_s, bandwidth, value_bytes, value_bytes)
    start = time.perf_counter()
    with LLM(str(model_dir), **engine_settings) as llm:
        started = time.perf_counter() - start
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        result: dict = {}

        def generate() -> None:
            begin = time.perf_counter()
            done = llm.generate(prompts, params, use_tqdm=False)
            result["generate_s"] = time.perf_counter() - begin
            result["tokens"] = sum(len(c.token_ids) for c in done)

        thread = threading.Thread(target=generate, daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"the workload did not finish in {timeout_s:.0f} s (--budget-s)")
        served = served_config(llm)
    output_tok_s = result["tokens"] / result["generate_s"]
    floor_tok_s = sum(outputs) / floor.overlapped_s
    return {
        **served,
        "num_seqs": num_seqs,
        "lengths": list(lengths),
        "output_tokens": result["tokens"],
        "expected_output_tokens": sum(outputs),
        "input_tokens": sum(len(p) for p in prompts),
        "generate_s": result["generate_s"],
        "output_tok_s": output_tok_s,
        "floor_s": floor.overlapped_s,
        "floor_serial_s": floor.serial_s,
        "floor_output_tok_s": floor_tok_s,
        "share_of_floor": output_tok_s / floor_tok_s,
        "engine_start_s": started,
    }
