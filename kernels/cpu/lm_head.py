"""The LM head's CPU copies: a greedy head (the argmax fused into the product, behind a screen
where the CPU has one that serves) and oneDNN's packed fp32 weight for the logits.

Each costs a copy of the weight:
- greedy tokens: GreedyHead (panels.py) computes every logit exactly and keeps only each row's
  first maximum, so the logits are never written nor read back. `greedy_head_screen` puts a
  cheaper screen in front with the same tokens: `int8` on AMX (screened_head_int8.py: an int8
  copy of the weight and a row-major fp32 one), `bf16` where the CPU has bf16 arithmetic
  (screened_head.py: a bf16 copy and a row-major one), `auto` the first of those that serves,
  `off` none.
- logits: oneDNN's packed fp32 GEMM (torch's private op, the one torch.compile's CPU freezing
  uses) reuses a layout made for a step's rows, where MKL re-reads the plain weight each call;
  one or two rows stay on the plain product, which is cheaper there. Where the op is missing,
  the logits stay on the plain product. Same result either way, up to the order of the sums.
"""

from __future__ import annotations

import logging

import torch

from .panels import GreedyHead
from .screened_head import ScreenedGreedyHead, ScreenedHead
from .screened_head_int8 import Int8ScreenedHead

log = logging.getLogger(__name__)
PACK_ROWS = 64  # oneDNN's packing hint: a step's sampling rows
PACKED_MIN_ROWS = 3  # fewer rows than this stay on the plain product


def greedy_head(
    weight: torch.Tensor, screen: str, huge: bool = True
) -> GreedyHead | ScreenedHead | None:
    """The cheapest exact greedy head `screen` allows here (see the module docstring), or None
    where none serves (not fp32 on CPU, no C library)."""
    exact = GreedyHead.for_weight(weight, huge)
    if exact is None:
        return None
    if screen in ("auto", "int8"):
        head = Int8ScreenedHead.for_weight(weight, exact, huge)
        if head is not None:
            return head
    if screen in ("auto", "bf16"):
        head = ScreenedGreedyHead.for_weight(weight, exact, force=screen == "bf16")
        if head is not None:
            return head
    if screen in ("int8", "bf16"):
        log.warning("greedy_head_screen=%s cannot serve here: the exact fused head", screen)
    return exact


def packed_logits_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of an fp32 CPU weight [V, H], or None where torch lacks the op."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
    except (AttributeError, RuntimeError):
        return None


def packed_logits(hidden: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """hidden [N, H] fp32 -> logits [N, V] through the packed copy."""
    return torch.ops.mkldnn._linear_pointwise(hidden, packed, None, "none", [], "")
