"""Weights packed once into the panels csrc/cpu_panel_gemm.c (fp32), csrc/cpu_panel_gemm_bf16.c
(bf16), csrc/cpu_panel_gemm_int8.c (int8 with fp32 scales) and csrc/cpu_panel_gemm_bf16_weights.c
(bf16 weights, fp32 rows) read, for products with
decode-sized batches on CPU: the projections (PanelLinear, served through PackedLinear, which
takes a Linear's place in the model) and the LM head with greedy sampling fused in (GreedyHead).

bf16 weights are packed only where the CPU multiplies bf16 in hardware (capability.py; a test
may say so instead): elsewhere the C kernel would widen every pair to fp32, no faster than
torch, so a bf16 model there keeps its plain Linears.

An fp32 weight may instead be quantized to int8 (quantize.py) as it is packed (`int8`): the
panels then hold the only copy of the weight, and every product with it, prefill-sized ones too,
runs on them (no fp32 copy is kept for them, nor is one made per call): int8 x int8 with each
row quantized where the library is built for AVX512-VNNI, else the weight widened to fp32
arithmetic (csrc/cpu_panel_gemm_int8.c says which runs where).

An fp32 weight may also be kept in bf16 (`bf16_weights`: quantization bf16, for a CPU without
bf16 arithmetic), rounded as it is packed (exact for a bf16 checkpoint's weights upcast), its rows
widened to fp32 in the kernel: half the fp32 panels' bytes, the same products to the bit. Like
int8 panels they are the weight's only copy and serve prefill-sized products too: the simpler of
the two choices (one code path with int8's in PackedLinear, no second copy to keep in step, half
the memory), and the widening costs the kernel at prefill sizes about what int8's does.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from . import bindings, panel_bindings
from .capability import cpu_has_bf16
from .quantize import quantize_int8

PANEL_ROWS = 128  # at most this many rows, a projection uses its packed panels

_Packed = TypeVar("_Packed", bound="PanelWeight")


class PanelWeight:
    """A weight [N, K] (any layout), fp32 or bf16, packed once into the panels of its dtype's
    kernel, or an fp32 one quantized to int8 (`int8`) or kept in bf16 (`bf16_weights`; either
    way its inputs and outputs stay fp32). Holds the copy (on huge pages where `huge`: every
    decode step streams it)."""

    def __init__(
        self,
        lib,
        weight: torch.Tensor,
        huge: bool = True,
        int8: bool = False,
        bf16_weights: bool = False,
    ):
        self._lib = lib
        self.out_features = weight.shape[0]
        self.int8, self.bf16_weights = int8, bf16_weights
        narrow = int8 or bf16_weights
        self.dtype = torch.float32 if narrow else weight.dtype  # of the rows it takes and gives
        if int8:
            self.panels = panel_bindings.pack_panels_int8(lib, *quantize_int8(weight), huge)
        elif bf16_weights:
            self.panels = panel_bindings.pack_panels_bf16_weights(lib, weight, huge)
        elif self.dtype == torch.bfloat16:
            self.panels = panel_bindings.pack_panels_bf16(lib, weight, huge)
        else:
            self.panels = panel_bindings.pack_panels(lib, weight, huge)

    @classmethod
    def for_weight(
        cls: type[_Packed],
        weight: torch.Tensor,
        huge: bool = True,
        bf16: bool | None = None,
        int8: bool = False,
        bf16_weights: bool = False,
    ) -> _Packed | None:
        """None where it cannot serve: not a CPU matrix, no C compiler, not fp32 nor bf16, bf16
        where `bf16` is False (None: where the CPU has bf16 products, cpu_has_bf16), or `int8`
        (quantize it) or `bf16_weights` (keep it in bf16 for fp32 rows) for a weight not fp32,
        or `int8` for one of more columns than the library's int8 panels take."""
        if weight.device.type != "cpu" or weight.dim() != 2:
            return None
        if int8 or bf16_weights:
            if weight.dtype != torch.float32:
                return None
        elif weight.dtype == torch.bfloat16:
            if not (cpu_has_bf16() if bf16 is None else bf16):
                return None
        elif weight.dtype != torch.float32:
            return None
        lib = bindings.load()
        if lib is None or (int8 and weight.shape[1] > lib.panel_max_k_int8()):
            return None  # int8 x int8 sums of more columns could leave int32
        return cls(lib, weight, huge, int8, bf16_weights)

    @property
    def only_copy(self) -> bool:
        """Whether the panels replace the weight (int8 or bf16 weights: no fp32 copy is kept,
        and they serve every product)."""
        return self.int8 or self.bf16_weights

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """x in the weight's dtype, its columns contiguous (what the kernels read)."""
        x = x.to(self.dtype)
        return x if x.stride(-1) == 1 else x.contiguous()

    def product(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] -> x @ weight.T [M, N] in `out_dtype` (default: the weight's; a bf16 weight
        may also give fp32 sums, an fp32 one gives fp32; an int8 one gives fp32, the products
        with its dequantized weight up to the order of the sums where the panels widen, else
        quantize.int8_dot_product's; bf16 weights give fp32, the fp32
        panels' products with the weight widened, to the bit)."""
        if self.int8:
            return panel_bindings.panel_linear_int8(
                self._lib, self._rows(x), self.panels, self.out_features
            )
        if self.bf16_weights:
            return panel_bindings.panel_linear_bf16_weights(
                self._lib, self._rows(x), self.panels, self.out_features
            )
        if self.dtype == torch.bfloat16:
            out_dtype = out_dtype or torch.bfloat16
            return panel_bindings.panel_linear_bf16(
                self._lib, self._rows(x), self.panels, self.out_features, out_dtype
            )
        return panel_bindings.panel_linear(self._lib, self._rows(x), self.panels, self.out_features)


class GreedyHead(PanelWeight):
    """An LM head with greedy sampling fused in: hidden rows -> the first maximum of each row's
    logits, which are never written (no pass to write them and none to read them back). A bf16
    head takes the maximum over fp32 sums of its bf16 products, the values `logits` returns."""

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] (the head's dtype) -> [N] int64 token ids."""
        return panel_bindings.greedy_head(
            self._lib, self._rows(hidden), self.panels, self.out_features
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, vocab] fp32, the values __call__ compares."""
        return self.product(hidden, torch.float32)


class PanelLinear(PanelWeight):
    """x @ weight.T for decode-sized x (tens of rows): the kernel streams the next panel from
    memory while it computes this one, where MKL stalls on weights the step's K/V stream has
    evicted from cache (and torch's bf16 product reads the weight far below memory speed)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] in the weight's dtype -> [M, N] in it (bf16 rounded to nearest even)."""
        return self.product(x)


class PackedLinear(nn.Linear):
    """A bias-free Linear that keeps its packed panels: batches of at most PANEL_ROWS rows in the
    panels' dtype (decode steps) go through PanelLinear, larger ones (prefill) and other dtypes
    through F.linear as before. Shares the original's weight Parameter, so names, shapes and
    values stay the same. Over int8 or bf16-weight panels there is no fp32 weight (`weight` is
    None): every product, of any size, goes through the panels."""

    def __init__(self, linear: nn.Linear, panel: PanelLinear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if panel.only_copy:
            self.register_parameter("weight", None)
        else:
            self.weight = linear.weight
        self.register_parameter("bias", None)
        self.panel = panel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:  # int8 or bf16-weight panels
            rows = self.panel(x.reshape(-1, self.in_features))
            return rows.reshape(*x.shape[:-1], self.out_features)
        if x.dim() == 2 and x.shape[0] <= PANEL_ROWS and x.dtype == self.panel.dtype:
            return self.panel(x)
        return F.linear(x, self.weight)
