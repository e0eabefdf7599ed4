"""What the supervisor resolves in an `EngineConfig` before it starts the actors: the facts read
from the checkpoint (`resolve_model`), the defaults that depend on the Worker's device
(`resolve_device`) and the block counts the Worker measured (`resolve_kv_blocks`).

Each returns a new config (the Struct is never changed in place); a setting the user gave stays
as given. The Worker resolves its own copy with `resolve_device`, as the supervisor does once the
Worker's Ready names the device, so every actor started after the Worker sees the same values.
"""

from __future__ import annotations

import os

import msgspec

from .config import EngineConfig
from .model_config import ModelConfig, ModelFacts
from .sharding import ShardLayout
from .tokenizer import tokenizer_file

# max_num_seqs unset: a GPU step reads each weight once whatever the batch; CPU GEMMs grow with it
DEFAULT_MAX_NUM_SEQS = {"cuda": 256, "cpu": 64}
# torch_threads unset on CUDA: the host thread only launches kernels; more take others' cores
CUDA_TORCH_THREADS = 1


def resolve_model(config: EngineConfig) -> EngineConfig:
    """Fill `facts` and `max_model_len` from the checkpoint's JSON files (ValueError naming
    the field of a model that tensor_parallel_size does not split, before any rank starts;
    or naming tokenizer.json, which the Engine and the gateway read, when it is missing)."""
    facts = ModelFacts.read(config.model)
    if config.tensor_parallel_size > 1:
        ShardLayout.of(ModelConfig.from_dir(config.model), 0, config.tensor_parallel_size)
    max_len = config.max_model_len or facts.max_position_embeddings
    if max_len > facts.max_position_embeddings:
        raise ValueError(
            f"max_model_len must be <= the model's max_position_embeddings "
            f"({facts.max_position_embeddings}), got {max_len}"
        )
    tokenizer_file(config.model)
    return msgspec.structs.replace(config, facts=facts, max_model_len=max_len)


def resolve_device(config: EngineConfig, device_type: str) -> EngineConfig:
    """Fill the settings whose default depends on the Worker's device ("cuda", else CPU):
    `max_num_seqs` (DEFAULT_MAX_NUM_SEQS, at most max_num_batched_tokens, so that a default
    never fails the check that every running decode fits in a step) and `torch_threads`
    (CUDA_TORCH_THREADS on CUDA; on CPU the cores, shared out among data_parallel_size
    replicas' tensor_parallel_size ranks); `cpu_fast_path` off on CPU with more than one
    rank (its packed weights and fused heads are whole-model ones). Settings the user gave
    stay; validate() passes on the result wherever it passed before. The Worker resolves its
    config with it, as the supervisor, once the Worker's Ready names the device, does."""
    kind = "cuda" if device_type == "cuda" else "cpu"
    max_num_seqs = config.max_num_seqs
    if max_num_seqs is None:
        max_num_seqs = min(DEFAULT_MAX_NUM_SEQS[kind], config.max_num_batched_tokens)
    threads = config.torch_threads
    if threads is None:
        processes = config.data_parallel_size * config.tensor_parallel_size
        cores = max(1, (os.cpu_count() or 1) // processes)
        threads = CUDA_TORCH_THREADS if kind == "cuda" else cores
    fast_path = config.cpu_fast_path and (kind == "cuda" or config.tensor_parallel_size == 1)
    return msgspec.structs.replace(
        config, max_num_seqs=max_num_seqs, torch_threads=threads, cpu_fast_path=fast_path
    )


def resolve_kv_blocks(
    config: EngineConfig, num_kv_blocks: int, num_cpu_blocks: int = 0
) -> EngineConfig:
    """Fix the block count the Worker measured; every sequence must fit in the cache alone."""
    capacity = num_kv_blocks * config.block_size
    if config.max_model_len is not None and capacity < config.max_model_len:
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({num_kv_blocks} blocks of "
            f"{config.block_size}), less than max_model_len={config.max_model_len}: raise "
            f"gpu_memory_utilization (CUDA), kv_cache_memory_gb or num_kv_blocks, or lower "
            f"max_model_len"
        )
    return msgspec.structs.replace(
        config, num_kv_blocks=num_kv_blocks, num_cpu_blocks=num_cpu_blocks
    )
