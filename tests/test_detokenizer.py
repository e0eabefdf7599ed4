"""Incremental detokenization equals decoding at once, and never emits half a character."""

from __future__ import annotations

from actorserve.actors.detokenizer import IncrementalDetokenizer
from support import tokenizer

TEXT = "Größe 🚀🚀 naïve café — 東京タワー def f(x):\n    return x ** 2  # ✓ done"


def test_tokens_fed_one_at_a_time_give_the_full_text_without_replacement_chars(llama_dir):
    tok = tokenizer(llama_dir)
    prompt = tok.encode("Once upon a time")
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.add([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert any(p == "" for p in pieces)  # some emoji bytes span tokens and were held back


def test_special_tokens_are_not_shown(llama_dir):
    tok = tokenizer(llama_dir)
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    assert detok.add([tok.eos_token_id]) == ""
