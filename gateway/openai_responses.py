"""OpenAI's response shapes as msgspec Structs: they encode to exactly OpenAI's JSON (None ->
null, no field left out); vLLM's `prompt_logprobs` appears only when asked for."""

from __future__ import annotations

import time

import msgspec

from ..messages.common import FinishReason
from .openai_logprobs import ChatLogprobs, CompletionLogprobs, PromptLogprob


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionChoiceWithPrompt(CompletionChoice):
    """vLLM's choice with `prompt_logprobs` (only when the request asked for them)."""

    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class Completion(msgspec.Struct):
    """A whole completion, and each chunk of a streamed one (OpenAI uses the same object)."""

    id: str
    choices: list[CompletionChoice]
    created: int
    model: str
    object: str = "text_completion"
    system_fingerprint: None = None
    usage: Usage | None = None


class AssistantMessage(msgspec.Struct):
    content: str
    role: str = "assistant"


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    choices: list[ChatChoice]
    created: int
    model: str
    object: str = "chat.completion"
    system_fingerprint: None = None
    usage: Usage | None = None


class ChatCompletionWithPrompt(ChatCompletion):
    """vLLM's chat response with `prompt_logprobs` (only when the request asked for them)."""

    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class ChunkDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChunkDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    choices: list[ChatChunkChoice]
    created: int
    model: str
    object: str = "chat.completion.chunk"
    system_fingerprint: None = None
    usage: Usage | None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    object: str = "model"
    owned_by: str = "actorserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


def now() -> int:
    return int(time.time())
