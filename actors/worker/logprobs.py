"""Logprobs of the raw model distribution (log_softmax of the unprocessed logits, as vLLM reports
by default): for sampled tokens, and for prompt tokens.

Each entry is a TokenLogprobs: the token's logprob, its rank (1 + the number of tokens with a
strictly higher logprob) and the k most likely tokens (k = the request's `logprobs` or
`prompt_logprobs`). Sampled rows: `start_sample_logprobs` takes the log_softmax before the sampler
changes the logits (penalties, temperature, filters), `PendingLogprobs.finish` reads the sampled
tokens' entries. Prompt rows: the hidden state at position j predicts prompt token j + 1, so a
prefill chunk over positions [s, e) yields entries for prompt tokens s + 1 .. min(e, P - 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...messages.common import TokenLogprobs
from ...messages.step import NewRequest, PromptLogprobs

if TYPE_CHECKING:
    from .cached_request import CachedRequest
    from .sample_row import SampleRow

PROMPT_ROWS_PER_CHUNK = 512  # rows of [rows, vocab] logits at once (memory bound)


def token_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, ks: Sequence[int]
) -> list[TokenLogprobs]:
    """logprobs [R, vocab] (log_softmax), token_ids [R], ks[r] alternatives for row r -> R
    entries: token_ids[r]'s logprob and rank, and row r's top ks[r] as (id, logprob)."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    kmax = max(ks, default=0)
    if kmax:
        top_values, top_ids = logprobs.topk(kmax, dim=1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    out = []
    for r, (token, value, rank, k) in enumerate(
        zip(token_ids.tolist(), chosen.squeeze(1).tolist(), ranks, ks)
    ):
        top = list(zip(top_ids[r][:k], top_values[r][:k])) if k else []
        out.append(TokenLogprobs(token, value, rank, top))
    return out


@dataclass
class PendingLogprobs:
    """The raw log_softmax of the sampled rows that asked for logprobs, awaiting their tokens."""

    picked: list[int]  # row indices into the step's sample rows
    index: torch.Tensor  # the same on the logits' device
    logprobs: torch.Tensor  # [len(picked), vocab]
    ks: list[int]
    num_rows: int

    def finish(self, tokens: Sequence[int] | torch.Tensor) -> list[TokenLogprobs | None]:
        """tokens: the step's sampled token per row (a list, or [N] int64 on the logits' device)
        -> one entry per row (None: not asked)."""
        if isinstance(tokens, torch.Tensor):
            ids = tokens.index_select(0, self.index)
        else:
            ids = torch.tensor([tokens[i] for i in self.picked], device=self.logprobs.device)
        out: list[TokenLogprobs | None] = [None] * self.num_rows
        for i, entry in zip(self.picked, token_logprobs(self.logprobs, ids, self.ks)):
            out[i] = entry
        return out


def start_sample_logprobs(
    logits: torch.Tensor, rows: Sequence[SampleRow]
) -> PendingLogprobs | None:
    """Before sampling: the log_softmax of the rows that ask for logprobs, and of no other row;
    None when none asks."""
    picked = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not picked:
        return None
    index = torch.tensor(picked, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    ks = [rows[i].params.logprobs for i in picked]
    return PendingLogprobs(picked, index, logprobs, ks, len(rows))


class PromptLogprobsTracker:
    """Requests of the Worker's batch that still owe prompt logprobs (they have sampled nothing
    yet: a request re-sent with output tokens after a preemption owes none)."""

    def __init__(self):
        self.owing: set[str] = set()

    def track(self, new: Sequence[NewRequest]) -> None:
        for request in new:
            if request.params.prompt_logprobs is not None:
                self.owing.add(request.request_id)

    def compute(
        self,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        hidden: torch.Tensor,
        scheduled: Sequence[tuple[str, int]],
        requests: dict[str, CachedRequest],
    ) -> list[PromptLogprobs]:
        """hidden [T, H]: the step's hidden states, request after request in `scheduled` order,
        before num_computed advances. One PromptLogprobs per request whose chunk covers prompt
        positions that predict a prompt token."""
        if not self.owing:
            return []
        self.owing.intersection_update(requests)  # dropped by the plan, or a reset
        spans = []  # (request id, first hidden row, first prompt token, count, request)
        offset = 0
        for rid, count in scheduled:
            request = requests[rid] if rid in self.owing else None
            if request is not None:
                prompt = request.num_prompt_tokens
                start = request.num_computed
                end = min(start + count, prompt - 1)
                if len(request.token_ids) > prompt:
                    self.owing.discard(rid)
                elif end > start:
                    spans.append((rid, offset, start + 1, end - start, request))
                if start + count >= prompt:
                    self.owing.discard(rid)
            offset += count
        if not spans:
            return []
        rows, targets, ks = [], [], []
        for _, row, first, count, request in spans:
            rows.extend(range(row, row + count))
            targets.extend(request.token_ids[first : first + count])
            ks.extend([request.new.params.prompt_logprobs] * count)
        entries: list[TokenLogprobs] = []
        device = hidden.device
        for at in range(0, len(rows), PROMPT_ROWS_PER_CHUNK):
            part = slice(at, at + PROMPT_ROWS_PER_CHUNK)
            index = torch.tensor(rows[part], device=device)
            logits = compute_logits(hidden.index_select(0, index))
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            entries.extend(
                token_logprobs(logprobs, torch.tensor(targets[part], device=device), ks[part])
            )
        out, at = [], 0
        for rid, _, first, count, _ in spans:
            out.append(PromptLogprobs(rid, first, entries[at : at + count]))
            at += count
        return out
