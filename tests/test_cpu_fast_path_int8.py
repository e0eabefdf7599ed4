"""`quantization int8` on CPU (kernels/cpu/fast_path.py, panels.py, quantize.py): every bias-free
projection keeps only its int8 panels, the embedding, the norms and the LM head stay fp32; where
the panels widen the weights to fp32 products, the model is then transformers' model with those
projections' weights dequantized, up to fp32 summation order, through prefill and decode steps;
where they multiply int8 by int8 (AVX512-VNNI), it is, to the bit, the same model with each
projection computed in torch by its definition (quantize.int8_dot_product); its decode stack
gives its layer-by-layer steps to the bit; and a quantization that cannot run is refused naming
the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from actorserve.actors.runtime.config import EngineConfig
from actorserve.actors.runtime.config_resolution import resolve_model
from actorserve.actors.worker.loader import load_model
from actorserve.actors.worker.worker import build_runner
from actorserve.kernels import attention_ops
from actorserve.kernels.cpu import bindings
from actorserve.kernels.cpu.capability import cpu_has_int8_dot
from actorserve.kernels.cpu.elementwise import C_ELEMENTWISE
from actorserve.kernels.cpu.fast_path import CpuFastPath
from actorserve.kernels.cpu.panels import PANEL_ROWS, PackedLinear
from actorserve.kernels.cpu.quantize import dequantize_int8, int8_dot_product, quantize_int8
from actorserve.weights.checkpoints import ensure_checkpoint
from model_support import (
    PagedCache,
    assert_close,
    check_decode_stack_steps,
    hf_logits,
    random_prompt,
    torch_threads,
)

KINDS = ["tiny-llama", "tiny-qwen3", "demo"]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    assert bindings.load() is not None, "the CPU kernels could not be built (no C compiler?)"
    with torch_threads(1):
        yield


def int8_model(path: Path, stack: bool = True, **cache_args):
    """(model, config, fast path, cache): an fp32 checkpoint as the Worker builds it with
    quantization int8, its decode stack packed over the cache where `stack`."""
    model, config = load_model(path, "cpu", torch.float32, attention_ops("cpu"), C_ELEMENTWISE)
    fast = CpuFastPath(bindings.load(), quantization="int8")
    cache = PagedCache(model, config, fast_path=fast, **cache_args)
    fast.prepare(model, cache.kv if stack else None)
    return model, config, fast, cache


def dequantized_hf(path: Path):
    """transformers' model of the checkpoint in fp32, each projection's weight replaced by its
    int8 round trip (quantized per row, as ours: a fused qkv's rows are q's, k's and v's)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    for name, module in hf.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            module.weight.data = dequantize_int8(*quantize_int8(module.weight.data))
    return hf.eval()


