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


class StreamDetokenizer:
    """Over `tokenizers.decoders.DecodeStream`, which buffers a character's bytes itself.

    DecodeStream keeps its buffer to itself, so this keeps a copy of what it holds: `held`, the
    tokens since the last piece it emitted (each emitted piece accounts for every token before
    it), and `context`, the last few tokens before them (a token's text may depend on them)."""

    def __init__(self, backend, prompt_token_ids: list[int]):
        from tokenizers.decoders import DecodeStream

        self.backend = backend
        self.context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.held: list[int] = []
        self.stream = DecodeStream(ids=list(self.context), skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens and return the text they complete (maybe empty)."""
        step, backend = self.stream.step, self.backend
        pieces = []
        for token in token_ids:
            piece = step(backend, token)
            self.held.append(token)
            if piece:
                pieces.append(piece)
                self.context = (self.context + self.held)[-PROMPT_CONTEXT_TOKENS:]
                self.held = []
        return "".join(pieces)

    def finish(self) -> str:
        """The text of the tokens still held back (an unfinished character as U+FFFD)."""
        if not self.held:
            return ""
        decode = self.backend.decode
        prefix = decode(self.context, skip_special_tokens=True)
        text = decode(self.context + self.held, skip_special_tokens=True)
        self.context = (self.context + self.held)[-PROMPT_CONTEXT_TOKENS:]
        self.held = []
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

    def finish(self) -> str:
        """The text of the tokens still held back (an unfinished character as U+FFFD)."""
        if self.read_offset == len(self.tokens):
            return ""
        decode = self.tokenizer.decode
        prefix = decode(
            self.tokens[self.prefix_offset : self.read_offset], skip_special_tokens=True
        )
        text = decode(self.tokens[self.prefix_offset :], skip_special_tokens=True)
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return text[len(prefix) :]
