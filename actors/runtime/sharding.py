"""Which part of the model one tensor-parallel rank holds (Megatron's layout, vLLM's conventions).

Column-parallel (rows of the weight split): qkv_proj by heads, each rank its query heads and the
KV heads they read; gate_up_proj by the intermediate dimension, gate and up each split.
Row-parallel (columns split, the partial outputs summed by an all-reduce): o_proj by query heads,
down_proj by the intermediate dimension. Vocabulary-parallel: the embedding's and the LM head's
rows (the same rows where they are tied).

KV heads: with at least as many KV heads as ranks each rank holds num_kv_heads / size of them
(they must divide); with fewer, each KV head is replicated on size / num_kv_heads ranks (that
must divide) and a rank holds the one its query heads read: query head h reads KV head
h // (num_heads / num_kv_heads), and rank r's query heads [r * H / size, (r + 1) * H / size)
all fall in one KV group exactly when num_kv_heads divides size.

Vocabulary: V is padded up to a multiple of size; rank r holds rows
[r * ceil(V / size), (r + 1) * ceil(V / size)) of the padded table. Padded rows are zeros, no
token id reaches them and their logits are dropped (compute_logits) or skipped (greedy), so they
never win.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from .model_config import ModelConfig


class TensorSlice(NamedTuple):
    """The part of a checkpoint tensor a rank reads: [start, stop) along `dim` (0: rows, 1:
    columns), zero-padded to `length` along it (only the vocabulary's last rank pads)."""

    dim: int
    start: int
    stop: int
    length: int


class ShardLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Rank `rank` of `size`: the ranges it holds of the query heads, the KV heads, the MLP's
    intermediate dimension and the vocabulary, each [start, stop). `vocab` holds real rows
    only; `vocab_rows` (ceil(V / size)) is the rank's row count with padding."""

    rank: int
    size: int
    head_dim: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_rows: int

    @classmethod
    def of(cls, config: ModelConfig, rank: int = 0, size: int = 1) -> ShardLayout:
        """The layout of rank `rank` of `size`; ValueError naming the config.json field that
        does not split across `size` ranks."""
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} of size {size} is out of range")
        heads, kv_heads = config.num_heads, config.num_kv_heads
        _check_divides("num_attention_heads", heads, size)
        _check_divides("intermediate_size", config.intermediate_size, size)
        if kv_heads >= size:
            _check_divides("num_key_value_heads", kv_heads, size)
            kv_per_rank = kv_heads // size
            kv_start = rank * kv_per_rank
        else:
            if size % kv_heads:
                raise ValueError(
                    f"config.json field 'num_key_value_heads' ({kv_heads}) must divide "
                    f"tensor_parallel_size ({size}) when it is smaller"
                )
            kv_per_rank = 1
            kv_start = rank // (size // kv_heads)
        q_per_rank = heads // size
        inter = config.intermediate_size // size
        rows = -(-config.vocab_size // size)
        vocab_start = min(rank * rows, config.vocab_size)
        return cls(
            rank=rank,
            size=size,
            head_dim=config.head_dim,
            q_heads=(rank * q_per_rank, (rank + 1) * q_per_rank),
            kv_heads=(kv_start, kv_start + kv_per_rank),
            intermediate=(rank * inter, (rank + 1) * inter),
            vocab=(vocab_start, min(vocab_start + rows, config.vocab_size)),
            vocab_rows=rows,
        )

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    def rank_config(self, config: ModelConfig) -> ModelConfig:
        """`config` with this rank's num_heads, num_kv_heads and intermediate_size: the shapes
        its layers and its KV cache have. vocab_size stays the full vocabulary's, as the logits
        every rank returns are full (compute_logits)."""
        if self.size == 1:
            return config
        return msgspec.structs.replace(
            config,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
        )

    def checkpoint_slice(self, name: str) -> TensorSlice | None:
        """What this rank reads of the checkpoint tensor `name` (Hugging Face's names, before
        q/k/v and gate/up are fused); None: the whole tensor (norms, o_proj's bias, which the
        reduced output gets once)."""
        if self.size == 1:
            return None
        d = self.head_dim
        module, _, kind = name.rpartition(".")
        leaf = module.rpartition(".")[2]
        if leaf == "q_proj":
            return _rows(0, self.q_heads, d)
        if leaf in ("k_proj", "v_proj"):
            return _rows(0, self.kv_heads, d)
        if leaf in ("gate_proj", "up_proj"):
            return _rows(0, self.intermediate, 1)
        if leaf == "o_proj" and kind == "weight":
            return _rows(1, self.q_heads, d)
        if leaf == "down_proj":
            return _rows(1, self.intermediate, 1)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return TensorSlice(0, self.vocab[0], self.vocab[1], self.vocab_rows)
        return None


def _rows(dim: int, span: tuple[int, int], width: int) -> TensorSlice:
    """The rows (or columns) of units span[0] .. span[1] - 1, each `width` wide."""
    start, stop = span[0] * width, span[1] * width
    return TensorSlice(dim, start, stop, stop - start)


def _check_divides(field: str, value: int, size: int) -> None:
    if value % size:
        raise ValueError(
            f"config.json field {field!r} ({value}) must be divisible by "
            f"tensor_parallel_size ({size})"
        )
