"""Client <-> Engine: what the SDK sends on its DEALER socket and what the Engine answers.

These are plain (map-encoded) msgpack Structs so clients in other languages can speak them.
"""

from __future__ import annotations

import msgspec

from .common import FinishReason, SamplingParams, TokenLogprobs
from .control import ActorStatus

MAX_TENANT_CHARS = 128  # GenerateRequest.tenant: the Engine refuses a longer one


class ResumedSample(msgspec.Struct, forbid_unknown_fields=True):
    """Sample `index` of a request, with the token ids its client has received so far."""

    index: int
    output_token_ids: list[int]


class GenerateRequest(msgspec.Struct, tag=True, forbid_unknown_fields=True, omit_defaults=True):
    """Exactly one of `prompt` (text, tokenized by the Engine) and `prompt_token_ids`.

    `resume` (the SDK's side of recovery from an Engine death): the samples of a request the
    client was receiving from an Engine that died, each with the tokens it received. The Engine
    continues each from there, as its own journal would after another actor's restart: same
    params (seeded draws keyed on the token's position, so the output is the fault-free one),
    the text and stop-string state rebuilt from those tokens, nothing sent twice. Samples not
    listed had finished; they are not run again.

    `tenant` (at most MAX_TENANT_CHARS): the client this request is on behalf of, when the sender
    serves several (the gateway names each API key or peer address). The Engine counts the
    request against the client (sender identity, tenant): its per-client limits and its fair
    share of the seats. A tenant is never trusted beyond its sender's connection: a sender that
    names many tenants is as many clients, as it would be opening as many sockets, and it
    cannot spend another sender's tenants' shares.
    """

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first; FCFS within a level
    resume: list[ResumedSample] | None = None
    tenant: str | None = None


class AbortRequest(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    request_id: str


class HealthRequest(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    request_id: str


class Ping(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """SDK liveness probe: which of these streams does the Engine still know? `seq` comes back
    in the Pong (the SDK numbers its pings: a Pong to a ping sent before a resumption says
    nothing of it)."""

    request_ids: list[str]
    seq: int = 0


class Pong(msgspec.Struct, tag=True):
    """`unknown`: ids of the Ping the Engine has no live request for (it restarted)."""

    unknown: list[str]
    draining: bool = False
    seq: int = 0  # the Ping's


class Delta(msgspec.Struct, tag=True, omit_defaults=True):
    """New text and token ids of one sample of a request; its last delta carries `finish_reason`.

    `text` holds only complete UTF-8 characters: bytes of a character split across tokens are held
    back until the character is whole, or until the sample finishes: then they come as U+FFFD,
    so a sample's text is `tokenizer.decode(token_ids, skip_special_tokens=True)`. With `n` > 1
    every delta names its sample by `index` (0 .. n-1) and the request ends when all n samples
    have finished; counts are per sample.
    `logprobs[i]` belongs to `token_ids[i]` when the request asked for logprobs.
    `prompt_logprobs` (first delta of sample 0): one entry per prompt token, None for the first.
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, found in the prefix cache (set on the last delta)
    index: int = 0
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def join(deltas: list[Delta]) -> Delta:
    """Consecutive deltas of one sample, in order, as one (cached_tokens, like the finish
    reason, only ever comes with a sample's last delta)."""
    last = deltas[-1]
    logprobs = [lp for d in deltas for lp in d.logprobs or ()]
    return Delta(
        last.request_id,
        "".join(d.text for d in deltas),
        [t for d in deltas for t in d.token_ids],
        last.finish_reason,
        last.prompt_tokens,
        last.completion_tokens,
        last.cached_tokens,
        last.index,
        logprobs if any(d.logprobs is not None for d in deltas) else None,
        next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None),
    )


class ErrorReply(msgspec.Struct, tag=True, omit_defaults=True):
    """A request the Engine refused or failed. `code` is machine-readable, `message` for people."""

    message: str
    # invalid_request | overloaded (the engine is full) | rate_limit_exceeded (the client holds
    # its limit: max_client_requests, max_client_output_tokens) | unavailable | internal
    code: str = "invalid_request"
    request_id: str | None = None


class StepCost(msgspec.Struct, omit_defaults=True):
    """How long a replica's steps take, fit to the steps it ran (actors/scheduler/step_cost.py):

        step seconds ~= step_s + prefill_token_s x prefill tokens + decode_row_s x decode rows

    where a request's row of one token in a step is a decode row and the tokens of longer rows
    are prefill tokens. `token_budget`: the most tokens one step computes
    (max_num_batched_tokens). `steps`: steps the fit has seen. The defaults are the prior, what a
    replica with no steps yet is taken to cost: 10 ms a step, 1 ms a token of either kind (only
    their ratios matter while no replica has measured its own)."""

    step_s: float = 0.01
    prefill_token_s: float = 0.001
    decode_row_s: float = 0.001
    token_budget: int = 2048
    steps: int = 0


class EngineStats(msgspec.Struct, omit_defaults=True):
    """The counters and gauges of one engine (every field a count but `step_cost`)."""

    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_partial_prefills: int = 0  # steps that computed part of a prompt, not all of it
    num_overlapped_steps: int = 0  # steps planned while the step before them still ran
    num_block_round_trips: int = 0  # steps that asked the BlockManager (others fit held blocks)
    num_swaps: int = 0  # preemptions that moved KV to CPU instead of dropping it
    num_recomputed_tokens: int = 0  # computed KV that recompute preemptions threw away
    num_forks: int = 0  # samples i > 0 of n > 1 requests that shared sample 0's prompt blocks
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    blocks_total: int = 0
    blocks_free: int = 0
    # prompt tokens of the running and waiting requests not computed yet (the prefill queue)
    prefill_tokens_queued: int = 0
    step_cost: StepCost | None = None  # None: an engine that does not measure its steps

    @property
    def blocks_used(self) -> int:
        return self.blocks_total - self.blocks_free


class HealthReply(msgspec.Struct, tag=True, omit_defaults=True):
    request_id: str
    ok: bool
    stats: EngineStats = msgspec.field(default_factory=EngineStats)
    actors: list[ActorStatus] = []


class DeltaBatch(msgspec.Struct, tag=True):
    """Several requests' deltas of one step for the same client, in one message (a client with
    many streams would otherwise receive one message per stream per step)."""

    deltas: list[Delta]


ClientToEngine = GenerateRequest | AbortRequest | HealthRequest | Ping
EngineToClient = Delta | DeltaBatch | ErrorReply | HealthReply | Pong
