"""POST /v1/completions: one prompt, or a batch of them (OpenAI's list `prompt`).

Each prompt of a batch is its own request in the Engine (its own id, `cmpl-...-{i}`), and they
are answered as one completion: choice `index` is `prompt_index * n + sample_index`, as OpenAI
numbers them, streamed chunks included (the prompts' chunks interleave, each naming its index);
`usage` sums the prompts' tokens. The batch runs together or not at all (prompt_batch.py): it is
refused before any prompt starts when it could not be admitted whole (Gateway.check_batch), one
prompt's error fails the call, naming the prompt (`prompt[3]: ...`), and a client that leaves
aborts every prompt. Echo, logprobs and `max_tokens: 0` scoring work per prompt
(prompt_scoring.py): what lm-evaluation-harness sends with batch_size > 1.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..messages.client import Delta
from ..messages.common import SamplingParams
from . import prompt_scoring
from .openai_errors import APIError
from .openai_logprobs import completion_logprobs, prompt_logprobs
from .openai_requests import CompletionRequest
from .openai_responses import (
    Completion,
    CompletionChoice,
    CompletionChoiceWithPrompt,
    Usage,
    finish_reason,
    now,
)
from .openai_routes import (
    SSE_DONE,
    SSE_HEADERS,
    check_model,
    collect,
    json_response,
    primed,
    read_body,
    running_usage,
    sse,
    until_disconnect,
)
from .prompt_batch import all_or_none, in_batch, merged
from .service import Gateway


@dataclass
class PromptRun:
    """One prompt of the request: its Engine request and how its choices are rendered."""

    index: int  # its place in the batch
    count: int  # prompts in the batch
    body: CompletionRequest
    scoring: prompt_scoring.PromptScoring | None
    params: SamplingParams
    deltas: AsyncIterator[Delta]
    offsets: list[int] = field(default_factory=list)  # each sample's logprobs text offset

    def choice_index(self, sample: int) -> int:
        return self.index * self.body.n + sample

    def failed(self, exc: APIError) -> APIError:
        return in_batch(exc, self.index, self.count)

    async def samples(self) -> list[Delta]:
        """The whole completion's samples, as the client sees them."""
        try:
            samples = await collect(self.deltas, self.params.n)
        except APIError as exc:
            raise self.failed(exc) from None
        return samples if self.scoring is None else self.scoring.samples(samples)

    async def primed(self) -> tuple[Delta, AsyncIterator[Delta]]:
        """The first delta as the client sees it (errors surface before any byte goes out)."""
        try:
            first, rest = await primed(self.deltas)
            if self.scoring is not None:
                rest = self.scoring.client_deltas(first, rest)
                first = await rest.__anext__()
        except APIError as exc:
            raise self.failed(exc) from None
        return first, rest


async def start(
    gateway: Gateway, body: CompletionRequest, prompts, rid: str, client: str
) -> list[PromptRun]:
    """Each prompt's scoring plan, params and (not yet started) Engine request, once the batch
    is known to fit (Gateway.check_batch). `client`: whom they count for."""
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    base = body.sampling_params(max_tokens or 1, body.logprobs)
    gateway.check_batch(len(prompts), client, base)
    runs = []
    for index, prompt in enumerate(prompts):
        try:
            scoring = await prompt_scoring.plan(gateway, body, prompt)  # echo, max_tokens 0
        except APIError as exc:
            raise in_batch(exc, index, len(prompts)) from None
        params = base
        if scoring is not None:
            prompt, params = scoring.prompt, scoring.engine_params(base)
        request_id = rid if len(prompts) == 1 else f"{rid}-{index}"
        deltas = gateway.generate(
            prompt, params, request_id, priority=body.priority,
            structured_param=body.structured_param, client=client,
        )  # fmt: skip
        runs.append(PromptRun(index, len(prompts), body, scoring, params, deltas, [0] * body.n))
    return runs


async def completions(request: Request, gateway: Gateway) -> Response:
    body = await read_body(request, CompletionRequest, gateway.settings)
    body.check()
    check_model(gateway, body.model)
    prompt_scoring.check_max_tokens(body)
    prompts = body.prompt_inputs()
    rid = f"cmpl-{uuid.uuid4().hex}"
    runs = await start(
        gateway, body, prompts, rid, gateway.client_of(request.headers, request.client)
    )
    if not body.stream:
        results = await until_disconnect(request, all_or_none([r.samples() for r in runs]))
        choices = [c for r, samples in zip(runs, results) for c in choices_of(r, samples, gateway)]
        usage = Usage.of(
            sum(samples[0].prompt_tokens for samples in results),
            sum(s.completion_tokens for samples in results for s in samples),
        )
        model = gateway.settings.model_id
        return json_response(Completion(rid, choices, now(), model, usage=usage))
    try:
        heads = await until_disconnect(request, all_or_none([r.primed() for r in runs]))
    except BaseException:  # the prompts primed before another failed wait at their first delta
        for run in runs:
            await run.deltas.aclose()
        raise
    return streamed(gateway, body, runs, heads, rid)


