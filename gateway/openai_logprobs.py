"""Logprobs in OpenAI's response shapes, built from the Engine's TokenLogprobs.

Completions (legacy): {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}],
"text_offset": [int]}; each top_logprobs dict holds the top k and the sampled token (so up to
k + 1 entries, as OpenAI documents); text_offset counts characters of the completion text from 0.
Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]} with the top k alternatives. Prompt logprobs (vLLM's extra): one entry per prompt
token, null for the first, else {"token id": {"logprob", "rank", "decoded_token"}} holding the
prompt token and the top k. A token's text is its own decoding (`tokenizer.decode([id])`).
"""

from __future__ import annotations

import msgspec

from ..messages.common import TokenLogprobs


class CompletionLogprobs(msgspec.Struct):
    """An echoed prompt's first token has null token_logprobs and top_logprobs entries."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None


class PromptLogprob(msgspec.Struct):
    """vLLM's Logprob as its OpenAI server writes it."""

    logprob: float
    rank: int | None
    decoded_token: str | None


class TokenNames:
    """Token id -> its text, decoded once per id (the vocabulary bounds the cache)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        name = self.cache.get(token_id)
        if name is None:
            name = self.cache[token_id] = self.tokenizer.decode([token_id])
        return name


def completion_logprobs(
    entries: list[TokenLogprobs], names: TokenNames, text_offset: int = 0
) -> tuple[CompletionLogprobs, int]:
    """OpenAI's legacy logprobs of `entries`, offsets counted on from `text_offset`; and the
    offset of the token after them (where a streamed chunk's next one starts)."""
    out = CompletionLogprobs([], [], [], [])
    for entry in entries:
        token = names(entry.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(entry.logprob)
        top = {names(t): lp for t, lp in entry.top}
        top.setdefault(token, entry.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out, text_offset


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(entries: list[TokenLogprobs], names: TokenNames) -> ChatLogprobs:
    content = []
    for entry in entries:
        token = names(entry.token_id)
        top = [TopLogprob(names(t), lp, _bytes(names(t))) for t, lp in entry.top]
        content.append(ChatTokenLogprob(token, entry.logprob, _bytes(token), top))
    return ChatLogprobs(content)


def prompt_logprobs(
    entries: list[TokenLogprobs | None], names: TokenNames
) -> list[dict[str, PromptLogprob] | None]:
    out: list[dict[str, PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {
            str(t): PromptLogprob(lp, rank, names(t)) for rank, (t, lp) in enumerate(entry.top, 1)
        }
        ranked[str(entry.token_id)] = PromptLogprob(
            entry.logprob, entry.rank, names(entry.token_id)
        )
        out.append(ranked)
    return out
