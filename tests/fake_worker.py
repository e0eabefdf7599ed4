"""A fake Worker for the step planner's in-process tests: the persistent batch as the real
Worker keeps it, over a simulated KV cache.

Every KV slot holds the identity of the token prefix whose KV was written there (a hash chained
over the tokens), and a step checks that every position it attends to holds exactly its own
prefix's. So a block handed to another request while a step that uses it has not run, a
prefix-cache hit or a fork sharing the wrong block, a swap or copy-on-write that moves the wrong
block: each shows up as a step that reads KV that is not its own.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from actorserve.actors.runtime.config import EngineConfig
from actorserve.messages.common import SamplingParams
from actorserve.messages.step import StepPlan, StepResult

EOS = 1
VOCAB = 12


class PrefixKeys:
    """keys[p]: the identity of tokens[: p + 1], what the KV at position p is a function of."""

    def __init__(self, tokens: list[int]):
        self.keys: list[int] = []
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.keys.append(hash((self.keys[-1] if self.keys else 0, token)))


@dataclass
class WorkerRequest:
    tokens: list[int]
    keys: PrefixKeys
    num_computed: int
    table: list[int]
    params: SamplingParams


class FakeWorker:
    """Runs StepPlans on a persistent batch as the real Worker does, over a simulated KV cache;
    samples random tokens (EOS with probability `eos_rate`)."""

    def __init__(self, config: EngineConfig, rng: random.Random, eos_rate: float):
        self.config = config
        self.rng = rng
        self.eos_rate = eos_rate
        self.batch: dict[str, WorkerRequest] = {}
        self.kv: dict[int, list[int | None]] = {}  # device block -> key per slot
        self.cpu: dict[int, list[int | None]] = {}
        self.sampled: dict[str, list[int]] = {}  # every token sampled for a request, in order
        self.blocks_of_step: dict[int, set[int]] = {}  # steps not run yet: the blocks they use

    def queued(self, plan: StepPlan) -> None:
        """Note the blocks a plan will use, when it is sent (it runs later)."""
        used = {b for new in plan.new for b in new.block_ids}
        used |= {b for update in plan.running for b in update.new_block_ids}
        for update in plan.running:
            if update.request_id in self.batch:
                used |= set(self.batch[update.request_id].table)
        self.blocks_of_step[plan.step_id] = used

    def run(self, plan: StepPlan) -> StepResult:
        self.blocks_of_step.pop(plan.step_id, None)
        bs = self.config.block_size
        for rid in plan.removed:
            self.batch.pop(rid, None)
        for gpu, cpu in plan.swap_out:
            self.cpu[cpu] = list(self._block(gpu))
        for cpu, gpu in plan.swap_in:
            self.kv[gpu] = list(self.cpu[cpu])
        for src, dst in plan.copies:
            self.kv[dst] = list(self._block(src))
        scheduled = []
        for update in plan.running:
            request = self.batch.get(update.request_id)
            assert request is not None, f"{update.request_id}: an update for whom it never had"
            request.table.extend(update.new_block_ids)
            scheduled.append((update.request_id, update.num_new_tokens))
        for new in plan.new:
            tokens = list(new.token_ids)
            sampled = tokens[new.num_prompt_tokens :]
            assert sampled == self.sampled.get(new.request_id, [])[: len(sampled)], "resent"
            self.batch[new.request_id] = WorkerRequest(
                tokens, PrefixKeys(tokens), new.num_computed_tokens, list(new.block_ids), new.params
            )
            scheduled.append((new.request_id, new.num_new_tokens))
        assert len(self.batch) <= self.config.max_num_seqs, "more requests than max_num_seqs"
        assert sum(c for _, c in scheduled) <= self.config.max_num_batched_tokens, "over budget"
        written: dict[tuple[int, int], int] = {}
        for rid, count in scheduled:  # KV is stored for every token before attention reads
            request = self.batch[rid]
            end = request.num_computed + count
            assert end <= len(request.tokens), f"{rid}: computes tokens it does not have"
            assert end <= len(request.table) * bs, f"{rid}: computes past its blocks"
            for p in range(request.num_computed, end):
                slot = (request.table[p // bs], p % bs)
                key = request.keys.keys[p]
                assert written.setdefault(slot, key) == key, f"{rid}: two requests write {slot}"
                self._block(slot[0])[slot[1]] = key
        ids, tokens = [], []
        for rid, count in scheduled:
            request = self.batch[rid]
            end = request.num_computed + count
            for p in range(end):
                held = self._block(request.table[p // bs])[p % bs]
                assert held == request.keys.keys[p], f"{rid}: position {p} reads another's KV"
            request.num_computed = end
            if end == len(request.tokens):
                token = self._draw(request.params)
                request.tokens.append(token)
                request.keys.extend([token])
                self.sampled.setdefault(rid, []).append(token)
                ids.append(rid)
                tokens.append(token)
        return StepResult(plan.epoch, plan.step_id, ids, tokens)

    def _block(self, block_id: int) -> list[int | None]:
        return self.kv.setdefault(block_id, [None] * self.config.block_size)

    def _draw(self, params: SamplingParams) -> int:
        if self.rng.random() < self.eos_rate:
            return EOS
        return self.rng.randrange(2, VOCAB)
