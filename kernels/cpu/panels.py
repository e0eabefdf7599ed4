"""Weights packed once into the panels csrc/cpu_panel_gemm.c reads, for fp32 products with
decode-sized batches on CPU: the projections (PanelLinear, served through PackedLinear, which
takes a Linear's place in the model) and the LM head with greedy sampling fused in (GreedyHead).
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from . import bindings

PANEL_ROWS = 128  # at most this many rows, a projection uses its packed panels

_Packed = TypeVar("_Packed", bound="PanelWeight")


class PanelWeight:
    """A weight [N, K] (any layout) packed once into the panels csrc/cpu_panel_gemm.c reads.
    Holds the copy (on huge pages where `huge`: every decode step streams it)."""

    def __init__(self, lib, weight: torch.Tensor, huge: bool = True):
        self._lib = lib
        self.out_features = weight.shape[0]
        self.panels = bindings.pack_panels(lib, weight, huge)

    @classmethod
    def for_weight(cls: type[_Packed], weight: torch.Tensor, huge: bool = True) -> _Packed | None:
        """None where it cannot serve (not fp32 on CPU, no C compiler)."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            return None
        lib = bindings.load()
        return cls(lib, weight, huge) if lib is not None else None

    @staticmethod
    def _rows(x: torch.Tensor) -> torch.Tensor:
        return x if x.stride(-1) == 1 else x.contiguous()


class GreedyHead(PanelWeight):
    """An fp32 LM head with greedy sampling fused in: hidden rows -> the first maximum of each
    row's logits, which are never written (no pass to write them and none to read them back)."""

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] fp32 -> [N] int64 token ids."""
        return bindings.greedy_head(self._lib, self._rows(hidden), self.panels, self.out_features)


class PanelLinear(PanelWeight):
    """x @ weight.T for decode-sized x (tens of rows): the kernel streams the next panel from
    memory while it computes this one, where MKL stalls on weights the step's K/V stream has
    evicted from cache."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32 -> [M, N]."""
        return bindings.panel_linear(self._lib, self._rows(x), self.panels, self.out_features)


class PackedLinear(nn.Linear):
    """A bias-free Linear that keeps its packed panels: batches of at most PANEL_ROWS fp32 rows
    (decode steps) go through PanelLinear, larger ones (prefill) through F.linear as before.
    Shares the original's weight Parameter, so names, shapes and values stay the same."""

    def __init__(self, linear: nn.Linear, panel: PanelLinear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", None)
        self.panel = panel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= PANEL_ROWS and x.dtype == torch.float32:
            return self.panel(x)
        return F.linear(x, self.weight)
