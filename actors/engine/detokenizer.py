"""Incremental detokenization that never emits a broken UTF-8 character.

Decoding tokens one at a time breaks multi-byte characters and drops context (a leading space may
depend on the previous token). Both ways below start from the prompt's last tokens as context
and emit only the text the new tokens complete:

- a fast tokenizer (a Rust `tokenizers` backend) uses its `DecodeStream`, which keeps that state
  in Rust: one call a token;
- any other decodes a short window, `prefix` tokens already emitted then the new ones, and emits
  the text past the prefix's, holding back while it ends in U+FFFD (two decodes a token).

`finish` releases what is still held back when the sample ends: the bytes of an unfinished
character, as U+FFFD, the way `tokenizer.decode` shows them. So the text of a whole sample is
`tokenizer.decode(output_ids, skip_special_tokens=True)`, however it ends.
"""

from __future__ import annotations

from typing import Protocol

PROMPT_CONTEXT_TOKENS = 5


class Detokenizer(Protocol):
    def add(self, token_ids: list[int]) -> str:
        """Append tokens and return the text they complete (maybe empty)."""
        ...

    def finish(self) -> str:
        """The text of the tokens still held back (an unfinished character as U+FFFD)."""
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


def decoded_window(decode, tokens: list[int], start: int, read: int) -> tuple[str, str]:
    """(the text of tokens[start:read], that of tokens[start:]): the new tokens' text is the
    second past the first, decoded with `read - start` tokens of context before them."""
    return (
        decode(tokens[start:read], skip_special_tokens=True),
        decode(tokens[start:], skip_special_tokens=True),
    )


class StreamDetokenizer:
    """Over `tokenizers.decoders.DecodeStream`, which buffers a character's bytes itself.

    DecodeStream keeps its buffer to itself, so this keeps the tokens (the prompt's last few,
    then every output token) and `emitted`, how many of them the pieces emitted so far account
    for: what it holds back is tokens[emitted:]."""

    def __init__(self, backend, prompt_token_ids: list[int]):
        from tokenizers.decoders import DecodeStream

        self.backend = backend
        self.tokens = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.emitted = len(self.tokens)
        self.stream = DecodeStream(ids=list(self.tokens), skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens and return the text they complete (maybe empty)."""
        step, backend, tokens = self.stream.step, self.backend, self.tokens
        pieces = []
        for token in token_ids:
            piece = step(backend, token)
            tokens.append(token)
            if piece:
                pieces.append(piece)
                self.emitted = len(tokens)
        return "".join(pieces)

    def finish(self) -> str:
        """The text of the tokens still held back (an unfinished character as U+FFFD)."""
        if self.emitted == len(self.tokens):
            return ""
        start = max(0, self.emitted - PROMPT_CONTEXT_TOKENS)
        prefix, text = decoded_window(self.backend.decode, self.tokens, start, self.emitted)
        self.emitted = len(self.tokens)
        return text[len(prefix) :]


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.tokens = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens and return the text they complete (maybe empty)."""
        self.tokens.extend(token_ids)
        return self._emit(final=False)

    def finish(self) -> str:
        """The text of the tokens still held back (an unfinished character as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        """The text past the last emitted, held back (before `final`) while it is empty or ends
        in an unfinished character."""
        if self.read_offset == len(self.tokens):
            return ""
        prefix, text = decoded_window(
            self.tokenizer.decode, self.tokens, self.prefix_offset, self.read_offset
        )
        if not final and (len(text) <= len(prefix) or text.endswith("\ufffd")):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return text[len(prefix) :]
