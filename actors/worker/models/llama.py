"""Llama-family decoder in plain torch (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

The step is flat: T tokens from B sequences, laid out sequence after sequence. Attention goes
through `ops` (kernels.attention_ops): store_kv writes this step's K/V into the paged cache, then
paged_attention reads each sequence's whole context back through its block table. Parameter names
follow Hugging Face's, except the fused `qkv_proj` (rows q, k, v) and `gate_up_proj` (rows gate,
up); the loader concatenates the checkpoint's tensors to match.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from actorserve.kernels import AttentionOps, native
from actorserve.kernels.cpu import GreedyHead, PanelLinear
from actorserve.kernels.decode_stack import DecodeStack, StackLayer, StackShape
from actorserve.kernels.elementwise import rms_norm, rope, silu_mul
from actorserve.kernels.screened_head import ScreenedGreedyHead, ScreenedHead
from actorserve.kernels.screened_head_int8 import Int8ScreenedHead

from ...model_config import ModelConfig, RopeScaling

PACK_ROWS = 64  # oneDNN's packing hint for the LM head: a step's sampling rows
PANEL_ROWS = 128  # at most this many rows, a projection uses its packed panels (CPU)


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
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x -> normed x; with the residual stream: (normed(x + residual), x + residual)."""
        normed, summed = rms_norm(x, residual, self.weight, self.eps)
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
    `apply_rope`: cos = [c, c], sin = [-s, s] (c, s = cos, sin of position x inv_freq)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        cos, sin = self._tables(None)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        device = device or torch.empty(0).device  # the default device, meta included
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of x [T, H, D], as Hugging Face's Llama: with x = [x1, x2] (halves),
    [x1 * c - x2 * s, x2 * c + x1 * s] = x * [c, c] + [x2, x1] * [-s, s] (the tables' layout);
    in C on CPU (kernels/elementwise.py)."""
    return rope(x, cos, sin)


class Projection(nn.Linear):
    """A layer's Linear; after pack_for_cpu(), batches of at most PANEL_ROWS rows (decode
    steps) go through kernels.cpu.PanelLinear, larger ones (prefill) through MKL as before."""

    panel: PanelLinear | None = None

    def pack_for_cpu(self) -> None:
        """fp32 on CPU and without bias: keep a packed copy of the weight (else no change)."""
        if self.bias is None:
            self.panel = PanelLinear.for_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panel is not None and x.shape[0] <= PANEL_ROWS and x.dtype == torch.float32:
            return self.panel(x)
        return F.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, ops: AttentionOps) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.sizes = [config.q_size, config.kv_size, config.kv_size]
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Projection(config.hidden_size, sum(self.sizes), bias=config.qkv_bias)
        self.o_proj = Projection(config.q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)  # each contiguous, as attention reads q
        k_cache, v_cache = kv_cache
        self.ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = self.ops.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale
        )
        return self.o_proj(out.reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Projection(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Projection(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: AttentionOps) -> None:
        super().__init__()
        self.self_attn = Attention(config, ops)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

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
    def __init__(self, config: ModelConfig, ops: AttentionOps) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, ops) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Decoder + LM head. With tied embeddings there is no `lm_head`; the embedding serves."""

    def __init__(self, config: ModelConfig, ops: AttentionOps) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, ops)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self._packed_lm_head: torch.Tensor | None = None  # see pack_lm_head_for_cpu
        self._greedy_head: GreedyHead | ScreenedHead | None = None
        self.decode_stack: DecodeStack | None = None  # see pack_decode_stack_for_cpu
        self._stack_kv_caches: list | None = None  # the caches the decode stack writes

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] after the final norm.

        kv_caches[layer] = (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, D].
        A step of decodes alone (one token per sequence, at most PANEL_ROWS) goes through the
        decode stack in one call where it was packed over these caches, with the same result.
        """
        stack = self.decode_stack is not None and kv_caches is self._stack_kv_caches
        if stack and input_ids.shape[0] <= PANEL_ROWS:  # the stack checks one token a sequence
            hidden = self.decode_stack(input_ids, positions, *meta)
            if hidden is not None:
                return hidden
        h = self.model.embed_tokens(input_ids)
        rope = self.rotary(positions, h.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, rope, kv_cache, meta)
        return self.model.norm(h, residual)[0]

    def use_column_major_weights(self) -> None:
        """Store each projection's weight [out, in] column-major (its transpose contiguous).

        For x @ W.T, CPU GEMM (MKL) is up to 2x faster at decode sizes (a few rows against the
        lm_head) and 10-25% faster on the layers' small-batch projections when W.T is row-major;
        prefill-sized products are unchanged. Names, shapes and values stay the same. The tied
        embedding is left as it is (its rows are looked up)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.data = module.weight.data.t().contiguous().t()

    def pack_projections_for_cpu(self) -> None:
        """Give each decoder projection its packed panels (Projection.pack_for_cpu)."""
        for module in self.modules():
            if isinstance(module, Projection):
                module.pack_for_cpu()

    def pack_decode_stack_for_cpu(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        """Let decode steps run the whole decoder in one C call (kernels.decode_stack), over these
        KV caches. Only after pack_projections_for_cpu, with the `cpu` attention backend, where
        every projection has its panels (no biases) and there is no q/k norm; else nothing
        changes. Returns whether it serves."""
        attentions = [layer.self_attn for layer in self.model.layers]
        projections = [m for m in self.modules() if isinstance(m, Projection)]
        lib = native.load()
        if (
            lib is None
            or any(a.ops.name != "cpu" or a.q_norm is not None for a in attentions)
            or any(p.panel is None for p in projections)
        ):
            return False
        c = self.config
        shape = StackShape(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            c.rms_norm_eps, attentions[0].scale,
        )  # fmt: skip
        layers = [
            StackLayer(
                layer.input_layernorm.weight.data,
                layer.post_attention_layernorm.weight.data,
                layer.self_attn.qkv_proj.panel.panels,
                layer.self_attn.o_proj.panel.panels,
                layer.mlp.gate_up_proj.panel.panels,
                layer.mlp.down_proj.panel.panels,
                *kv_cache,
            )
            for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True)
        ]
        embed = self.model.embed_tokens.weight.data
        tables = (self.rotary.cos, self.rotary.sin)
        try:
            self.decode_stack = DecodeStack(
                lib, shape, embed, tables, self.model.norm.weight.data, layers
            )
        except ValueError:  # a tensor not fp32 or not contiguous
            return False
        self._stack_kv_caches = kv_caches
        return True

    def pack_lm_head_for_cpu(self) -> bool:
        """Keep packed copies of the LM head weight for the CPU (fp32; elsewhere nothing changes):

        - one for greedy_tokens: the LM head with the argmax fused in (kernels.cpu.GreedyHead),
          a third less time than the GEMM and a separate argmax at a step's rows; where the CPU
          has AMX, behind an int8 screen with the same tokens (Int8ScreenedHead: an int8 copy
          of the weight and a row-major one more), else where it has bf16 arithmetic behind a
          bf16 screen (ScreenedGreedyHead, a bf16 copy and a row-major one);
        - one for compute_logits: from 8 to a few hundred rows oneDNN's packed fp32 GEMM is
          10-20% faster than MKL on the plain weight at the demo's [32000, 256], with the same
          result; one or two rows stay faster unpacked. It is torch's private op (what
          torch.compile's CPU freezing uses): where it is missing, compute_logits stays on MKL.
        Each costs a copy of the weight. Returns whether compute_logits has the oneDNN one."""
        weight = self._lm_head_weight()
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return False
        exact = GreedyHead.for_weight(weight)
        self._greedy_head = (
            Int8ScreenedHead.for_weight(weight, exact)
            or ScreenedGreedyHead.for_weight(weight, exact)
            or exact
        )
        if not torch.backends.mkldnn.is_available():
            return False
        try:
            self._packed_lm_head = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
        except (AttributeError, RuntimeError):
            return False
        return True

    def _lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden] -> [N] int64, the first maximum of each row's logits (what
        compute_logits then an argmax gives), or None where no fused head serves."""
        if self._greedy_head is None or hidden.dtype != torch.float32:
            return None
        return self._greedy_head(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        packed = self._packed_lm_head
        if packed is not None and hidden.shape[0] > 2 and hidden.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(hidden, packed, None, "none", [], "")
        return F.linear(hidden, self._lm_head_weight()).float()
