"""The CPU fast path over our model (kernels/cpu/fast_path.py): its packed LM head gives the plain
logits, its greedy heads the first maximum of them, its packed projections and its one-call decode
stack the plain model's results (the stack to the bit), each against transformers where it runs a
whole schedule (tolerance: tests/model_support.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from actorserve.actors.runtime.model_config import ModelConfig
from actorserve.actors.worker.loader import load_model
from actorserve.kernels import attention_ops
from actorserve.kernels.cpu import bindings
from actorserve.kernels.cpu.capability import cpu_has_bf16
from actorserve.kernels.cpu.elementwise import C_ELEMENTWISE
from actorserve.kernels.cpu.fast_path import CpuFastPath
from actorserve.kernels.cpu.panels import GreedyHead, PackedLinear
from actorserve.kernels.cpu.screened_head import ScreenedGreedyHead
from actorserve.kernels.cpu.screened_head_int8 import Int8ScreenedHead
from actorserve.weights.checkpoints import ensure_checkpoint
from model_support import (
    BLOCK_SIZE,
    PagedCache,
    check_chunked_prefill_then_decode,
    check_decode_stack_steps,
    random_prompt,
    torch_threads,
)

KINDS = ["tiny-llama", "tiny-qwen3", "tiny-qwen2", "tiny-mistral", "tiny-llama3", "demo"]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny matmuls gain nothing from a second thread and lose much when the cores are busy."""
    assert bindings.load() is not None, "the CPU kernels could not be built (no C compiler?)"
    with torch_threads(1):
        yield


@pytest.fixture(scope="module", params=KINDS)
def models(request):
    """(HF model, our model in plain torch, config, checkpoint path) of one kind."""
    from transformers import AutoModelForCausalLM

    path = ensure_checkpoint(request.param)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    ours, config = load_model(path, "cpu", torch.float32, attention_ops("cpu", "reference"))
    return hf.eval(), ours, config, path


def for_fast_path(path: Path) -> tuple[nn.Module, ModelConfig]:
    """Our model built as the Worker builds it with the fast path: `cpu` attention, C
    elementwise ops (not yet prepared)."""
    return load_model(path, "cpu", torch.float32, attention_ops("cpu"), C_ELEMENTWISE)


def prepared(path: Path, screen: str = "auto", stack: bool = True, **cache_args):
    """(model, config, fast path, cache): the model prepared as the Worker does, its decode
    stack packed over the cache where `stack`."""
    model, config = for_fast_path(path)
    fast = CpuFastPath(bindings.load(), screen)
    cache = PagedCache(model, config, fast_path=fast, **cache_args)
    fast.prepare(model, cache.kv if stack else None)
    return model, config, fast, cache


def sum_order_bound(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """How far apart two fp32 products hidden @ weight.T may lie when each sums its k terms in
    its own order: each is within g |a| . |w_j| of the exact value, g = k u / (1 - k u)."""
    k, u = hidden.shape[1], 2.0**-24
    g = k * u / (1 - k * u)
    return 2 * g * (hidden.double().abs() @ weight.double().abs().T)


@pytest.mark.parametrize("rows", [1, 3, 64, 200])
def test_the_packed_cpu_lm_head_gives_the_plain_logits(models, rows):
    """oneDNN's packed GEMM and MKL sum in different orders: the logits agree within the bound
    of that (relative to each logit's magnitude), not to a fixed atol."""
    _, ours, config, path = models
    _, _, fast, _ = prepared(path, stack=False)
    assert fast._packed_lm_head is not None, "oneDNN packing is unavailable in this torch build"
    hidden = torch.randn(rows, config.hidden_size, generator=torch.Generator().manual_seed(rows))
    packed, plain = fast.compute_logits(hidden), ours.compute_logits(hidden)
    assert packed.shape == plain.shape and packed.dtype == torch.float32
    error = (packed.double() - plain.double()).abs()
    assert bool((error <= sum_order_bound(hidden, ours.lm_head_weight())).all())


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64, 200])
def test_the_fused_greedy_head_picks_the_first_maximum_of_the_logits(models, rows):
    _, ours, config, path = models
    _, _, fast, _ = prepared(path, stack=False)
    hidden = torch.randn(rows, config.hidden_size, generator=torch.Generator().manual_seed(rows))
    tokens = fast.greedy_tokens(hidden)
    assert tokens is not None, "the fused greedy head is unavailable"
    assert torch.equal(tokens, ours.compute_logits(hidden).max(dim=-1).indices)
    each_alone = torch.cat([fast.greedy_tokens(hidden[i : i + 1]) for i in range(rows)])
    assert torch.equal(tokens, each_alone)  # a row's token does not depend on the batch


