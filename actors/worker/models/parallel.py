"""The collectives a tensor-parallel model's forward does (sharding.py says who holds what).

Every function is the single-device computation when the group has one rank, so the model runs
one code path. Where a function reduces, every rank gets the same result: a sum of partial
projections (all_reduce) or the ranks' pieces concatenated in rank order (all_gather).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...runtime.sharding import ShardLayout
from ..tensor_parallel import TensorParallel


def row_parallel(linear: nn.Linear, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A row-parallel projection: this rank's columns of the weight over its slice of `x`,
    summed over the ranks; the bias (whole on every rank) is added once, after the sum."""
    if tp.size == 1:
        return linear(x)
    out = tp.all_reduce(F.linear(x, linear.weight))
    return out if linear.bias is None else out.add_(linear.bias)


def vocab_parallel_embedding(
    embedding: nn.Embedding, ids: torch.Tensor, layout: ShardLayout, tp: TensorParallel
) -> torch.Tensor:
    """[T] token ids -> [T, hidden]: each rank looks up the ids in its rows of the vocabulary
    and gives zeros for the others; the all-reduce sums one real row and zeros, so every rank
    gets the single-device embedding exactly."""
    if tp.size == 1:
        return embedding(ids)
    start, stop = layout.vocab
    outside = (ids < start) | (ids >= stop)
    h = embedding((ids - start).masked_fill_(outside, 0))
    return tp.all_reduce(h.masked_fill_(outside[:, None], 0.0))


def gathered_logits(
    hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, tp: TensorParallel
) -> torch.Tensor:
    """hidden [N, hidden] -> the full logits [N, vocab_size] float32 on every rank: each rank's
    columns (its vocabulary rows of `weight`), gathered, the padded columns dropped."""
    logits = F.linear(hidden, weight)
    if tp.size > 1:
        logits = tp.all_gather(logits)[:, :vocab_size]
    return logits.float()


def local_best(logits: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """This rank's logits [N, vocab_rows] -> [N, 2] float64: each row's largest logit over the
    rank's real vocabulary rows (padding skipped) and its first index there, as a global token
    id (exact in float64). A rank that holds no real row offers -inf."""
    real = layout.vocab[1] - layout.vocab[0]
    best = torch.empty(logits.shape[0], 2, dtype=torch.float64, device=logits.device)
    if real == 0:
        best[:, 0], best[:, 1] = float("-inf"), layout.vocab[0]
        return best
    values, index = logits[:, :real].float().max(dim=-1)  # the first maximum, as argmax
    best[:, 0], best[:, 1] = values, index + layout.vocab[0]
    return best


def global_best(gathered: torch.Tensor) -> torch.Tensor:
    """Every rank's local_best stacked [size, N, 2] -> [N] int64 token ids: the largest value,
    and on a tie the lowest rank, whose ids are the lower ones: the first maximum over the full
    row, as torch.argmax over the whole vocabulary picks."""
    rank = gathered[..., 0].argmax(dim=0)  # the first maximum: the lowest rank
    return gathered[..., 1].gather(0, rank[None]).squeeze(0).long()


def greedy_ids(
    hidden: torch.Tensor, weight: torch.Tensor, layout: ShardLayout, tp: TensorParallel
) -> torch.Tensor:
    """hidden [N, hidden] -> [N] int64 greedy tokens, the same on every rank: a gather of each
    rank's best (value, id) per row, not of the logits."""
    best = local_best(F.linear(hidden, weight), layout)
    return global_best(tp.all_gather(best[None], dim=0))
