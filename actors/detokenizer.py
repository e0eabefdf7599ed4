"""Incremental detokenization that never emits a broken UTF-8 character.

Decoding tokens one at a time breaks multi-byte characters and drops context (a leading space may
depend on the previous token). We decode a short window: `prefix` tokens already emitted, then the
new ones, and emit only the text past the prefix's, holding back while it ends in U+FFFD (the
bytes of a character not yet complete).
"""

from __future__ import annotations

PROMPT_CONTEXT_TOKENS = 5


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
