"""A checkpoint's tokenizer, read from its files without transformers (nor torch).

The Engine and the gateway tokenize, detokenize and render chats; importing transformers for
that (and torch with it) would cost every start and every restart of both processes seconds of
imports. What transformers' fast tokenizer does is the Rust `tokenizers` pipeline of
tokenizer.json plus a few settings of tokenizer_config.json, reproduced here as transformers 5
applies them to a tokenizer.json checkpoint (tests/test_tokenizer.py holds it to AutoTokenizer):

- the pipeline is tokenizer.json's as written: its post-processor alone decides what
  `add_special_tokens` adds. `add_bos_token` / `add_eos_token` in tokenizer_config.json are
  ignored when tokenizer.json exists (transformers drops them then: the file's template is
  authoritative), and truncation and padding are off;
- the named special tokens (bos_token, eos_token, unk_token, sep_token, pad_token, cls_token,
  mask_token), each a string or a serialized AddedToken, from tokenizer_config.json (or, when
  it has no `added_tokens_decoder`, the legacy special_tokens_map.json over it); other
  `*_token` strings and `extra_special_tokens` / `additional_special_tokens` are special too. Any
  of them, or of `added_tokens_decoder`'s, missing from the vocabulary is added, as
  transformers adds it;
- decoding is the pipeline's decoder; `clean_up_tokenization_spaces` applies, as in
  transformers, to tokenizers other than BPE only.

Transformers 5 also rebuilds the pipeline of a few model-specific tokenizer classes (e.g.
`LlamaTokenizer`) from the vocabulary instead of reading the file's; this follows the file, as
`tokenizers` and the checkpoint's authors wrote it. A checkpoint with only a slow tokenizer
(tokenizer.model, vocab files, no tokenizer.json) is refused, naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .chat_templates import find_chat_template, render_chat

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def tokenizer_file(model_dir: str | Path) -> Path:
    """The checkpoint's tokenizer.json; ValueError naming it when it is missing."""
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise ValueError(
            f"{path} is missing: actorserve reads the fast (Rust `tokenizers`) tokenizer of a "
            f"checkpoint, and this one has none. Convert its slow tokenizer once with "
            f"transformers: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)"
        )
    return path


def _content(token: Any) -> str | None:
    """A special token's text: a string, or a serialized AddedToken's content."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _added_token(token: Any, special: bool):
    """A tokenizers.AddedToken from a config entry (a string, or a serialized AddedToken)."""
    from tokenizers import AddedToken

    if isinstance(token, str):
        return AddedToken(token, special=special, normalized=not special)
    fields = {k: v for k, v in token.items() if k not in ("__type", "content", "special")}
    return AddedToken(token["content"], special=special or token.get("special", False), **fields)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


class Tokenizer:
    """encode / decode / the vocabulary / chat templates of one checkpoint: what the Engine,
    its detokenizer (which reads `backend_tokenizer`) and the gateway use."""

    def __init__(self, backend, config: dict, chat_template: str | dict[str, str] | None):
        """`backend`: a tokenizers.Tokenizer; `config`: tokenizer_config.json's fields (with
        the legacy special_tokens_map.json's merged in)."""
        self.backend_tokenizer = backend
        backend.no_truncation()
        backend.no_padding()
        self.chat_template = chat_template
        named = {k: config.get(k) for k in NAMED_SPECIAL_TOKENS if config.get(k) is not None}
        extra: list[Any] = []
        for key, value in config.items():  # model-specific ones (image_token, ...), as v5 does
            if key.endswith("_token") and key not in named and _content(value) is not None:
                named[key] = value
        listed = config.get("extra_special_tokens") or config.get("additional_special_tokens")
        if isinstance(listed, dict):
            named.update(listed)
        elif isinstance(listed, list):
            extra = listed
        self.special_tokens_map = {k: _content(v) for k, v in named.items() if _content(v)}
        self._add_missing(config.get("added_tokens_decoder") or {}, [*named.values(), *extra])
        clean_up = bool(config.get("clean_up_tokenization_spaces", False))
        model_kind = type(backend.model).__name__
        self.clean_up_tokenization_spaces = clean_up and model_kind != "BPE"

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        from tokenizers import Tokenizer as Backend

        backend = Backend.from_file(str(tokenizer_file(model_dir)))
        config = _read_json(model_dir / TOKENIZER_CONFIG_FILE)
        if "added_tokens_decoder" not in config:  # transformers reads the legacy file then
            for key, value in _read_json(model_dir / SPECIAL_TOKENS_MAP_FILE).items():
                config[key] = value
        return cls(backend, config, find_chat_template(model_dir, config))

    def _add_missing(self, decoder: dict[str, Any], special: list[Any]) -> None:
        """Add the tokens the config declares and the vocabulary lacks, in transformers'
        order: added_tokens_decoder's by id, then the special tokens."""
        declared = [(t, False) for _, t in sorted(decoder.items(), key=lambda kv: int(kv[0]))]
        missing, seen = [], set()
        for token, forced in [*declared, *((t, True) for t in special)]:
            content = _content(token)
            if content is None or content in seen or self.token_to_id(content) is not None:
                continue
            missing.append(_added_token(token, forced))
            seen.add(content)
        if missing:
            self.backend_tokenizer.add_tokens(missing)

    # -- special tokens ----------------------------------------------------------------------

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.token_to_id(self.eos_token)

    def token_to_id(self, token: str) -> int | None:
        return self.backend_tokenizer.token_to_id(token)

    # -- text <-> ids ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text`; `add_special_tokens`: what tokenizer.json's post-processor
        adds (a BOS, typically). Through encode_batch, which lets go of the GIL while it works
        (encode does not): a long prompt tokenized on a thread leaves the event loop running."""
        backend = self.backend_tokenizer
        batch = getattr(backend, "encode_batch_fast", backend.encode_batch)  # fast: no offsets
        return batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode(list(token_ids), skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            for old, new in _CLEAN_UP:
                text = text.replace(old, new)
        return text

    def get_vocab(self) -> dict[str, int]:
        """Every token (the added ones included) -> its id."""
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    # -- chats -------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
    ) -> str:
        """The conversation rendered as text (not tokenized) by `chat_template`, else the
        checkpoint's, as transformers' apply_chat_template(..., tokenize=False) renders it.
        Raises ValueError without a template, jinja2's TemplateError when the template refuses
        the conversation (its raise_exception)."""
        template = chat_template if chat_template is not None else self.chat_template
        if isinstance(template, dict):
            if "default" not in template:
                raise ValueError(
                    f"this tokenizer has several chat templates and none named 'default': "
                    f"{sorted(template)}"
                )
            template = template["default"]
        if template is None:
            raise ValueError("this tokenizer has no chat template")
        return render_chat(template, messages, add_generation_prompt, self.special_tokens_map)
