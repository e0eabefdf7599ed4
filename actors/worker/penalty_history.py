"""What one request's penalties read of its tokens, kept on its SampleRow from step to step."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class PenaltyHistory:
    """One request's tokens as its penalties read them: the distinct prompt tokens, and how many
    times each output token occurs. Held by the request's SampleRow from step to step; each step
    counts only the output tokens sampled since the last (token_ids only ever grow)."""

    __slots__ = ("split", "prompt_tokens", "counts", "num_counted")

    def __init__(self, token_ids: Sequence[int], split: int):
        self.split = split  # prompt | output in token_ids
        self.prompt_tokens = np.unique(np.fromiter(token_ids[:split], np.int64, split))
        self.counts: dict[int, int] = {}
        self.num_counted = 0  # output tokens counted so far

    def output_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """(distinct output tokens int64, their counts float32)."""
        n = len(self.counts)
        return (
            np.fromiter(self.counts.keys(), np.int64, n),
            np.fromiter(self.counts.values(), np.float32, n),
        )
