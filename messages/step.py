"""The hot path: Engine -> Scheduler -> Worker -> Scheduler -> Engine, one step at a time.

Token counts, for one request: `token_ids` = prompt + sampled tokens so far; the Worker has computed
KV for the first `num_computed` of them; a step computes the next `num_new_tokens`. A step samples
a token for a request exactly when it reaches the end of `token_ids` (a decode, or a prefill's last
chunk); a partial prefill chunk samples nothing.
"""

from __future__ import annotations

import msgspec

from .client import EngineStats
from .common import FinishReason, SamplingParams, TokenLogprobs


class AddRequest(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Engine -> Scheduler. `output_token_ids`: tokens already sent to the client (resumption).
    `client`: whom the request counts for in the Scheduler's fair share of seats (the Engine's
    client key: its sender's identity and tenant); requests of one client share one key."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = []
    priority: int = 0
    fork_of: str | None = None  # sample i > 0 of an n > 1 request: share sample 0's prompt KV
    client: str = ""


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class RequestOutput(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """`logprobs[i]` belongs to `token_ids[i]` (only for a request that asked for logprobs).
    `prompt_logprobs` (on the request's first output): one entry per prompt token, None for the
    first (nothing predicts it)."""

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (on the last output)
    logprobs: list[TokenLogprobs] = []
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class TokensOut(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Scheduler -> Engine after each step: new tokens and finishes (aborts included). `epoch`:
    the Scheduler's; the Engine drops those of another epoch than its last Recover's, so a stale
    message read after a recovery can never duplicate tokens."""

    epoch: int
    outputs: list[RequestOutput]


class NewRequest(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """A request the Worker has not seen (or has dropped after preemption), in full."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_new_tokens: int
    params: SamplingParams
    num_computed_tokens: int = 0


class RunningUpdate(msgspec.Struct, array_like=True, gc=False):
    """A request already in the Worker's persistent batch: only what changed."""

    request_id: str
    new_block_ids: list[int]
    num_new_tokens: int


class StepPlan(msgspec.Struct, tag=True, array_like=True, gc=False, omit_defaults=True):
    """Scheduler -> Worker. `removed` (finished, aborted, preempted) is applied before the rest."""

    epoch: int
    step_id: int
    removed: list[str]
    running: list[RunningUpdate]
    new: list[NewRequest]
    swap_out: list[tuple[int, int]] = []  # (gpu block, cpu block), copied before swap_in
    swap_in: list[tuple[int, int]] = []  # (cpu block, gpu block), copied before the forward
    copies: list[tuple[int, int]] = []  # (src, dst) device blocks, copied after the swaps


class PromptLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of prompt tokens `start .. start + len(entries) - 1` of one request (start >= 1),
    from one step's chunk of its prefill."""

    request_id: str
    start: int
    entries: list[TokenLogprobs]


class StepResult(msgspec.Struct, tag=True, array_like=True, gc=False, omit_defaults=True):
    """Worker -> Scheduler: `token_ids[i]` was sampled for `request_ids[i]`.

    `logprobs` is empty unless a sampled row asked for them; then `logprobs[i]` belongs to
    `token_ids[i]` (None for the rows that did not ask). `prompt_logprobs`: one chunk per request
    with `prompt_logprobs` whose prompt this step computed part of.
    """

    epoch: int
    step_id: int
    request_ids: list[str]
    token_ids: list[int]
    forward_s: float = 0.0
    error: str | None = None
    logprobs: list[TokenLogprobs | None] = []
    prompt_logprobs: list[PromptLogprobs] = []


class StatsQuery(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Engine -> Scheduler -> BlockManager; the BlockManager answers the Engine with StatsReply.

    Riding the same sockets as frees, the reply counts every free sent before the query.
    """

    query_id: str
    stats: EngineStats = msgspec.field(default_factory=EngineStats)


class StatsReply(msgspec.Struct, tag=True, array_like=True):
    query_id: str
    stats: EngineStats
