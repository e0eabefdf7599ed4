"""One request in the Worker's persistent batch (the runner's record of it)."""

from __future__ import annotations

from dataclasses import dataclass

from ...messages.step import NewRequest
from .sample_row import SampleRow


@dataclass
class CachedRequest:
    """One request in the persistent batch. Its block table is row `row` of the runner's
    BlockTables, `num_blocks` long; `sample_row` is reused by every step that samples for it."""

    token_ids: list[int]
    num_prompt_tokens: int
    num_computed: int
    row: int
    num_blocks: int
    new: NewRequest  # the params and identity as first received
    sample_row: SampleRow
