"""Token sampling over the rows of a step that sample: greedy, temperature, top-k, top-p, min-p,
all on the logits' device; only the [N] int64 ids go back to the host (token_readback.py).

A step: stop tokens masked for min_tokens (one indexed write), penalties and logit bias
(logits_processors.py), then greedy rows take the first maximum and the others a draw from their
scaled, filtered logits (sampling_filters.py) by the exponential race (kernels/sampling.py).

Each drawing row brings a 63-bit key: draw_seed(seed, position of the sampled token) for a request
with a `seed`, else one drawn from the Sampler's generator. The draw is a function of the key and
the row's logits alone, so a seeded request's tokens depend neither on the other requests in the
batch nor on how many steps came before (a restarted Worker resumes the same stream).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ...kernels.sampling import draw_backend, gumbel_argmax
from ...messages.common import SamplingParams
from .logits_processors import apply_logits_processors
from .sample_row import SampleRow
from .sampling_filters import filtered_logits
from .token_readback import SampledTokens, TokenReadback

_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


def draw_seed(seed: int, position: int) -> int:
    """The 63-bit key of one draw, mixed from the request seed and the token's position."""
    x = (seed * _MIX + position * 0xBF58476D1CE4E5B9 + 1) & ((1 << 64) - 1)
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 29)) & _MASK


def first_maximum(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N] int64: the first maximum of each row."""
    return logits.argmax(dim=-1)


def needs_processing(rows: Sequence[SampleRow]) -> bool:
    """Some row changes its logits before its token is picked (stop tokens masked, penalties or
    bias, a draw): the step works on float32 logits."""
    return any(
        row.params.temperature != 0.0 or row.params.processes_logits or row.masks_stop_tokens
        for row in rows
    )


def mask_stop_tokens(logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    """Before min_tokens, set each row's stop tokens to -inf: one indexed write for the step."""
    masked = [(i, row.stop_token_ids) for i, row in enumerate(rows) if row.masks_stop_tokens]
    if not masked:
        return
    where = torch.tensor(
        [[i for i, stops in masked for _ in stops], [t for _, stops in masked for t in stops]]
    ).to(logits.device, non_blocking=True)
    logits[where[0], where[1]] = float("-inf")


class Sampler:
    def __init__(
        self,
        seed: int = 0,
        argmax_rows: Callable[..., torch.Tensor] = first_maximum,
        device: torch.device | str = "cpu",
        backend: str | None = None,
    ):
        """`argmax_rows`: first_maximum's contract (the CPU fast path gives one in C). `backend`:
        how rows are drawn (kernels/sampling.py), by default draw_backend(device)."""
        device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)  # the keys of unseeded rows
        self.argmax_rows = argmax_rows
        self.backend = draw_backend(device) if backend is None else backend
        self.min_programs = 0  # a few programs per SM, so that a small batch fills the GPU
        if device.type == "cuda":
            self.min_programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count
        self.readback = TokenReadback(device)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[int]:
        """logits [N, vocab] on any device -> N token ids."""
        return self.sample(logits, rows).tolist()

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampledTokens:
        """logits [N, vocab] on any device, one row per SampleRow -> the N tokens, on the device
        and on their way to the host. Float32 logits may be changed in place."""
        drawn = [i for i, row in enumerate(rows) if row.params.temperature != 0.0]
        if needs_processing(rows):
            logits = logits.float()
            mask_stop_tokens(logits, rows)
            logits = apply_logits_processors(logits, rows)  # penalties, logit_bias (if any asks)
        if len(drawn) == len(rows):
            tokens = self.draw(logits, rows)
        else:
            tokens = self.argmax_rows(logits)  # the first maximum of each row
            if drawn:
                index = torch.tensor(drawn).to(logits.device, non_blocking=True)
                some = self.draw(logits.index_select(0, index), [rows[i] for i in drawn])
                tokens.index_copy_(0, index, some)
        return self.readback.start(tokens)

    def warm_up(self, vocab_size: int) -> None:
        """Draw once over a vocabulary of `vocab_size`, so that the Triton kernel (one variant
        per vocabulary size) is compiled before a request needs it."""
        logits = torch.zeros(1, vocab_size, device=self.readback.device)
        self.draw(logits, [SampleRow(SamplingParams(temperature=1.0), 0, 0, [])])

    def draw(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """logits [R, vocab] float32 of rows with temperature > 0 -> [R] int64 tokens drawn from
        their scaled, filtered distributions."""
        unseeded = iter(
            torch.randint(
                _MASK, (sum(row.params.seed is None for row in rows),), generator=self.generator
            ).tolist()
        )
        keys = [
            next(unseeded) if row.params.seed is None else draw_seed(row.params.seed, row.position)
            for row in rows
        ]
        keys = torch.tensor(keys, dtype=torch.int64).to(logits.device, non_blocking=True)
        z = filtered_logits(logits, rows)
        return gumbel_argmax(z, keys, self.backend, self.min_programs)
