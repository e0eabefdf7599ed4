"""One place for the engine's settings, the actors' addresses and the model facts they share.

The supervisor builds an `EngineConfig` from the user's flags, resolves what depends on the
checkpoint (`ModelFacts`) and on the Worker's memory measurement (`num_kv_blocks`), and hands the
resolved config to every actor it starts.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from .model_config import ModelConfig

ACTORS = ("worker", "block_manager", "scheduler", "engine")  # start order; stop is the reverse
# The Worker's second mailbox, read by its forward thread alone: StepPlan and Reset from the
# Scheduler (its first, "worker", is the event loop's: Stop).
WORKER_STEPS = "worker_steps"
PREEMPTION_MODES = ("recompute", "swap")
VICTIM_POLICIES = ("fewest_computed", "last_admitted")
GREEDY_HEAD_SCREENS = ("auto", "int8", "bf16", "off")


class ModelFacts(msgspec.Struct, frozen=True):
    """What the Scheduler and Engine need of the checkpoint, read from its JSON files alone."""

    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]

    @classmethod
    def read(cls, model_dir: str | Path) -> ModelFacts:
        """Parse the checkpoint's config (the Worker's parser: unsupported models fail here,
        before any process starts). max_position_embeddings is capped by a sliding window."""
        config = ModelConfig.from_dir(model_dir)
        return cls(config.vocab_size, config.max_model_len, list(config.eos_token_ids))


class Addresses(msgspec.Struct, frozen=True):
    """ZeroMQ endpoints: one PULL mailbox per actor and the supervisor, plus the clients' ROUTER."""

    run_dir: str
    client: str

    def mailbox(self, actor: str) -> str:
        return f"ipc://{self.run_dir}/{actor}.sock"


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: measured by the Worker from kv_cache_memory_gb
    kv_cache_memory_gb: float | None = None  # None: 1 GiB on CPU, 90% of free memory on CUDA
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_live_requests: int = 1024  # over this, new requests get an `overloaded` error
    # Limits on what one client message may ask (errors name the field and the limit):
    max_client_message_bytes: int = 16 << 20  # ZMQ_MAXMSGSIZE of the client socket
    max_request_output_tokens: int = 1 << 18  # n x the tokens each sample may generate
    max_logprob_entries: int = 1 << 20  # logprobs (+ prompt_logprobs) entries of one request
    priority_min: int = 0  # priorities clients may ask (lower runs first): none can jump
    priority_max: int = 1 << 20  # ahead of the default 0 unless priority_min is lowered
    client_queue_messages: int = 10_000  # replies queued for one client before they wait
    client_lease_s: float = 30.0  # a client silent this long has its requests aborted
    poison_crashes: int = 2  # a request in flight at this many crashes of an actor is failed
    fault_crash_on_token_id: int | None = None  # tests only: the Worker dies on a plan with it
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"  # or "swap": KV to a CPU block pool and back
    preemption_victim: str = "fewest_computed"  # or "last_admitted"
    async_scheduling: bool = True  # plan step N+1 while the Worker runs step N
    final_only_flush_s: float = 1.0  # how often held final_only outputs go out while running
    num_cpu_blocks: int | None = None  # swap space; None: as many as GPU blocks in swap mode
    device: str = "auto"
    dtype: str = "auto"  # float32 on CPU, bfloat16 on CUDA
    attention_backend: str = "auto"
    torch_threads: int | None = None  # None: every core (only the Worker runs torch compute)
    # The CPU fast path (kernels/cpu/: C kernels over the paged cache, packed weights, the fused
    # decode stack and greedy heads); off: plain torch, the same tokens.
    cpu_fast_path: bool = True
    greedy_head_screen: str = "auto"  # auto | int8 | bf16 | off: the CPU greedy head's screen
    transparent_huge_pages: bool = True  # advise THP on the large CPU weight copies
    step_trace: str | None = None  # PATH: each step's clock times (scripts/bench_overhead.py)
    heartbeat_interval_s: float = 1.0
    ready_timeout_s: float = 180.0
    stop_timeout_s: float = 10.0
    seed: int = 0
    epoch: int = 0  # actors drop stamped messages of other epochs; restarted ones start at -1
    max_restarts: int = 5  # per actor within restart_window_s; past it the tree stops
    restart_window_s: float = 60.0
    drain_timeout_s: float = 30.0
    # CurveZMQ on the client socket (actors/curve.py has the rules; `actorserve keys` the files)
    curve_server_key: str | None = None  # the server's secret certificate (0600)
    curve_authorized_clients: str | None = None  # dir of client *.key certs; None: any client
    insecure_loopback: bool = False  # allow tcp:// on a loopback host without CURVE
    curve_gateway_key: str | None = None  # resolved, not a flag: see curve.with_own_client
    addresses: Addresses | None = None
    facts: ModelFacts | None = None

    def validate(self) -> None:
        """Raise ValueError naming the first setting out of range."""
        checks = [
            ("block_size", self.block_size in (8, 16, 32, 64), "one of 8, 16, 32, 64"),
            ("max_num_seqs", self.max_num_seqs >= 1, ">= 1"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, ">= 1"),
            ("num_kv_blocks", self.num_kv_blocks is None or self.num_kv_blocks >= 1, ">= 1"),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 2, ">= 2"),
            ("heartbeat_interval_s", self.heartbeat_interval_s > 0, "> 0"),
            ("max_client_message_bytes", self.max_client_message_bytes >= 1024, ">= 1024"),
            ("max_request_output_tokens", self.max_request_output_tokens >= 1, ">= 1"),
            ("max_logprob_entries", self.max_logprob_entries >= 1, ">= 1"),
            ("priority_max", self.priority_max >= self.priority_min, ">= priority_min"),
            ("poison_crashes", self.poison_crashes >= 1, ">= 1"),
            ("client_lease_s", self.client_lease_s > 0, "> 0"),
            ("client_queue_messages", self.client_queue_messages >= 1, ">= 1"),
            ("final_only_flush_s", self.final_only_flush_s >= 0, ">= 0"),
            (
                "preemption_mode",
                self.preemption_mode in PREEMPTION_MODES,
                f"one of {PREEMPTION_MODES}",
            ),
            (
                "greedy_head_screen",
                self.greedy_head_screen in GREEDY_HEAD_SCREENS,
                f"one of {GREEDY_HEAD_SCREENS}",
            ),
            (
                "preemption_victim",
                self.preemption_victim in VICTIM_POLICIES,
                f"one of {VICTIM_POLICIES}",
            ),
            (
                "max_num_batched_tokens",
                self.max_num_batched_tokens >= self.max_num_seqs,
                f">= max_num_seqs ({self.max_num_seqs}) so every running decode fits in a step",
            ),
        ]
        for name, ok, limit in checks:
            if not ok:
                raise ValueError(f"{name} must be {limit}, got {getattr(self, name)}")

    def resolve_model(self) -> EngineConfig:
        """Fill `facts` and `max_model_len` from the checkpoint's JSON files."""
        facts = ModelFacts.read(self.model)
        max_len = self.max_model_len or facts.max_position_embeddings
        if max_len > facts.max_position_embeddings:
            raise ValueError(
                f"max_model_len must be <= the model's max_position_embeddings "
                f"({facts.max_position_embeddings}), got {max_len}"
            )
        return msgspec.structs.replace(self, facts=facts, max_model_len=max_len)

    def resolve_kv_blocks(self, num_kv_blocks: int, num_cpu_blocks: int = 0) -> EngineConfig:
        """Fix the block count the Worker measured; every sequence must fit in the cache alone."""
        capacity = num_kv_blocks * self.block_size
        if self.max_model_len is not None and capacity < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_kv_blocks} blocks of "
                f"{self.block_size}), less than max_model_len={self.max_model_len}: raise "
                f"kv_cache_memory_gb / num_kv_blocks or lower max_model_len"
            )
        return msgspec.structs.replace(
            self, num_kv_blocks=num_kv_blocks, num_cpu_blocks=num_cpu_blocks
        )

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> EngineConfig:
        return msgspec.json.decode(data, type=cls)
