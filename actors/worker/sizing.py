"""How much the Worker allocates: KV cache blocks on the device, swap blocks in host memory.

CUDA, as vLLM and nano-vllm size it: once the weights are loaded, one forward at the largest
step the Scheduler can plan (max_num_batched_tokens tokens over max_num_seqs sequences, each a
prefill from position 0, on a dummy cache of a few blocks), then the LM head over every
sequence's last token and a sort of those logits (the sampler's costliest row, top-p, on every
row). torch.cuda.max_memory_allocated is then the peak of the weights and that step; memory
torch does not hold (the CUDA context, the driver, other processes) is what the device reports
used less what torch reserved. The KV cache gets the rest of `gpu_memory_utilization` of the
device: utilization x total - peak - non-torch. What lies past the utilization is left to what
comes after the cache (CUDA graphs' pool) and to the allocator's fragmentation.
CPU: a quarter of the available memory, at most 1 GiB.
kv_cache_memory_gb, and num_kv_blocks above it, replace the measurement on either device.
"""

from __future__ import annotations

import logging
import math

import msgspec
import torch

from ..runtime.config import EngineConfig
from .kv_cache import KVCache
from .models.llama import AttentionMetadata

GIB = 1 << 30
PROFILE_CACHE_BLOCKS = 4  # the profiling step's dummy cache: every table entry points into it

log = logging.getLogger("worker")


class DeviceMemory(msgspec.Struct, frozen=True):
    """A CUDA device's memory after the profiling step, in bytes."""

    total: int
    peak: int  # torch's peak: the weights, the profiling step's activations and logits
    non_torch: int  # used on the device but not reserved by this process's torch


def kv_cache_blocks(memory: DeviceMemory, utilization: float, block_bytes: int) -> int:
    """KV blocks of `block_bytes` in utilization x total - peak - non-torch (at least one, else
    a ValueError naming gpu_memory_utilization and what took the memory)."""
    budget = int(utilization * memory.total) - memory.peak - memory.non_torch
    blocks = max(0, budget) // block_bytes
    if blocks < 1:
        raise ValueError(
            f"gpu_memory_utilization {utilization} leaves no room for the KV cache: "
            f"{utilization} x {memory.total / GIB:.2f} GiB of the device, less "
            f"{memory.peak / GIB:.2f} GiB for the weights and the largest step and "
            f"{memory.non_torch / GIB:.2f} GiB held outside torch, is {budget / GIB:.2f} GiB, "
            f"less than one {block_bytes}-byte block: raise gpu_memory_utilization or lower "
            f"max_num_batched_tokens / max_num_seqs"
        )
    return blocks


def swap_blocks(config: EngineConfig, device_type: str, num_blocks: int, block_bytes: int) -> int:
    """Host blocks for swap preemption: num_cpu_blocks if set; none unless preemption_mode is
    swap; else swap_space_gb's worth on CUDA (pinned memory: as many as the device holds would
    pin more host memory than a machine has), as many as the KV cache on CPU."""
    if config.num_cpu_blocks is not None:
        return config.num_cpu_blocks
    if config.preemption_mode != "swap":
        return 0
    if device_type == "cuda":
        return int(config.swap_space_gb * GIB) // block_bytes
    return num_blocks


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else 4 GiB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * GIB


def device_kv_blocks(
    config: EngineConfig, model, layout: tuple[int, int, int, int], dtype, device
) -> int:
    """The KV cache's block count: num_kv_blocks, else kv_cache_memory_gb's worth, else measured
    (module docstring); `layout` is (layers, block_size, kv heads, head_dim) of `dtype`."""
    block_bytes = KVCache.block_bytes(*layout, dtype)
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory_gb is not None:
        return max(1, int(config.kv_cache_memory_gb * GIB) // block_bytes)
    if device.type != "cuda":
        return max(1, min(GIB, available_memory_bytes() // 4) // block_bytes)
    memory = profile_cuda_memory(config, model, layout, dtype, device)
    blocks = kv_cache_blocks(memory, config.gpu_memory_utilization, block_bytes)
    log.info(
        "KV cache sizing: %.2f GiB x gpu_memory_utilization %.2f, less peak %.2f GiB (weights "
        "and a step of %d tokens over %d sequences) and %.2f GiB outside torch: %d blocks of "
        "%d bytes (%.2f GiB)", memory.total / GIB, config.gpu_memory_utilization,
        memory.peak / GIB, config.max_num_batched_tokens, config.max_num_seqs,
        memory.non_torch / GIB, blocks, block_bytes, blocks * block_bytes / GIB,
    )  # fmt: skip
    return blocks


def profile_cuda_memory(
    config: EngineConfig, model, layout: tuple[int, int, int, int], dtype, device
) -> DeviceMemory:
    """Run the profiling step on a fresh peak counter; read the device's memory after it."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_step(config, model, layout, dtype, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()  # the step's blocks go back before the cache takes its share
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    return DeviceMemory(total, peak, non_torch)


def profile_step(
    config: EngineConfig, model, layout: tuple[int, int, int, int], dtype, device
) -> tuple[int, int]:
    """The largest step the Scheduler can plan, run once and thrown away -> (tokens, sequences).

    max_num_seqs sequences (config resolved) share max_num_batched_tokens tokens as evenly as
    they can, each at most max_model_len; each is a prefill from position 0 whose block table
    cycles through a dummy cache of PROFILE_CACHE_BLOCKS blocks (what the slots hold does not
    matter, only the memory the step takes)."""
    num_layers, block_size, num_kv_heads, head_dim = layout
    max_len = config.max_model_len or config.max_num_batched_tokens
    num_seqs = max(1, min(config.max_num_seqs, config.max_num_batched_tokens))
    num_tokens = min(config.max_num_batched_tokens, num_seqs * max_len)
    lengths = torch.full((num_seqs,), num_tokens // num_seqs, dtype=torch.long)
    lengths[: num_tokens % num_seqs] += 1
    starts = torch.zeros(num_seqs + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=starts[1:])
    rows = torch.repeat_interleave(torch.arange(num_seqs), lengths)
    positions = torch.arange(num_tokens) - starts[:-1][rows]
    max_blocks = math.ceil(int(lengths.max()) / block_size)
    table = (torch.arange(max_blocks) % PROFILE_CACHE_BLOCKS).to(torch.int32)
    slots = table[positions // block_size].long() * block_size + positions % block_size
    cache = KVCache(
        num_layers, PROFILE_CACHE_BLOCKS, 0, block_size, num_kv_heads, head_dim, dtype, device
    )
    meta = AttentionMetadata(
        slots.to(device),
        table.expand(num_seqs, max_blocks).contiguous().to(device),
        lengths.to(torch.int32).to(device),
        starts.to(torch.int32).to(device),
    )
    with torch.inference_mode():
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        hidden = model(input_ids, positions.to(device), cache.layers, meta)
        logits = model.compute_logits(hidden.index_select(0, (starts[1:] - 1).to(device)))
        torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True)
    return num_tokens, num_seqs
