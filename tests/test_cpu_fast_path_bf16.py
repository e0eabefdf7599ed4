"""The CPU fast path over a bf16 model where the CPU multiplies bf16 natively (kernels/cpu/
fast_path.py, panels.py): its projections go through bf16 panels, its greedy head is the exact
bf16 one (no screen), whose panels also give the decode-sized logits, and over a bf16 KV cache
its decode steps run in one C call (the decode stack, fp32 inside); its steps stay within bf16
noise of the plain bf16 model's. Without native bf16
(injected, not faked in /proc) nothing of it serves: test_bf16_dtype.py."""

from __future__ import annotations

import pytest
import torch

from actorserve.actors.runtime.config import EngineConfig
from actorserve.actors.runtime.config_resolution import resolve_model
from actorserve.actors.worker.worker import build_runner
from actorserve.kernels.cpu import bindings, capability
from actorserve.kernels.cpu.fast_path import CpuFastPath
from actorserve.kernels.cpu.panels import GreedyHead, PackedLinear
from actorserve.weights.checkpoints import ensure_checkpoint
from model_support import PagedCache, bf16_model, random_prompt, torch_threads

KINDS = ["demo-bf16", "tiny-qwen3-bf16"]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    assert bindings.load() is not None, "the CPU kernels could not be built (no C compiler?)"
    with torch_threads(1):
        yield


def kind_model(kind: str, fast_path: CpuFastPath | None, kv_dtype=torch.bfloat16):
    """bf16_model of a checkpoint kind."""
    return bf16_model(ensure_checkpoint(kind), fast_path, kv_dtype)


def projections(model) -> list:
    return [
        p
        for layer in model.model.layers
        for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj)
        + (layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_a_bf16_model_gets_bf16_panels_and_the_exact_bf16_head(kind):
    fast = CpuFastPath(bindings.load(), native_bf16=True)
    model, _ = kind_model(kind, fast)
    assert all(isinstance(p, PackedLinear) for p in projections(model))
    assert all(p.panel.dtype == torch.bfloat16 for p in projections(model))
    assert type(fast.greedy_head) is GreedyHead and fast.greedy_head.dtype == torch.bfloat16


def test_the_bf16_decode_stack_serves_over_a_bf16_cache_only():
    over_bf16 = CpuFastPath(bindings.load(), native_bf16=True)
    kind_model("demo-bf16", over_bf16, torch.bfloat16)
    assert over_bf16.serves_decode_stack
    over_fp32 = CpuFastPath(bindings.load(), native_bf16=True)
    kind_model("demo-bf16", over_fp32, torch.float32)
    assert not over_fp32.serves_decode_stack


def test_native_bf16_defaults_to_what_the_cpu_has():
    assert CpuFastPath(bindings.load()).native_bf16 == capability.cpu_has_bf16()


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_bf16_greedy_tokens_are_the_first_maximum_of_the_fast_paths_logits(rows):
    fast = CpuFastPath(bindings.load(), native_bf16=True)
    model, _ = kind_model("demo-bf16", fast)
    torch.manual_seed(rows)
    hidden = torch.randn(rows, model.config.hidden_size).bfloat16()
    logits = fast.compute_logits(hidden)
    assert logits.dtype == torch.float32
    assert torch.equal(fast.greedy_tokens(hidden), logits.max(dim=-1).indices)
    plain = model.compute_logits(hidden)  # bf16 logits, widened
    assert (logits - plain).abs().max() <= 2.0**-7 * plain.abs().max()


def run(cache: PagedCache, follow: list[torch.Tensor] | None = None, steps: int = 6):
    """A prefill of three sequences, then decode steps of all: every step's logits. Each step
    feeds the greedy tokens of `follow` (another run's logits) where given, else its own, so
    two runs see the same tokens even where a near tie flips one's argmax."""
    prompts = {"a": random_prompt(21, 1), "b": random_prompt(7, 2), "c": random_prompt(40, 3)}
    out, chunks = [], prompts
    for _ in range(steps):
        logits = cache.step(chunks)
        out += [logits[seq] for seq in chunks]
        chosen = out[-len(chunks) :] if follow is None else follow[len(out) - len(chunks) :]
        chunks = {seq: [int(rows[-1].argmax())] for seq, rows in zip(chunks, chosen)}
    return out


@torch.no_grad()
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_bf16_fast_path_steps_stay_within_bf16_noise_of_the_plain_model(kind, kv_dtype):
    """Over the same tokens, every step's logits close to the plain bf16 model's (bf16 sums in
    another order are not bit-equal, the model rounds its activations to bf16 between ops and
    the decode stack does not). Over a bf16 cache the decode stack serves the decode steps."""
    fast = CpuFastPath(bindings.load(), native_bf16=True)
    _, fast_cache = kind_model(kind, fast, kv_dtype)
    stack_steps = []  # the steps the stack computed (it declines the prefill)
    if fast.serves_decode_stack:
        stack = fast._stack

        def counted(*args):
            hidden = stack(*args)
            stack_steps.extend([] if hidden is None else [hidden.dtype])
            return hidden

        fast._stack = counted
    _, plain_cache = kind_model(kind, None, kv_dtype)
    expected_run = run(plain_cache)
    for got, expected in zip(run(fast_cache, expected_run), expected_run, strict=True):
        scale = expected.abs().amax(dim=-1, keepdim=True)
        assert ((got - expected).abs() <= 0.05 * scale).all()
    uses_stack = kv_dtype == torch.bfloat16  # qwen3's q/k norms included
    assert stack_steps == ([torch.bfloat16] * 5 if uses_stack else [])


def test_the_worker_gives_a_bf16_checkpoint_the_bf16_fast_path_on_a_native_cpu():
    if not capability.cpu_has_bf16():
        pytest.skip("this CPU has no AMX-BF16 or AVX512-BF16: auto serves fp32")
    config = EngineConfig(model=str(ensure_checkpoint("demo-bf16")), num_kv_blocks=8)
    runner = build_runner(resolve_model(config))
    assert runner.model.lm_head_weight().dtype == torch.bfloat16
    assert all(isinstance(p, PackedLinear) for p in projections(runner.model))
    assert isinstance(runner.fast_path.greedy_head, GreedyHead)
