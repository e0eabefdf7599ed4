"""Incremental detokenization equals decoding at once, and never emits half a character."""

from __future__ import annotations

import pytest

from actorserve.actors.engine.detokenizer import (
    IncrementalDetokenizer,
    StreamDetokenizer,
    incremental_detokenizer,
)
from support import tokenizer

TEXT = "Größe 🚀🚀 naïve café — 東京タワー def f(x):\n    return x ** 2  # ✓ done"
BOTH = [
    pytest.param(lambda tok, prompt: StreamDetokenizer(tok.backend_tokenizer, prompt), id="stream"),
    pytest.param(IncrementalDetokenizer, id="window"),
]


@pytest.mark.parametrize("make", BOTH)
def test_tokens_fed_one_at_a_time_give_the_full_text_without_replacement_chars(llama_dir, make):
    tok = tokenizer(llama_dir)
    prompt = tok.encode("Once upon a time")
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = make(tok, prompt)
    pieces = [detok.add([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert any(p == "" for p in pieces)  # some emoji bytes span tokens and were held back


@pytest.mark.parametrize("make", BOTH)
def test_tokens_fed_several_at_a_time_give_the_same_text(llama_dir, make):
    tok = tokenizer(llama_dir)
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = make(tok, tok.encode("Once upon a time"))
    pieces = [detok.add(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("make", BOTH)
def test_special_tokens_are_not_shown(llama_dir, make):
    tok = tokenizer(llama_dir)
    detok = make(tok, tok.encode("x"))
    assert detok.add([tok.eos_token_id]) == ""


def test_a_fast_tokenizer_gets_the_stream_detokenizer(llama_dir):
    assert isinstance(incremental_detokenizer(tokenizer(llama_dir), [1]), StreamDetokenizer)


@pytest.mark.parametrize("make", BOTH)
@pytest.mark.parametrize("text", ["東京", "🚀", "ok 🚀 ok", "naïve 東"])
def test_finish_flushes_an_unfinished_character_as_decode_does(llama_dir, make, text):
    """Every cut of a text's tokens, even mid-character: the pieces and then `finish` make
    exactly `decode(ids)`, U+FFFD for the bytes of a character the tokens did not finish."""
    tok = tokenizer(llama_dir)
    ids = tok.encode(text, add_special_tokens=False)
    for cut in range(1, len(ids) + 1):
        detok = make(tok, tok.encode("Once upon a time"))
        pieces = [detok.add([t]) for t in ids[:cut]]
        assert "".join(pieces) + detok.finish() == tok.decode(ids[:cut], skip_special_tokens=True)
        assert detok.finish() == ""  # nothing is flushed twice


@pytest.mark.parametrize("make", BOTH)
def test_a_detokenizer_goes_on_after_a_flush_that_had_nothing_held(llama_dir, make):
    tok = tokenizer(llama_dir)
    detok = make(tok, tok.encode("x"))
    ids = tok.encode("abc def", add_special_tokens=False)
    text = detok.add(ids) + detok.finish()
    assert text == tok.decode(ids)
