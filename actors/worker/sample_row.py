"""One row of a step that samples: what the sampler, its logits processors, the grammar masks and
the logprobs read of the request it samples for. The runner keeps one per request in its
CachedRequest and reuses it at every step that samples for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...messages.common import SamplingParams

if TYPE_CHECKING:
    from .grammar_state import GrammarState
    from .penalty_history import PenaltyHistory


@dataclass
class SampleRow:
    params: SamplingParams
    position: int  # index of the token being sampled in prompt + output
    num_output: int  # tokens already generated
    stop_token_ids: list[int]  # EOS (unless ignore_eos) + stop_token_ids, masked before min_tokens
    token_ids: list[int] | None = None  # prompt + output so far (read only for penalties)
    penalty_history: PenaltyHistory | None = None  # kept across steps by apply_penalties
    grammar: GrammarState | None = None  # a structured output's matcher (grammar_state.py)
    masked_until: int = field(init=False)  # see __post_init__
    plain_from: int | None = field(init=False)

    def __post_init__(self) -> None:
        """Set once, so that a step's checks are one comparison each: masked_until, the
        num_output before which its stop tokens are masked (min_tokens, or 0 without stop
        tokens); plain_from, the num_output from which the row is plain greedy
        (is_plain_greedy), None when its params never are."""
        params = self.params
        self.masked_until = params.min_tokens if self.stop_token_ids else 0
        plain = (
            params.temperature == 0.0
            and params.logprobs is None
            and not params.processes_logits
            and params.structured is None
        )
        self.plain_from = self.masked_until if plain else None

    @property
    def masks_stop_tokens(self) -> bool:
        """Before min_tokens, its stop tokens (EOS included) may not be sampled."""
        return self.num_output < self.masked_until


def is_plain_greedy(row: SampleRow) -> bool:
    """Greedy with nothing between the logits and the argmax (no penalties or bias, no stop
    token masked for min_tokens, no logprobs, no grammar): the LM head may pick the token
    itself."""
    return row.plain_from is not None and row.num_output >= row.plain_from
