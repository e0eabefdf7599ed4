"""A step's tokens from its hidden states: the LM head's own greedy pick for the rows that are
plain greedy, the logits, grammar masks, logprobs and the sampler for the others."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .grammar_masks import advance_grammars, mask_grammar_rows
from .logprobs import start_sample_logprobs
from .sample_row import is_plain_greedy
from .sampler import Sampler
from .step_inputs import StepInputs


class StepSampler:
    """`compute_logits`: hidden [N, H] -> logits [N, V]; `greedy_tokens`: hidden -> [N] int64
    tokens of the LM head's own greedy pick (the fast path's fused head, a tensor-parallel
    model's gather), or None where there is none."""

    def __init__(
        self,
        sampler: Sampler,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        greedy_tokens: Callable[[torch.Tensor], torch.Tensor | None] | None,
    ):
        self.sampler = sampler
        self.compute_logits = compute_logits
        self.greedy_tokens = greedy_tokens

    def sample(
        self,
        hidden: torch.Tensor,
        inputs: StepInputs,
        forwarded: float | None,
        clock: Callable[[], float | None],
    ):
        """-> the sampling rows' tokens, the same as a tensor where the LM head picked them all
        (else None), their logprobs ([] when none asked), and (tracing) when the LM head was
        done.

        Rows that are plain greedy get their tokens from the LM head itself (greedy_tokens,
        where one serves) and make no logits; the others go through the logits and the sampler,
        on their own rows."""
        rows = inputs.sample_rows
        if not rows:
            return [], None, [], forwarded
        index = inputs.sample_index
        sampled = hidden if index is None else hidden.index_select(0, index)
        if inputs.decodes is not None and not inputs.decodes.rows_read_positions:
            plain = range(len(rows))  # every row plain greedy from its first token
        else:
            plain = [i for i, row in enumerate(rows) if is_plain_greedy(row)]
        every_plain = len(plain) == len(rows)
        fused = None
        if plain and self.greedy_tokens is not None:
            fused = self.greedy_tokens(sampled if every_plain else sampled[plain])
        if fused is None:  # no plain row, or no fused head on this device
            plain = []
        elif every_plain:
            return fused.tolist(), fused, [], clock()
        taken = set(plain)
        other = [i for i in range(len(rows)) if i not in taken]
        tokens = [0] * len(rows)
        for i, token in zip(plain, fused.tolist() if plain else []):
            tokens[i] = token
        logits_done, logprobs = clock(), []
        if other:
            other_rows = [rows[i] for i in other]
            logits = self.compute_logits(sampled[other])
            logits_done = clock()
            if any(row.grammar is not None for row in other_rows):
                logits = logits.float()  # masked in place (the sampler's dtype anyway)
            constrained = mask_grammar_rows(logits, other_rows)
            pending = start_sample_logprobs(logits, other_rows)  # raw (but masked) distribution
            sampled_tokens = self.sampler.sample(logits, other_rows)  # on its way to the host
            if pending is not None:  # their entries from the tokens on the device
                logprobs = [None] * len(rows)
                for i, entry in zip(other, pending.finish(sampled_tokens.device)):
                    logprobs[i] = entry
            some = sampled_tokens.tolist()
            advance_grammars(other_rows, some, constrained)
            for i, token in zip(other, some):
                tokens[i] = token
        return tokens, None, logprobs, logits_done
