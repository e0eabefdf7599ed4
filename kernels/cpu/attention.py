"""Paged attention for serving on CPU (the `cpu` backend): the reference's semantics
(kernels/reference.py). Where the machine has a C compiler, every row goes to the C kernels, which
read K/V straight from the cache blocks: decodes to csrc/cpu_decode.c, prefill chunks to
csrc/cpu_prefill.c. A bf16 cache is read by the decode kernel alone (csrc/cpu_decode_bf16.c: q
rounded to bf16, bf16 products, sums and softmax in fp32): steps of decodes only go to it, steps
with prefill chunks (few, and bound by their products) to the torch path. Otherwise the torch
path below, built from torch's fused CPU attention (`scaled_dot_product_attention`, flash-style,
GQA without copying K/V per query head), serves.

What costs on CPU is memory traffic, not FLOPs: every decode reads its whole context. So, on
the torch path:
- the step's layout (which rows decode, their blocks, masks) is worked out once per step and
  reused by every layer (the layers pass the same metadata; it is compared by content, which
  costs microseconds);
- decodes are sorted by context length and cut into groups, each padded only to its own longest
  context, so short sequences do not pay for the longest one;
- K/V are gathered block by block (one index_select per group) and handed to the attention as
  strided views: no repeat per query head, no transposed copy.
Prefill chunks run one sequence at a time, causal inside the chunk, full over the cached prefix.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import reference
from . import bindings

DECODE_GROUP = 16  # decode rows per attention call (sorted by length, padded within the group)


class _DecodeGroup(NamedTuple):
    token_rows: torch.Tensor  # [R] rows of q / out
    blocks: torch.Tensor  # [R * nb] block ids (past a row's own blocks: block 0, masked)
    num_blocks: int  # nb
    mask: torch.Tensor | None  # [R, 1, 1, nb * bs] True = attend; None when nothing is padded


class _Prefill(NamedTuple):
    start: int
    end: int
    blocks: torch.Tensor  # the sequence's blocks, in order
    context: int  # tokens in the cache for it, this chunk included
    mask: torch.Tensor | None  # [n, context]; None = plain causal (no cached prefix)


class _Layout(NamedTuple):
    decode: list[_DecodeGroup]
    prefill: list[_Prefill]


def _same(key: tuple[torch.Tensor, ...], tensors: tuple[torch.Tensor, ...]) -> bool:
    return all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(key, tensors))


def _decode_groups(block_tables, lens, starts, block_size: int) -> list[_DecodeGroup]:
    device = block_tables.device
    decode_rows = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    decode_rows.sort(key=lambda b: lens[b])
    groups = []
    for i in range(0, len(decode_rows), DECODE_GROUP):
        rows = decode_rows[i : i + DECODE_GROUP]
        ctx = torch.tensor([lens[b] for b in rows], device=device)
        nb = -(-lens[rows[-1]] // block_size)  # the longest of the group (sorted)
        tables = block_tables[torch.tensor(rows, device=device), :nb].long()
        owned = torch.arange(nb, device=device) * block_size < ctx.unsqueeze(1)
        tables = torch.where(owned, tables, torch.zeros_like(tables))
        mask = None
        if lens[rows[0]] != nb * block_size:  # some row has padding to hide
            positions = torch.arange(nb * block_size, device=device)
            mask = (positions < ctx.unsqueeze(1)).view(len(rows), 1, 1, -1)
        token_rows = torch.tensor([starts[b] for b in rows], device=device)
        groups.append(_DecodeGroup(token_rows, tables.reshape(-1), nb, mask))
    return groups


def _prefills(block_tables, lens, starts, block_size: int) -> list[_Prefill]:
    device = block_tables.device
    prefills = []
    for b, context in enumerate(lens):
        n = starts[b + 1] - starts[b]
        if n <= 1:
            continue
        nb = -(-context // block_size)
        mask = None
        if n != context:
            q_pos = torch.arange(context - n, context, device=device).unsqueeze(1)
            mask = torch.arange(context, device=device).unsqueeze(0) <= q_pos
        blocks = block_tables[b, :nb].long()
        prefills.append(_Prefill(starts[b], starts[b + 1], blocks, context, mask))
    return prefills


class CpuAttention:
    """The `cpu` backend's paged attention. Holds the last step's layout (every layer of a step
    passes the same metadata) and, where the machine can build them, the C kernels (via
    kernels/cpu/bindings.py): decodes and prefill chunks then read K/V straight from the cache
    blocks; without them decodes take the grouped torch path above and prefill chunks SDPA."""

    def __init__(self, use_native: bool = True) -> None:
        self.native = bindings.load() if use_native else None
        self._key: tuple[int, tuple[torch.Tensor, ...]] | None = None
        self._layout = _Layout([], [])

    def _step_layout(self, block_tables, seq_lens, query_start_loc, block_size: int) -> _Layout:
        """The step's decode groups and prefill chunks, for the torch path."""
        tensors = (block_tables, seq_lens, query_start_loc)
        key = self._key
        if key is not None and key[0] == block_size and _same(key[1], tensors):
            return self._layout
        starts = query_start_loc.tolist()
        lens = seq_lens.tolist()
        self._layout = _Layout(
            _decode_groups(block_tables, lens, starts, block_size),
            _prefills(block_tables, lens, starts, block_size),
        )
        self._key = (block_size, tuple(t.clone() for t in tensors))
        return self._layout

    def _native(self, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
        """The C kernels fill every row (decodes, then prefill chunks) in fp32, or None when the
        inputs do not suit them: a cache neither fp32 nor bf16, or bf16 with prefill chunks."""
        if self.native is None or q.dtype not in (torch.float32, torch.bfloat16):
            return None
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return None
        decodes_only = q.shape[0] == seq_lens.shape[0]  # one token per sequence
        if k_cache.dtype == v_cache.dtype == torch.bfloat16:
            if not decodes_only:
                return None
        elif k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32:
            return None
        meta = [t.to(torch.int32).contiguous() for t in (block_tables, seq_lens, query_start_loc)]
        q = q.to(torch.float32).contiguous()
        out = torch.empty_like(q)  # contiguous, as the kernels write it
        bindings.paged_attention(self.native, "decode", q, k_cache, v_cache, *meta, scale, out)
        if not decodes_only:
            bindings.paged_attention(self.native, "prefill", q, k_cache, v_cache, *meta, scale, out)
        return out

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Same contract as kernels.reference.paged_attention. A cache in a wider dtype than q
        (an fp32 KV cache under a bf16 model) is attended in the cache's dtype, the result
        rounded to q's; the C kernels attend in fp32 whatever the dtypes."""
        work = torch.promote_types(q.dtype, k_cache.dtype)
        meta = (block_tables, seq_lens, query_start_loc, scale)
        out = self._native(q, k_cache, v_cache, *meta)
        if out is None:
            out = self._torch_path(q.to(work), k_cache, v_cache, *meta)
        return out.to(q.dtype)

    def _torch_path(self, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
        """The paged attention in torch (SDPA: accumulation and softmax in fp32 for bf16 inputs);
        K/V are read in q's dtype."""
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        gqa = q.shape[1] != num_kv_heads
        layout = self._step_layout(block_tables, seq_lens, query_start_loc, block_size)
        out = torch.empty_like(q)
        for g in layout.decode:
            _grouped_decode(q, k_cache, v_cache, g, scale, gqa, out)
        for p in layout.prefill:
            k = k_cache.index_select(0, p.blocks).view(1, -1, num_kv_heads, head_dim).to(q.dtype)
            v = v_cache.index_select(0, p.blocks).view(1, -1, num_kv_heads, head_dim).to(q.dtype)
            k, v = k[:, : p.context].transpose(1, 2), v[:, : p.context].transpose(1, 2)
            qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            o = F.scaled_dot_product_attention(
                qp, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=gqa
            )
            out[p.start : p.end] = o[0].transpose(0, 1)
        return out


def _grouped_decode(q, k_cache, v_cache, g: _DecodeGroup, scale: float, gqa: bool, out) -> None:
    """One group of decodes: K/V gathered block by block, padded to the group's longest context."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    rows = g.token_rows.numel()
    length = g.num_blocks * block_size
    # [R * nb, bs, Hkv, D] -> [R, L, Hkv, D] -> strided view [R, Hkv, L, D]
    k = k_cache.index_select(0, g.blocks).view(rows, length, num_kv_heads, head_dim).to(q.dtype)
    v = v_cache.index_select(0, g.blocks).view(rows, length, num_kv_heads, head_dim).to(q.dtype)
    qd = q.index_select(0, g.token_rows).unsqueeze(2)  # [R, Hq, 1, D]
    o = F.scaled_dot_product_attention(
        qd, k.transpose(1, 2), v.transpose(1, 2), attn_mask=g.mask, scale=scale, enable_gqa=gqa
    )
    out.index_copy_(0, g.token_rows, o.squeeze(2))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N] int64, the first maximum of each row (as logits.max(dim=-1).indices): in C
    (csrc/cpu_argmax.c: one pass over the logits, where torch's max makes values and indices)
    for fp32 CPU logits."""
    lib = bindings.library_for(logits) if logits.shape[-1] > 0 else None
    if lib is not None:
        return bindings.argmax_rows(lib, logits)
    return logits.max(dim=-1).indices


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """kernels.reference.store_kv's contract; in C (csrc/cpu_store_kv.c) where the rows and the
    caches are all fp32 or all bf16."""
    tensors = (k, v, k_cache, v_cache)
    fits = k.dtype in (torch.float32, torch.bfloat16)
    fits = fits and all(t.dtype == k.dtype and t.device.type == "cpu" for t in tensors)
    fits = fits and k_cache.is_contiguous() and v_cache.is_contiguous()
    fits = fits and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
    fits = fits and k.shape[1:] == v.shape[1:] == k_cache.shape[2:]  # the rows the C copies
    lib = bindings.load() if fits and slot_mapping.dtype == torch.int64 else None
    if lib is None:
        reference.store_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    bindings.store_kv(lib, k, v, k_cache, v_cache, slot_mapping.contiguous())
