"""Chat messages -> prompt token ids, with the checkpoint's own chat template.

A tokenizer without a chat template gets a simple built-in one (logged once at start-up):

    <|role|>\\ncontent\\n ... <|assistant|>\\n
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..actors.runtime.tokenizer import Tokenizer

log = logging.getLogger("gateway")

FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


class ChatTemplate:
    """Loads only the tokenizer (no weights) of the checkpoint in `model_dir`
    (actors/runtime/tokenizer.py: neither transformers nor torch)."""

    def __init__(self, model_dir: str | Path):
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.builtin = not self.tokenizer.chat_template
        # a chat longer than messages.common.max_prompt_chars allows is refused untokenized
        self.longest_token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        if self.builtin:
            log.warning(
                "the tokenizer in %s has no chat template: /v1/chat/completions uses a "
                "simple built-in one (<|role|> lines)",
                model_dir,
            )

    def prompt_ids(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Render the conversation and tokenize it; the template itself places BOS if any.

        Raises ValueError when the template refuses the conversation (e.g. roles out of order).
        """
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                chat_template=FALLBACK_TEMPLATE if self.builtin else None,
            )
        except Exception as exc:  # jinja2's TemplateError, or the template's raise_exception()
            raise ValueError(f"the chat template refused these messages: {exc}") from exc
        return self.tokenizer.encode(text, add_special_tokens=self.builtin)
