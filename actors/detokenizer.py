"""Incremental detokenization that never emits a broken UTF-8 character.

Decoding tokens one at a time breaks multi-byte characters and drops context (a leading space may
depend on the previous token). Both ways below start from the prompt's last tokens as context
and emit only the text the new tokens complete:

- a fast tokenizer (a Rust `tokenizers` backend) uses its `DecodeStream`, which keeps that state
  in Rust: one call a token;
- any other decodes a short window, `prefix` tokens already emitted then the new ones, and emits
  the text past the prefix's, holding back while it ends in U+FFFD (two decodes a token).
"""

from __future__ import annotations

from typing import Protocol

PROMPT_CONTEXT_TOKENS = 5


class Detokenizer(Protocol):
    def add(self, token_ids: list[int]) -> str:
        """Append tokens and return the text they complete (maybe empty)."""
        ...


def incremental_detokenizer(tokenizer, prompt_token_ids: list[int]) -> Detokenizer:
    """The fastest detokenizer this tokenizer allows."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            return StreamDetokenizer(backend, prompt_token_ids)
        except (ImportError, TypeError):  # tokenizers without DecodeStream(ids=...)
            pass
    return IncrementalDetokenizer(tokenizer, prompt_token_ids)


class StreamDetokenizer:
    """Over `tokenizers.decoders.DecodeStream`, which buffers a character's bytes itself."""

    def __init__(self, backend, prompt_token_ids: list[int]):
        from tokenizers.decoders import DecodeStream

        self.backend = backend
        self.stream = DecodeStream(
            ids=list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]), skip_special_tokens=True
        )

    def add(self, token_ids: list[int]) -> str:
        """Append tokens and return the text they complete (maybe empty)."""
        step, backend = self.stream.step, self.backend
        pieces = [step(backend, token) for token in token_ids]
        return "".join(piece for piece in pieces if piece)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.tokens = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens and return the text they complete (maybe empty)."""
        self.tokens.extend(token_ids)
        decode = self.tokenizer.decode
        prefix = decode(
            self.tokens[self.prefix_offset : self.read_offset], skip_special_tokens=True
        )
        text = decode(self.tokens[self.prefix_offset :], skip_special_tokens=True)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return text[len(prefix) :]
