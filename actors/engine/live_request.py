"""The Engine's journal entry of one live request: what it re-submits after a crash, and how each
of the Scheduler's outputs for it becomes the client's Delta (detokenized, stop strings cut).

Parallel samples: a GenerateRequest with n > 1 becomes n entries `{id}#{i}` (seeds seed + i when
seeded, so the samples differ and are reproducible); sample i > 0 forks sample 0's prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from ...messages.client import Delta, GenerateRequest
from ...messages.common import FinishReason, SamplingParams
from ...messages.step import AddRequest, RequestOutput
from .detokenizer import Detokenizer, incremental_detokenizer
from .stop_strings import StopStrings


def key(identity: bytes, request_id: str) -> str:
    """A client's request id as the engine knows it: unique across clients."""
    return f"{identity.hex()}/{request_id}"


@dataclass
class LiveRequest:
    """A journal entry: enough to re-submit the request with nothing lost."""

    identity: bytes
    request: AddRequest  # request_id: key(identity, client_id), + "#i" for sample i of n > 1
    detokenizer: Detokenizer
    stop_strings: StopStrings | None = None
    output_token_ids: list[int] = field(default_factory=list)
    client_id: str = ""  # the id the client knows (deltas carry it)
    index: int = 0  # which of the client's n samples
    group_id: str | None = None  # the engine id of its n > 1 request (a key of Engine.groups)

    def stream(self, output: RequestOutput) -> Delta:
        """Journal `output`'s tokens and turn them into the client's Delta. Its finish_reason is
        STOP where a stop string matched, even before the Scheduler finished the request (then
        the caller aborts it there); a stop string wins over the length limit of one token.
        At the finish, bytes of an unfinished character come out as U+FFFD (as decode does)."""
        first = not self.output_token_ids
        self.output_token_ids.extend(output.token_ids)
        text = self.detokenizer.add(output.token_ids) if output.token_ids else ""
        reason = output.finish_reason
        if reason is not None:  # the sample's text is decode(output ids): nothing held back
            text += self.detokenizer.finish()
        if self.stop_strings is not None:
            text, matched = self.stop_strings.feed(text, final=reason is not None)
            if matched:
                reason = FinishReason.STOP
        delta = self.delta(text, output.token_ids, reason)
        delta.cached_tokens = output.cached_tokens
        if output.logprobs:
            delta.logprobs = output.logprobs
        if first and output.prompt_logprobs is not None:
            delta.prompt_logprobs = output.prompt_logprobs
        return delta

    def delta(self, text: str, token_ids: list[int], reason: FinishReason | None) -> Delta:
        return Delta(
            self.client_id,
            text,
            token_ids,
            reason,
            len(self.request.prompt_token_ids),
            len(self.output_token_ids),
            index=self.index,
        )


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of an n > 1 request: n = 1, seed + index, and only sample 0 computes the
    prompt logprobs (the others may then share the prompt's blocks)."""
    seed = None if params.seed is None else (params.seed + index) % 2**63
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return msgspec.structs.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def journal_entries(
    identity: bytes, message: GenerateRequest, prompt_ids: list[int], tokenizer, client: str
) -> list[LiveRequest]:
    """The entries of a client's request: one per sample it asks for (those it resumes, for a
    resumption), each with the tokens the client has already and its detokenizer caught up.
    `client`: the key it counts for (client_shares.client_key)."""
    eid = key(identity, message.request_id)
    params, n = message.params, message.params.n
    if n == 1:
        children = [(eid, 0, params)]
    else:
        children = [(f"{eid}#{i}", i, child_params(params, i)) for i in range(n)]
    resumed = {s.index: s.output_token_ids for s in message.resume or ()}
    if message.resume is not None:
        children = [child for child in children if child[1] in resumed]
    entries = []
    for cid, index, child in children:
        outputs = list(resumed.get(index, ()))
        fork_of = children[0][0] if index and message.resume is None else None
        if outputs:
            child = msgspec.structs.replace(child, prompt_logprobs=None)  # sent already
        request = AddRequest(cid, prompt_ids, child, outputs, message.priority, fork_of, client)
        live = LiveRequest(
            identity,
            request,
            incremental_detokenizer(tokenizer, prompt_ids),
            StopStrings(child.stop, child.include_stop_str_in_output) if child.stop else None,
            outputs,
            message.request_id,
            index,
            eid if n > 1 else None,
        )
        if outputs:  # rebuild what the client has: its text was this text, held back alike
            text = live.detokenizer.add(outputs)
            if live.stop_strings is not None:
                live.stop_strings.feed(text, final=False)
        entries.append(live)
    return entries
