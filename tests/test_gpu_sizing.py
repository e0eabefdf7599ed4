"""Sizing as vLLM and nano-vllm do it (actors/worker/sizing.py): the KV cache gets what
gpu_memory_utilization leaves after a profiling step at the largest batch; swap space in GiB on
CUDA; max_num_seqs and torch_threads default by the Worker's device, resolved once
(config_resolution.resolve_device) and reported to the supervisor in the Worker's Ready."""

from __future__ import annotations

import os
import types

import msgspec
import pytest
import torch

from actorserve.actors.runtime.config import EngineConfig
from actorserve.actors.runtime.config_resolution import resolve_device, resolve_model
from actorserve.actors.worker.kv_cache import KVCache
from actorserve.actors.worker.sizing import (
    GIB,
    DeviceMemory,
    kv_cache_blocks,
    profile_step,
    swap_blocks,
)
from actorserve.actors.worker.worker import build_runner
from actorserve.offline import LLM

BLOCK_BYTES = 2 * 28 * 16 * 8 * 128 * 2  # Qwen3-0.6B in bf16: 28 layers, 8 KV heads of 128


def test_the_kv_cache_gets_utilization_of_the_device_less_the_peak_and_non_torch_memory():
    memory = DeviceMemory(total=140 * GIB, peak=3 * GIB, non_torch=GIB // 2)
    blocks = kv_cache_blocks(memory, 0.9, BLOCK_BYTES)
    budget = int(0.9 * 140 * GIB) - 3 * GIB - GIB // 2
    assert blocks == budget // BLOCK_BYTES
    assert blocks * BLOCK_BYTES <= budget < (blocks + 1) * BLOCK_BYTES
    # a higher peak (a larger step) leaves fewer blocks; more utilization, more blocks
    assert kv_cache_blocks(DeviceMemory(140 * GIB, 6 * GIB, GIB // 2), 0.9, BLOCK_BYTES) < blocks
    assert kv_cache_blocks(memory, 0.95, BLOCK_BYTES) > blocks


@pytest.mark.parametrize(
    "memory, utilization",
    [
        (DeviceMemory(total=80 * GIB, peak=70 * GIB, non_torch=GIB), 0.5),  # over the share
        (DeviceMemory(total=80 * GIB, peak=40 * GIB - 1000, non_torch=0), 0.5),  # < one block
    ],
)
def test_nothing_left_for_the_cache_is_an_error_naming_gpu_memory_utilization(memory, utilization):
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.5 leaves no room"):
        kv_cache_blocks(memory, utilization, BLOCK_BYTES)


def test_swap_space_is_swap_space_gb_on_cuda_and_the_cache_size_on_cpu():
    swap = EngineConfig(model="m", preemption_mode="swap", swap_space_gb=4.0)
    assert swap_blocks(swap, "cuda", 500_000, BLOCK_BYTES) == 4 * GIB // BLOCK_BYTES
    assert swap_blocks(swap, "cpu", 500, BLOCK_BYTES) == 500
    # num_cpu_blocks overrides on either; recompute mode keeps no swap space
    forced = msgspec.structs.replace(swap, num_cpu_blocks=7)
    assert swap_blocks(forced, "cuda", 500, BLOCK_BYTES) == swap_blocks(forced, "cpu", 5, 1) == 7
    recompute = EngineConfig(model="m", swap_space_gb=4.0)
    assert swap_blocks(recompute, "cuda", 500, BLOCK_BYTES) == 0


def test_on_cuda_blocks_come_from_num_kv_blocks_then_kv_cache_memory_gb_then_the_profile(
    monkeypatch,
):
    from actorserve.actors.worker import sizing

    profiled = []

    def profile(config, model, layout, dtype, device):
        profiled.append(config.max_num_seqs)
        return DeviceMemory(total=100 * GIB, peak=10 * GIB, non_torch=GIB)

    monkeypatch.setattr(sizing, "profile_cuda_memory", profile)
    cuda = types.SimpleNamespace(type="cuda")
    layout = (28, 16, 8, 128)
    config = resolve_device(EngineConfig(model="m"), "cuda")
    blocks = sizing.device_kv_blocks(config, None, layout, torch.bfloat16, cuda)
    assert blocks == (90 * GIB - 11 * GIB) // BLOCK_BYTES and profiled == [256]
    by_size = msgspec.structs.replace(config, kv_cache_memory_gb=2.0)
    assert sizing.device_kv_blocks(by_size, None, layout, torch.bfloat16, cuda) == (
        2 * GIB // BLOCK_BYTES
    )
    by_count = msgspec.structs.replace(by_size, num_kv_blocks=5)
    assert sizing.device_kv_blocks(by_count, None, layout, torch.bfloat16, cuda) == 5
    assert profiled == [256]  # neither override profiles


def test_unset_max_num_seqs_and_torch_threads_resolve_by_the_device():
    unset = EngineConfig(model="m")
    assert unset.max_num_seqs is None and unset.torch_threads is None
    cuda, cpu = resolve_device(unset, "cuda"), resolve_device(unset, "cpu")
    assert (cuda.max_num_seqs, cuda.torch_threads) == (256, 1)
    assert (cpu.max_num_seqs, cpu.torch_threads) == (64, os.cpu_count())
    # settings the user gave stay
    given = resolve_device(EngineConfig(model="m", max_num_seqs=32, torch_threads=3), "cuda")
    assert (given.max_num_seqs, given.torch_threads) == (32, 3)
    # resolving twice changes nothing (the supervisor resolves what the Worker resolved)
    assert resolve_device(cuda, "cuda") == cuda


def test_a_default_max_num_seqs_never_exceeds_the_token_budget_a_given_one_is_checked():
    small = EngineConfig(model="m", max_num_batched_tokens=100)
    small.validate()
    resolved = resolve_device(small, "cuda")
    assert resolved.max_num_seqs == 100
    resolved.validate()
    with pytest.raises(ValueError, match=r"max_num_batched_tokens must be >= max_num_seqs \(256\)"):
        EngineConfig(model="m", max_num_seqs=256, max_num_batched_tokens=100).validate()
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        EngineConfig(model="m", max_num_seqs=0).validate()


def test_the_profiling_step_is_the_largest_the_scheduler_can_plan(llama_dir):
    """On CPU (what it runs is the same code on CUDA): max_num_batched_tokens over max_num_seqs
    sequences, on a dummy cache of a few blocks, each sequence at most max_model_len."""
    config = EngineConfig(
        model=str(llama_dir), device="cpu", num_kv_blocks=8, max_num_batched_tokens=300
    )
    runner = build_runner(resolve_model(config))
    assert runner.config.max_num_seqs == 64  # resolved for the CPU before the runner saw it
    layer = runner.kv.layers[0][0]
    layout = (len(runner.kv.layers), layer.shape[1], layer.shape[2], layer.shape[3])
    with torch.inference_mode():
        assert profile_step(runner.config, runner.model, layout, layer.dtype, runner.device) == (
            300,
            64,
        )
        few = msgspec.structs.replace(runner.config, max_num_seqs=2, max_model_len=100)
        assert profile_step(few, runner.model, layout, layer.dtype, runner.device) == (200, 2)


def test_the_supervisor_resolves_the_defaults_from_the_workers_device(llama_dir):
    with LLM(str(llama_dir), device="cpu", torch_threads=1, num_kv_blocks=128) as llm:
        config = llm._stack.supervisor.config
        assert config.max_num_seqs == 64 and config.torch_threads == 1
        assert llm.generate([[5, 6, 7]], use_tqdm=False)[0].token_ids


@pytest.mark.gpu
def test_on_cuda_the_cache_fills_the_utilization_left_after_the_profiling_step(llama_dir, caplog):
    """A small share of the device: weights, KV cache and the largest step fit in it, and the
    cache takes all but what the profiled step and the CUDA context need."""
    utilization = 0.1
    config = resolve_model(
        EngineConfig(
            model=str(llama_dir),
            device="cuda",
            gpu_memory_utilization=utilization,
            preemption_mode="swap",
            swap_space_gb=0.25,
        )
    )
    torch.cuda.empty_cache()
    with caplog.at_level("INFO", logger="worker"):
        runner = build_runner(config)
    assert "KV cache sizing" in caplog.text
    assert runner.config.max_num_seqs == 256 and runner.config.torch_threads == 1
    _, total = torch.cuda.mem_get_info()
    kv = runner.kv
    k = kv.layers[0][0]
    block_bytes = KVCache.block_bytes(len(kv.layers), k.shape[1], k.shape[2], k.shape[3], k.dtype)
    cache_bytes = kv.num_blocks * block_bytes
    assert torch.cuda.memory_allocated() <= utilization * total
    assert cache_bytes >= utilization * total - 3 * GIB  # the tiny model's step is small
    assert kv.num_cpu_blocks == int(0.25 * GIB) // block_bytes
    assert kv.cpu_layers[0][0].is_pinned()
    with torch.inference_mode():  # the largest step runs in what was left
        layout = (len(kv.layers), k.shape[1], k.shape[2], k.shape[3])
        profile_step(runner.config, runner.model, layout, k.dtype, runner.device)
    torch.cuda.synchronize()