def choices_of(run: PromptRun, samples: list[Delta], gateway: Gateway) -> list[CompletionChoice]:
    """One prompt's choices of a whole completion."""
    body, scoring, names = run.body, run.scoring, gateway.token_names
    entries = samples[0].prompt_logprobs  # sample 0 carries them; every choice repeats them
    prompt_lps = None
    if body.prompt_logprobs is not None:
        user_entries = entries if scoring is None else scoring.user_prompt_logprobs(entries)
        prompt_lps = prompt_logprobs(user_entries or [], names)
    echo_text, echo_lps, offset = "", None, 0
    if scoring is not None and scoring.echo:
        echo_text, echo_lps, offset = scoring.echoed(entries, names)
    choices = []
    for i, sample in enumerate(samples):
        logprobs = None
        if body.logprobs is not None:
            generated = completion_logprobs(sample.logprobs or [], names, offset)[0]
            logprobs = prompt_scoring.joined_logprobs(echo_lps, generated)
        index, text = run.choice_index(i), echo_text + sample.text
        reason = finish_reason(sample.finish_reason)
        if prompt_lps is None:
            choices.append(CompletionChoice(index, text, logprobs, reason))
        else:
            choices.append(CompletionChoiceWithPrompt(index, text, logprobs, reason, prompt_lps))
    return choices


def streamed(gateway: Gateway, body, runs: list[PromptRun], heads, rid: str) -> StreamingResponse:
    """The prompts' chunks as SSE, as they come; an error event if one fails midway (the others
    are aborted), then the usage chunk (when asked for and every choice finished) and [DONE]."""
    model, created, names = gateway.settings.model_id, now(), gateway.token_names
    echoes = [prompt_scoring.StreamedEcho(run.scoring, names) for run in runs]

    def chunk(choice: CompletionChoice, usage: Usage | None = None) -> bytes:
        return sse(Completion(rid, [choice], created, model, usage=usage))

    def render_generated(run: PromptRun, delta: Delta) -> list[bytes]:
        if not delta.text and not delta.finished and not delta.logprobs:
            return []
        logprobs = None
        if body.logprobs is not None:
            logprobs, run.offsets[delta.index] = completion_logprobs(
                delta.logprobs or [], names, run.offsets[delta.index]
            )
        index, reason = run.choice_index(delta.index), finish_reason(delta.finish_reason)
        choice = CompletionChoice(index, delta.text, logprobs, reason)
        return [chunk(choice, running_usage(body, delta))]

    def render(run: PromptRun, delta: Delta) -> list[bytes]:
        events = []
        for ready, echoed in echoes[run.index].take(delta):
            if echoed is not None:  # the choice's first chunk: its prompt
                text, logprobs, run.offsets[ready.index] = echoed
                index = run.choice_index(ready.index)
                events.append(chunk(CompletionChoice(index, text, logprobs)))
            events += render_generated(run, ready)
        return events

    async def events() -> AsyncIterator[bytes]:
        lasts: dict[int, Delta] = {}  # by choice index
        streams = [chained(first, rest) for first, rest in heads]
        try:
            async for i, delta in merged(streams):
                if delta.finished:
                    lasts[runs[i].choice_index(delta.index)] = delta
                for event in render(runs[i], delta):
                    yield event
        except APIError as exc:
            yield sse(exc.body())
        finally:  # a stream merged never started is closed here
            for _, rest in heads:
                await rest.aclose()
        if body.include_usage and len(lasts) == len(runs) * body.n:
            prompt_tokens = sum(lasts[run.choice_index(0)].prompt_tokens for run in runs)
            usage = Usage.of(prompt_tokens, sum(d.completion_tokens for d in lasts.values()))
            yield sse(Completion(rid, [], created, model, usage=usage))
        yield SSE_DONE

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


async def chained(first: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """`first`, then the rest (iterated to its end, so the request's metrics get recorded)."""
    try:
        yield first
        async for delta in rest:
            yield delta
    finally:
        await rest.aclose()
