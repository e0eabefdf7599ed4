"""One structured request's matcher in the Worker.

A GrammarState is the xgrammar matcher of one request (one sample of an n > 1 request: each has
its own), advanced by every token sampled for it. It is made when the request enters the
Worker's batch (runner.apply: a NewRequest), from the compiled grammar and the request's output
tokens so far, replayed: that is all a matcher's state is, so it survives preemption (recompute
or swap: the request comes back as a NewRequest with its tokens) and recovery (a restarted
Worker gets every request again from the Engine's journal) with nothing else kept.
(grammar_masks.py applies it to a step's logits.)
"""

from __future__ import annotations

from collections.abc import Sequence


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
