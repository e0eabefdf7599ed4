"""Greedy tokens from the LM head behind an int8 screen on the AMX tile unit, with the fp32 head's
result to the bit: the bf16 screen's idea (kernels/screened_head.py) at half its bytes and with
integer products.

Why: a decode step's head behind the bf16 screen still streams a bf16 weight from memory (the
step's K/V have pushed it out of cache) and writes and rereads its bf16 logits. Here the weight
is int8 (half the bytes), the products are exact in int32 on AMX (TDPBSSD), and each column is
screened while its products are in L1, so no logits are written.

Exactness. Each column j keeps a scale s_j and int8 values q_j, with r_j bounding the 2-norm of
w_j - s_j q_j and m_j that of s_j q_j, both computed in fp64 and rounded up; each row gets its
own int8 copy and residual norm in the kernel. Together they bound how far the exact head's fp32
logit can lie from the integer product's scaled value (the derivation is in
csrc/cpu_screen_int8.c), with no assumption about any library's arithmetic; the candidates
are computed exactly and the first maximum taken, as the bf16 screen does. On the demo
checkpoint a handful of columns a row survive. A row it cannot settle (a value not finite or
outside [2^-60, 2^60], or too many candidates) goes to the exact head.

Only where the CPU has AMX-INT8, the C kernels were built with it and Linux grants the process
the tile state (EngineConfig.greedy_head_screen picks it or not: kernels/cpu/lm_head.py). At load
it checks its tokens against the exact head's on random rows.
"""

from __future__ import annotations

import logging

import torch

from . import bindings, huge_pages
from .panels import GreedyHead
from .screened_head import ScreenedHead

log = logging.getLogger(__name__)
COLS, KTILE = 16, 64  # a weight block's columns, the int8 products along k in a tile row
RANGE = 2.0**60  # nonzero weights outside [1 / RANGE, RANGE] keep the int8 screen off
MAX_HIDDEN = 65536  # int32 products of this many int8 pairs cannot overflow


def quantize_columns(weight: torch.Tensor, huge: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [V, K] fp32 -> (the int8 copy in the kernel's blocks [ceil(V / 16), ceil(K / 64),
    16, 16, 4], column terms [3, ceil(V / 16) * 16]: each column's scale s_j, the 2-norm of w_j -
    s_j q_j and that of s_j q_j, both rounded up; zero past V); the copy on huge pages where
    `huge`."""
    vocab, k = weight.shape
    vpad, kpad = -(-vocab // COLS) * COLS, -(-k // KTILE) * KTILE
    q = torch.zeros(vpad, kpad, dtype=torch.int8)
    terms = torch.zeros(3, vpad)
    for start in range(0, vocab, 4096):  # fp64 copies of slices, not of the whole weight
        w = weight[start : start + 4096].float()
        amax = w.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        values = torch.round(w / scale[:, None]).clamp(-127, 127)
        exact = values.double() * scale.double()[:, None]  # s_j q_ji: exact in fp64
        rows = slice(start, start + w.shape[0])
        q[rows, :k] = values.to(torch.int8)
        terms[0, rows] = scale
        terms[1, rows] = ((w.double() - exact).norm(dim=1) * (1 + 1e-6)).float()
        terms[2, rows] = (exact.norm(dim=1) * (1 + 1e-6)).float()
    blocks = q.view(vpad // COLS, COLS, kpad // KTILE, KTILE // 4, 4).permute(0, 2, 3, 1, 4)
    packed = huge_pages.empty(tuple(blocks.shape), torch.int8, huge)  # streamed every step
    packed.copy_(blocks)
    return packed, terms


class Int8ScreenedHead(ScreenedHead):
    """The LM head's greedy tokens: an int8 screen on AMX, then exact fp32 logits of the
    survivors; rows the screen cannot settle go to the exact head. Same tokens as `exact`."""

    def __init__(self, lib, weight: torch.Tensor, exact: GreedyHead, huge: bool = True) -> None:
        super().__init__(lib, weight, exact)
        self._packed, terms = quantize_columns(self._weight, huge)
        self._terms = tuple(terms)  # scales, residual norms, int8 norms: unbound once, here
        self._largest = (float(terms[1].max()), float(terms[2].max()))

    @classmethod
    def for_weight(cls, weight: torch.Tensor, exact: GreedyHead | None, huge: bool = True):
        """The int8-screened head over `exact`, or None where it cannot serve: no exact head, no
        AMX here, a hidden size past MAX_HIDDEN, or a weight that is not finite or has a nonzero
        value outside [2^-60, 2^60]."""
        lib = bindings.load()
        if exact is None or lib is None:
            return None
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            return None
        if weight.shape[1] > MAX_HIDDEN:
            return None
        if not lib.int8_screen_available():
            return None
        magnitudes = weight.detach().abs()
        nonzero = magnitudes[magnitudes > 0]
        if not bool(torch.isfinite(weight).all()) or (
            nonzero.numel() and (nonzero.min() < 1 / RANGE or nonzero.max() > RANGE)
        ):
            return None
        head = cls(lib, weight, exact, huge)
        if not head.agrees_with_exact():
            log.warning("the int8 screen disagreed with the exact LM head here: not used")
            return None
        return head

    def agrees_with_exact(self, rows: int = 8) -> bool:
        """Whether the rows the screen settles among random ones (scales 1e-2 to 1e2) get the
        exact head's tokens: a check, at load, that the tile unit computed what the kernel
        expects (a row it leaves to the exact head is slower, not wrong)."""
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(rows, self._weight.shape[1], generator=gen)
        hidden *= torch.logspace(-2, 2, rows)[:, None]
        tokens, _ = self.screen(hidden)
        settled = tokens >= 0
        return torch.equal(tokens[settled], self._exact(hidden)[settled])

    def screen(self, hidden: torch.Tensor) -> tuple[torch.Tensor, int]:
        """cpu_screen_int8.c (see ScreenedHead.screen)."""
        return bindings.int8_screened_argmax(
            self._lib, hidden, self._packed, self._weight.shape[0], self._terms, self._largest,
            self._weight,
        )  # fmt: skip
