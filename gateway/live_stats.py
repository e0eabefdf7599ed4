"""GET /v1/stats: the engine's load now and over the last minutes, for the playground's charts.

Each answer is one `LiveStats`: the newest `StatsSample` (requests running and waiting, KV cache
use, output tokens per second) and the samples of the last `stats_window_s`, oldest first. The
gateway takes a sample only when someone asks, at most once per `stats_interval_s` (callers within
one interval share it), so an idle server costs the Engine nothing and many open pages cost it
one round trip per interval. The history is therefore the history of what was watched: a page
opened after a quiet spell starts with the samples its predecessors took.

Output tokens per second is the change of the Engine's generation-token counter between two
samples over the time between them; the counter starting again (an Engine that was replaced)
reads as 0 for that interval, never negative.
"""

from __future__ import annotations

import collections
import time

import msgspec

from ..messages.client import EngineStats
from .health import RateLimited
from .replicas import ReplicaSet


class StatsSample(msgspec.Struct, kw_only=True):
    at: float  # Unix time of the sample, seconds
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # blocks in use / blocks in the pool, 0..1
    output_tokens_per_s: float  # since the sample before it; 0 for the first


class LiveStats(msgspec.Struct, kw_only=True):
    object: str = "stats"
    model: str
    window_s: float
    interval_s: float
    blocks_total: int
    blocks_free: int
    generation_tokens: int  # since the Engine started
    prompt_tokens: int
    num_preemptions: int
    now: StatsSample
    history: list[StatsSample]  # oldest first, `now` last


class StatsHistory:
    """The samples of the last `window_s`, and the engine counters they were computed from."""

    def __init__(self, client: ReplicaSet, model: str, interval_s: float, window_s: float):
        self.client = client
        self.model = model
        self.interval_s = interval_s
        self.window_s = window_s
        self.timeout_s = max(2.0, interval_s)
        # (monotonic time, sample, generation tokens at that time)
        self._samples: collections.deque[tuple[float, StatsSample, int]] = collections.deque()
        self._sampler = RateLimited(self._sample, interval_s)

    async def get(self) -> LiveStats:
        """Raises the SDK's EngineError when the Engine does not answer."""
        stats = await self._sampler.get()
        return LiveStats(
            model=self.model,
            window_s=self.window_s,
            interval_s=self.interval_s,
            blocks_total=stats.blocks_total,
            blocks_free=stats.blocks_free,
            generation_tokens=stats.generation_tokens,
            prompt_tokens=stats.prompt_tokens,
            num_preemptions=stats.num_preemptions,
            now=self._samples[-1][1],
            history=self.samples(),
        )

    def samples(self) -> list[StatsSample]:
        """The samples of the window, oldest first."""
        return [sample for _, sample, _ in self._samples]

    async def _sample(self) -> EngineStats:
        stats = (await self.client.health(self.timeout_s)).stats
        self.add(time.monotonic(), time.time(), stats)
        return stats

    def add(self, mono: float, wall: float, stats: EngineStats) -> StatsSample:
        """Record the Engine's stats as seen at `mono` (monotonic) / `wall` (Unix) time."""
        rate = 0.0
        if self._samples:
            last_mono, _, last_tokens = self._samples[-1]
            if mono > last_mono:
                rate = max(0, stats.generation_tokens - last_tokens) / (mono - last_mono)
        usage = stats.blocks_used / stats.blocks_total if stats.blocks_total else 0.0
        sample = StatsSample(
            at=round(wall, 3),
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_cache_usage=round(usage, 4),
            output_tokens_per_s=round(rate, 2),
        )
        self._samples.append((mono, sample, stats.generation_tokens))
        while mono - self._samples[0][0] > self.window_s:
            self._samples.popleft()
        return sample
