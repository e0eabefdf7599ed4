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
    """`broken`: a token did not match the grammar. Only a client can make that happen (an SDK
    resumption, GenerateRequest.resume, carrying output tokens of its own), and it must cost no
    other request anything: the request's next token is then forced to one of `stop_token_ids`
    (EOS), which ends it, instead of failing the step that every request in it shares."""

    __slots__ = ("matcher", "broken")

    def __init__(self, compiled, output_token_ids: Sequence[int]):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.broken = False
        for token in output_token_ids:
            self.accept(token)

    @property
    def live(self) -> bool:
        """Not terminated: it has not taken the grammar's end (EOS) yet."""
        return not self.matcher.is_terminated()

    def accept(self, token: int) -> None:
        """Advance by a sampled (or replayed) token."""
        if not self.broken and not self.matcher.accept_token(token):
            self.broken = True


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
