"""OpenAI's request shapes as msgspec Structs, and their mapping to SamplingParams.

Requests decode strictly (a wrong type or an unknown field is a 400 naming the field, as OpenAI's
own API does: openai_errors.decode_json). Fields we accept but cannot honour yet are refused with
a 400 that says so, never silently ignored.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..messages.common import MAX_LOGPROBS, MAX_N, OutputKind, SamplingParams
from .openai_errors import invalid
from .openai_structured import StructuredFields


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class _Common(StructuredFields, kw_only=True, forbid_unknown_fields=True):
    """Fields both routes share: OpenAI's, then the sampling extras vLLM accepts, and the
    structured-output ones (openai_structured.py)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0  # vLLM's: lower runs first
    prompt_logprobs: int | None = None
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks shared only within one salt

    def check_common(self) -> None:
        """Refuse what we cannot honour yet, with a 400 naming the field. The sampling ranges
        are SamplingParams.validate's: the Gateway runs it before sending (so a bad request
        never reaches the Engine, which runs it again for the SDK's other users)."""
        if self.n < 1:
            raise invalid(f"n must be >= 1, got {self.n}", "n")
        if self.n > MAX_N:
            raise invalid(f"n must be <= {MAX_N}, got {self.n}", "n")
        if self.prompt_logprobs is not None and self.stream:
            raise invalid(
                "prompt_logprobs are not available when stream is true", "prompt_logprobs"
            )
        if not self.skip_special_tokens:
            raise invalid("skip_special_tokens=false is not supported yet", "skip_special_tokens")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")

    def token_bias(self) -> dict[int, float]:
        """logit_bias with OpenAI's string keys as token ids."""
        try:
            return {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            raise invalid(
                f"logit_bias keys must be token ids (integers as strings), got "
                f"{list(self.logit_bias)!r:.80}",
                "logit_bias",
            ) from None

    def sampling_params(self, max_tokens: int, logprobs: int | None = None) -> SamplingParams:
        """The engine's params; a non-streamed request is a whole completion (final_only)."""
        structured, _ = self.structured()
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=(
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            logit_bias=self.token_bias(),
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            cache_salt=self.cache_salt,
            output_kind=OutputKind.DELTA if self.stream else OutputKind.FINAL_ONLY,
            structured=structured,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    prompt: str | list[Any]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        self.check_common()
        if self.best_of is not None and self.best_of != 1:
            raise invalid(f"best_of must be 1 (not supported yet), got {self.best_of}", "best_of")
        if self.suffix:
            raise invalid("suffix is not supported", "suffix")

    def prompt_inputs(self) -> list[str | list[int]]:
        """The prompts, in order: OpenAI's `prompt` is a string, a list of token ids (one
        prompt), or a list of strings and token-id lists (a batch, each its own request). A 400
        naming `prompt` (and the place in the batch) when it is none of those."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        if all(is_token_id(t) for t in prompt):
            return [list(prompt)]
        for i, one in enumerate(prompt):
            if not isinstance(one, (str, list)) or (
                isinstance(one, list) and not all(is_token_id(t) for t in one)
            ):
                raise invalid(
                    f"prompt[{i}] must be a string or a list of token ids (integers), got "
                    f"{one!r:.40}",
                    "prompt",
                )
        return list(prompt)


def is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(
                    f"messages[{index}].content[{j}]: only parts of type 'text' are supported",
                    f"messages[{index}].content[{j}]",
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise invalid("messages must hold at least one message", "messages")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise invalid("top_logprobs needs logprobs to be true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise invalid(
                    f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                    "top_logprobs",
                )
        if self.tools:
            raise invalid("tools are not supported yet", "tools")

    @property
    def logprobs_count(self) -> int | None:
        """SamplingParams.logprobs: None unless logprobs is true, then top_logprobs (0)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
