"""Turning the CPU fast path off (EngineConfig.cpu_fast_path=False) leaves plain torch: no C
kernel, no packed weight, the reference attention under `auto`; and the engine's greedy fp32
tokens are still transformers', token for token, and the fast path's."""

from __future__ import annotations

import logging

import msgspec
import pytest
import torch
from torch import nn

from actorserve.actors.runtime.config import EngineConfig
from actorserve.actors.runtime.config_resolution import resolve_model
from actorserve.actors.worker.sampler import first_maximum
from actorserve.actors.worker.worker import build_runner
from actorserve.kernels.cpu import bindings
from actorserve.kernels.cpu.fast_path import CpuFastPath
from actorserve.kernels.cpu.panels import PackedLinear
from actorserve.kernels.elementwise import TORCH_ELEMENTWISE
from actorserve.messages.common import SamplingParams
from actorserve.messages.step import NewRequest, RunningUpdate, StepPlan
from actorserve.offline import LLM
from support import generate_concurrently, hf_greedy, prompts_of_lengths

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def test_create_says_why_it_is_off(llama_dir, monkeypatch, caplog):
    config = EngineConfig(model=str(llama_dir), greedy_head_screen="off")
    off = msgspec.structs.replace(config, cpu_fast_path=False)
    with caplog.at_level(logging.INFO):
        assert CpuFastPath.create(off, "cpu") is None
        assert "cpu_fast_path=False" in caplog.text
        assert CpuFastPath.create(config, "cuda") is None
        assert "the device is cuda" in caplog.text
    fast = CpuFastPath.create(config, "cpu")
    assert fast is not None and fast.screen == "off" and fast.huge
    monkeypatch.setattr(bindings, "load", lambda: None)  # no compiler: load() logs why
    assert CpuFastPath.create(config, "cpu") is None


def runner_for(llama_dir, **settings):
    config = EngineConfig(model=str(llama_dir), device="cpu", torch_threads=1, **settings)
    config = msgspec.structs.replace(resolve_model(config), num_kv_blocks=64, num_cpu_blocks=0)
    return build_runner(config)


def greedy_steps(runner, steps: int = 12) -> list[list[int]]:
    """Two prompts prefilled, then decoded one token a step: each step's sampled tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    new = [
        NewRequest("a", list(range(1, 30)), 29, [0, 1, 2, 3], 29, params),
        NewRequest("b", list(range(40, 51)), 11, [4, 5, 6, 7], 11, params),
    ]
    out = [runner.execute(StepPlan(0, 1, [], [], new)).token_ids]
    for step in range(2, 2 + steps):
        running = [RunningUpdate("a", [], 1), RunningUpdate("b", [], 1)]
        out.append(runner.execute(StepPlan(0, step, [], running, [])).token_ids)
    return out


def test_a_runner_with_the_fast_path_off_is_plain_torch_with_the_same_tokens(llama_dir):
    off = runner_for(llama_dir, cpu_fast_path=False)
    assert off.fast_path is None and off.sampler.argmax_rows is first_maximum
    model = off.model
    assert model.elementwise is TORCH_ELEMENTWISE
    assert all(layer.self_attn.ops.name == "reference" for layer in model.model.layers)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert all(m.weight.is_contiguous() for m in model.modules() if isinstance(m, nn.Linear))
    on = runner_for(llama_dir)
    assert on.fast_path is not None and on.fast_path.serves_decode_stack
    with torch.inference_mode():
        assert greedy_steps(off) == greedy_steps(on)


@pytest.fixture(scope="module")
def engines(llama_dir):
    """{"off": an engine with the fast path off, "on": one with it on}, real processes."""
    started = {}
    try:
        for name, on in (("off", False), ("on", True)):
            started[name] = LLM(str(llama_dir), torch_threads=2, cpu_fast_path=on)
        yield started
    finally:
        for llm in started.values():
            llm.shutdown()


def test_the_engine_with_the_fast_path_off_matches_transformers_and_the_fast_path(
    llama_dir, engines
):
    prompts = prompts_of_lengths(llama_dir)
    off = generate_concurrently(engines["off"].address, prompts, GREEDY)
    on = generate_concurrently(engines["on"].address, prompts, GREEDY)
    for prompt, (_, ids, _), (_, fast_ids, _) in zip(prompts, off, on, strict=True):
        assert ids == hf_greedy(llama_dir, prompt, MAX_TOKENS), f"{len(prompt)} tokens diverged"
        assert ids == fast_ids
