"""What the model tests share: a paged KV cache with shuffled blocks that runs steps through our
model (and the CPU fast path, where a test gives one), transformers' logits and greedy tokens, and
the tolerance they are compared with.

Tolerance: |ours - HF| <= 1e-4 * max|HF logit| (about 4e-3 for these checkpoints, whose logits have
standard deviation 4-8); fp32 op-order noise is an order of magnitude below it and the greedy
top1-top2 gap far above it, so greedy tokens must also be identical.
"""

from __future__ import annotations

import contextlib

import torch

from actorserve.actors.runtime.model_config import ModelConfig
from actorserve.actors.worker.models.llama import AttentionMetadata, CausalLM

BLOCK_SIZE = 16
REL_ATOL = 1e-4


@contextlib.contextmanager
def torch_threads(n: int):
    """torch (and the C kernels, on the same OpenMP runtime) on n threads, then back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class PagedCache:
    """A KV cache whose blocks are handed out in a shuffled order, and one step's inputs."""

    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        num_blocks: int = 24,
        seed: int = 0,
        device: str = "cpu",
        fast_path=None,
    ):
        """`fast_path`: a CpuFastPath that serves the steps it can (as the runner's), or None."""
        self.model, self.device, self.fast_path = model, device, fast_path
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
        args = self.inputs(chunks)
        hidden = None if self.fast_path is None else self.fast_path.forward(*args)
        hidden = self.model(*args) if hidden is None else hidden
        logits = (self.fast_path or self.model).compute_logits(hidden).cpu()
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


def check_decode_stack_steps(model, fast, cache: PagedCache, num_seqs: int) -> None:
    """Three steps of `num_seqs` decodes through the fast path's decode stack (one C call) give
    the layer-by-layer path's hidden states and K/V writes, bit for bit. Contexts of 5-90+
    tokens, prefilled first; runs on 2 threads (few rows: each kernel shares its work out; 16
    or more a thread: each thread its own rows)."""
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
            rewritten = [t for layer in cache.kv for t in layer]
            assert all(torch.equal(a, b) for a, b in zip(written, rewritten))


def check_chunked_prefill_then_decode(
    hf, ours, config, device: str = "cpu", fast_path=None, decode_stack: bool = False
) -> None:
    """Seq a prefills in two chunks while seq b, prefilled whole, is already decoding (with a
    CpuFastPath, prepared here over the model; with `decode_stack`, over the cache too: its
    decode stack then serves steps 3 on where it can)."""
    steps = 6
    prompts = {"a": random_prompt(29, 4), "b": random_prompt(11, 5)}
    full = {seq: p + hf_greedy(hf, p, steps + 1) for seq, p in prompts.items()}
    ref = {seq: hf_logits(hf, tokens) for seq, tokens in full.items()}
    cache = PagedCache(ours, config, seed=1, device=device, fast_path=fast_path)
    if fast_path is not None:
        fast_path.prepare(ours, cache.kv if decode_stack else None)
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


def bf16_model(path, fast_path=None, kv_dtype: torch.dtype = torch.bfloat16):
    """(model, cache): a bf16 checkpoint as the Worker builds it on CPU (the `cpu` attention
    backend, the C elementwise ops), over a PagedCache in kv_dtype, prepared by `fast_path` (a
    CpuFastPath) when one is given."""
    from actorserve.actors.worker.loader import load_model
    from actorserve.kernels import attention_ops
    from actorserve.kernels.cpu.elementwise import C_ELEMENTWISE

    model, config = load_model(path, "cpu", torch.bfloat16, attention_ops("cpu"), C_ELEMENTWISE)
    cache = PagedCache(model, config, fast_path=fast_path)
    cache.kv = [(k.to(kv_dtype), v.to(kv_dtype)) for k, v in cache.kv]
    if fast_path is not None:
        fast_path.prepare(model, cache.kv)
    return model, cache
