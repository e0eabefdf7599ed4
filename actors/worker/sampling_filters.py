"""Temperature, then top-k, top-p and min-p, on the logits' device, vectorized over the rows that
draw: each filter is a cutoff on the scaled logits z = logits / temperature, and a token below its
row's cutoff gets z = -inf (the draw never picks it).

Per row, with p = softmax(z):
    top-k  keeps the k largest z (and any tied with the k-th); k <= 0 or k >= vocab: off
    top-p  then keeps the tokens, most likely first, whose mass before them (in the top-k
           distribution, renormalized) is at most top_p
    min-p  keeps p_i >= min_p * p_max, that is z_i >= max(z) + log(min_p): no sort
The most likely token always survives. Only top-p needs the whole row sorted (its cumulative
mass); top-k alone takes torch.topk of the largest k; a step where no row asks for either sorts
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .sample_row import SampleRow


def filtered_logits(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """logits [R, vocab] float32, one row per SampleRow (temperature > 0) -> z [R, vocab]: a new
    tensor, scaled and filtered."""
    vocab = logits.shape[1]
    params = [row.params for row in rows]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    host = torch.tensor(
        [
            [p.temperature for p in params],
            top_k,
            [p.top_p for p in params],
            [p.min_p for p in params],
        ],
        dtype=torch.float32,
    )  # one copy to the device for the four per-row parameters (k < 2**24: exact in float32)
    temperature, k, top_p, min_p = host.to(logits.device, non_blocking=True).unsqueeze(2)
    z = logits / temperature
    if any(p.top_p < 1.0 for p in params):
        z.masked_fill_(z < sorted_cutoff(z, k, top_p), float("-inf"))
    elif any(n < vocab for n in top_k):
        z.masked_fill_(z < top_k_cutoff(z, k, max(top_k)), float("-inf"))
    if any(p.min_p > 0.0 for p in params):
        z.masked_fill_(z < z.amax(dim=1, keepdim=True) + min_p.log(), float("-inf"))
    return z


def top_k_cutoff(z: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """[R, 1]: each row's k-th largest z (-inf where k is the vocabulary: no top-k), from the
    k_max largest alone."""
    largest = z.topk(k_max, dim=1).values  # descending
    kth = largest.gather(1, (k.long() - 1).clamp(max=k_max - 1))
    return kth.masked_fill(k >= z.shape[1], float("-inf"))


def sorted_cutoff(z: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, 1]: each row's smallest z that top-k then top-p keep, from the row sorted."""
    ordered = z.sort(dim=1, descending=True).values
    ranks = torch.arange(z.shape[1], device=z.device)
    drop = ranks >= k
    probs = ordered.masked_fill(drop, float("-inf")).softmax(dim=1)
    before = probs.cumsum(dim=1) - probs  # mass strictly above each token
    drop |= before > top_p
    kept = (~drop).sum(dim=1, keepdim=True).clamp_(min=1)  # drop is a suffix of each row
    return ordered.gather(1, kept - 1)
