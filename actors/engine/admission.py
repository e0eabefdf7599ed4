"""What the Engine checks of a GenerateRequest before it journals it: each error names the field
and its limit (the client sees it as an `invalid_request` ErrorReply, HTTP 400).

Cheap checks first (counts before contents), so a huge list is refused without a pass over it.
"""

from __future__ import annotations

from ...messages.client import MAX_TENANT_CHARS, GenerateRequest
from ...messages.common import SamplingParams
from ..runtime.config import EngineConfig
from ..runtime.grammars import CheckedSpecs


class InvalidRequest(Exception):
    """A client error; the message names the field and its limit."""


def check_request(message: GenerateRequest, config: EngineConfig) -> None:
    """The request's own fields, before its prompt is tokenized."""
    if (message.prompt is None) == (message.prompt_token_ids is None):
        raise InvalidRequest("exactly one of prompt and prompt_token_ids must be given")
    if not config.priority_min <= message.priority <= config.priority_max:
        raise InvalidRequest(
            f"priority must be in [{config.priority_min}, {config.priority_max}] "
            f"(priority_min, priority_max), got {message.priority}"
        )
    if message.tenant is not None and len(message.tenant) > MAX_TENANT_CHARS:
        raise InvalidRequest(
            f"tenant must be at most {MAX_TENANT_CHARS} characters, got {len(message.tenant)}"
        )
    if message.prompt_token_ids is not None:
        check_prompt_length(len(message.prompt_token_ids), config)
    error = message.params.validate(config.facts.vocab_size, config.max_structured_chars)
    if error:
        raise InvalidRequest(error)


def check_structured(params: SamplingParams, checked: CheckedSpecs) -> None:
    """A structured output's schema, regex or grammar must parse (the Worker compiles it)."""
    if params.structured is not None:
        try:
            checked.check(params.structured)
        except ValueError as exc:
            raise InvalidRequest(f"structured: {exc}") from None


def check_prompt_length(num_tokens: int, config: EngineConfig) -> None:
    max_len = config.max_model_len
    if num_tokens == 0:
        raise InvalidRequest("prompt must not be empty")
    if num_tokens >= max_len:
        raise InvalidRequest(
            f"prompt is {num_tokens} tokens, max_model_len is {max_len}: the prompt "
            f"must be at most {max_len - 1} tokens to leave room for one output token"
        )


def check_prompt_text(prompt: str, max_chars: int, max_model_len: int) -> None:
    if len(prompt) > max_chars:
        raise InvalidRequest(
            f"prompt is {len(prompt)} characters, more than max_model_len={max_model_len} tokens "
            f"can hold with this tokenizer (at most {max_chars} characters)"
        )


def check_prompt_ids(ids: list[int], config: EngineConfig) -> None:
    vocab = config.facts.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"prompt_token_ids must be in [0, vocab_size={vocab}), got {bad}")


def check_output_size(num_prompt_tokens: int, params: SamplingParams, config: EngineConfig):
    """What the request may make the engine produce: n samples of at most max_tokens each (and
    never past max_model_len), their logprobs, the prompt's logprobs."""
    per_sample = min(params.max_tokens, config.max_model_len - num_prompt_tokens)
    tokens = params.n * per_sample
    if tokens > config.max_request_output_tokens:
        raise InvalidRequest(
            f"n x max_tokens must be at most max_request_output_tokens="
            f"{config.max_request_output_tokens} (with max_tokens capped by max_model_len), got "
            f"{params.n} x {per_sample} = {tokens}"
        )
    entries = 0
    if params.logprobs is not None:
        entries += tokens * (1 + params.logprobs)
    if params.prompt_logprobs is not None:
        entries += num_prompt_tokens * (1 + params.prompt_logprobs)
    if entries > config.max_logprob_entries:
        raise InvalidRequest(
            f"logprobs: the request would return {entries} logprob entries (n x tokens x "
            f"(1 + logprobs), plus the prompt's), more than max_logprob_entries="
            f"{config.max_logprob_entries}"
        )


def check_resume(message: GenerateRequest, config: EngineConfig) -> None:
    """A resumption (GenerateRequest.resume) must name distinct samples of the request, each
    with fewer tokens than max_tokens (else it had finished), every id in the vocabulary."""
    if message.resume is None:
        return
    n, max_tokens = message.params.n, message.params.max_tokens
    vocab = config.facts.vocab_size
    seen: set[int] = set()
    for sample in message.resume:
        if not 0 <= sample.index < n or sample.index in seen:
            raise InvalidRequest(
                f"resume: sample indices must be distinct and in [0, n={n}), got {sample.index}"
            )
        seen.add(sample.index)
        if len(sample.output_token_ids) >= max_tokens:
            raise InvalidRequest(
                f"resume: sample {sample.index} has {len(sample.output_token_ids)} tokens, "
                f"max_tokens is {max_tokens}: it has finished"
            )
        bad = next((t for t in sample.output_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"resume: output_token_ids must be in [0, vocab_size={vocab}), got {bad}"
            )
