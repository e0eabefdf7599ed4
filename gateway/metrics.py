"""Prometheus metrics: the Engine's counters (refreshed on each scrape), the gateway's latencies.

Engine side, from `AsyncClient.health()`: requests running and waiting, KV blocks, preemptions,
prompt and generation tokens. Gateway side, observed per request: time to first token, time per
output token, end-to-end latency, finished requests by reason; and read at each scrape: its
requests in flight and open connections. With route_policy kv_events, per replica: its KV
event index's lag (now minus the publisher's clock on the newest message), blocks, whether it is
in step, and its resyncs. Each app has its own registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector

from ..messages.client import EngineStats, StepCost

PREFIX = "actorserve_"
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)


class _EngineCollector(Collector):
    """Yields the last engine stats snapshot; `Metrics.refresh` replaces it before each scrape."""

    def __init__(self, model: str):
        self.model = model
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        label = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=label)
            family.add_metric([self.model], value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=label)
            family.add_metric([self.model], value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_blocks_total", "KV cache blocks in the pool.", s.blocks_total)
        yield gauge("kv_cache_blocks_free", "KV cache blocks free.", s.blocks_free)
        usage = s.blocks_used / s.blocks_total if s.blocks_total else 0.0
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", usage)
        yield counter(
            "num_preemptions", "Requests preempted for lack of KV blocks.", s.num_preemptions
        )
        yield counter("prompt_tokens", "Prompt tokens computed (prefill).", s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens)


class ReplicaReading(NamedTuple):
    index: int
    routed: int
    in_flight: int
    up: bool
    step_cost: StepCost | None = None  # its last measured step costs (kv_events routes on them)


class _ReplicaCollector(Collector):
    """Per data-parallel replica (label replica="0", ...): requests this gateway routed there
    (resumptions after a failover too), its requests in flight there, whether it is up, and its
    measured step costs once it reported them (label term: step, prefill_token, decode_row)."""

    def __init__(self, model: str, read: Callable[[], Iterable[ReplicaReading]]):
        self.model = model
        self.read = read

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "replica"]
        routed = CounterMetricFamily(
            PREFIX + "replica_requests_routed", "Requests sent to the replica.", labels=labels
        )
        in_flight = GaugeMetricFamily(
            PREFIX + "replica_requests_in_flight", "Requests there, not ended.", labels=labels
        )
        up = GaugeMetricFamily(
            PREFIX + "replica_up", "1 while the replica takes new requests.", labels=labels
        )
        cost = GaugeMetricFamily(
            PREFIX + "replica_step_cost_seconds",
            "The replica's fit of its step time: a step, a prefill token, a decode row.",
            labels=[*labels, "term"],
        )
        for index, sent, live, is_up, step_cost in self.read():
            routed.add_metric([self.model, str(index)], sent)
            in_flight.add_metric([self.model, str(index)], live)
            up.add_metric([self.model, str(index)], float(is_up))
            if step_cost is not None:
                for term, seconds in (
                    ("step", step_cost.step_s),
                    ("prefill_token", step_cost.prefill_token_s),
                    ("decode_row", step_cost.decode_row_s),
                ):
                    cost.add_metric([self.model, str(index), term], seconds)
        yield from (routed, in_flight, up, cost)


class KvIndexReading(NamedTuple):
    replica: int
    blocks: int
    usable: bool
    newest_ts: float | None  # wall clock (time.time()) of the newest event; None: none yet
    resyncs: int


class _KvIndexCollector(Collector):
    """Per replica, its KV event index (gateway/kv_index.py), read at each scrape; and the
    requests routed on the indexes, or by prefix affinity while one was not in step."""

    def __init__(self, model: str, read: Callable[[], Iterable[KvIndexReading]], routed):
        self.model = model
        self.read = read
        self.routed = routed  # -> (routed on the indexes, fallbacks)

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "replica"]
        lag = GaugeMetricFamily(
            PREFIX + "replica_kv_index_lag_seconds",
            "Now minus the timestamp of the newest KV event from the replica (grows while it "
            "publishes nothing: an idle cache).",
            labels=labels,
        )
        blocks = GaugeMetricFamily(
            PREFIX + "replica_kv_index_blocks", "Block hashes the index holds.", labels=labels
        )
        usable = GaugeMetricFamily(
            PREFIX + "replica_kv_index_usable",
            "1 while the index is in step with the replica's events and whole.",
            labels=labels,
        )
        resyncs = CounterMetricFamily(
            PREFIX + "replica_kv_index_resyncs",
            "Times the index missed events and was cleared.",
            labels=labels,
        )
        now = time.time()
        for reading in self.read():
            label = [self.model, str(reading.replica)]
            if reading.newest_ts is not None:
                lag.add_metric(label, max(0.0, now - reading.newest_ts))
            blocks.add_metric(label, reading.blocks)
            usable.add_metric(label, float(reading.usable))
            resyncs.add_metric(label, reading.resyncs)
        by_cache, fallbacks = self.routed()
        routed = CounterMetricFamily(
            PREFIX + "gateway_kv_routed",
            "Requests routed on the replicas' KV event indexes (kv_events), or by prefix "
            "affinity while an index was not in step (way=fallback).",
            labels=["model_name", "way"],
        )
        routed.add_metric([self.model, "kv_events"], by_cache)
        routed.add_metric([self.model, "fallback"], fallbacks)
        yield from (lag, blocks, usable, resyncs, routed)


class Metrics:
    def __init__(self, model: str):
        self.model = model
        self.registry = CollectorRegistry()
        self.engine = _EngineCollector(model)
        self.registry.register(self.engine)
        label = ["model_name"]
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from request arrival to its first token (streamed requests).",
            label,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time between output tokens after the first, per streamed request.",
            label,
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            label,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self._success = Counter(
            PREFIX + "request_success",
            "Requests finished, by reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._http_errors = Counter(
            PREFIX + "request_errors",
            "Requests refused or failed, by HTTP status.",
            ["model_name", "status"],
            registry=self.registry,
        )

    def observe(
        self, arrival: float, first: float | None, end: float, num_tokens: int, reason: str
    ) -> None:
        """Record one finished request (perf_counter times)."""
        if first is not None:
            self.ttft.observe(first - arrival)
            if num_tokens > 1:
                self.tpot.observe((end - first) / (num_tokens - 1))
        self.e2e.observe(end - arrival)
        self._success.labels(self.model, reason).inc()

    def watch(self, in_flight: Callable[[], float], connections: Callable[[], float]) -> None:
        """Gauges read at each scrape: the gateway's requests in flight, its open connections."""
        for name, doc, read in (
            ("gateway_requests_in_flight", "Requests admitted, not ended.", in_flight),
            ("gateway_connections", "Open HTTP and WebSocket connections.", connections),
        ):
            gauge = Gauge(PREFIX + name, doc, ["model_name"], registry=self.registry)
            gauge.labels(self.model).set_function(read)

    def watch_replicas(self, read: Callable[[], Iterable[ReplicaReading]]) -> None:
        """The per-replica metrics, from `read()` at each scrape (_ReplicaCollector)."""
        self.registry.register(_ReplicaCollector(self.model, read))

    def watch_kv_indexes(
        self, read: Callable[[], Iterable[KvIndexReading]], routed: Callable[[], tuple[int, int]]
    ) -> None:
        """The per-replica KV event index metrics (_KvIndexCollector)."""
        self.registry.register(_KvIndexCollector(self.model, read, routed))

    def error(self, status: int) -> None:
        self._http_errors.labels(self.model, str(status)).inc()

    def refresh(self, stats: EngineStats | None) -> None:
        self.engine.stats = stats

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
