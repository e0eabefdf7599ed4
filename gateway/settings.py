"""The gateway's settings (GatewaySettings): every field not marked NOT_A_FLAG is a flag of
`actorserve serve` (cli/flags.py); the engine's facts it needs come from the resolved config."""

from __future__ import annotations

import os
from typing import Annotated, Literal, get_args

import msgspec
from msgspec import Meta

from ..actors.runtime.config import NOT_A_FLAG

RoutePolicy = Literal["kv_events", "prefix", "round_robin"]
ROUTE_POLICIES = get_args(RoutePolicy)


def _unset_or(value: int | None, least: int) -> bool:
    return value is None or value >= least


class GatewaySettings(msgspec.Struct, kw_only=True):
    """The gateway's settings; each one not marked NOT_A_FLAG (those come from the engine) is a
    flag of `actorserve serve`, generated from its field (cli/flags.py). Sizes in bytes, times
    in seconds."""

    model_id: Annotated[str, Meta(description="the name clients pass as `model`", extra=NOT_A_FLAG)]
    model_dir: Annotated[str, Meta(description="the checkpoint", extra=NOT_A_FLAG)]
    max_model_len: Annotated[int, Meta(description="the engine's", extra=NOT_A_FLAG)]
    vocab_size: Annotated[int, Meta(description="the model's", extra=NOT_A_FLAG)]
    block_size: Annotated[int, Meta(description="the engine's", extra=NOT_A_FLAG)] = 16
    send_timeout_s: Annotated[
        float,
        Meta(
            description="the engine's: drop a connection that takes none of our output for "
            "this long, aborting its requests",
            extra=NOT_A_FLAG,
        ),
    ] = 30.0
    api_key: Annotated[
        list[str],
        Meta(
            description="require 'Authorization: Bearer KEY', KEY one of these (comma-separated; "
            "each key is a client of its own to max_client_requests and "
            "max_client_output_tokens); unset: $ACTORSERVE_API_KEY's if set"
        ),
    ] = []
    max_client_requests: Annotated[
        int | None, Meta(description="the engine's, resolved", extra=NOT_A_FLAG)
    ] = None
    max_client_output_tokens: Annotated[
        int | None, Meta(description="the engine's", extra=NOT_A_FLAG)
    ] = None
    max_concurrent_requests: Annotated[
        int | None,
        Meta(description="answer 429 over this many requests in flight; unset: max_live_requests"),
    ] = None
    max_batch_prompts: Annotated[
        int,
        Meta(
            description="prompts in one /v1/completions request (a list: each its own request "
            "in the engine, each counted against max_concurrent_requests)"
        ),
    ] = 256
    max_body_bytes: Annotated[
        int, Meta(description="largest request body accepted, and WebSocket message")
    ] = 8 * 1024 * 1024
    max_connections: Annotated[
        int, Meta(description="open HTTP + WebSocket connections; one more gets 503")
    ] = 2048
    keep_alive_s: Annotated[
        float, Meta(description="close an idle keep-alive connection after this")
    ] = 5.0
    read_timeout_s: Annotated[
        float,
        Meta(description="a request's head, then its body, must arrive within this; else 408"),
    ] = 30.0
    max_header_bytes: Annotated[
        int, Meta(description="longest request line + headers; over it, 431")
    ] = 16 * 1024
    max_requests_per_socket: Annotated[
        int, Meta(description="live requests on one WebSocket; a generate over it gets an error")
    ] = 64
    health_timeout_s: Annotated[
        float, Meta(description="how long /health and /ready wait for the engine")
    ] = 10.0
    health_interval_s: Annotated[
        float, Meta(description="/health and /ready ask the engine at most once per interval")
    ] = 5.0
    stats_interval_s: Annotated[
        float, Meta(description="/v1/stats asks the engine at most once per interval")
    ] = 1.0
    stats_window_s: Annotated[
        float, Meta(description="how far back the history /v1/stats returns goes")
    ] = 300.0
    allowed_origins: Annotated[
        list[str],
        Meta(
            description="comma-separated browser origins allowed besides the server's own pages "
            "(CORS, WebSocket handshakes); '*': any; unset: the server's own only"
        ),
    ] = []
    allowed_hosts: Annotated[
        list[str],
        Meta(
            description="comma-separated Host names accepted ('*.example.com': subdomains); set "
            "it on a private address against DNS rebinding; unset: any"
        ),
    ] = []

    replicas: Annotated[
        list[str],
        Meta(
            description="comma-separated client addresses of the engine replicas to route across "
            "(data parallel, see gateway/replicas.py); unset: the engines this server starts"
        ),
    ] = []
    route_load_margin: Annotated[
        int,
        Meta(
            description="a request goes to its prefix's replica unless that one has more than "
            "this many requests in flight above the least-loaded replica"
        ),
    ] = 4
    route_prefix_blocks: Annotated[
        int, Meta(description="full KV blocks of the prompt that pick its replica (at most)")
    ] = 4
    route_policy: Annotated[
        RoutePolicy,
        Meta(
            description="kv_events: the replica where a request is predicted to add the least "
            "latency, from what its prefix cache holds (its KV events), its queue, the rows "
            "decoding there and its measured step times; prefix affinity while an index is "
            "not in step; prefix: a prompt's first blocks pick its replica, balanced against "
            "load and KV use; round_robin: each request to the next replica (a baseline)"
        ),
    ] = "prefix"
    route_kv_max_blocks: Annotated[
        int,
        Meta(
            description="kv_events: block hashes kept per replica; over it the oldest go and "
            "the replica's index is partial (prefix affinity) until its cache is cleared"
        ),
    ] = 1 << 18
    route_kv_prompt_blocks: Annotated[
        int, Meta(description="kv_events: a prompt's first blocks looked up (at most)")
    ] = 256
    route_kv_tie: Annotated[
        float,
        Meta(
            description="kv_events: replicas whose measured step costs differ by at most this "
            "fraction are priced alike (the difference taken for noise), so that equal work "
            "goes to prefix affinity's pick; more, each by its own"
        ),
    ] = 0.5
    route_kv_steps_ahead: Annotated[
        float,
        Meta(
            description="kv_events: steps a request arriving at a decoding replica waits for "
            "before its own (the rest of the one running, and the one the scheduler planned "
            "while it ran), each priced at that replica's step of its decodes"
        ),
    ] = 1.5
    route_kv_load_margin: Annotated[
        int | None,
        Meta(
            description="kv_events: a replica with more than this many requests in flight above "
            "the least-loaded one gets none, whatever its cache holds; unset: no bound"
        ),
    ] = None
    route_kv_assume_s: Annotated[
        float,
        Meta(
            description="kv_events: a prompt's blocks count as held by the replica it went to "
            "for this long, until its events say so (0: only what they say)"
        ),
    ] = 10.0
    route_kv_message_bytes: Annotated[
        int,
        Meta(
            description="kv_events: largest KV event message read (a snapshot of a cache holds "
            "about 20 bytes a block); a larger one is dropped, and the index resyncs"
        ),
    ] = 16 << 20
    route_stats_interval_s: Annotated[
        float,
        Meta(
            description="ask each replica for its running, waiting and KV use at most this often "
            "(its load, for routing)"
        ),
    ] = 1.0
    route_kv_high: Annotated[
        float,
        Meta(
            description="a replica whose KV cache use (0..1) is over this gets no requests while "
            "another is under it"
        ),
    ] = 0.9
    replica_server_keys: Annotated[
        list[str],
        Meta(
            description="comma-separated server.key files (CurveZMQ public keys) of the "
            "--replicas, by position; one file: every replica's"
        ),
    ] = []
    curve_client_key: Annotated[
        str | None,
        Meta(
            description="the gateway's client.key_secret for the --replicas (each replica "
            "authorizes its client.key); unset: a fresh key pair (for replicas that admit any "
            "client)"
        ),
    ] = None
    engine_liveness_timeout_s: Annotated[
        float,
        Meta(
            description="an engine silent this long while streams are open is taken for dead: "
            "its streams go on on another replica, or fail with one"
        ),
    ] = 10.0

    def validate(self) -> None:
        """Raise ValueError("<field> must be <limit>, got <value>") for the first setting out of
        range, in the order of the fields."""
        checks = [
            ("max_concurrent_requests", _unset_or(self.max_concurrent_requests, 1), ">= 1"),
            ("max_batch_prompts", self.max_batch_prompts >= 1, ">= 1"),
            ("max_body_bytes", self.max_body_bytes >= 1024, ">= 1024"),
            ("max_connections", self.max_connections >= 1, ">= 1"),
            ("keep_alive_s", self.keep_alive_s > 0, "> 0"),
            ("read_timeout_s", self.read_timeout_s > 0, "> 0"),
            ("max_header_bytes", self.max_header_bytes >= 1024, ">= 1024"),
            ("max_requests_per_socket", self.max_requests_per_socket >= 1, ">= 1"),
            ("health_timeout_s", self.health_timeout_s > 0, "> 0"),
            ("health_interval_s", self.health_interval_s >= 0, ">= 0"),
            ("stats_interval_s", self.stats_interval_s >= 0, ">= 0"),
            ("stats_window_s", self.stats_window_s > 0, "> 0"),
            ("route_load_margin", self.route_load_margin >= 0, ">= 0"),
            ("route_prefix_blocks", self.route_prefix_blocks >= 1, ">= 1"),
            ("route_policy", self.route_policy in ROUTE_POLICIES, f"one of {ROUTE_POLICIES}"),
            ("route_kv_max_blocks", self.route_kv_max_blocks >= 1, ">= 1"),
            ("route_kv_prompt_blocks", self.route_kv_prompt_blocks >= 1, ">= 1"),
            ("route_kv_tie", self.route_kv_tie >= 0, ">= 0"),
            ("route_kv_steps_ahead", self.route_kv_steps_ahead >= 0, ">= 0"),
            ("route_kv_load_margin", _unset_or(self.route_kv_load_margin, 0), ">= 0"),
            ("route_kv_assume_s", self.route_kv_assume_s >= 0, ">= 0"),
            ("route_kv_message_bytes", self.route_kv_message_bytes >= 1024, ">= 1024"),
            ("route_stats_interval_s", self.route_stats_interval_s > 0, "> 0"),
            ("route_kv_high", 0 < self.route_kv_high <= 1, "in (0, 1]"),
            ("engine_liveness_timeout_s", self.engine_liveness_timeout_s > 0, "> 0"),
        ]
        for name, ok, limit in checks:
            if not ok:
                raise ValueError(f"{name} must be {limit}, got {getattr(self, name)}")

    def accepts_model(self, name: str | None) -> bool:
        return name is None or name in (self.model_id, os.path.basename(self.model_id.rstrip("/")))
