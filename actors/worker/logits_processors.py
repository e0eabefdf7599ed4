"""Logits processors that run before sampling: logit bias, then repetition, frequency and presence
penalties (vLLM's order and semantics), vectorized over the rows that ask for them.

For one row with prompt tokens P, output tokens O (the tokens sampled so far) and logits l:
    l[t] += logit_bias[t]
    r = repetition_penalty, for t in P or O:  l[t] = l[t] / r if l[t] > 0 else l[t] * r
    l[t] -= frequency_penalty * count(t in O) + presence_penalty * (t in O)
Histories travel as Python lists (the runner's `CachedRequest.token_ids`); they become one flat
index tensor per step (numpy, no per-token Python loop) and per-row token counts by bincount.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .sampler import SampleRow


def apply_logits_processors(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """logits [N, vocab] float32, one row per SampleRow -> the same tensor, the rows whose params
    ask for penalties or a logit bias rewritten in place (the others untouched)."""
    picked = [i for i, row in enumerate(rows) if row.params.processes_logits]
    if not picked:
        return logits
    index = torch.tensor(picked, device=logits.device)
    sub = logits.index_select(0, index)
    params = [rows[i].params for i in picked]
    if any(p.logit_bias for p in params):
        sub = apply_logit_bias(sub, [p.logit_bias for p in params])
    if any(p.penalises for p in params):
        prompts, outputs = [], []
        for i in picked:
            row = rows[i]
            tokens = row.token_ids or ()
            split = row.position - row.num_output  # prompt | output, in token_ids[:position]
            prompts.append(tokens[:split])
            outputs.append(tokens[split : row.position])
        sub = apply_penalties(
            sub,
            prompts,
            outputs,
            [p.presence_penalty for p in params],
            [p.frequency_penalty for p in params],
            [p.repetition_penalty for p in params],
        )
    return logits.index_copy_(0, index, sub)


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[dict[int, float]]) -> torch.Tensor:
    """logits [R, vocab]; biases[r] {token id: value} -> logits with the values added."""
    sizes = [len(b) for b in biases]
    total = sum(sizes)
    if total == 0:
        return logits
    rows = np.repeat(np.arange(len(biases)), sizes)
    tokens = np.fromiter(chain.from_iterable(b.keys() for b in biases), np.int64, total)
    values = np.fromiter(chain.from_iterable(b.values() for b in biases), np.float32, total)
    device = logits.device
    logits.index_put_(
        (torch.from_numpy(rows).to(device), torch.from_numpy(tokens).to(device)),
        torch.from_numpy(values).to(device),
        accumulate=True,
    )
    return logits


def token_counts(seqs: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """[R, vocab] int64: how many times each token occurs in each of the R sequences."""
    lengths = [len(s) for s in seqs]
    total = sum(lengths)
    flat = np.fromiter(chain.from_iterable(seqs), np.int64, total)
    flat += np.repeat(np.arange(len(seqs), dtype=np.int64) * vocab, lengths)
    bins = torch.from_numpy(flat).to(device)
    return torch.bincount(bins, minlength=len(seqs) * vocab).view(len(seqs), vocab)


def apply_penalties(
    logits: torch.Tensor,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    presence: Sequence[float],
    frequency: Sequence[float],
    repetition: Sequence[float],
) -> torch.Tensor:
    """logits [R, vocab] float32 with row r's penalties over prompts[r] and outputs[r] -> logits.

    Repetition applies to tokens seen in the prompt or the output; frequency and presence to
    tokens of the output only (OpenAI's semantics).
    """
    num_rows, vocab = logits.shape
    device = logits.device
    out_counts = token_counts(outputs, vocab, device)
    if any(r != 1.0 for r in repetition):
        seen = (token_counts(prompts, vocab, device) > 0) | (out_counts > 0)
        factor = torch.tensor(repetition, dtype=logits.dtype, device=device).unsqueeze(1)
        factor = torch.where(seen, factor, torch.ones((), dtype=logits.dtype, device=device))
        logits = torch.where(logits > 0, logits / factor, logits * factor)
    if any(frequency):
        freq = torch.tensor(frequency, dtype=logits.dtype, device=device).unsqueeze(1)
        logits = logits - freq * out_counts.to(logits.dtype)
    if any(presence):
        pres = torch.tensor(presence, dtype=logits.dtype, device=device).unsqueeze(1)
        logits = logits - pres * (out_counts > 0).to(logits.dtype)
    return logits
