"""The Worker's dtypes (actors/worker/dtypes.py): `dtype auto` keeps a bf16 checkpoint where the
device runs bf16 natively and upcasts elsewhere, an fp32 checkpoint stays fp32, the KV cache
follows kv_cache_dtype; and the CPU fast path serves no step of a bf16 model where the CPU
lacks native bf16 (nor the decode stack over a bf16 cache). Where it has it:
test_cpu_fast_path_bf16.py."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch import nn

from actorserve.actors.runtime.config import EngineConfig
from actorserve.actors.runtime.config_resolution import resolve_model
from actorserve.actors.worker import dtypes
from actorserve.actors.worker.loader import load_model
from actorserve.actors.worker.worker import build_runner
from actorserve.kernels import attention_ops
from actorserve.kernels.cpu import bindings, capability
from actorserve.kernels.cpu.elementwise import C_ELEMENTWISE
from actorserve.kernels.cpu.fast_path import CpuFastPath
from actorserve.kernels.cpu.panels import PackedLinear
from actorserve.weights.checkpoints import ensure_checkpoint
from model_support import PagedCache, bf16_model, random_prompt, torch_threads

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
needs_bf16_cpu = pytest.mark.skipif(
    not capability.cpu_has_bf16(), reason="this CPU has no AMX-BF16 or AVX512-BF16"
)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


def test_auto_keeps_fp32_and_upcasts_bf16_where_the_cpu_lacks_it(monkeypatch):
    assert dtypes.model_dtype("auto", "float32", CPU).dtype == torch.float32
    assert dtypes.model_dtype("auto", None, CPU).dtype == torch.float32
    assert dtypes.model_dtype("auto", "float32", CUDA).dtype == torch.float32
    assert dtypes.model_dtype("auto", "bfloat16", CUDA).dtype == torch.bfloat16
    assert dtypes.model_dtype("auto", "float16", CPU).dtype == torch.float32
    monkeypatch.setattr(dtypes, "cpu_bf16_feature", lambda: None)
    choice = dtypes.model_dtype("auto", "bfloat16", CPU)
    assert choice.dtype == torch.float32 and "no AMX-BF16 or AVX512-BF16" in choice.reason
    monkeypatch.setattr(dtypes, "cpu_bf16_feature", lambda: "amx_bf16")
    choice = dtypes.model_dtype("auto", "bfloat16", CPU)
    assert choice.dtype == torch.bfloat16 and "amx_bf16" in choice.reason


def test_an_explicit_dtype_is_taken_as_asked():
    assert dtypes.model_dtype("float32", "bfloat16", CPU).dtype == torch.float32
    assert dtypes.model_dtype("bfloat16", "float32", CPU).dtype == torch.bfloat16
    assert dtypes.kv_cache_dtype("auto", torch.bfloat16).dtype == torch.bfloat16
    assert dtypes.kv_cache_dtype("float32", torch.bfloat16).dtype == torch.float32
    assert dtypes.kv_cache_dtype("bfloat16", torch.float32).dtype == torch.bfloat16


def test_kv_cache_dtype_is_validated():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model="m", kv_cache_dtype="float16").validate()
    decoded = msgspec.json.decode(
        b'{"model": "m", "kv_cache_dtype": "bfloat16"}', type=EngineConfig
    )
    assert decoded.kv_cache_dtype == "bfloat16"


def _runner(kind: str, **settings):
    config = EngineConfig(model=str(ensure_checkpoint(kind)), num_kv_blocks=8, **settings)
    return build_runner(resolve_model(config))


def _dtypes(runner) -> tuple[torch.dtype, torch.dtype]:
    return runner.model.lm_head_weight().dtype, runner.kv.layers[0][0].dtype


@needs_bf16_cpu
def test_the_worker_serves_a_bf16_checkpoint_in_bf16_on_this_cpu():
    assert _dtypes(_runner("demo-bf16")) == (torch.bfloat16, torch.bfloat16)
    assert _dtypes(_runner("demo-bf16", kv_cache_dtype="float32")) == (
        torch.bfloat16,
        torch.float32,
    )


def test_the_worker_serves_fp32_checkpoints_and_explicit_float32_in_fp32():
    assert _dtypes(_runner("tiny-llama")) == (torch.float32, torch.float32)
    assert _dtypes(_runner("demo-bf16", dtype="float32")) == (torch.float32, torch.float32)


def _run(cache: PagedCache) -> list[torch.Tensor]:
    """A prefill of two sequences, then three decode steps of both, greedy: every step's logits."""
    prompts = {"a": random_prompt(21, 1), "b": random_prompt(7, 2)}
    out, chunks = [], prompts
    for _ in range(4):
        logits = cache.step(chunks)
        out += [logits[seq] for seq in chunks]
        chunks = {seq: [int(logits[seq][-1].argmax())] for seq in chunks}
    return out


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_the_fast_path_serves_no_step_of_a_bf16_model_without_native_bf16(kv_dtype):
    path = ensure_checkpoint("demo-bf16")
    fast = CpuFastPath(bindings.load(), native_bf16=False)
    model, cache = bf16_model(path, fast, kv_dtype)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert all(m.weight.is_contiguous() for m in model.modules() if isinstance(m, nn.Linear))
    assert fast.greedy_head is None and not fast.serves_decode_stack
    hidden = torch.randn(3, model.config.hidden_size).bfloat16()
    assert fast.greedy_tokens(hidden) is None
    assert fast.forward(*cache.inputs({"x": [5]})) is None
    _, plain = bf16_model(path, None, kv_dtype)
    got, expected = _run(cache), _run(plain)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_an_fp32_model_over_a_bf16_cache_gets_no_decode_stack():
    path = ensure_checkpoint("demo")
    model, config = load_model(path, "cpu", torch.float32, attention_ops("cpu"), C_ELEMENTWISE)
    fast = CpuFastPath(bindings.load())
    cache = PagedCache(model, config, fast_path=fast)
    cache.kv = [(k.bfloat16(), v.bfloat16()) for k, v in cache.kv]
    fast.prepare(model, cache.kv)
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    assert not fast.serves_decode_stack
    assert all(torch.isfinite(logits).all() for logits in _run(cache))
