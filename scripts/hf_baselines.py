"""Hugging Face transformers as the baseline engine, on bench_common's workload: `generate` in
static batches (hf-static) and transformers' continuous batching (hf-cb). Each returns the wall
time, the output tokens and the token ids (bench_throughput.py runs each in a fresh process)."""

from __future__ import annotations

import gc
import math
import time
from pathlib import Path

import bench_common as bc


def _hf_model(model_dir: Path, threads: int, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    return model.eval()


def run_hf_static(model_dir: Path, workload: list[bc.Request], args) -> dict:
    import torch

    model = _hf_model(model_dir, args.threads, args.dtype)
    pad = 0
    bs = args.hf_batch_size
    sample = dict(do_sample=args.temperature > 0, pad_token_id=pad)
    if args.hf_cache != "dynamic":
        sample["cache_implementation"] = args.hf_cache
    if args.temperature > 0:
        sample.update(temperature=args.temperature, top_k=0, top_p=1.0)

    def batch_inputs(batch: list[bc.Request]):
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        return ids, mask

    def run(batch: list[bc.Request]) -> list[list[int]]:
        ids, mask = batch_inputs(batch)
        n = max(r.output_len for r in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, **sample
            )
        width = ids.shape[1]
        return [out[i, width : width + r.output_len].tolist() for i, r in enumerate(batch)]

    run([bc.Request([7] * 32, 4), bc.Request([8] * 32, 4)])  # warm-up
    tokens: list[list[int]] = []
    generated = 0
    start = time.perf_counter()
    for i in range(0, len(workload), bs):
        batch = workload[i : i + bs]
        tokens.extend(run(batch))
        generated += len(batch) * max(r.output_len for r in batch)
    wall = time.perf_counter() - start
    gc.collect()
    return {
        "wall_s": wall,
        "output_tokens": sum(r.output_len for r in workload),
        "generated_tokens": generated,
        "tokens": tokens,
    }


def run_hf_cb(model_dir: Path, workload: list[bc.Request], args) -> dict:
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    # The manager computes on a thread of its own. Load with one thread, so that this main thread
    # never starts an OpenMP team of its own (two teams whose threads outnumber the cores make
    # libgomp stop spin-waiting, which slows every op of the generation thread); the generation
    # thread then picks up `threads`.
    model = _hf_model(model_dir, 1, args.dtype)
    torch.set_num_threads(args.threads)
    max_out = max(r.output_len for r in workload)
    gen = GenerationConfig(
        max_new_tokens=max_out,
        do_sample=args.temperature > 0,
        eos_token_id=-1,  # ignore_eos
        pad_token_id=0,
        **({"temperature": args.temperature, "top_k": 0, "top_p": 1.0} if args.temperature else {}),
    )
    page = 256
    cb = ContinuousBatchingConfig(
        page_size=page,
        # the same limits as the engine's defaults, and room for the whole workload at once
        max_batch_tokens=args.max_num_batched_tokens or 2048,
        max_requests_per_batch=args.max_num_seqs or 64,
        num_blocks=sum(math.ceil((len(r.prompt_ids) + r.output_len) / page) for r in workload) + 4,
    )
    hints = WorkloadHints(max(len(r.prompt_ids) for r in workload), max_out, len(workload))
    with (
        torch.inference_mode(),
        model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb, workload_hints=hints
        ) as manager,
    ):
        start = time.perf_counter()
        ids = [
            manager.add_request(r.prompt_ids, max_new_tokens=r.output_len, eos_token_id=-1)
            for r in workload
        ]
        done: dict[str, list[int]] = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = list(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped")
        wall = time.perf_counter() - start
    tokens = [done[i] for i in ids]
    gc.collect()
    return {"wall_s": wall, "output_tokens": sum(len(t) for t in tokens), "tokens": tokens}
