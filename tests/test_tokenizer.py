"""The Engine's and the gateway's tokenizer (actors/runtime/tokenizer.py) tokenizes, decodes and
detokenizes exactly as transformers' AutoTokenizer does on the same checkpoint, without
importing transformers: every checkpoint the tests build, the trained demo, and copies whose
tokenizer_config.json declares what real checkpoints declare."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest

from actorserve.actors.engine.detokenizer import (
    IncrementalDetokenizer,
    StreamDetokenizer,
    incremental_detokenizer,
)
from actorserve.actors.runtime.config import EngineConfig
from actorserve.actors.runtime.config_resolution import resolve_model
from actorserve.actors.runtime.tokenizer import Tokenizer
from actorserve.weights.checkpoints import ensure_checkpoint

KINDS = ("tiny-llama", "tiny-qwen3", "demo", "demo-python")
TEXTS = (
    "",
    " ",
    "hello world",
    "Hello, World! It's 3.14159 o'clock; isn't it?",
    "    indented\n\tand tabbed\n\n\n   trailing   ",
    "a  b   c    d     e      f",
    "\r\n\r\nwindows\r\nlines\r\n",
    "Größe naïve café — 東京タワー 🚀🚀 👩‍👩‍👧 e\u0301 שלום مرحبا",
    "<s>special</s> inside <|im_start|>user\ntext<|im_end|> and <unk>",
    "<s><s></s>",
    "def f(x):\n    return {'a': [1, 2, 3]}  # ✓\n",
    "\u200b\u00a0\u2028zero width and odd spaces\ufeff",
)


@pytest.fixture(scope="module", params=KINDS)
def pair(request):
    """(ours, transformers') on one checkpoint."""
    from transformers import AutoTokenizer

    model_dir = ensure_checkpoint(request.param)
    return Tokenizer.from_dir(model_dir), AutoTokenizer.from_pretrained(model_dir)


def random_texts(count: int = 40, seed: int = 0) -> list[str]:
    """Strings mixing ASCII, whitespace runs, accents, CJK, emoji and special tokens."""
    rng = random.Random(seed)
    pieces = [
        "the", " quick", "  ", "\n", "\t", "\n\n  ", "é", "ß", "東", "京", "🚀", "👍🏽", "¿",
        "<s>", "</s>", "<|im_end|>", "0", "42", "==", "->", "'s", " ", "\u3000", "x",
    ]  # fmt: skip
    return ["".join(rng.choices(pieces, k=rng.randint(1, 30))) for _ in range(count)]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_equals_transformers(pair, add_special_tokens):
    ours, hf = pair
    for text in (*TEXTS, *random_texts()):
        expected = hf.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_equals_transformers(pair, skip_special_tokens):
    """Whole texts, and random id sequences: special ids among them, multi-byte characters cut
    (U+FFFD), ids in any order."""
    ours, hf = pair
    rng = random.Random(1)
    sequences = [hf.encode(text) for text in (*TEXTS, *random_texts())]
    sequences += [[rng.randrange(len(hf)) for _ in range(rng.randint(1, 40))] for _ in range(40)]
    sequences += [[1, 2, 3, 4, 0], []]
    for ids in sequences:
        expected = hf.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected, ids


def test_vocabulary_and_special_tokens_equal_transformers(pair):
    ours, hf = pair
    assert ours.get_vocab() == hf.get_vocab()
    assert len(ours) == len(hf)
    assert ours.special_tokens_map == hf.special_tokens_map
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    assert ours.chat_template == hf.chat_template


@pytest.mark.parametrize("chunk", [1, 3])
def test_the_detokenizer_streams_the_same_pieces_as_with_transformers(pair, chunk):
    """The Engine's incremental detokenization over our tokenizer: the same pieces, token by
    token, as over AutoTokenizer's (both the stream and the window kind)."""
    ours, hf = pair
    prompt = hf.encode("Once upon a time")
    ids = hf.encode(TEXTS[7] + TEXTS[8] + TEXTS[4], add_special_tokens=False)
    assert isinstance(incremental_detokenizer(ours, prompt), StreamDetokenizer)
    makers = (incremental_detokenizer, IncrementalDetokenizer)
    for make in makers:
        streams = [make(tok, prompt) for tok in (ours, hf)]
        for detok in streams:
            detok.pieces = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
            detok.pieces.append(detok.finish())
        assert streams[0].pieces == streams[1].pieces
        assert "".join(streams[0].pieces) == hf.decode(ids, skip_special_tokens=True)


def copy_tokenizer(src: Path, dst: Path, config_changes: dict) -> Path:
    dst.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copyfile(src / name, dst / name)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.update(config_changes)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


CONFIG_VARIANTS = {
    "add_bos_eos_flags": {"add_bos_token": False, "add_eos_token": True},
    "new_special_tokens": {
        "bos_token": "<|begin_of_text|>",
        "eos_token": {"__type": "AddedToken", "content": "<|eot_id|>", "special": True},
        "pad_token": "<|pad|>",
        "additional_special_tokens": ["<|tool|>", "<|im_end|>"],
        "image_token": "<|image|>",
    },
    "added_tokens_decoder": {
        "added_tokens_decoder": {
            "32000": {"content": "<|plain|>", "special": False, "normalized": False},
            "32001": {"content": "<|hidden|>", "special": True, "normalized": False},
        }
    },
    "clean_up_spaces": {"clean_up_tokenization_spaces": True},
}


@pytest.mark.parametrize("variant", list(CONFIG_VARIANTS))
def test_tokenizer_config_settings_act_as_in_transformers(tmp_path, variant):
    """add_bos_token / add_eos_token beside a tokenizer.json (transformers ignores them: the
    file's post-processor decides), special tokens the vocabulary lacks (added, with the same
    ids), added_tokens_decoder entries, clean_up_tokenization_spaces on a BPE tokenizer (not
    applied)."""
    from transformers import AutoTokenizer

    model_dir = copy_tokenizer(ensure_checkpoint("tiny-llama"), tmp_path, CONFIG_VARIANTS[variant])
    ours, hf = Tokenizer.from_dir(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert ours.get_vocab() == hf.get_vocab()
    assert ours.special_tokens_map == hf.special_tokens_map
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    text = "hi <|begin_of_text|> <|eot_id|><|pad|> <|tool|><|image|> <|plain|><|hidden|> it 's ."
    for special in (True, False):
        ids = hf.encode(text, add_special_tokens=special)
        assert ours.encode(text, add_special_tokens=special) == ids
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)


def test_a_checkpoint_without_tokenizer_json_is_refused_naming_the_file(tmp_path):
    """Refused when the supervisor reads the checkpoint, before any process starts (and by the
    tokenizer itself)."""
    src = ensure_checkpoint("tiny-llama")
    for name in ("tokenizer_config.json", "config.json", "generation_config.json"):
        shutil.copyfile(src / name, tmp_path / name)
    (tmp_path / "tokenizer.model").write_bytes(b"a slow tokenizer's sentencepiece model")
    missing = f"{tmp_path / 'tokenizer.json'} is missing"
    with pytest.raises(ValueError, match=re.escape(missing)):
        resolve_model(EngineConfig(model=str(tmp_path)))
    with pytest.raises(ValueError, match=re.escape(missing)):
        Tokenizer.from_dir(tmp_path)


def test_a_long_encode_lets_other_threads_run(demo_dir):
    """Tokenizing a long prompt on a thread must leave the event loop's thread running (the
    Engine tokenizes long prompts off the loop): `tokenizers` lets go of the GIL while it
    works, in encode_batch (its plain encode does not)."""
    import threading
    import time

    tok = Tokenizer.from_dir(demo_dir)
    text = "def f(x):\n    return x ** 2  # naïve 東京\n" * 40_000
    done = threading.Event()
    worker = threading.Thread(target=lambda: (tok.encode(text), done.set()))
    ticks = 0
    worker.start()
    while not done.is_set():
        time.sleep(0.001)
        ticks += 1
    worker.join()
    assert ticks > 20
