"""`quantization bf16` on CPU (kernels/cpu/fast_path.py, panels.py): a bf16 checkpoint served in
fp32 with every bias-free projection kept only in bf16-weight panels (half the fp32 bytes), the
embedding, the norms and the LM head in fp32. Its weights widened are exactly the fp32 upcast
model's, so every step of at most PANEL_ROWS tokens (where the fp32 fast path multiplies on its
panels too) gives the fp32 fast path's logits to the bit, layer by layer and through the decode
stack; a longer prefill is transformers' fp32 model up to summation order. A quantization bf16
that cannot run is refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from actorserve.actors.runtime.config import EngineConfig
from actorserve.actors.runtime.config_resolution import resolve_model
from actorserve.actors.worker import dtypes
from actorserve.actors.worker.loader import load_model
from actorserve.actors.worker.worker import build_runner
from actorserve.kernels import attention_ops
from actorserve.kernels.cpu import bindings
from actorserve.kernels.cpu.elementwise import C_ELEMENTWISE
from actorserve.kernels.cpu.fast_path import CpuFastPath
from actorserve.kernels.cpu.panels import PANEL_ROWS, PackedLinear
from actorserve.weights.checkpoints import ensure_checkpoint
from model_support import (
    PagedCache,
    assert_close,
    check_decode_stack_steps,
    hf_logits,
    random_prompt,
    torch_threads,
)

KINDS = ["demo-bf16", "tiny-qwen3-bf16"]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    assert bindings.load() is not None, "the CPU kernels could not be built (no C compiler?)"
    with torch_threads(1):
        yield


def fp32_model(path: Path, quantization: str, **cache_args):
    """(model, config, fast path, cache): the checkpoint upcast to fp32 as the Worker builds it
    with `quantization` (none: the fp32 fast path), its decode stack packed over the cache."""
    model, config = load_model(path, "cpu", torch.float32, attention_ops("cpu"), C_ELEMENTWISE)
    fast = CpuFastPath(bindings.load(), quantization=quantization)
    cache = PagedCache(model, config, fast_path=fast, **cache_args)
    fast.prepare(model, cache.kv)
    return model, config, fast, cache


def projections(model) -> list[nn.Module]:
    return [
        p
        for layer in model.model.layers
        for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj)
        + (layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_keeps_only_bf16_panels_of_the_projections_and_the_rest_in_fp32(kind):
    model, config, fast, _ = fp32_model(ensure_checkpoint(kind), "bf16")
    for p in projections(model):
        assert isinstance(p, PackedLinear) and p.weight is None
        assert p.panel.bf16_weights and p.panel.panels.dtype == torch.bfloat16
        assert p.panel.panels.numel() < p.in_features * p.out_features * 1.3  # ~2 bytes each
    params = dict(model.named_parameters())
    assert all(t.dtype == torch.float32 for t in params.values())
    assert not any("_proj" in name for name in params)  # the fp32 copies are gone
    assert model.lm_head_weight().dtype == torch.float32
    assert fast.serves_decode_stack  # qwen3 too: the stack norms its q/k heads


@torch.no_grad()
@pytest.mark.parametrize("kind", KINDS)
def test_steps_of_at_most_panel_rows_tokens_are_the_fp32_fast_paths_to_the_bit(kind):
    """Prefill chunks and decodes (through the decode stack where it serves) side by side with
    the fp32 fast path over the same checkpoint upcast: the same logits, bit for bit."""
    path = ensure_checkpoint(kind)
    _, _, _, narrow = fp32_model(path, "bf16", num_blocks=40)
    _, _, _, wide = fp32_model(path, "none", num_blocks=40)
    prompts = {f"s{i}": random_prompt(n, i) for i, n in enumerate((PANEL_ROWS - 40, 17, 5))}
    plan = [{"s0": prompts["s0"], "s1": prompts["s1"][:9]}, {"s1": prompts["s1"][9:]}]
    plan.append({"s2": prompts["s2"]})
    plan += [{seq: [200 + i + j] for j, seq in enumerate(prompts)} for i in range(4)]
    for chunks in plan:
        ours, theirs = narrow.step(chunks), wide.step(chunks)
        for seq in chunks:
            assert torch.equal(ours[seq], theirs[seq])


@torch.no_grad()
@pytest.mark.parametrize("kind", KINDS)
def test_a_prefill_past_panel_rows_is_transformers_fp32_model_up_to_summation_order(kind):
    """Over PANEL_ROWS tokens the panels serve the prefill too (the fp32 path's MKL sums in
    another order); every logit against transformers' fp32 model (model_support's tolerance)."""
    from transformers import AutoModelForCausalLM

    path = ensure_checkpoint(kind)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    _, _, _, cache = fp32_model(path, "bf16", num_blocks=40)
    tokens = random_prompt(PANEL_ROWS + 22, 1)
    ours = [cache.step({"long": tokens})["long"]]
    for _ in range(3):
        tokens = tokens + [int(ours[-1][-1].argmax())]
        ours.append(cache.step({"long": tokens[-1:]})["long"])
    assert_close(torch.cat(ours), hf_logits(hf, tokens))


@torch.no_grad()
@pytest.mark.parametrize("num_seqs", [4, 40])
def test_the_bf16_weight_decode_stack_gives_its_layer_by_layer_steps_to_the_bit(num_seqs):
    """4 sequences: each kernel shares its work out; 40: each of 2 threads its own rows."""
    path = ensure_checkpoint("demo-bf16")
    model, _, fast, cache = fp32_model(path, "bf16", num_blocks=8 * num_seqs, seed=2)
    assert fast.serves_decode_stack
    check_decode_stack_steps(model, fast, cache, num_seqs)


def test_the_worker_runs_bf16_weights_in_fp32_and_says_so(caplog):
    config = EngineConfig(
        model=str(ensure_checkpoint("demo-bf16")), num_kv_blocks=8, quantization="bf16"
    )
    with caplog.at_level("INFO"):
        runner = build_runner(resolve_model(config))
    assert runner.model.lm_head_weight().dtype == torch.float32
    assert runner.kv.layers[0][0].dtype == torch.float32
    assert runner.fast_path.serves_decode_stack
    assert all(p.panel.bf16_weights for p in projections(runner.model))
    assert "quantization=bf16: fp32 activations" in caplog.text
    assert "quantization bf16: 16 projections in bf16-weight panels" in caplog.text


@pytest.mark.parametrize(
    "settings",
    [
        dict(dtype="bfloat16"),
        dict(dtype="float16"),
        dict(cpu_fast_path=False),
        dict(device="cuda"),
        dict(tensor_parallel_size=2),
    ],
)
def test_bf16_is_refused_where_the_settings_cannot_run_it(settings):
    EngineConfig(model="m", quantization="bf16", dtype="float32").validate()
    with pytest.raises(ValueError, match="quantization must be none unless the CPU fast path"):
        EngineConfig(model="m", quantization="bf16", **settings).validate()
    with pytest.raises(ValueError, match=r"quantization must be one of \('none', 'int8', 'bf16'\)"):
        EngineConfig(model="m", quantization="fp8").validate()


def test_bf16_of_a_float16_checkpoint_is_refused_naming_the_field():
    """bf16 would round an fp16 checkpoint's weights (3 bits of mantissa fewer)."""
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="quantization must be none or int8 for a float16"):
        dtypes.model_dtype("auto", "float16", cpu, "bf16")
    for stored in ("bfloat16", "float32", None):
        assert dtypes.model_dtype("auto", stored, cpu, "bf16").dtype == torch.float32


def test_bf16_is_refused_where_the_worker_has_no_c_kernels(monkeypatch):
    monkeypatch.setattr(bindings, "load", lambda *march: None)  # as without a C compiler
    config = EngineConfig(
        model=str(ensure_checkpoint("demo-bf16")), num_kv_blocks=8, quantization="bf16"
    )
    with pytest.raises(ValueError, match="quantization must be none where the CPU fast path"):
        build_runner(resolve_model(config))
