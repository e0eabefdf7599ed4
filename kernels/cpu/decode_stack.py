"""A whole decode step of the decoder in one C call (csrc/cpu_decode_stack.c): embedding, every
layer and the final norm, with no Python between the kernels.

For an fp32 model the kernels are those the model's layers call one at a time on CPU when the
fast path serves them (panels, C elementwise ops, the `cpu` attention backend), in the same
order, so the hidden states are the same to the bit. A bf16 model (bf16 embedding, bf16 panels
and KV caches) keeps fp32 activations inside the step, rounding each projection's input and the
new K/V to bf16: close to its layer-by-layer steps, not the same bits. An fp32 model whose
projections are int8 panels (quantization int8) runs the int8 kernel in their place, the same
kernel its layers call: the same bits again; so does one whose projections keep bf16 weights
(quantization bf16: bf16-weight panels, fp32 rows), through their kernel.

What it saves is the Python between the kernels: a decode step streams the KV cache and the
weights through the caches, and each of the dozens of calls of the layer-by-layer path then runs
on a cold interpreter.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

_ptr, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class StackLayer(NamedTuple):
    """One decoder layer's tensors: norm weights [hidden] fp32, projections as packed panels
    (panel_bindings.pack_panels, pack_panels_bf16 for a bf16 model, or pack_panels_int8 or
    pack_panels_bf16_weights for an fp32 one quantized: qkv rows q, k, v heads; gate_up rows
    gate, up), its KV cache (bf16 for a bf16 model), and the per-head q/k norm weights [D] fp32
    of a layer that has them (Qwen3), else None."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


class _Layer(ctypes.Structure):  # cpu_decode_stack.c's stack_layer: StackLayer's pointers
    _fields_ = [(name, _ptr) for name in StackLayer._fields]


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in (
            "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate",
            "num_blocks", "block_size", "max_position", "vocab", "bf16", "int8", "bf16_weights",
        )),
        ("eps", _f32),
        ("scale", _f32),
        ("embed", _ptr),
        ("cos", _ptr),
        ("sin", _ptr),
        ("final_norm", _ptr),
        ("layers", ctypes.POINTER(_Layer)),
    ]  # fmt: skip


class StackShape(NamedTuple):
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


_ERRORS = {
    -1: (MemoryError, "the decode stack could not allocate its scratch buffers"),
    -2: (IndexError, "store_kv: a slot lies past the KV cache"),
    -3: (IndexError, "a position lies past the rope tables"),
    -4: (IndexError, "a token id lies past the vocabulary"),
}


class DecodeStack:
    """Holds the C description of one model and its KV cache (and the tensors it points at)."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        shape: StackShape,
        embed: torch.Tensor,
        rope_tables: tuple[torch.Tensor, torch.Tensor],
        final_norm: torch.Tensor,
        layers: list[StackLayer],
    ):
        """embed [vocab, hidden] fp32 (with fp32, int8 or bf16-weight panels, fp32 caches) or
        bf16 (with bf16 panels and caches); rope tables and norm weights fp32; all contiguous
        (else ValueError)."""
        tensors = [embed, *rope_tables, final_norm]
        tensors += [t for layer in layers for t in layer if t is not None]
        bf16 = embed.dtype == torch.bfloat16
        int8 = not bf16 and layers[0].qkv.dtype == torch.int8
        bf16_weights = not bf16 and layers[0].qkv.dtype == torch.bfloat16
        panels = torch.int8 if int8 else torch.bfloat16 if bf16_weights else torch.float32
        weights = (torch.int32 if bf16 else panels,) * 4
        caches = (torch.bfloat16 if bf16 else torch.float32,) * 2
        expected = [embed.dtype] + [torch.float32] * 3
        for layer in layers:
            if (layer.q_norm is None) != (layer.k_norm is None):
                raise ValueError("the decode stack takes a layer's q and k norms together")
            norms = (torch.float32,) * (0 if layer.q_norm is None else 2)
            expected += [torch.float32] * 2 + [*weights, *caches, *norms]
        if embed.dtype not in (torch.float32, torch.bfloat16) or not all(
            t.dtype == d and t.is_contiguous() for t, d in zip(tensors, expected, strict=True)
        ):
            raise ValueError("the decode stack takes contiguous tensors of the model's dtypes")
        self._dtype = embed.dtype
        self._lib = lib
        self._tensors = tensors  # keeps what the structs point at alive
        self._layers = (_Layer * len(layers))(
            *(_Layer(*(None if t is None else t.data_ptr() for t in layer)) for layer in layers)
        )
        k_cache = layers[0].k_cache
        self._model = _Model(
            len(layers), shape.hidden, shape.num_heads, shape.num_kv_heads, shape.head_dim,
            shape.intermediate, k_cache.shape[0], k_cache.shape[1], rope_tables[0].shape[0],
            embed.shape[0], int(bf16), int(int8), int(bf16_weights), shape.eps, shape.scale,
            embed.data_ptr(), rope_tables[0].data_ptr(), rope_tables[1].data_ptr(),
            final_norm.data_ptr(), self._layers,
        )  # fmt: skip
        self._hidden = shape.hidden

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
    ) -> torch.Tensor | None:
        """One token per sequence -> hidden states [T, hidden] after the final norm, in the
        model's dtype; None when the step's tensors are not in the layout the kernel reads (the
        caller's torch path serves then)."""
        tokens = input_ids.shape[0]
        int64 = (input_ids, positions, slot_mapping)
        int32 = (block_tables, seq_lens, query_start_loc)
        if not (
            all(t.dtype == torch.int64 and t.is_contiguous() for t in int64)
            and all(t.dtype == torch.int32 and t.stride(-1) == 1 for t in int32)
            and seq_lens.is_contiguous()
            and query_start_loc.is_contiguous()
            and seq_lens.shape[0] == tokens
        ):
            return None
        hidden = torch.empty(tokens, self._hidden, dtype=torch.float32)
        status = self._lib.decode_stack(
            ctypes.byref(self._model),
            tokens,
            input_ids.data_ptr(),
            positions.data_ptr(),
            slot_mapping.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            query_start_loc.data_ptr(),
            hidden.data_ptr(),
        )
        if status != 0:
            error, message = _ERRORS[status]
            raise error(message)
        return hidden.to(self._dtype)