def test_the_greedy_head_is_the_one_greedy_head_screen_asks(models):
    """auto: the int8 screen where there is AMX, else the bf16 screen where there is bf16
    arithmetic, else the exact fused head; int8 / bf16: that screen where it serves (bf16 even
    without bf16 hardware), else the exact head; off: the exact head."""
    path = models[3]

    def served(screen: str) -> type:
        return type(prepared(path, screen, stack=False)[2]._greedy_head)

    amx = bool(bindings.load().int8_screen_available())
    auto = served("auto")
    if amx:
        assert auto is Int8ScreenedHead and served("int8") is Int8ScreenedHead
    else:
        assert served("int8") is GreedyHead
        assert auto in ((ScreenedGreedyHead, GreedyHead) if cpu_has_bf16() else (GreedyHead,))
    assert served("bf16") in (ScreenedGreedyHead, GreedyHead)
    assert served("off") is GreedyHead


def test_projections_on_packed_panels_match_hf(models):
    """As the Worker serves on CPU: up to PANEL_ROWS rows (every step of this schedule) a
    projection without bias runs on its packed panels (csrc/cpu_panel_gemm.c)."""
    hf, _, _, path = models
    model, config = for_fast_path(path)
    fast = CpuFastPath(bindings.load())
    check_chunked_prefill_then_decode(hf, model, config, fast_path=fast)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert packed, "no projection got its panels"
    biased = [m for m in model.modules() if isinstance(m, nn.Linear) and m.bias is not None]
    assert all(type(m) is nn.Linear for m in biased)  # biased: F.linear as before


def serves_decode_stack(config: ModelConfig) -> bool:
    """The one-call decode stack covers the kinds without biases (Qwen3's q/k norm included)."""
    return not (config.qkv_bias or config.o_bias)


@torch.no_grad()
@pytest.mark.parametrize("num_seqs", [4, 40])
def test_the_decode_stack_gives_the_layer_by_layer_path_to_the_bit(models, num_seqs):
    """A step of decodes alone runs the whole decoder in one C call (csrc/cpu_decode_stack.c):
    the same hidden states and the same K/V written as the layer-by-layer path, bit for bit.
    4 sequences: each kernel shares its work out among the threads; 40 (at least 16 a thread):
    each of 2 threads takes its own rows through every layer, attention shared between them."""
    _, _, _, path = models
    model, config, fast, cache = prepared(path, num_blocks=8 * num_seqs, seed=2)
    assert fast.serves_decode_stack == serves_decode_stack(config)
    if not fast.serves_decode_stack:
        return  # biases: every step keeps the layer-by-layer path
    check_decode_stack_steps(model, fast, cache, num_seqs)


def test_the_decode_stack_matches_hf(models):
    """The chunked prefill then decode schedule with its decode steps through the stack."""
    hf, _, _, path = models
    model, config = for_fast_path(path)
    fast = CpuFastPath(bindings.load())
    check_chunked_prefill_then_decode(hf, model, config, fast_path=fast, decode_stack=True)
    assert fast.serves_decode_stack == serves_decode_stack(config)


@torch.no_grad()
def test_the_decode_stack_serves_only_the_caches_it_was_packed_over():
    model, config, fast, packed = prepared(ensure_checkpoint("tiny-llama"), seed=3)
    other = PagedCache(model, config, seed=4, fast_path=fast)
    assert fast.serves_decode_stack
    prompt = random_prompt(21, 5)
    first = {seq: cache.step({"a": prompt})["a"] for seq, cache in (("p", packed), ("o", other))}
    assert fast.forward(*other.inputs({"b": [9]})) is None  # another cache: the model serves
    decoded = {name: cache.step({"a": [9]})["a"] for name, cache in (("p", packed), ("o", other))}
    assert torch.equal(first["p"], first["o"]) and torch.equal(decoded["p"], decoded["o"])


@pytest.mark.parametrize("num_seqs", [1, 40])
def test_the_decode_stack_refuses_a_slot_position_or_token_past_its_tables(num_seqs):
    """1 sequence: the kernels share each call out; 40 on 2 threads: each thread its own rows."""
    path = ensure_checkpoint("tiny-llama")
    _, config, fast, cache = prepared(path, num_blocks=4 * num_seqs)
    assert fast.serves_decode_stack
    input_ids, positions, kv, meta = cache.inputs({f"s{i}": [7] for i in range(num_seqs)})
    past = meta.slot_mapping.clone()
    past[-1] = 4 * num_seqs * BLOCK_SIZE
    with torch_threads(2):
        with pytest.raises(IndexError, match="past the KV cache"):
            fast.forward(input_ids, positions, kv, meta._replace(slot_mapping=past))
        fast.forward(input_ids, positions, kv, meta)  # the same step with its own slots runs
    beyond = positions.clone()
    beyond[-1] = config.max_position_embeddings
    with pytest.raises(IndexError, match="past the rope tables"):
        fast.forward(input_ids, beyond, kv, meta)
    unknown = input_ids.clone()
    unknown[-1] = config.vocab_size
    with pytest.raises(IndexError, match="past the vocabulary"):
        fast.forward(unknown, positions, kv, meta)
