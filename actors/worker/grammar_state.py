"""One structured request's matcher in the Worker, and the step's token masks.

A GrammarState is the xgrammar matcher of one request (one sample of an n > 1 request: each has
its own), advanced by every token sampled for it. It is made when the request enters the
Worker's batch (runner.apply: a NewRequest), from the compiled grammar and the request's output
tokens so far, replayed: that is all a matcher's state is, so it survives preemption (recompute
or swap: the request comes back as a NewRequest with its tokens) and recovery (a restarted
Worker gets every request again from the Engine's journal) with nothing else kept.

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
    from .sampler import SampleRow


class GrammarState:
    __slots__ = ("matcher",)

    def __init__(self, compiled, output_token_ids: Sequence[int]):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        for token in output_token_ids:
            if not self.matcher.accept_token(token):
                raise ValueError(f"output token {token} does not match the request's grammar")

    @property
    def live(self) -> bool:
        """Not terminated: it has not taken the grammar's end (EOS) yet."""
        return not self.matcher.is_terminated()

    def accept(self, token: int) -> None:
        """Advance by a sampled token (the mask allowed it)."""
        self.matcher.accept_token(token)


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
    return picked


def advance_grammars(rows: Sequence[SampleRow], tokens: Sequence[int], picked: list[int]) -> None:
    """Each structured row's matcher takes the token sampled for it."""
    for i in picked:
        rows[i].grammar.accept(tokens[i])
