"""Llama-family decoder in plain torch (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

The step is flat: T tokens from B sequences, laid out sequence after sequence. Attention goes
through `ops` (kernels.attention_ops): store_kv writes this step's K/V into the paged cache, then
paged_attention reads each sequence's whole context back through its block table. The norms,
rope and SiLU-and-multiply go through `elementwise` (kernels.elementwise.ElementwiseOps: plain
torch unless a backend gives its own, as the CPU fast path and the Triton kernels do). Nothing
here knows a backend: the CPU fast path (kernels/cpu/fast_path.py) lays out and packs these
weights itself. Parameter names follow Hugging Face's, except the fused `qkv_proj` (rows q, k, v)
and `gate_up_proj` (rows gate, up); the loader concatenates the checkpoint's tensors to match.

Tensor parallel (`tp` of more than one rank): each rank's model holds its shard (sharding.py:
its query and KV heads, its part of the MLP, its rows of the vocabulary) and its forward does the
collectives (parallel.py): an all-reduce after o_proj, after down_proj and of the embedding, an
all-gather of the logits or of each row's best token.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from actorserve.kernels import AttentionOps
from actorserve.kernels.elementwise import TORCH_ELEMENTWISE, ElementwiseOps

from ...runtime.model_config import ModelConfig, RopeScaling
from ...runtime.sharding import ShardLayout
from ..tensor_parallel import TensorParallel
from .parallel import gathered_logits, greedy_ids, row_parallel, vocab_parallel_embedding


class AttentionMetadata(NamedTuple):
    """Flat step layout; see kernels/reference.py for the exact meaning of each field.

    slot_mapping    [T] int64: cache slot (block * block_size + offset) of each token, -1 = skip
    block_tables    [B, max_blocks] int32
    seq_lens        [B] int32: context length of each sequence including this step's tokens
    query_start_loc [B+1] int32: cumulative token counts; sequence b owns rows [qsl[b], qsl[b+1])
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, elementwise: ElementwiseOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.rms_norm = elementwise.rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x -> normed x; with the residual stream: (normed(x + residual), x + residual)."""
        normed, summed = self.rms_norm(x, residual, self.weight, self.eps)
        return normed if residual is None else (normed, summed)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, scaled as `scaling` says."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Tables [max_position_embeddings, head_dim] in float32, built once, laid out for
    ElementwiseOps.rope: cos = [c, c], sin = [-s, s] (c, s = cos, sin of position x inv_freq)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        device = torch.empty(0).device  # the default device, meta included
        if device.type == "meta":  # shapes only, for rebuild() to fill on the model's device:
            # arithmetic on meta runs torch's Python reference kernels (they import torch._dynamo)
            cos = sin = torch.empty(config.max_position_embeddings, config.head_dim)
        else:
            cos, sin = self._tables(device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling).to(device)
        positions = torch.arange(c.max_position_embeddings, device=device).float()
        freqs = positions[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def rebuild(self, device: torch.device | str) -> None:
        """Recompute the tables on `device` (after the model was built on the meta device)."""
        self.cos, self.sin = self._tables(torch.device(device))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """[T] positions -> cos, sin [T, 1, head_dim] in `dtype` (broadcast over heads)."""
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


class Attention(nn.Module):
    """`config`: this rank's (ShardLayout.rank_config), whose heads it computes."""

    def __init__(
        self,
        config: ModelConfig,
        ops: AttentionOps,
        elementwise: ElementwiseOps,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.ops, self.tp = ops, tp
        # q/k norm and neox-style rope in one step (the tables' layout: see RotaryEmbedding)
        self.qk_norm_rope = elementwise.qk_norm_rope
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.scale = config.head_dim**-0.5
        qkv_size = config.q_size + 2 * config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:  # their weights; qk_norm_rope applies them
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, elementwise)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, elementwise)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q_weight = k_weight = None
        eps = 0.0
        if self.q_norm is not None:
            q_weight, k_weight, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        q, k, v = self.qk_norm_rope(
            self.qkv_proj(x), self.num_heads, self.num_kv_heads, *rope, q_weight, k_weight, eps
        )  # q, k contiguous, as attention reads q; v a view of the projection
        k_cache, v_cache = kv_cache
        self.ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = self.ops.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale
        )
        return row_parallel(self.o_proj, out.reshape(x.shape[0], -1), self.tp)


class MLP(nn.Module):
    def __init__(
        self, config: ModelConfig, elementwise: ElementwiseOps, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.silu_mul = elementwise.silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_parallel(self.down_proj, self.silu_mul(self.gate_up_proj(x)), self.tp)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        ops: AttentionOps,
        elementwise: ElementwiseOps,
        tp: TensorParallel,
    ):
        super().__init__()
        self.self_attn = Attention(config, ops, elementwise, tp)
        self.mlp = MLP(config, elementwise, tp)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, elementwise)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, elementwise)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) -> (this layer's MLP output, the residual stream before it): the
        stream is residual + h, each sublayer's output added to it inside the next norm (the
        first layer's h is the embedding, with no residual yet)."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        x = self.self_attn(x, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        ops: AttentionOps,
        elementwise: ElementwiseOps,
        tp: TensorParallel,
        rows: int,
    ) -> None:
        """`rows`: this rank's rows of the (padded) vocabulary."""
        super().__init__()
        # No initial values: the loader assigns every weight. Embedding's own init (normal_) on
        # the meta device runs torch's Python reference kernels, which import torch._dynamo: a
        # restart would pay that import for values it throws away.
        weight = torch.empty(rows, config.hidden_size)
        self.embed_tokens = nn.Embedding(rows, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(
            DecoderLayer(config, ops, elementwise, tp) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, elementwise)


class CausalLM(nn.Module):
    """Decoder + LM head. With tied embeddings there is no `lm_head`; the embedding serves.

    Built from the full model's `config`, it holds rank `tp.rank`'s shard (`layout`); its
    `config` is then the rank's (ShardLayout.rank_config: its heads, its intermediate size,
    the full vocab_size)."""

    def __init__(
        self,
        config: ModelConfig,
        ops: AttentionOps,
        elementwise: ElementwiseOps = TORCH_ELEMENTWISE,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.tp = TensorParallel.single() if tp is None else tp
        self.layout = ShardLayout.of(config, self.tp.rank, self.tp.size)
        self.config = config = self.layout.rank_config(config)
        self.elementwise = elementwise
        rows = self.layout.vocab_rows
        self.model = DecoderModel(config, ops, elementwise, self.tp, rows)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, rows, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] after the final norm.

        kv_caches[layer] = (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, D].
        """
        h = vocab_parallel_embedding(self.model.embed_tokens, input_ids, self.layout, self.tp)
        rope = self.rotary(positions, h.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, rope, kv_cache, meta)
        return self.model.norm(h, residual)[0]

    def lm_head_weight(self) -> torch.Tensor:
        """[vocab rows, hidden]: the LM head's weight, or the embedding's where they are tied
        (this rank's rows of the padded vocabulary: all of it on a single device)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32, the full vocabulary on every rank."""
        return gathered_logits(hidden, self.lm_head_weight(), self.config.vocab_size, self.tp)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> [N] int64: each row's first maximum over the full vocabulary,
        the same on every rank, with no full logits made (parallel.greedy_ids)."""
        return greedy_ids(hidden, self.lm_head_weight(), self.layout, self.tp)
