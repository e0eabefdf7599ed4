"""The range each EngineConfig setting must be in: one check a setting, read in order, so the
error names the first setting out of range and the limit it broke."""

from __future__ import annotations

from typing import Any, Literal, get_args

from .quantization import QUANTIZATION_NEEDS, quantization_fits

PreemptionMode = Literal["recompute", "swap"]
VictimPolicy = Literal["fewest_computed", "last_admitted"]
GreedyHeadScreen = Literal["auto", "int8", "bf16", "off"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
KvCacheDtype = Literal["auto", "bfloat16", "float32"]
Quantization = Literal["none", "int8", "bf16"]
Placement = Literal["local", "ray"]


def check_ranges(config: Any) -> None:
    """Raise ValueError("<field> must be <limit>, got <value>") for the first setting of an
    EngineConfig out of range."""

    def one_of(name: str, choices) -> tuple[str, bool, str]:  # choices: a Literal type
        return name, getattr(config, name) in get_args(choices), f"one of {get_args(choices)}"

    def unset_or_positive(name: str) -> tuple[str, bool, str]:  # an `int | None` setting
        return name, getattr(config, name) is None or getattr(config, name) >= 1, ">= 1"

    checks = [
        ("block_size", config.block_size in (8, 16, 32, 64), "one of 8, 16, 32, 64"),
        unset_or_positive("max_num_seqs"),
        unset_or_positive("torch_threads"),
        ("data_parallel_size", config.data_parallel_size >= 1, ">= 1"),
        ("tensor_parallel_size", config.tensor_parallel_size >= 1, ">= 1"),
        ("tp_follower_timeout_s", config.tp_follower_timeout_s > 0, "> 0"),
        one_of("placement", Placement),
        ("ray_replica_cpus", config.ray_replica_cpus >= 1, ">= 1"),
        ("gpu_memory_utilization", 0.0 < config.gpu_memory_utilization <= 1.0, "in (0, 1]"),
        ("swap_space_gb", config.swap_space_gb >= 0.0, ">= 0"),
        ("max_num_batched_tokens", config.max_num_batched_tokens >= 1, ">= 1"),
        unset_or_positive("num_kv_blocks"),
        unset_or_positive("max_prefill_tokens_beside_decodes"),
        ("max_model_len", config.max_model_len is None or config.max_model_len >= 2, ">= 2"),
        ("heartbeat_interval_s", config.heartbeat_interval_s > 0, "> 0"),
        ("omp_spin_count", config.omp_spin_count >= 0, ">= 0"),
        ("max_client_message_bytes", config.max_client_message_bytes >= 1024, ">= 1024"),
        ("max_request_output_tokens", config.max_request_output_tokens >= 1, ">= 1"),
        unset_or_positive("max_client_requests"),
        unset_or_positive("max_client_output_tokens"),
        ("max_logprob_entries", config.max_logprob_entries >= 1, ">= 1"),
        ("max_structured_chars", config.max_structured_chars >= 1, ">= 1"),
        ("structured_cache_size", config.structured_cache_size >= 2, ">= 2"),
        ("structured_max_whitespace", config.structured_max_whitespace >= 0, ">= 0"),
        ("priority_max", config.priority_max >= config.priority_min, ">= priority_min"),
        ("poison_crashes", config.poison_crashes >= 1, ">= 1"),
        ("client_lease_s", config.client_lease_s > 0, "> 0"),
        ("send_timeout_s", config.send_timeout_s > 0, "> 0"),
        ("client_queue_messages", config.client_queue_messages >= 1, ">= 1"),
        ("final_only_flush_s", config.final_only_flush_s >= 0, ">= 0"),
        one_of("preemption_mode", PreemptionMode),
        one_of("dtype", Dtype),
        one_of("kv_cache_dtype", KvCacheDtype),
        one_of("greedy_head_screen", GreedyHeadScreen),
        one_of("preemption_victim", VictimPolicy),
        one_of("quantization", Quantization),
        ("quantization", quantization_fits(config), QUANTIZATION_NEEDS),
        (
            "max_num_batched_tokens",
            config.max_num_seqs is None or config.max_num_batched_tokens >= config.max_num_seqs,
            f">= max_num_seqs ({config.max_num_seqs}) so every running decode fits in a step",
        ),
    ]
    for name, ok, limit in checks:
        if not ok:
            raise ValueError(f"{name} must be {limit}, got {getattr(config, name)}")
