"""One place for the engine's settings (the actors' addresses are in addresses.py, the checkpoint's
facts in model_config.py).

The supervisor builds an `EngineConfig` from the user's flags, resolves what depends on the
checkpoint (`ModelFacts`), on the Worker's device (`max_num_seqs`, `torch_threads`) and on its
memory measurement (`num_kv_blocks`) with config_resolution.py, and hands the resolved config to
every actor it starts after the Worker.

Each field says what it is in its `Meta(description=...)`: `actorserve serve --help` shows that
text, and the flag (`--block-size` for `block_size`) is generated from the field (cli/flags.py).
A field marked `extra=NOT_A_FLAG` is resolved by the engine, not set by the user.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from .addresses import Addresses
from .config_checks import (
    Dtype,
    GreedyHeadScreen,
    KvCacheDtype,
    Placement,
    PreemptionMode,
    Quantization,
    VictimPolicy,
    check_ranges,
)
from .model_config import ModelFacts

NOT_A_FLAG = {"flag": False}  # Meta.extra of a field the program resolves, not a user setting


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The engine's settings (each a flag of `actorserve serve` unless marked NOT_A_FLAG) and
    what the supervisor resolves before it starts the actors (facts, addresses, block counts)."""

    model: Annotated[str, Meta(description="Hugging Face checkpoint directory")]
    # The KV cache and the step's budgets
    block_size: Annotated[int, Meta(description="tokens per KV cache block: 8, 16, 32 or 64")] = 16
    num_kv_blocks: Annotated[
        int | None, Meta(description="KV cache blocks; unset: measured from kv_cache_memory_gb")
    ] = None
    kv_cache_memory_gb: Annotated[
        float | None,
        Meta(
            description="KV cache size; unset: 1 GiB on CPU (at most a quarter of the free "
            "memory), on CUDA what gpu_memory_utilization leaves after a profiling step"
        ),
    ] = None
    max_num_seqs: Annotated[
        int | None,
        Meta(
            description="sequences running in one step; unset: 256 on CUDA, 64 on CPU (at most "
            "max_num_batched_tokens)"
        ),
    ] = None
    max_num_batched_tokens: Annotated[
        int, Meta(description="tokens in one step (prefill chunks and decodes together)")
    ] = 2048
    max_prefill_tokens_beside_decodes: Annotated[
        int | None,
        Meta(
            description="prompt tokens one step computes while requests decode in it, so that "
            "a newcomer's prompt, chunked over steps, delays each of their tokens by at most "
            "this many tokens' work (stall-free batching); unset: the whole token budget"
        ),
    ] = None
    max_model_len: Annotated[
        int | None,
        Meta(description="longest sequence (prompt + output); unset: the model's maximum"),
    ] = None
    max_live_requests: Annotated[
        int, Meta(description="requests in the engine at once; over it, `overloaded` errors")
    ] = 1024
    # What one client may hold (a sender's identity, or a tenant its gateway names): over it, 429
    max_client_requests: Annotated[
        int | None, Meta(description="live samples of one client; unset: max_live_requests / 2")
    ] = None
    max_client_output_tokens: Annotated[
        int | None, Meta(description="n x max_tokens of one client's live requests; unset: any")
    ] = None
    # Limits on what one client message may ask (errors name the field and the limit)
    max_client_message_bytes: Annotated[
        int, Meta(description="largest client message (ZMQ_MAXMSGSIZE of the client socket)")
    ] = 16 << 20
    max_request_output_tokens: Annotated[
        int, Meta(description="n x max_tokens of one request: the tokens it may generate")
    ] = 1 << 18
    max_logprob_entries: Annotated[
        int, Meta(description="logprobs (+ prompt_logprobs) entries of one request")
    ] = 1 << 20
    max_structured_chars: Annotated[
        int, Meta(description="characters of a structured output's schema, regex or grammar")
    ] = 1 << 16
    structured_cache_size: Annotated[
        int, Meta(description="compiled grammars the Worker keeps (LRU), one per schema text")
    ] = 64
    structured_max_whitespace: Annotated[
        int,
        Meta(
            description="whitespace characters a JSON output may put between two tokens where "
            "the request lets whitespace in (vLLM's default; its disable_any_whitespace does "
            "not); 0: no limit, as in vLLM"
        ),
    ] = 8
    priority_min: Annotated[
        int, Meta(description="lowest priority a client may ask (lower runs first)")
    ] = 0
    priority_max: Annotated[
        int,
        Meta(
            description="highest priority a client may ask; none jumps ahead of 0 unless "
            "priority_min is lowered"
        ),
    ] = 1 << 20
    client_queue_messages: Annotated[
        int, Meta(description="replies queued for one client before they wait")
    ] = 10_000
    client_lease_s: Annotated[
        float, Meta(description="a client silent this long has its requests aborted")
    ] = 30.0
    send_timeout_s: Annotated[
        float,
        Meta(
            description="a client that takes none of our output for this long (SDK, HTTP, "
            "WebSocket) has its requests aborted, and over HTTP its connection dropped"
        ),
    ] = 30.0
    poison_crashes: Annotated[
        int, Meta(description="a request in flight at this many crashes of an actor is failed")
    ] = 2
    fault_crash_on_token_id: Annotated[
        int | None, Meta(description="tests only: the Worker dies on a step plan with this token")
    ] = None
    kv_events: Annotated[
        bool,
        Meta(
            description="the BlockManager publishes its prefix cache's changes (KV events) "
            "beside the client address, for gateways that route on them (route_policy "
            "kv_events)"
        ),
    ] = True
    # Scheduling
    enable_prefix_caching: Annotated[
        bool, Meta(description="reuse the KV blocks of a prompt prefix already computed")
    ] = True
    preemption_mode: Annotated[
        PreemptionMode,
        Meta(
            description="what a preempted request keeps: recompute (nothing) or swap (its KV, "
            "moved to a CPU block pool and back)"
        ),
    ] = "recompute"
    preemption_victim: Annotated[
        VictimPolicy, Meta(description="which running request is preempted first")
    ] = "fewest_computed"
    async_scheduling: Annotated[
        bool, Meta(description="plan step N+1 while the Worker runs step N")
    ] = True
    final_only_flush_s: Annotated[
        float, Meta(description="how often held final_only outputs go out while running")
    ] = 1.0
    num_cpu_blocks: Annotated[
        int | None,
        Meta(
            description="swap space in blocks (swap mode); unset: swap_space_gb on CUDA, as many "
            "as the KV cache on CPU"
        ),
    ] = None
    # The Worker's device and kernels
    device: Annotated[
        str, Meta(description="torch device (cpu, cuda, cuda:1); auto: cuda if there is one")
    ] = "auto"
    dtype: Annotated[
        Dtype,
        Meta(
            description="weights and activations; auto: the checkpoint's where the device runs "
            "it natively (CUDA; a CPU with AMX-BF16 or AVX512-BF16), else float32"
        ),
    ] = "auto"
    kv_cache_dtype: Annotated[
        KvCacheDtype, Meta(description="the KV cache's dtype; auto: the model's (dtype)")
    ] = "auto"
    attention_backend: Annotated[
        str,
        Meta(
            description="auto (triton on CUDA, cpu elsewhere), cpu, reference or triton "
            "(kernels/__init__.py)"
        ),
    ] = "auto"
    torch_threads: Annotated[
        int | None,
        Meta(
            description="each Worker rank's torch threads; unset: 1 on CUDA, else the cores "
            "shared out among the data_parallel_size replicas' tensor_parallel_size ranks (1 "
            "at least)"
        ),
    ] = None
    data_parallel_size: Annotated[
        int, Meta(description="`serve`: engine stacks, one gateway routing across them")
    ] = 1
    placement: Annotated[
        Placement,
        Meta(
            description="`serve`: where the data_parallel_size engine stacks run: local (child "
            "processes of this server) or ray (one Ray actor each, on the cluster at "
            "ray_address; needs the `actorserve[ray]` extra)"
        ),
    ] = "local"
    ray_address: Annotated[
        str | None,
        Meta(
            description="placement ray: the Ray cluster to join (ray.init's address, e.g. "
            "ray://HEAD:10001 or auto); unset: start a local one, its engines on 127.0.0.1"
        ),
    ] = None
    ray_replica_cpus: Annotated[
        int,
        Meta(
            description="placement ray: CPUs Ray reserves for each replica (its Worker's torch "
            "threads when torch_threads is unset)"
        ),
    ] = 1
    tensor_parallel_size: Annotated[
        int,
        Meta(
            description="Worker ranks sharing the model, rank r on cuda:r; on CPU above 1: "
            "cpu_fast_path off, the cores shared out among the ranks (torch_threads)"
        ),
    ] = 1
    tp_follower_timeout_s: Annotated[
        float,
        Meta(
            description="tensor parallel: a follower rank that stamps no sign of life for this "
            "long (stopped) is killed and the group restarted; a collective of the serving "
            "group times out at twice this"
        ),
    ] = 5.0
    # CUDA only
    enforce_eager: Annotated[
        bool, Meta(description="CUDA: run every step eagerly (no CUDA graphs for decode)")
    ] = False
    gpu_memory_utilization: Annotated[
        float,
        Meta(
            description="CUDA: the share of the device's memory the Worker may use (weights, "
            "activations at the largest step, KV cache)"
        ),
    ] = 0.9
    swap_space_gb: Annotated[
        float,
        Meta(description="CUDA: pinned host memory for swapped-out KV blocks (swap preemption)"),
    ] = 4.0
    # An OpenMP thread that spins long for its next region keeps a core that another process on
    # the machine (a load generator, the gateway) needs, and the step then waits for that
    # process's time slice: a short spin keeps back-to-back regions fast and yields the core.
    omp_spin_count: Annotated[
        int,
        Meta(
            description="spin iterations of the Worker's OpenMP threads before they sleep "
            "(libgomp's GOMP_SPINCOUNT); short keeps a shared machine from stalling"
        ),
    ] = 1000
    # The CPU fast path (kernels/cpu/: C kernels over the paged cache, packed weights, the fused
    # decode stack and greedy heads); off: plain torch, the same tokens.
    cpu_fast_path: Annotated[
        bool, Meta(description="the CPU fast path (packed weights, C kernels); off: plain torch")
    ] = True
    greedy_head_screen: Annotated[
        GreedyHeadScreen,
        Meta(
            description="the CPU greedy head's cheap first pass over the vocabulary (the tokens "
            "are exact either way); auto: int8 or bf16 where the CPU has it; off: fp32 alone"
        ),
    ] = "auto"
    transparent_huge_pages: Annotated[
        bool, Meta(description="advise huge pages on the large CPU weight copies")
    ] = True
    kv_cache_prefault: Annotated[
        bool,
        Meta(
            description="fault the CPU KV cache's pages in while the Worker is idle, so that "
            "steps do not pay for them (off: each page on its first write)"
        ),
    ] = True
    quantization: Annotated[
        Quantization,
        Meta(
            description="int8: the projections' weights stored as int8 with an fp32 scale per "
            "output channel, quantized at load; bf16: stored as bf16 (a bf16 or fp32 "
            "checkpoint; for CPUs without bf16 arithmetic); both CPU fast path, fp32 "
            "activations (with int8 on a CPU with AVX512-VNNI each projection's input rows "
            "are quantized to int8 too, for int8 x int8 products); none: as loaded (dtype "
            "auto may still pick bf16, by a measurement)"
        ),
    ] = "none"
    step_trace: Annotated[
        str | None,
        Meta(description="PATH: write each step's clock times (scripts/bench_overhead.py)"),
    ] = None
    # Supervision
    heartbeat_interval_s: Annotated[
        float, Meta(description="how often each actor tells the supervisor it is alive")
    ] = 1.0
    ready_timeout_s: Annotated[
        float, Meta(description="an actor not Ready this long after its start fails start-up")
    ] = 180.0
    stop_timeout_s: Annotated[
        float, Meta(description="an actor not gone this long after Stop is killed")
    ] = 10.0
    seed: Annotated[int, Meta(description="the sampler's seed for requests without one")] = 0
    max_restarts: Annotated[
        int,
        Meta(
            description="restarts of one actor within restart_window_s; past it, the engine stops"
        ),
    ] = 5
    restart_window_s: Annotated[float, Meta(description="the window of max_restarts")] = 60.0
    drain_timeout_s: Annotated[
        float, Meta(description="on SIGTERM, how long requests in flight may finish")
    ] = 30.0
    # CurveZMQ on the client socket (runtime/curve.py has the rules; `actorserve keys` the files)
    curve_server_key: Annotated[
        str | None, Meta(description="the server's secret certificate (a 0600 file)")
    ] = None
    curve_authorized_clients: Annotated[
        str | None, Meta(description="directory of client *.key certificates; unset: any client")
    ] = None
    insecure_loopback: Annotated[
        bool, Meta(description="allow tcp:// on a loopback host without CURVE")
    ] = False
    # Resolved by the engine, not set by the user
    epoch: Annotated[
        int,
        Meta(
            description="actors drop stamped messages of other epochs; restarted ones start at -1",
            extra=NOT_A_FLAG,
        ),
    ] = 0
    curve_gateway_key: Annotated[
        str | None,
        Meta(
            description="the gateway's own CURVE key: see curve.with_own_client", extra=NOT_A_FLAG
        ),
    ] = None
    addresses: Annotated[
        Addresses | None, Meta(description="the actors' mailboxes", extra=NOT_A_FLAG)
    ] = None
    facts: Annotated[
        ModelFacts | None, Meta(description="read from the checkpoint", extra=NOT_A_FLAG)
    ] = None

    def validate(self) -> None:
        """Raise ValueError naming the first setting out of range (config_checks.py)."""
        check_ranges(self)

    def client_request_limit(self) -> int:
        """max_client_requests; unset, half of max_live_requests: one client alone may still
        queue several batches, and never shuts the others out of the engine."""
        limit = self.max_client_requests
        return limit if limit is not None else max(1, self.max_live_requests // 2)

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> EngineConfig:
        return msgspec.json.decode(data, type=cls)
