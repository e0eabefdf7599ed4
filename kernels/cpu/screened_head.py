"""Greedy tokens from the LM head at a fraction of its fp32 cost, with the fp32 head's result to
the bit: screen every column with a bf16 product, then compute exactly the few that can still be
a row's maximum.

Why: at a decode step's rows the fp32 LM head (the demo's is [32000, 256]) is a large part of the
step, and at a few rows it streams the whole fp32 weight. On CPUs with bf16 arithmetic
(AVX512-BF16, AMX) oneDNN does the same product in bf16 from half the bytes, at a higher rate.

Exactness. Let e_j be the fp32 logit the exact head (panels.GreedyHead) computes for column j of
a row a (hidden size k), and y_j the bf16 product's logit. With u = 2^-8 (bf16 rounding),
g = k 2^-24 / (1 - k 2^-24) (fp32 accumulation of k terms in any order) and P_j = sum |a_i w_ij|:

    |e_j - a.w_j|         <= g P_j                    (e_j: the exact head's FMA chain)
    |a'.w'_j - a.w_j|     <= (2u + u^2) P_j           (a', w': a, w rounded to bf16)
    |y~_j - a'.w'_j|      <= g (1 + u)^2 P_j          (y~_j: summed in fp32, products exact)
    |y_j - y~_j|          <= u (1 + g) (1 + u)^2 P_j  (y_j: y~_j rounded to bf16)

so |y_j - e_j| <= 0.0128 P_j for k <= 8192, and P_j <= |a| |w_j| (Cauchy-Schwarz). FACTOR =
1/64 leaves room for the fp32 rounding of the screen's own arithmetic (cpu_screen.c): bound_j =
FACTOR |a| |w_j|. A column whose exact logit equals the row's maximum always passes the screen,
every candidate is recomputed as the exact head computes it, so the token (the first maximum) is
the same. On the demo checkpoint 4-7 columns a row pass (of 32000); a row with a non-finite value
or too many candidates goes to the exact head.

The derivation assumes the bf16 product accumulates in fp32 (oneDNN's contract for bf16
matmul); at load, holds_its_bound checks it keeps within BOUND on random rows, which catches a
product that does something else (not the worst case a bf16 accumulation could reach). Only
where the CPU has bf16 arithmetic (elsewhere bf16 GEMMs are emulated, far slower than fp32),
unless EngineConfig.greedy_head_screen asks for it by name (kernels/cpu/lm_head.py).
"""

from __future__ import annotations

import logging

import torch

from . import bindings
from .capability import cpu_has_bf16
from .panels import GreedyHead

log = logging.getLogger(__name__)
BOUND = 0.0128  # |y_j - e_j| <= BOUND |a| |w_j| (above)
FACTOR = 1.0 / 64.0  # the screen's bound: BOUND and room for its own fp32 rounding
MAX_HIDDEN = 8192  # the bound above holds up to this hidden size
PACK_ROWS = 64  # oneDNN's packing hint: a step's sampling rows


class ScreenedHead:
    """What both screens share (this one and kernels/screened_head_int8.py): a row-major copy of
    the weight to compute the candidates from, the exact head behind the screen, and the rows
    the screen leaves unsettled (-1) sent to that head. Subclasses give `screen`."""

    def __init__(self, lib, weight: torch.Tensor, exact: GreedyHead) -> None:
        self._lib = lib
        self._exact = exact
        # [V, H] row-major: each candidate's row read in one stretch (a copy where the Linear
        # keeps its weight column-major, whose rows would be read a float per cache line)
        self._weight = weight.detach().contiguous()

    @property
    def exact(self) -> GreedyHead:
        """The exact fp32 head behind the screen."""
        return self._exact

    def screen(self, hidden: torch.Tensor) -> tuple[torch.Tensor, int]:
        """hidden [N, H] fp32, rows contiguous -> ([N] int64 tokens, -1 where the screen cannot
        settle the row; how many rows got -1)."""
        raise NotImplementedError

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] fp32 -> [N] int64 token ids, as GreedyHead's."""
        hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
        tokens, unsettled = self.screen(hidden)
        if unsettled:  # rare: the common step makes no more torch calls
            rows = (tokens < 0).nonzero().flatten()
            tokens[rows] = self._exact(hidden[rows])
        return tokens


class ScreenedGreedyHead(ScreenedHead):
    """The LM head's greedy tokens: a bf16 screen, then exact fp32 logits of the survivors; rows
    the screen cannot settle go to the exact head. Same tokens as `exact`, to the bit."""

    def __init__(self, lib, weight: torch.Tensor, exact: GreedyHead) -> None:
        super().__init__(lib, weight, exact)
        norms = torch.cat([rows.double().norm(dim=1) for rows in self._weight.split(4096)])
        self._col_norms = (norms * (1.0 + 1e-6)).float()  # rounded up, as the bound needs
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self._weight.bfloat16(), PACK_ROWS)

    @classmethod
    def for_weight(cls, weight: torch.Tensor, exact: GreedyHead | None, force: bool = False):
        """The screened head over `exact`, or None where it cannot serve or would not be faster:
        no exact head, no bf16 hardware (unless `force`), no oneDNN, a hidden size past
        MAX_HIDDEN, or a weight that is not finite."""
        lib = bindings.load()
        if exact is None or lib is None:
            return None
        if not (force or cpu_has_bf16()) or not torch.backends.mkldnn.is_available():
            return None
        if weight.shape[1] > MAX_HIDDEN or not bool(torch.isfinite(weight).all()):
            return None
        try:
            head = cls(lib, weight, exact)
        except (AttributeError, RuntimeError):  # torch without oneDNN's linear ops
            return None
        if not head.holds_its_bound():
            log.warning("the bf16 product here exceeds the screen's bound: exact LM head only")
            return None
        return head

    def approx_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] fp32 -> the screen's bf16 logits [N, V]."""
        return torch.ops.mkldnn._linear_pointwise(
            hidden.bfloat16(), self._packed, None, "none", [], ""
        )

    def holds_its_bound(self, rows: int = 8, columns: int = 4096) -> bool:
        """Whether this machine's bf16 product keeps within BOUND |a| |w_j| of the true logits
        on random rows of scales 1e-2 to 1e2, over up to `columns` columns spread across the
        vocabulary (the derivation assumes fp32 accumulation, oneDNN's contract; checked once,
        at load)."""
        gen = torch.Generator().manual_seed(0)
        vocab, hidden_size = self._weight.shape
        hidden = torch.randn(rows, hidden_size, generator=gen)
        hidden *= torch.logspace(-2, 2, rows)[:, None]
        picked = torch.linspace(0, vocab - 1, min(vocab, columns)).long().unique()
        true = hidden.double() @ self._weight[picked].double().T
        error = (self.approx_logits(hidden)[:, picked].double() - true).abs()
        norms = self._col_norms[picked].double()
        bound = BOUND * hidden.double().norm(dim=1, keepdim=True) * norms
        return bool((error <= bound).all())

    def screen(self, hidden: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The bf16 logits, then cpu_screen.c (see ScreenedHead.screen)."""
        approx = self.approx_logits(hidden)
        return bindings.screened_argmax(
            self._lib, hidden, approx, self._weight, self._col_norms, FACTOR
        )
