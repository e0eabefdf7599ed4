"""Our Llama-family model (reference kernels, fp32, CPU) against transformers, logit for logit.

Tolerance: |ours - HF| <= 1e-4 * max|HF logit| (about 4e-3 for these checkpoints, whose logits have
standard deviation 4-8); fp32 op-order noise measures ~4e-5 and the greedy top1-top2 gap has a
1st percentile of ~0.02, so greedy tokens must also be identical.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from actorserve.actors.model_config import ModelConfig, RopeScaling
from actorserve.actors.worker.loader import load_model
from actorserve.actors.worker.models.llama import AttentionMetadata, CausalLM, Projection
from actorserve.checkpoints import ensure_checkpoint
from actorserve.kernels import attention_ops, native
from actorserve.kernels.cpu import GreedyHead
from actorserve.kernels.screened_head import ScreenedGreedyHead
from actorserve.kernels.screened_head_int8 import Int8ScreenedHead

KINDS = ["tiny-llama", "tiny-qwen3", "tiny-qwen2", "tiny-mistral", "tiny-llama3", "demo"]
BLOCK_SIZE = 16
REL_ATOL = 1e-4


@pytest.fixture(scope="session")
def checkpoint():
    """kind -> directory in the shared default root (built once, reused by every test file)."""
    return ensure_checkpoint


@contextlib.contextmanager
def torch_threads(n: int):
    """torch (and the C kernels, on the same OpenMP runtime) on n threads, then back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny matmuls gain nothing from a second thread and lose much when the cores are busy."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module", params=KINDS)
def models(request, checkpoint):
    """(HF model, our model with the reference kernels, config, checkpoint path) of one kind."""
    from transformers import AutoModelForCausalLM

    path = checkpoint(request.param)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    ours, config = load_model(path, "cpu", torch.float32, attention_ops("cpu", "reference"))
    return hf.eval(), ours, config, path


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


TRITON_ON = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            torch.cuda.is_available() or not _triton_importable(),
            reason="Triton's CPU interpreter runs only where there is no CUDA device",
        ),
    ),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


class PagedCache:
    """A KV cache whose blocks are handed out in a shuffled order, and one step's inputs."""

    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        num_blocks: int = 24,
        seed: int = 0,
        device: str = "cpu",
    ):
        self.model, self.device = model, device
        shape = (num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        self.kv = [
            (torch.zeros(shape, device=device), torch.zeros(shape, device=device))
            for _ in range(config.num_layers)
        ]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.free = self.free.tolist()
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    @torch.no_grad()
    def step(self, chunks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Run one step over {seq: new token ids}; returns {seq: logits [len(ids), vocab]}."""
        hidden = self.model(*self.inputs(chunks))
        logits = self.model.compute_logits(hidden).cpu()
        assert logits.dtype == torch.float32
        return dict(zip(chunks, logits.split([len(t) for t in chunks.values()]), strict=True))

    def inputs(self, chunks: dict[str, list[int]]):
        """The model's arguments for a step over {seq: new token ids} (taking their blocks)."""
        ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for seq, tokens in chunks.items():
            start = self.lens.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free.pop())
            pos = list(range(start, end))
            ids += tokens
            positions += pos
            slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in pos]
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(end)
            self.lens[seq] = end
        width = max(len(self.tables[seq]) for seq in chunks)
        tables = [self.tables[seq] + [0] * (width - len(self.tables[seq])) for seq in chunks]
        dev = {"device": self.device}
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, **dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, **dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, **dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, **dev),
        )
        input_ids, positions = torch.tensor(ids, **dev), torch.tensor(positions, **dev)
        return input_ids, positions, self.kv, meta