def projections(model) -> list[nn.Module]:
    return [
        p
        for layer in model.model.layers
        for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj)
        + (layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_int8_keeps_only_int8_panels_of_the_projections_and_the_rest_in_fp32(kind):
    model, config, fast, _ = int8_model(ensure_checkpoint(kind))
    for p in projections(model):
        assert isinstance(p, PackedLinear) and p.weight is None
        assert p.panel.int8 and p.panel.panels.dtype == torch.int8
        assert p.panel.panels.numel() < p.in_features * p.out_features * 1.3  # ~1 byte each
    params = dict(model.named_parameters())
    assert all(t.dtype == torch.float32 for t in params.values())
    assert not any("_proj" in name for name in params)  # the fp32 copies are gone
    assert "model.embed_tokens.weight" in params
    assert model.lm_head_weight().dtype == torch.float32
    assert fast.serves_decode_stack  # qwen3 too: the stack norms its q/k heads


def test_a_projection_with_a_bias_stays_as_loaded():
    model, _, _, _ = int8_model(ensure_checkpoint("tiny-qwen2"))  # q/k/v biases
    for layer in model.model.layers:
        assert type(layer.self_attn.qkv_proj) is nn.Linear
        assert layer.self_attn.qkv_proj.weight.dtype == torch.float32
        assert layer.mlp.down_proj.panel.int8


PROMPTS = {"long": random_prompt(PANEL_ROWS + 22, 1), "short": random_prompt(9, 2)}


def plan_steps(full: dict[str, list[int]]) -> list[dict[str, tuple[int, int]]]:
    """A prefill longer than PANEL_ROWS (the int8 kernel at prefill size), a chunked prefill
    beside it, then decode steps (through the decode stack where it serves) over the tokens of
    `full` past PROMPTS."""
    plan = [{"long": (0, PANEL_ROWS + 22), "short": (0, 4)}, {"short": (4, 9)}]
    for i in range(len(full["short"]) - len(PROMPTS["short"])):
        plan.append({seq: (len(PROMPTS[seq]) + i, len(PROMPTS[seq]) + i + 1) for seq in full})
    return plan


def run_steps(cache, full: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Each sequence's logits over the steps of plan_steps, concatenated."""
    got: dict[str, list[torch.Tensor]] = {seq: [] for seq in full}
    for chunks in plan_steps(full):
        out = cache.step({seq: full[seq][lo:hi] for seq, (lo, hi) in chunks.items()})
        for seq, logits in out.items():
            got[seq].append(logits)
    return {seq: torch.cat(logits) for seq, logits in got.items()}


@torch.no_grad()
@pytest.mark.parametrize("kind", KINDS)
def test_the_int8_model_is_the_dequantized_model_up_to_fp32_summation_order(kind):
    """plan_steps' prefills and decode steps; every logit against transformers with the same
    dequantized weights (model_support's tolerance, which fp32 order noise is far below), each
    step fed transformers' greedy token."""
    if bindings.load().panel_int8_dot():
        pytest.skip(
            "the panels multiply int8 by int8: each projection rounds its input rows to int8, "
            "and fp32 order noise upstream moving a value across a rounding boundary moves it a "
            "whole step, so no fp32-order tolerance holds (test_the_int8_x_int8_model_is_...)"
        )
    path = ensure_checkpoint(kind)
    hf = dequantized_hf(path)
    _, _, _, cache = int8_model(path, num_blocks=40)
    full = {seq: list(tokens) for seq, tokens in PROMPTS.items()}
    for _ in range(5):
        for seq in full:  # transformers' greedy token: both sides see the same context
            full[seq] = full[seq] + [int(hf_logits(hf, full[seq])[-1].argmax())]
    for seq, ours in run_steps(cache, full).items():
        assert_close(ours, hf_logits(hf, full[seq][: len(ours)]))


@torch.no_grad()
@pytest.mark.skipif(not cpu_has_int8_dot(), reason="no AVX512-VNNI: the int8 panels widen")
@pytest.mark.parametrize("kind", KINDS)
def test_the_int8_x_int8_model_is_its_torch_definition_to_the_bit(kind):
    """plan_steps' prefills and decode steps (the decode stack where it serves) give, to the
    bit, the logits of the same model run layer by layer with each projection computed in torch
    as int8_dot_product of its input rows and its weight's int8 quantization: the kernel is its
    definition at every size, and nothing around it (the fused qkv and gate_up, the stack)
    changes what it is given. (That the model around the projections is transformers' is the
    fp32 fast path's tests; that int8 serving stays logprobs-close to transformers in fp32,
    tests/test_int8_matches_transformers.py.)"""
    path = ensure_checkpoint(kind)
    model, _, fast, cache = int8_model(path, num_blocks=40)
    assert bindings.load().panel_int8_dot() and fast.serves_decode_stack
    reference, _, _, reference_cache = int8_model(path, stack=False, num_blocks=40)
    plain, _ = load_model(path, "cpu", torch.float32, attention_ops("cpu"), C_ELEMENTWISE)
    weights = dict(plain.named_modules())
    for name, module in reference.named_modules():
        if isinstance(module, PackedLinear):
            q, scale = quantize_int8(weights[name].weight.data)
            module.forward = lambda x, q=q, scale=scale: int8_dot_product(
                x.reshape(-1, q.shape[1]), q, scale
            ).reshape(*x.shape[:-1], len(q))
    full = {seq: tokens + [100 + i for i in range(5)] for seq, tokens in PROMPTS.items()}
    ours, theirs = run_steps(cache, full), run_steps(reference_cache, full)
    for seq in full:
        assert ours[seq].shape[0] == len(full[seq]) and torch.equal(ours[seq], theirs[seq])


@torch.no_grad()
@pytest.mark.parametrize("kind", ["tiny-llama", "demo"])
@pytest.mark.parametrize("num_seqs", [4, 40])
def test_the_int8_decode_stack_gives_its_layer_by_layer_steps_to_the_bit(kind, num_seqs):
    """The stack runs the layers' own int8 kernel in their order: the same hidden states and
    K/V. 4 sequences: each kernel shares its work out; 40: each of 2 threads its own rows."""
    model, _, fast, cache = int8_model(ensure_checkpoint(kind), num_blocks=8 * num_seqs, seed=2)
    assert fast.serves_decode_stack
    check_decode_stack_steps(model, fast, cache, num_seqs)


def test_the_worker_runs_int8_in_fp32_and_says_so(caplog):
    config = EngineConfig(
        model=str(ensure_checkpoint("demo-bf16")), num_kv_blocks=8, quantization="int8"
    )
    with caplog.at_level("INFO"):
        runner = build_runner(resolve_model(config))
    assert runner.model.lm_head_weight().dtype == torch.float32  # a bf16 checkpoint, upcast
    assert runner.kv.layers[0][0].dtype == torch.float32
    assert runner.fast_path.serves_decode_stack
    assert all(p.panel.int8 for p in projections(runner.model))
    assert "quantization=int8: fp32 activations" in caplog.text
    assert "quantization int8: 16 projections in int8 panels" in caplog.text


@pytest.mark.parametrize(
    "settings",
    [
        dict(dtype="bfloat16"),
        dict(dtype="float16"),
        dict(cpu_fast_path=False),
        dict(device="cuda"),
        dict(device="cuda:1"),
        dict(tensor_parallel_size=2),
    ],
)
def test_int8_is_refused_where_the_settings_cannot_run_it(settings):
    EngineConfig(model="m", quantization="int8", dtype="float32").validate()
    with pytest.raises(ValueError, match="quantization must be none unless the CPU fast path"):
        EngineConfig(model="m", quantization="int8", **settings).validate()
    EngineConfig(model="m", **settings).validate()  # without int8, the same settings pass
    with pytest.raises(ValueError, match=r"quantization must be one of \('none', 'int8', 'bf16'\)"):
        EngineConfig(model="m", quantization="int4").validate()


def test_int8_is_refused_where_the_worker_has_no_c_kernels(monkeypatch):
    monkeypatch.setattr(bindings, "load", lambda *march: None)  # as without a C compiler
    config = EngineConfig(
        model=str(ensure_checkpoint("tiny-llama")), num_kv_blocks=8, quantization="int8"
    )
    with pytest.raises(ValueError, match="quantization must be none where the CPU fast path"):
        build_runner(resolve_model(config))
