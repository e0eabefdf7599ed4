"""The trained demo checkpoint (weights/demo-python, what `bash scripts/demo.sh` serves): it is in
the repo, small, learnt Python from permissively licensed installed packages, and the engine
serves it."""

from __future__ import annotations

import ast
import json
import math
import re

import pytest
import torch

from actorserve.messages.common import SamplingParams
from actorserve.weights.checkpoints import TRAINED_DEMO, TRAINED_DEMO_KIND, ensure_checkpoint
from support import EngineServer

# Python written by hand for the evaluation, in no installed package: the model never saw it
HELD_OUT_FILE = TRAINED_DEMO.parent / "held_out" / "inventory_service.py"
WINDOW_TOKENS = 256  # the training windows' length: the model has never read further


@pytest.fixture(scope="module")
def held_out_ids() -> torch.Tensor:
    """[windows, WINDOW_TOKENS]: the held-out file's tokens (BOS first), whole windows of them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TRAINED_DEMO)
    ids = tokenizer(HELD_OUT_FILE.read_text(encoding="utf-8"))["input_ids"]
    windows = len(ids) // WINDOW_TOKENS
    return torch.tensor(ids[: windows * WINDOW_TOKENS]).view(windows, WINDOW_TOKENS)


def perplexity(model_dir, ids: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return math.exp(model(input_ids=ids, labels=ids).loss.item())


def test_the_trained_demo_is_a_small_committed_checkpoint():
    from transformers import AutoTokenizer

    assert ensure_checkpoint(TRAINED_DEMO_KIND) == TRAINED_DEMO
    on_disk = sum(
        (TRAINED_DEMO / name).stat().st_size for name in ("model.safetensors", "tokenizer.json")
    )
    assert on_disk <= 25_000_000, on_disk
    config = json.loads((TRAINED_DEMO / "config.json").read_text())
    # it carries its own tokenizer (trained on its corpus), whose every id the model can embed
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in TRAINED_DEMO.iterdir()}
    tokenizer = AutoTokenizer.from_pretrained(TRAINED_DEMO)
    assert config["model_type"] == "llama" and config["vocab_size"] == len(tokenizer)


def test_the_trained_demo_predicts_unseen_python_far_better_than_the_random_one(held_out_ids):
    trained = perplexity(TRAINED_DEMO, held_out_ids)
    random = perplexity(ensure_checkpoint("demo"), held_out_ids)
    print(f"held-out perplexity: trained {trained:.1f}, random demo {random:.3g}")
    # the goal of issue 36: under 100 on Python written for the evaluation (the demo trained on
    # the stdlib alone scored 447 on it); the random demo is no language model at all
    assert trained < 100, trained
    assert trained * 1e6 < random


@pytest.mark.slow
def test_the_engine_serves_the_trained_demo_writing_python():
    server = EngineServer(TRAINED_DEMO)
    try:
        # the penalty breaks the greedy loops a model this small falls into, as the demo does
        params = SamplingParams(temperature=0.0, max_tokens=64, repetition_penalty=1.3)
        text = server.client.complete("def fibonacci(n):", params).text
    finally:
        server.stop()
    print(repr(text))
    source = "def fibonacci(n):" + text
    lines = source.splitlines()
    parsed = max(k for k in range(len(lines) + 1) if parses("\n".join(lines[:k])))
    tree = ast.parse("\n".join(lines[:parsed]))  # no line at all parses too: an empty module
    # Python's own parser reads the prompt and the completion's first lines as a function with
    # a body: a statement a Python reader recognises, not token soup
    assert tree.body and isinstance(tree.body[0], ast.FunctionDef), source
    function = tree.body[0]
    assert any(not isinstance(line, ast.Pass) for line in function.body), source
    assert re.search(r"\b[a-z_]+\(", text), text  # a call or a definition


def parses(source: str) -> bool:
    try:
        ast.parse(source)
    except SyntaxError:
        return False
    return True
