"""`quantization int8` on CPU (kernels/cpu/fast_path.py, panels.py, quantize.py): every bias-free
projection keeps only its int8 panels, the embedding, the norms and the LM head stay fp32; the
model is then transformers' model with those projections' weights dequantized, up to fp32
summation order, through prefill and decode steps; its decode stack gives its layer-by-layer
steps to the bit; and a quantization that cannot run is refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from actorserve.actors.runtime.config import EngineConfig
from actorserve.actors.worker.loader import load_model
from actorserve.actors.worker.worker import build_runner
from actorserve.kernels import attention_ops
from actorserve.kernels.cpu import bindings
from actorserve.kernels.cpu.elementwise import C_ELEMENTWISE
from actorserve.kernels.cpu.fast_path import CpuFastPath
from actorserve.kernels.cpu.panels import PANEL_ROWS, PackedLinear
from actorserve.kernels.cpu.quantize import dequantize_int8, quantize_int8
from actorserve.weights.checkpoints import ensure_checkpoint
from model_support import PagedCache, assert_close, hf_logits, random_prompt, torch_threads

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
    assert fast.serves_decode_stack == (not config.qk_norm)  # qwen3: layer by layer


def test_a_projection_with_a_bias_stays_as_loaded():
    model, _, _, _ = int8_model(ensure_checkpoint("tiny-qwen2"))  # q/k/v biases
    for layer in model.model.layers:
        assert type(layer.self_attn.qkv_proj) is nn.Linear
        assert layer.self_attn.qkv_proj.weight.dtype == torch.float32
        assert layer.mlp.down_proj.panel.int8


@torch.no_grad()
@pytest.mark.parametrize("kind", KINDS)
def test_the_int8_model_is_the_dequantized_model_up_to_fp32_summation_order(kind):
    """A prefill longer than PANEL_ROWS (the int8 kernel at prefill size), a chunked prefill
    beside it, then decode steps (through the decode stack where it serves); every logit
    against transformers with the same dequantized weights (model_support's tolerance, which
    fp32 order noise is far below), each step fed transformers' greedy token."""
    path = ensure_checkpoint(kind)
    hf = dequantized_hf(path)
    _, _, _, cache = int8_model(path, num_blocks=40)
    prompts = {"long": random_prompt(PANEL_ROWS + 22, 1), "short": random_prompt(9, 2)}
    full = dict(prompts)
    plan = [{"long": (0, PANEL_ROWS + 22), "short": (0, 4)}, {"short": (4, 9)}]
    for _ in range(5):
        plan.append({seq: (len(full[seq]), len(full[seq]) + 1) for seq in prompts})
        for seq in prompts:  # transformers' greedy token: both sides see the same context
            full[seq] = full[seq] + [int(hf_logits(hf, full[seq])[-1].argmax())]
    got: dict[str, list[torch.Tensor]] = {seq: [] for seq in prompts}
    for chunks in plan:
        out = cache.step({seq: full[seq][lo:hi] for seq, (lo, hi) in chunks.items()})
        for seq, logits in out.items():
            got[seq].append(logits)
    for seq, tokens in full.items():
        ours = torch.cat(got[seq])
        assert_close(ours, hf_logits(hf, tokens[: len(ours)]))


@torch.no_grad()
@pytest.mark.parametrize("kind", ["tiny-llama", "demo"])
@pytest.mark.parametrize("num_seqs", [4, 40])
def test_the_int8_decode_stack_gives_its_layer_by_layer_steps_to_the_bit(kind, num_seqs):
    """The stack runs the layers' own int8 kernel in their order: the same hidden states and
    K/V. 4 sequences: each kernel shares its work out; 40: each of 2 threads its own rows."""
    model, _, fast, cache = int8_model(ensure_checkpoint(kind), num_blocks=8 * num_seqs, seed=2)
    assert fast.serves_decode_stack
    lengths = {f"s{i}": (5, 19, 37, 64, 90)[i % 5] + i for i in range(num_seqs)}
    with torch_threads(2):
        cache.step({seq: random_prompt(n, i) for i, (seq, n) in enumerate(lengths.items())})
        for i in range(3):
            args = cache.inputs({seq: [100 + i] for seq in lengths})
            stacked = fast.forward(*args)
            assert stacked is not None
            written = [t.clone() for layer in cache.kv for t in layer]
            layered = model(*args)  # writes the same slots again
            assert torch.equal(stacked, layered)
            assert all(
                torch.equal(a, b) for a, b in zip(written, [t for kv in cache.kv for t in kv])
            )


def test_the_worker_runs_int8_in_fp32_and_says_so(caplog):
    config = EngineConfig(
        model=str(ensure_checkpoint("demo-bf16")), num_kv_blocks=8, quantization="int8"
    )
    with caplog.at_level("INFO"):
        runner = build_runner(config.resolve_model())
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
    with pytest.raises(ValueError, match=r"quantization must be one of \('none', 'int8'\)"):
        EngineConfig(model="m", quantization="int4").validate()


def test_int8_is_refused_where_the_worker_has_no_c_kernels(monkeypatch):
    monkeypatch.setattr(bindings, "load", lambda *march: None)  # as without a C compiler
    config = EngineConfig(
        model=str(ensure_checkpoint("tiny-llama")), num_kv_blocks=8, quantization="int8"
    )
    with pytest.raises(ValueError, match="quantization must be none where the CPU fast path"):
        build_runner(config.resolve_model())
