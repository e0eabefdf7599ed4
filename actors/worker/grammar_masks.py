"""A step's token masks from its structured rows' matchers (grammar_state.py).

Per step, `mask_grammar_rows` sets to -inf the logits of the tokens each structured row's grammar
forbids, before logprobs and sampling: rows without a grammar are not touched (and stay on the
plain-greedy paths). Logprobs are therefore of the masked distribution, as vLLM's (it applies the
grammar bitmask to the logits before its sampler computes logprobs): a forbidden token has
logprob -inf and never appears among the top alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .sample_row import SampleRow


def mask_grammar_rows(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[int]:
    """logits [N, vocab], one row per SampleRow: the structured rows' forbidden tokens set to
    -inf in place. -> the indices of those rows (empty: nothing done).

    A matcher that has terminated (it took EOS) is skipped: its request has ended, and this step
    was planned before the Scheduler knew (two steps in flight); the token is dropped."""
    picked = [i for i, row in enumerate(rows) if row.grammar is not None and row.grammar.live]
    if not picked:
        return picked
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
    for i in picked:
        rows[i].grammar.matcher.fill_next_token_bitmask(bitmask, i)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=picked)
    for i in picked:
        if rows[i].grammar.broken:  # end it (see GrammarState)
            stops = rows[i].stop_token_ids
            kept = logits[i, stops].clone()
            logits[i] = float("-inf")
            logits[i, stops] = torch.where(torch.isfinite(kept), kept, 0.0)
    return picked


def advance_grammars(rows: Sequence[SampleRow], tokens: Sequence[int], picked: list[int]) -> None:
    """Each structured row's matcher takes the token sampled for it."""
    for i in picked:
        rows[i].grammar.accept(tokens[i])
