"""Prompt scoring on /v1/completions: `echo`, and `max_tokens: 0` (OpenAI's legacy semantics,
which lm-evaluation-harness's `local-completions` model relies on to score loglikelihoods).

- `echo`: each choice's text starts with the prompt's text. With `logprobs: N` its logprobs start
  with one entry per prompt token: the first token's logprob and top_logprobs are null (nothing
  predicts it), every other one has the token's logprob given the tokens before it, and its top
  N. The generated tokens' entries follow, their text_offset counted on from the prompt's.
- `max_tokens: 0`: no token is generated; each choice finishes with "length" and
  completion_tokens 0. The Engine samples at least one token per request, so the request runs
  with max_tokens 1 (and n 1: every choice is the same) and that token is dropped: what it costs
  is the prompt's prefill, which is the work of scoring it.

The Engine's prompt logprobs name every prompt token but the first, so a text prompt whose
logprobs are echoed is tokenized here, as the Engine would, and sent as token ids.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from ..messages.client import Delta
from ..messages.common import FinishReason, SamplingParams, TokenLogprobs, max_prompt_chars
from .openai_errors import invalid
from .openai_logprobs import CompletionLogprobs, TokenNames
from .openai_requests import CompletionRequest


def check_max_tokens(body: CompletionRequest) -> None:
    """max_tokens >= 0 on completions (0: score the prompt only), and no min_tokens then."""
    if body.max_tokens is not None and body.max_tokens < 0:
        raise invalid(f"max_tokens must be >= 0, got {body.max_tokens}", "max_tokens")
    if body.max_tokens == 0 and body.min_tokens:
        raise invalid(
            f"min_tokens must be 0 when max_tokens is 0, got {body.min_tokens}", "min_tokens"
        )


@dataclass
class PromptScoring:
    """How one completion request echoes and scores its prompt. `prompt_ids` is known when
    logprobs are echoed (the first token's name), `prompt_text` when the prompt is echoed."""

    echo: bool
    generate: bool  # False for max_tokens 0
    logprobs: int | None  # the request's top-N (None: no logprobs)
    prompt_logprobs: int | None  # vLLM's field, as the request asked for it
    n: int
    prompt: str | list[int]  # what goes to the Engine
    prompt_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""

    @property
    def echoes_logprobs(self) -> bool:
        return self.echo and self.logprobs is not None

    def engine_params(self, params: SamplingParams) -> SamplingParams:
        """The Engine's params: the prompt's logprobs where echoed (top N of the larger ask),
        and one sample of one token, its output unused, for max_tokens 0."""
        prompt_k = self.prompt_logprobs
        if self.echoes_logprobs:
            prompt_k = max(self.logprobs, prompt_k or 0)
        params = msgspec.structs.replace(params, prompt_logprobs=prompt_k)
        if self.generate:
            return params
        return msgspec.structs.replace(
            params, n=1, max_tokens=1, min_tokens=0, stop=[], logprobs=None
        )

    def sample(self, delta: Delta) -> Delta:
        """A delta as the client sees it: for max_tokens 0, without the token that was sampled
        (and finished "length" however the Engine ended it)."""
        if self.generate:
            return delta
        reason = None if delta.finish_reason is None else FinishReason.LENGTH
        if delta.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            reason = delta.finish_reason
        return msgspec.structs.replace(
            delta,
            text="",
            token_ids=[],
            finish_reason=reason,
            completion_tokens=0,
            logprobs=None,
        )

    def samples(self, samples: list[Delta]) -> list[Delta]:
        """A whole completion's samples, one per choice (max_tokens 0 ran only one)."""
        if self.generate:
            return samples
        only = self.sample(samples[0])
        return [msgspec.structs.replace(only, index=i) for i in range(self.n)]

    async def client_deltas(self, first: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
        """A streamed request's deltas as the client sees them (see `sample`): for max_tokens 0,
        one last delta per choice, carrying the prompt's logprobs."""
        prompt_entries = None
        try:
            async for delta in _chained(first, rest):
                if self.generate:
                    yield delta
                    continue
                prompt_entries = delta.prompt_logprobs or prompt_entries
                if delta.finished:
                    last = msgspec.structs.replace(
                        self.sample(delta), prompt_logprobs=prompt_entries
                    )
                    for i in range(self.n):
                        yield msgspec.structs.replace(last, index=i)
        finally:
            await rest.aclose()

    def echoed(
        self, prompt_entries: list[TokenLogprobs | None] | None, names: TokenNames
    ) -> Echoed:
        """The prompt's text and (when asked) its logprobs in OpenAI's legacy shape, and the
        text offset where the generated tokens' entries start."""
        if not self.echoes_logprobs:
            return self.prompt_text, None, 0
        out = CompletionLogprobs([], [], [], [])
        entries = list(prompt_entries or [])
        offset = 0
        for position, token_id in enumerate(self.prompt_ids):
            token = names(token_id)
            entry = entries[position] if position < len(entries) else None
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(entry.logprob)
            top = {names(t): lp for t, lp in entry.top[: self.logprobs]}
            top.setdefault(token, entry.logprob)
            out.top_logprobs.append(top)
        return self.prompt_text, out, offset

    def user_prompt_logprobs(self, entries: list[TokenLogprobs | None] | None):
        """vLLM's `prompt_logprobs` field as asked for: top k of that ask, not of echo's."""
        if not entries or self.prompt_logprobs is None:
            return entries
        k = self.prompt_logprobs
        return [None if e is None else msgspec.structs.replace(e, top=e.top[:k]) for e in entries]


Echoed = tuple[str, CompletionLogprobs | None, int]  # PromptScoring.echoed's


class StreamedEcho:
    """A streamed echo's progress: each choice's first chunk is its prompt, sent once the
    prompt's logprobs have come (with sample 0's first delta: where they are echoed, another
    choice's deltas wait for them)."""

    def __init__(self, scoring: PromptScoring | None, names: TokenNames):
        self.scoring = scoring if scoring is not None and scoring.echo else None
        self.names = names
        self.entries: list[TokenLogprobs | None] | None = None
        self.sent: set[int] = set()
        self.held: list[Delta] = []
        self.echo: Echoed | None = None  # the same for every choice: built once

    def take(self, delta: Delta) -> list[tuple[Delta, Echoed | None]]:
        """The deltas ready to go out, each with its choice's echo when that is due first."""
        if self.scoring is None:
            return [(delta, None)]
        self.entries = delta.prompt_logprobs or self.entries
        self.held.append(delta)
        if self.scoring.echoes_logprobs and self.entries is None:
            return []
        ready = []
        for held in self.held:
            echoed = None
            if held.index not in self.sent:
                self.sent.add(held.index)
                if self.echo is None:
                    self.echo = self.scoring.echoed(self.entries, self.names)
                echoed = self.echo
            ready.append((held, echoed))
        self.held = []
        return ready


async def _chained(first: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    yield first
    async for delta in rest:
        yield delta


def joined_logprobs(
    prompt: CompletionLogprobs | None, generated: CompletionLogprobs | None
) -> CompletionLogprobs | None:
    """The echoed prompt's entries, then the generated ones (either may be absent)."""
    if prompt is None or generated is None:
        return generated if prompt is None else prompt
    return CompletionLogprobs(
        prompt.tokens + generated.tokens,
        prompt.token_logprobs + generated.token_logprobs,
        prompt.top_logprobs + generated.top_logprobs,
        prompt.text_offset + generated.text_offset,
    )


async def plan(gateway, body: CompletionRequest, prompt: str | list[int]) -> PromptScoring | None:
    """`prompt`'s scoring (one of the request's prompts), None when the request asks for none
    (no echo, max_tokens > 0).
    A prompt needs tokenizing (or decoding, to echo its text) here: on a thread, as the chat
    template does, so a long prompt does not stall the event loop."""
    generate = body.max_tokens != 0
    if not body.echo and generate:
        return None
    scoring = PromptScoring(
        body.echo, generate, body.logprobs, body.prompt_logprobs, body.n, prompt
    )
    if not body.echo:
        return scoring
    tokenizer = gateway.chat.tokenizer
    if isinstance(prompt, list):
        scoring.prompt_ids = prompt
        scoring.prompt_text = await asyncio.to_thread(tokenizer.decode, prompt)
        return scoring
    scoring.prompt_text = prompt
    if scoring.echoes_logprobs:
        limit = max_prompt_chars(gateway.chat.longest_token_chars, gateway.settings.max_model_len)
        if len(prompt) > limit:
            raise invalid(
                f"prompt holds {len(prompt)} characters, more than max_model_len="
                f"{gateway.settings.max_model_len} tokens can hold with this tokenizer (at most "
                f"{limit} characters)",
                "prompt",
            )
        scoring.prompt_ids = await asyncio.to_thread(tokenizer.encode, prompt)
        scoring.prompt = scoring.prompt_ids
    return scoring
