"""Token sampling over the rows of a step that sample: greedy, temperature, top-k, top-p, min-p.

A request with a `seed` draws from a generator seeded by (seed, position of the sampled token), so
its tokens depend neither on the other requests in the batch nor on how many steps came before
(a restarted Worker resumes the same stream).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ...messages.common import SamplingParams
from .logits_processors import PenaltyHistory, apply_logits_processors

if TYPE_CHECKING:
    from .grammar_state import GrammarState

_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


def draw_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for one draw, mixed from the request seed and token position."""
    x = (seed * _MIX + position * 0xBF58476D1CE4E5B9 + 1) & ((1 << 64) - 1)
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 29)) & _MASK


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


def first_maximum(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N] int64: the first maximum of each row."""
    return logits.max(dim=-1).indices


class Sampler:
    def __init__(self, seed: int = 0, argmax_rows: Callable[..., torch.Tensor] = first_maximum):
        """`argmax_rows`: first_maximum's contract (the CPU fast path gives one in C)."""
        self.generator = torch.Generator().manual_seed(seed)
        self.argmax_rows = argmax_rows

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
        """logits [N, vocab] float32 on any device -> N token ids."""
        logits = logits.float()
        for i, row in enumerate(rows):
            if row.masks_stop_tokens:
                logits[i, row.stop_token_ids] = float("-inf")
        logits = apply_logits_processors(logits, rows)  # penalties, logit_bias (if any asks)
        tokens = self.argmax_rows(logits).cpu()  # the first maximum of each row
        if all(r.params.temperature == 0.0 for r in rows):
            return tokens.tolist()
        random_rows = [i for i, r in enumerate(rows) if r.params.temperature != 0.0]
        idx = torch.tensor(random_rows, device=logits.device)
        probs = self._filtered_probs(logits.index_select(0, idx), [rows[i] for i in random_rows])
        noise = self._exponential_noise(probs.shape, [rows[i] for i in random_rows])
        sampled = (probs.cpu() / noise).argmax(dim=-1)
        tokens[torch.tensor(random_rows)] = sampled
        return tokens.tolist()

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Temperature, then top-k, top-p and min-p filters, vectorized over rows."""
        device = logits.device
        temps = torch.tensor([r.params.temperature for r in rows], device=device)
        logits = logits / temps.unsqueeze(1)
        vocab = logits.shape[1]
        top_k = torch.tensor(
            [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows], device=device
        )
        top_p = torch.tensor([r.params.top_p for r in rows], device=device)
        min_p = torch.tensor([r.params.min_p for r in rows], device=device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        drop = ranks >= top_k.unsqueeze(1)
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        drop |= before > top_p.unsqueeze(1)
        drop |= sorted_probs < min_p.unsqueeze(1) * sorted_probs[:, :1]
        drop[:, 0] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        return filtered.softmax(dim=-1)

    def _exponential_noise(self, shape: torch.Size, rows: list[SampleRow]) -> torch.Tensor:
        """Exp(1) noise: argmax(p / noise) is a draw from p (the exponential race)."""
        noise = torch.empty(shape).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                g = torch.Generator().manual_seed(draw_seed(row.params.seed, row.position))
                noise[i] = torch.empty(shape[1]).exponential_(generator=g)
        return noise
