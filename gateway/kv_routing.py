"""Routing on what each replica's prefix cache holds against how busy it is (`route_policy`
kv_events): the replica where a request is predicted to add the least latency, its own first
token first. Pure.

A request's chain (`prompt_block_hashes`) is the one the BlockManager looks up for it:
actors/runtime/block_hash.py's hashes of its full blocks from its cache salt's root, leaving at
least one prompt token to compute (block_pool.py `_lookup`), at most `max_blocks` of them. Each
replica whose index is usable (kv_index.py) holds the first `cached[i]` of them.

The time to a request's first token on replica i (`predicted_ttft`), in its own step costs
(messages/client.py StepCost: a step's seconds ~= step_s + prefill_token_s x prefill tokens +
decode_row_s x decode rows, fit by the replica to the steps it ran):

    tokens = queued prefill tokens there + this prompt's tokens not cached there
    step   = step_s + decodes x decode_row_s            (a step of its running decodes)
    steps  = ceil(tokens / (token budget - decodes))   (at least one)
    ahead  = steps_ahead if it has running decodes, else 0
    ttft   = tokens x prefill_token_s + (ahead + steps) x step

The prefill queued ahead of it and its own, then every step that takes also runs the replica's
running decodes (each a row of every step); and a replica that is decoding first finishes the
steps already under way (`steps_ahead`, `route_kv_steps_ahead`: about half of the one running
and the one planned after it, as the Scheduler plans a step while the one before it runs). A
cached block is block_size tokens not computed: the cache's worth is priced in the same seconds
as the load's, and is worth most where a prefill token is dear. Requests that wait for a seat
(max_num_seqs) are not counted.

A replica that has not measured its steps yet (no stats, or none run) is priced like the mean of
those that have; while none has, every one by the prior (StepCost's defaults), so the first
requests spread on the load counts alone. Replicas whose costs differ by at most `tie` (a
fraction, `route_kv_tie`: on this prompt computed on an idle replica) are taken to be alike, the
difference noise in their measures, and are all priced at their mean: their predictions then
differ by their work alone. Replicas that differ more (another kind of machine) are each priced
by its own. Equal predictions go to prefix affinity's pick (`affine`) when it is one of them, so
that a prefix seen nowhere starts on one replica; else the least predicted takes the request.

The request's first token is not all it costs a replica (`added_latency`, what the gateway
routes on): its rows then share `out_tokens - 1` decode steps with the rows decoding there
(`Decoding`), each of its steps slowed by theirs and each of theirs by its. Priced by its first
token alone, a request goes where its prompt is cached however many rows decode there, and each
hot prefix stays on the replica that first computed it while another replica idles, its steps
short, for the requests that arrive next. Priced by its own latency to its last token and the
seconds its rows add to the steps of the rows beside it, a cached prefix wins while the loads
are close and loses to a replica decoding fewer rows once the slower steps outweigh the
prefill it saves:

    shared = row-steps the rows there decode beside its out_tokens - 1 steps
             (each known row: min(its tokens left, out_tokens - 1); another gateway's: all)
    added  = ttft + (out_tokens - 1) x (step_s + rows x decode_row_s) + shared x decode_row_s
                  + rows x shared x decode_row_s

Not priced: the step its prefill stalls for the rows decoding there (a one-off in their
inter-token latency, which also buys a second replica holding the prefix for the requests that
share it next).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from ..actors.runtime.block_hash import chain_hashes, chain_root
from ..messages.client import StepCost
from .kv_index import ReplicaIndex

EQUAL = 1e-9  # predictions this close (relative) are equal: float sums of the same terms


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None, max_blocks: int
) -> list[bytes]:
    """The hashes of the prompt's blocks a replica's prefix cache could serve."""
    count = min(max(0, len(token_ids) - 1) // block_size, max_blocks)
    if count == 0:
        return []
    tokens = token_ids[: count * block_size]
    return list(chain_hashes(chain_root(cache_salt), tokens, block_size))


def predicted_ttft(
    cost: StepCost, queued_prefill: int, uncached: int, decodes: int, steps_ahead: float = 0.0
) -> float:
    """Seconds to the first token of a request with `uncached` prompt tokens to compute, behind
    `queued_prefill` tokens, beside `decodes` running decodes (the module's docstring)."""
    tokens = queued_prefill + uncached
    step = cost.step_s + decodes * cost.decode_row_s
    steps = max(1, -(-tokens // max(1, cost.token_budget - decodes)))
    ahead = steps_ahead if decodes > 0 else 0.0
    return tokens * cost.prefill_token_s + (ahead + steps) * step


class Decoding(msgspec.Struct, frozen=True):
    """The decode rows a request would share its steps with on a replica: `tokens_left` of each
    row of this gateway's requests there (max_tokens less the tokens streamed, one entry a
    sample; those still waiting for their first token included), and `unknown` rows (other
    gateways' requests, counted from the replica's stats) taken to outlast it."""

    tokens_left: tuple[int, ...] = ()
    unknown: int = 0

    def shared_steps(self, steps: int) -> int:
        """Row-steps these rows decode beside a request's `steps` decode steps."""
        return sum(min(left, steps) for left in self.tokens_left) + self.unknown * steps


def added_latency(
    cost: StepCost,
    queued_prefill: int,
    uncached: int,
    decodes: int,
    decoding: Decoding,
    out_tokens: int,
    rows: int = 1,
    steps_ahead: float = 0.0,
) -> float:
    """Seconds a request of `rows` samples of up to `out_tokens` tokens is predicted to take to
    its last token on a replica, and to add to the steps of the rows decoding beside it (the
    module's docstring)."""
    steps = max(0, out_tokens - 1)
    shared = decoding.shared_steps(steps)
    own = steps * (cost.step_s + rows * cost.decode_row_s) + shared * cost.decode_row_s
    others = rows * shared * cost.decode_row_s
    return predicted_ttft(cost, queued_prefill, uncached, decodes, steps_ahead) + own + others


def priced(costs: Sequence[StepCost | None]) -> list[StepCost]:
    """Each replica's step costs: its own where measured, else the mean of the measured ones,
    else the prior."""
    measured = [c for c in costs if c is not None and c.steps > 0]
    if not measured:
        return [StepCost()] * len(costs)
    mean = _mean(measured)
    return [c if c is not None and c.steps > 0 else mean for c in costs]


def _mean(costs: Sequence[StepCost]) -> StepCost:
    n = len(costs)
    return StepCost(
        step_s=sum(c.step_s for c in costs) / n,
        prefill_token_s=sum(c.prefill_token_s for c in costs) / n,
        decode_row_s=sum(c.decode_row_s for c in costs) / n,
        token_budget=round(sum(c.token_budget for c in costs) / n),
        steps=min(c.steps for c in costs),
    )


def choose_by_latency(
    uncached: Sequence[int],
    prefill_tokens: Sequence[int],
    decodes: Sequence[int],
    costs: Sequence[StepCost | None],
    usable: Sequence[bool],
    tie: float = 0.0,
    affine: int | None = None,
    kv_use: Sequence[float] | None = None,
    kv_high: float = 1.0,
    steps_ahead: float = 0.0,
    loads: Sequence[int] | None = None,
    load_margin: int | None = None,
    decoding: Sequence[Decoding] | None = None,
    out_tokens: int = 1,
    rows: int = 1,
) -> int | None:
    """The replica (index) with the least predicted latency: the seconds a request of `rows`
    samples of up to `out_tokens` tokens adds to all latencies there (`added_latency`) beside
    `decoding[i]`, or its time to the first token alone where `decoding` is None; None when
    none is usable. `uncached[i]`: the prompt's tokens replica i would compute; `prefill_tokens[i]`,
    `decodes[i]`: its queue; `costs[i]`: its step costs (None: not measured); `tie`,
    `steps_ahead`: the module's docstring. The candidates:
    the usable replicas with KV use at most `kv_high`, or all usable ones when none is (as
    choose_replica's), less those whose load (`loads[i]`, requests in flight) exceeds the least
    candidate's by more than `load_margin` (None: no bound): the prediction prices one
    request's wait, not the waits it adds to the others', so without a bound the replica that
    holds a hot prefix takes its requests while another one idles. Equal predictions go to
    `affine` when it is one of them."""
    usable_ones = [i for i, ok in enumerate(usable) if ok]
    if not usable_ones:
        return None
    roomy = [i for i in usable_ones if kv_use is None or kv_use[i] <= kv_high]
    candidates = roomy or usable_ones
    if loads is not None and load_margin is not None:
        least_load = min(loads[i] for i in candidates)
        candidates = [i for i in candidates if loads[i] - least_load <= load_margin]
    prices = priced(costs)
    if alike([prices[i] for i in candidates], max(uncached[i] for i in candidates), tie):
        mean = _mean([prices[i] for i in candidates])
        prices = [mean] * len(prices)
    decoding = decoding or [Decoding()] * len(uncached)  # its first token alone (out_tokens 1)
    latency = {
        i: added_latency(
            prices[i],
            prefill_tokens[i],
            uncached[i],
            decodes[i],
            decoding[i],
            out_tokens,
            rows,
            steps_ahead,
        )
        for i in candidates
    }
    least = min(candidates, key=lambda i: (latency[i], i))
    if affine in latency and latency[affine] <= latency[least] * (1.0 + EQUAL):
        return affine
    return least


def alike(costs: Sequence[StepCost], prompt_tokens: int, tie: float) -> bool:
    """Whether the replicas' costs differ by at most `tie` (a fraction) on a prompt of
    `prompt_tokens` tokens computed on an idle replica: then the difference is taken for noise
    in their measures."""
    idle = [predicted_ttft(cost, 0, prompt_tokens, 0) for cost in costs]
    return max(idle) <= min(idle) * (1.0 + tie)


class KvRouter:
    """The indexes of the replicas (by position) and the policy's settings: `choose` routes on
    them while every usable replica's index is (`ready`), else the caller falls back to prefix
    affinity. Counts both, for the metrics."""

    def __init__(
        self,
        indexes: list[ReplicaIndex],
        block_size: int,
        max_blocks: int,
        assume_s: float,
        tie: float = 0.0,
        steps_ahead: float = 0.0,
        load_margin: int | None = None,
    ):
        self.indexes = indexes
        self.load_margin = load_margin
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.assume_s = assume_s
        self.tie = tie
        self.steps_ahead = steps_ahead
        self.by_cache = 0  # requests routed on the indexes
        self.fallbacks = 0  # requests routed by prefix affinity, an index not usable

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> list[bytes]:
        return prompt_block_hashes(token_ids, self.block_size, cache_salt, self.max_blocks)

    def ready(self, usable: Sequence[bool]) -> bool:
        ready = all(index.usable for index, ok in zip(self.indexes, usable, strict=True) if ok)
        if ready:
            self.by_cache += 1
        else:
            self.fallbacks += 1
        return ready

    def uncached(self, replica: int, hashes: Sequence[bytes], num_tokens: int) -> int:
        """The prompt's tokens (`num_tokens` of them) `replica` would compute: those past the
        blocks of its chain the replica holds (at least one, as the BlockManager leaves)."""
        cached = self.indexes[replica].cached_prefix_blocks(hashes)
        return max(1, num_tokens - cached * self.block_size)

    def choose(
        self,
        hashes: Sequence[bytes],
        num_tokens: int,
        usable: Sequence[bool],
        prefill_tokens: Sequence[int],
        decodes: Sequence[int],
        costs: Sequence[StepCost | None],
        affine: int | None,
        kv_use: Sequence[float] | None = None,
        kv_high: float = 1.0,
        loads: Sequence[int] | None = None,
        decoding: Sequence[Decoding] | None = None,
        out_tokens: int = 1,
        rows: int = 1,
    ) -> int | None:
        uncached = [self.uncached(i, hashes, num_tokens) for i in range(len(self.indexes))]
        return choose_by_latency(
            uncached,
            prefill_tokens,
            decodes,
            costs,
            usable,
            self.tie,
            affine,
            kv_use,
            kv_high,
            self.steps_ahead,
            loads,
            self.load_margin,
            decoding,
            out_tokens,
            rows,
        )

    def routed(self, replica: int, hashes: Sequence[bytes]) -> None:
        """A request with this chain went to `replica`: assume its blocks there for a while."""
        self.indexes[replica].assume(hashes, self.assume_s)
