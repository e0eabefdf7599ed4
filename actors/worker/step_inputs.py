"""One step's inputs as the model and the sampler read them, host tensors or views of the
persistent step buffers (the runner makes them: flat_step.py, decode_batch.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cached_request import CachedRequest
from .decode_batch import DecodeBatch
from .models.llama import AttentionMetadata
from .sample_row import SampleRow


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_index: torch.Tensor | None  # rows of the hidden states that sample; None: all
    sample_ids: list[str]
    sample_rows: list[SampleRow]
    requests: list[CachedRequest]  # the scheduled ones, in the step's order
    sample_requests: list[CachedRequest]  # those that sample, in sample_ids' order
    decodes: DecodeBatch | None = None  # a step of decodes: its numbers, for the next step
    decode_graph: int | None = None  # the captured batch size whose graph runs the step
