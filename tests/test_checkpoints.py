"""The checkpoint builder: cached and atomic builds, a byte-level tokenizer, the chat template."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from actorserve.weights import checkpoints
from actorserve.weights.checkpoints import ensure_checkpoint

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  \n\n\ttabs\r\n",
    "emoji 👋🏽 🧑‍🚀 and flags 🇫🇷",
    "日本語のテキスト, русский текст, ελληνικά, עברית",
    "decomposed e\u0301 and NFC é, zero width \u200b joiner",
    "def f(x):\n    return x ** 2  # 12345678\n",
    "<|im_start|> is special, <s> too",
]


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return ensure_checkpoint("tiny-llama")


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def _mtimes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(path.iterdir())}


def test_ensure_checkpoint_is_cached(tiny_llama):
    before = _mtimes(tiny_llama)
    assert ensure_checkpoint("tiny-llama") == tiny_llama
    assert _mtimes(tiny_llama) == before
    assert {"config.json", "generation_config.json", "model.safetensors"} <= before.keys()
    assert {"tokenizer.json", "tokenizer_config.json"} <= before.keys()


def test_concurrent_builders_leave_one_result(tmp_path):
    """Racing builders each build into a temp dir; one rename wins, the rest are dropped."""
    barrier = threading.Barrier(3)

    def build(out: Path) -> None:
        (out / "data").write_text(threading.current_thread().name)
        barrier.wait(timeout=10)  # all three built before any renames

    final = tmp_path / "kind"
    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: checkpoints._ensure_dir(final, "fp", build), range(3)))
    assert paths == [final] * 3
    assert [p.name for p in tmp_path.iterdir()] == ["kind"]
    assert sorted(p.name for p in final.iterdir()) == ["actorserve_checkpoint.json", "data"]


def test_build_in_fresh_root_then_cached_then_stale(tiny_llama, tmp_path, monkeypatch):
    shutil.copytree(tiny_llama.parent / "tokenizer", tmp_path / "tokenizer")  # skip training
    path = ensure_checkpoint("tiny-qwen2", tmp_path)
    assert path == tmp_path / "tiny-qwen2"
    built = _mtimes(path)
    assert ensure_checkpoint("tiny-qwen2", tmp_path) == path
    assert _mtimes(path) == built

    spec = dataclasses.replace(checkpoints.KINDS["tiny-qwen2"], seed=99)
    monkeypatch.setitem(checkpoints.KINDS, "tiny-qwen2", spec)
    assert ensure_checkpoint("tiny-qwen2", tmp_path) == path
    assert _mtimes(path)["model.safetensors"] != built["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-qwen2", "tokenizer"]


def test_unknown_kind_is_named():
    with pytest.raises(ValueError, match="unknown checkpoint kind 'nope'"):
        ensure_checkpoint("nope")


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_utf8(hf_tokenizer, tiny_llama, text):
    from tokenizers import Tokenizer

    ids = hf_tokenizer(text).input_ids
    assert ids[0] == hf_tokenizer.bos_token_id == 1
    assert hf_tokenizer.decode(ids[1:]) == text
    raw = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    assert raw.encode(text).ids == ids
    assert raw.decode(ids[1:], skip_special_tokens=False) == text


def test_special_tokens_and_generation_config(hf_tokenizer, tiny_llama):
    assert len(hf_tokenizer) == checkpoints.VOCAB_SIZE
    ids = hf_tokenizer.convert_tokens_to_ids(list(checkpoints.SPECIAL_TOKENS))
    assert ids == [0, 1, 2, 3, 4]
    assert hf_tokenizer("<|im_start|>", add_special_tokens=False).input_ids == [3]
    generation = json.loads((tiny_llama / "generation_config.json").read_text())
    assert generation["eos_token_id"] == hf_tokenizer.eos_token_id == 2
    assert generation["bos_token_id"] == 1


def test_chat_template_renders(hf_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 👋"},
    ]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 👋<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = hf_tokenizer(text, add_special_tokens=False).input_ids
    assert ids[:2] == [1, 3] and ids.count(4) == 2


def test_cli_prints_the_path(tiny_llama):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "actorserve.weights.checkpoints",
            "tiny-llama",
            "--root",
            tiny_llama.parent,
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == str(tiny_llama)
