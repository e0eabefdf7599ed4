"""Logits processors that run before sampling: logit bias, then repetition, frequency and presence
penalties (vLLM's order and semantics), vectorized over the rows that ask for them.

For one row with prompt tokens P, output tokens O (the tokens sampled so far) and logits l:
    l[t] += logit_bias[t]
    r = repetition_penalty, for t in P or O:  l[t] = l[t] / r if l[t] > 0 else l[t] * r
    l[t] -= frequency_penalty * count(t in O) + presence_penalty * (t in O)
A row's history is read from its SampleRow's `token_ids` (the runner's `CachedRequest.token_ids`)
into a PenaltyHistory kept on the row across steps: the distinct prompt tokens, found once, and a
count per distinct output token, updated with the tokens sampled since the step before. A step
then touches only those (row, token) entries of the logits (gather, index_copy, index_add): its
cost grows with the distinct tokens, not with the history's length or the vocabulary. Each
entry gets the formula's operations in its order, each rounded on its own (repetition, then
frequency, then presence).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

from .penalty_history import PenaltyHistory

if TYPE_CHECKING:
    from .sample_row import SampleRow


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
        histories = [penalty_history(rows[i]) for i in picked]
        sub = apply_penalties(
            sub,
            histories,
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


def penalty_history(row: SampleRow) -> PenaltyHistory:
    """The row's history brought up to its `position` (made on its first step)."""
    tokens = row.token_ids or ()
    split = row.position - row.num_output
    history = row.penalty_history
    if history is None or history.split != split or history.num_counted > row.num_output:
        history = row.penalty_history = PenaltyHistory(tokens, split)
    counts = history.counts
    for token in tokens[split + history.num_counted : row.position]:
        counts[token] = counts.get(token, 0) + 1
    history.num_counted = row.num_output
    return history


def apply_penalties(
    logits: torch.Tensor,
    histories: Sequence[PenaltyHistory],
    presence: Sequence[float],
    frequency: Sequence[float],
    repetition: Sequence[float],
) -> torch.Tensor:
    """logits [R, vocab] float32 with row r's penalties over histories[r] -> logits (in place).

    Repetition applies to tokens seen in the prompt or the output; frequency and presence to
    tokens of the output only (OpenAI's semantics).
    """
    num_rows, vocab = logits.shape
    device = logits.device
    outputs = [history.output_tokens() for history in histories]
    flat = logits.view(-1)  # row r, token t at r * vocab + t

    def entries(rows: list[int], tokens: list[np.ndarray]) -> torch.Tensor:
        offsets = np.repeat(np.array(rows, dtype=np.int64) * vocab, [len(t) for t in tokens])
        joined = np.concatenate(tokens) if tokens else np.empty(0, np.int64)
        return torch.from_numpy(joined + offsets).to(device)

    rows = [r for r in range(num_rows) if repetition[r] != 1.0]
    if rows:  # a token in both prompt and output is listed twice, and written twice alike
        seen = [histories[r].prompt_tokens for r in rows] + [outputs[r][0] for r in rows]
        index = entries(rows + rows, seen)
        values = flat.index_select(0, index)
        factor = torch.tensor(repetition, dtype=logits.dtype, device=device)[index // vocab]
        flat.index_copy_(0, index, torch.where(values > 0, values / factor, values * factor))
    index = entries(list(range(num_rows)), [tokens for tokens, _ in outputs])
    row_of = index // vocab
    if any(frequency):
        counts = torch.from_numpy(np.concatenate([c for _, c in outputs])).to(device)
        freq = torch.tensor(frequency, dtype=logits.dtype, device=device)[row_of]
        flat.index_add_(0, index, -(freq * counts))
    if any(presence):
        pres = torch.tensor(presence, dtype=logits.dtype, device=device)[row_of]
        flat.index_add_(0, index, -pres)
    return logits