@torch.no_grad()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation by full recomputation (no HF cache involved)."""
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    atol = REL_ATOL * float(ref.abs().max())
    err = float((ours - ref).abs().max())
    assert err <= atol, f"max |ours - HF| = {err:.3e} > {atol:.3e}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def random_prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(5, 32000, (length - 1,), generator=gen).tolist()


def test_batched_prefill_matches_hf(models):
    hf, ours, config, _ = models
    prompts = {"a": random_prompt(5, 1), "b": random_prompt(19, 2), "c": random_prompt(37, 3)}
    out = PagedCache(ours, config).step(prompts)
    for seq, prompt in prompts.items():
        assert_close(out[seq], hf_logits(hf, prompt))


def check_chunked_prefill_then_decode(
    hf, ours, config, device: str = "cpu", decode_stack: bool = False
) -> None:
    """Seq a prefills in two chunks while seq b, prefilled whole, is already decoding (with
    `decode_stack`, the model packs its decode stack over the cache: steps 3 on use it)."""
    steps = 6
    prompts = {"a": random_prompt(29, 4), "b": random_prompt(11, 5)}
    full = {seq: p + hf_greedy(hf, p, steps + 1) for seq, p in prompts.items()}
    ref = {seq: hf_logits(hf, tokens) for seq, tokens in full.items()}
    cache = PagedCache(ours, config, seed=1, device=device)
    if decode_stack:
        ours.pack_decode_stack_for_cpu(cache.kv)
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    schedule = [{"a": (0, 13), "b": (0, 11)}, {"a": (13, 29), "b": (11, 12)}]
    schedule += [{"a": (29 + i, 30 + i), "b": (12 + i, 13 + i)} for i in range(steps - 1)]
    for plan in schedule:
        out = cache.step({seq: full[seq][lo:hi] for seq, (lo, hi) in plan.items()})
        for seq, logits in out.items():
            got[seq].append(logits)
    for seq, prompt in prompts.items():
        logits = torch.cat(got[seq])
        n = len(logits)
        assert_close(logits, ref[seq][:n])
        greedy = logits[len(prompt) - 1 :].argmax(-1).tolist()
        assert greedy == full[seq][len(prompt) : n + 1]


def test_chunked_prefill_then_decode_matches_hf(models):
    hf, ours, config, _ = models
    check_chunked_prefill_then_decode(hf, ours, config)


@pytest.mark.parametrize("device", TRITON_ON)
def test_triton_kernels_match_hf(models, device):
    """The same schedule through the Triton kernels (interpreted on CPU), fp32."""
    hf, _, _, path = models
    ours, config = load_model(path, device, torch.float32, attention_ops(device, "triton"))
    check_chunked_prefill_then_decode(hf, ours, config, device)


def test_config_fields(checkpoint):
    qwen2 = ModelConfig.from_dir(checkpoint("tiny-qwen2"))
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_dir(checkpoint("tiny-qwen3"))
    assert qwen3.qk_norm and qwen3.head_dim == 64 and qwen3.num_heads * 64 != qwen3.hidden_size
    llama = ModelConfig.from_dir(checkpoint("tiny-llama"))
    assert llama.tie_word_embeddings and llama.rope_scaling is None
    assert (llama.bos_token_id, llama.eos_token_ids, llama.max_model_len) == (1, (2,), 2048)
    llama3 = ModelConfig.from_dir(checkpoint("tiny-llama3"))
    assert llama3.rope_scaling == RopeScaling(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=256,
    )


def test_config_reads_transformers4_rope_spelling(checkpoint):
    hf = json.loads((checkpoint("tiny-llama3") / "config.json").read_text())
    old = dict(hf)
    params = dict(old.pop("rope_parameters"))
    old["rope_theta"] = params.pop("rope_theta")
    old["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in params.items()}
    assert ModelConfig.from_hf(old) == ModelConfig.from_hf(hf)


def test_sliding_window_caps_max_model_len(checkpoint):
    hf = json.loads((checkpoint("tiny-mistral") / "config.json").read_text())
    config = ModelConfig.from_hf({**hf, "sliding_window": 1024})
    assert (config.sliding_window, config.max_model_len) == (1024, 1024)
    qwen2 = json.loads((checkpoint("tiny-qwen2") / "config.json").read_text())
    assert ModelConfig.from_hf({**qwen2, "sliding_window": 1024}).sliding_window is None


def test_config_rejects_unsupported(checkpoint):
    hf = json.loads((checkpoint("tiny-llama") / "config.json").read_text())
    with pytest.raises(ValueError, match="architectures.*GPT2LMHeadModel"):
        ModelConfig.from_hf({**hf, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="rope_type.*yarn"):
        ModelConfig.from_hf({**hf, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf({**hf, "hidden_act": "gelu"})


@pytest.fixture
def broken_checkpoint(checkpoint, tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    src = checkpoint("tiny-llama")
    for name in ("config.json", "generation_config.json"):
        shutil.copyfile(src / name, tmp_path / name)
    return tmp_path, load_file(src / "model.safetensors")


def test_loader_names_missing_tensor(broken_checkpoint):
    path, tensors = broken_checkpoint
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model.layers.1.self_attn.k_proj"):
        load_model(path, "cpu", torch.float32, attention_ops("cpu", "reference"))


def test_loader_names_unexpected_tensor(broken_checkpoint):
    path, tensors = broken_checkpoint
    tensors["model.layers.7.mlp.up_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected tensor.*model.layers.7.mlp.up_proj.weight"):
        load_model(path, "cpu", torch.float32, attention_ops("cpu", "reference"))


def test_loader_names_wrong_shape(broken_checkpoint):
    path, tensors = broken_checkpoint
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:8]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.0.mlp.gate_up_proj.weight"):
        load_model(path, "cpu", torch.float32, attention_ops("cpu", "reference"))


@pytest.mark.parametrize("rows", [1, 3, 64, 200])
def test_the_packed_cpu_lm_head_gives_the_plain_logits(models, rows):
    _, ours, config, path = models
    packed, _ = load_model(path, "cpu", torch.float32, attention_ops("cpu"))
    assert packed.pack_lm_head_for_cpu(), "oneDNN packing is unavailable in this torch build"
    hidden = torch.randn(rows, config.hidden_size, generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(
        packed.compute_logits(hidden), ours.compute_logits(hidden), rtol=1e-6, atol=1e-5
    )


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64, 200])
def test_the_fused_greedy_head_picks_the_first_maximum_of_the_logits(models, rows):
    _, ours, config, path = models
    fused, _ = load_model(path, "cpu", torch.float32, attention_ops("cpu"))
    fused.use_column_major_weights()  # as the ModelRunner does, before packing
    fused.pack_lm_head_for_cpu()
    hidden = torch.randn(rows, config.hidden_size, generator=torch.Generator().manual_seed(rows))
    tokens = fused.greedy_tokens(hidden)
    assert tokens is not None, "the fused greedy head is unavailable (no C compiler?)"
    assert torch.equal(tokens, ours.compute_logits(hidden).max(dim=-1).indices)
    each_alone = torch.cat([fused.greedy_tokens(hidden[i : i + 1]) for i in range(rows)])
    assert torch.equal(tokens, each_alone)  # a row's token does not depend on the batch


def test_the_greedy_head_is_the_cheapest_exact_one_the_machine_has(models, monkeypatch):
    """The int8 screen where there is AMX, else the bf16 screen where there is bf16 arithmetic,
    else the exact fused head; each screen can be turned off for A/B runs."""
    path = models[3]

    def served() -> type:
        model, _ = load_model(path, "cpu", torch.float32, attention_ops("cpu"))
        model.pack_lm_head_for_cpu()
        return type(model._greedy_head)

    if native.load().int8_screen_available():
        assert served() is Int8ScreenedHead
    monkeypatch.setenv("ACTORSERVE_INT8_SCREEN", "0")
    assert served() in (ScreenedGreedyHead, GreedyHead)
    monkeypatch.setenv("ACTORSERVE_BF16_SCREEN", "0")
    assert served() is GreedyHead


def test_projections_on_packed_panels_match_hf(models):
    """As the ModelRunner serves on CPU: up to PANEL_ROWS rows (every step of this schedule) a
    projection without bias runs on its packed panels (kernels/cpu_panel_gemm.c)."""
    hf, _, _, path = models
    packed, config = load_model(path, "cpu", torch.float32, attention_ops("cpu"))
    packed.use_column_major_weights()
    packed.pack_projections_for_cpu()
    projections = [m for m in packed.modules() if isinstance(m, Projection)]
    assert any(m.panel is not None for m in projections), "no projection got its panels"
    assert all(m.panel is None for m in projections if m.bias is not None)  # biased: MKL
    check_chunked_prefill_then_decode(hf, packed, config)


def packed_for_cpu(path: Path) -> tuple[CausalLM, ModelConfig]:
    """Our model with the `cpu` kernels, its weights laid out and packed as the ModelRunner does."""
    model, config = load_model(path, "cpu", torch.float32, attention_ops("cpu"))
    model.use_column_major_weights()
    model.pack_projections_for_cpu()
    return model, config


def serves_decode_stack(config: ModelConfig) -> bool:
    """The one-call decode stack covers the kinds without biases or q/k norm."""
    return not (config.qkv_bias or config.o_bias or config.qk_norm)


def kv_tensors(cache: PagedCache) -> list[torch.Tensor]:
    return [t for layer in cache.kv for t in layer]


@torch.no_grad()
@pytest.mark.parametrize("num_seqs", [4, 40])
def test_the_decode_stack_gives_the_layer_by_layer_path_to_the_bit(models, num_seqs):
    """A step of decodes alone runs the whole decoder in one C call (kernels/cpu_decode_stack.c):
    the same hidden states and the same K/V written as the layer-by-layer path, bit for bit.
    4 sequences: each kernel shares its work out among the threads; 40 (at least 16 a thread):
    each of 2 threads takes its own rows through every layer, attention shared between them."""
    _, _, _, path = models
    model, config = packed_for_cpu(path)
    cache = PagedCache(model, config, num_blocks=8 * num_seqs, seed=2)
    assert model.pack_decode_stack_for_cpu(cache.kv) == serves_decode_stack(config)
    if model.decode_stack is None:
        return  # biases or q/k norm: every step keeps the layer-by-layer path
    lengths = {f"s{i}": (5, 19, 37, 64, 90)[i % 5] + i for i in range(num_seqs)}
    with torch_threads(2):
        cache.step({seq: random_prompt(n, i) for i, (seq, n) in enumerate(lengths.items())})
        for i in range(3):
            args = cache.inputs({seq: [100 + i] for seq in lengths})
            stacked = model(*args)
            written = [t.clone() for t in kv_tensors(cache)]
            stack, model.decode_stack = model.decode_stack, None
            layered = model(*args)  # writes the same slots again
            model.decode_stack = stack
            assert torch.equal(stacked, layered)
            assert all(torch.equal(a, b) for a, b in zip(written, kv_tensors(cache)))


def test_the_decode_stack_matches_hf(models):
    """The chunked prefill then decode schedule with its decode steps through the stack."""
    hf, _, _, path = models
    model, config = packed_for_cpu(path)
    check_chunked_prefill_then_decode(hf, model, config, decode_stack=True)
    assert (model.decode_stack is not None) == serves_decode_stack(config)


@torch.no_grad()
def test_the_decode_stack_serves_only_the_caches_it_was_packed_over(checkpoint):
    model, config = packed_for_cpu(checkpoint("tiny-llama"))
    packed, other = PagedCache(model, config, seed=3), PagedCache(model, config, seed=4)
    assert model.pack_decode_stack_for_cpu(packed.kv)
    prompt = random_prompt(21, 5)
    first = {seq: cache.step({"a": prompt})["a"] for seq, cache in (("p", packed), ("o", other))}
    decoded = {name: cache.step({"a": [9]})["a"] for name, cache in (("p", packed), ("o", other))}
    assert torch.equal(first["p"], first["o"]) and torch.equal(decoded["p"], decoded["o"])


@pytest.mark.parametrize("num_seqs", [1, 40])
def test_the_decode_stack_refuses_a_slot_position_or_token_past_its_tables(checkpoint, num_seqs):
    """1 sequence: the kernels share each call out; 40 on 2 threads: each thread its own rows."""
    model, config = packed_for_cpu(checkpoint("tiny-llama"))
    cache = PagedCache(model, config, num_blocks=4 * num_seqs)
    assert model.pack_decode_stack_for_cpu(cache.kv)
    input_ids, positions, kv, meta = cache.inputs({f"s{i}": [7] for i in range(num_seqs)})
    past = meta.slot_mapping.clone()
    past[-1] = 4 * num_seqs * BLOCK_SIZE
    with torch_threads(2):
        with pytest.raises(IndexError, match="past the KV cache"):
            model(input_ids, positions, kv, meta._replace(slot_mapping=past))
        model(input_ids, positions, kv, meta)  # the same step with its own slots still runs
    beyond = positions.clone()
    beyond[-1] = config.max_position_embeddings
    with pytest.raises(IndexError, match="past the rope tables"):
        model(input_ids, beyond, kv, meta)
    unknown = input_ids.clone()
    unknown[-1] = config.vocab_size
    with pytest.raises(IndexError, match="past the vocabulary"):
        model(unknown, positions, kv, meta)
