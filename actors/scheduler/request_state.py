"""The Scheduler's view of one request: its tokens, how far they are computed and scheduled, when
it ends, and (final_only) the output it holds back from the Engine."""

from __future__ import annotations

from collections.abc import Callable

from ...messages.blocks import BlockNeed, Grant
from ...messages.common import FinishReason, OutputKind, SamplingParams, TokenLogprobs
from ...messages.step import AddRequest, NewRequest, PromptLogprobs, RequestOutput


class Request:
    """The Scheduler's view of one request. `token_ids` = prompt + sampled tokens.

    Its counters are positions in `token_ids` (len = len(token_ids)), and always satisfy

        num_prompt_tokens <= len
        0 <= num_computed <= num_scheduled <= len + samples_in_flight - 1
        num_computed < len,  0 <= samples_in_flight <= 2,  len + samples_in_flight <= length_limit

    - num_computed: tokens whose KV a finished step wrote; the last token is never among them
      (the step that computes it samples the next).
    - num_scheduled: num_computed + the tokens of the steps in flight for it.
    - samples_in_flight: steps in flight that sample for it, one token each (at most two steps
      are in flight). The Worker appends each sampled token itself, so the next step may
      compute it: `num_unscheduled` (len + samples_in_flight - num_scheduled) is always >= 1,
      and exactly 1 while a sample is in flight (everything before it is scheduled).
    - capacity: tokens its KV blocks hold (its block table's length * block_size).
    - told_block_manager: how many of token_ids the BlockManager has seen (<= len).
    Running (admitted, in the Worker's batch): num_scheduled <= capacity; not swapped, no
    fork_of. Waiting (new or preempted): nothing in flight (samples_in_flight == 0,
    num_scheduled == num_computed), capacity == 0, num_computed == 0 unless swapped (its KV
    waits in CPU blocks), and told_block_manager == 0 unless an AllocateStep offering it awaits
    its Allocation (then len). `check_invariants` checks all of this (tests call it).
    """

    __slots__ = (
        "request_id",
        "token_ids",
        "num_prompt_tokens",
        "params",
        "num_computed",
        "num_scheduled",
        "samples_in_flight",
        "stops",
        "priority",
        "arrival",
        "client",
        "told_block_manager",
        "swapped",
        "cached_tokens",
        "prompt_logprobs",
        "fork_of",
        "holds_output",
        "unsent",
        "capacity",
        "length_limit",
    )

    def __init__(
        self, message: AddRequest, eos_token_ids: list[int], arrival: int, max_model_len: int
    ):
        self.request_id = message.request_id
        self.token_ids = list(message.prompt_token_ids) + list(message.output_token_ids)
        self.num_prompt_tokens = len(message.prompt_token_ids)
        self.params: SamplingParams = message.params
        # the length at which it ends: max_tokens sampled, or max_model_len reached
        self.length_limit = min(self.num_prompt_tokens + message.params.max_tokens, max_model_len)
        self.priority = message.priority
        self.arrival = arrival
        self.client = message.client  # whom it counts for in the fair share of seats
        self.num_computed = 0  # tokens whose KV a finished step wrote
        self.num_scheduled = 0  # num_computed + the tokens of steps in flight
        self.samples_in_flight = 0  # steps in flight that sample a token for it (0, 1 or 2)
        self.told_block_manager = 0  # tokens of token_ids the BlockManager has seen
        self.capacity = 0  # tokens its KV blocks hold (granted so far; 0 when it holds none)
        self.swapped = False  # KV waits in CPU blocks; num_computed stays valid
        self.cached_tokens: int | None = None  # set when first admitted
        # sample i > 0 of an n > 1 request, waiting to share sample 0's prompt KV
        self.fork_of = message.fork_of if not message.output_token_ids else None
        # prompt logprobs gathered over prefill chunks, sent with the first output (None: not
        # asked, or already sent). Entry 0 (the first prompt token) is always None.
        wants = message.params.prompt_logprobs is not None and not message.output_token_ids
        self.prompt_logprobs: list | None = [None] if wants else None
        self.stops = message.params.stop_token_set(eos_token_ids)
        final_only = message.params.output_kind is OutputKind.FINAL_ONLY
        self.holds_output = final_only and not message.params.stop  # the Engine checks stop
        self.unsent: RequestOutput | None = None  # output not sent to the Engine yet

    @property
    def queue_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)

    @property
    def num_unscheduled(self) -> int:
        """Tokens to compute, counting one per sample in flight (the Worker already has it)."""
        return len(self.token_ids) + self.samples_in_flight - self.num_scheduled

    def ends_in_flight(self) -> bool:
        """The samples in flight take it to max_tokens or max_model_len."""
        in_flight = self.samples_in_flight
        return in_flight > 0 and len(self.token_ids) + in_flight >= self.length_limit

    @staticmethod
    def victim_order(policy: str) -> Callable[[Request], tuple[int, int, int] | tuple[int, int]]:
        """Sort key of running requests for a preemption policy: the last are preempted first
        (lowest priority, then fewest computed tokens or last admitted)."""
        if policy == "fewest_computed":
            return lambda r: (r.priority, -r.num_computed, r.arrival)
        return lambda r: r.queue_key

    def schedule_tokens(self, num_computed: int, count: int) -> None:
        """A step computes tokens [num_computed, num_computed + count): it samples for the request
        when that reaches the last token (counting the samples already in flight)."""
        self.num_scheduled = num_computed + count
        if self.num_scheduled == len(self.token_ids) + self.samples_in_flight:
            self.samples_in_flight += 1

    def block_need(self, count: int, is_new: bool, block_size: int) -> BlockNeed:
        """What a step computing `count` more tokens asks of the BlockManager: the tokens it has
        not seen yet, and (running requests) a block of room beyond the step."""
        told = self.told_block_manager
        self.told_block_manager = len(self.token_ids)
        return BlockNeed(
            self.request_id,
            self.num_scheduled,
            count,
            is_new,
            self.token_ids[told:],
            is_new and self.prompt_logprobs is not None,  # computes its whole prompt
            lookahead=0 if is_new else block_size,
            cache_salt=self.params.cache_salt if is_new else None,
        )

    def take_output(self) -> RequestOutput:
        """Its output not yet sent (a final_only request's held tokens), else an empty one."""
        output, self.unsent = self.unsent, None
        return output if output is not None else RequestOutput(self.request_id, [])

    def last_output(self, reason: FinishReason) -> RequestOutput:
        """Its output not yet sent, ending it for `reason` (abort, error)."""
        output = self.take_output()
        output.finish_reason = reason
        return output

    def finish_reason(self) -> FinishReason | None:
        """Checked after each sampled token: stop tokens (after min_tokens), then length limits."""
        tokens = self.token_ids
        num_output = len(tokens) - self.num_prompt_tokens
        if tokens[-1] in self.stops and num_output >= self.params.min_tokens:
            return FinishReason.STOP
        if len(tokens) >= self.length_limit:
            return FinishReason.LENGTH
        return None

    def add_sample(self, token: int, logprobs: TokenLogprobs | None) -> RequestOutput | None:
        """Append a token a step sampled for it: the output to send now (with its finish reason
        when the token ends it), or None while a final_only request holds its output."""
        self.samples_in_flight -= 1
        self.token_ids.append(token)
        output = self.take_output()
        output.token_ids.append(token)
        if logprobs is not None:
            output.logprobs.append(logprobs)
        if self.prompt_logprobs is not None:
            output.prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        reason = self.finish_reason()
        if reason is None and self.holds_output:
            self.unsent = output
            return None
        output.finish_reason = reason
        if reason is not None:
            output.cached_tokens = self.cached_tokens or 0
        return output

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Gather a prefill chunk's prompt logprobs (a recompute repeats some: kept once)."""
        gathered = self.prompt_logprobs
        if gathered is not None and chunk.start <= len(gathered):
            gathered.extend(chunk.entries[len(gathered) - chunk.start :])

    def fork_need(self) -> BlockNeed:
        """A forked sample shares its sample 0's prompt KV (copy-on-write of the partial last
        block) and recomputes only the last prompt token, for its own first draw."""
        self.told_block_manager = len(self.token_ids)
        return BlockNeed(
            self.request_id,
            self.num_prompt_tokens - 1,
            1,
            True,
            list(self.token_ids),
            fork_of=self.fork_of,
            cache_salt=self.params.cache_salt,  # its own later blocks hash in the salt's chain
        )

    def admit(self, grant: Grant, capacity: int) -> NewRequest:
        """Waiting -> running, its whole block table granted (`capacity` tokens of room): what
        the Worker is told of it, in full."""
        if self.cached_tokens is None:
            self.cached_tokens = grant.num_computed
        self.fork_of = None
        self.swapped = False
        self.num_computed = grant.num_computed
        self.capacity = capacity
        return NewRequest(
            request_id=self.request_id,
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            block_ids=grant.block_ids,
            num_new_tokens=grant.num_new_tokens,
            params=self.params,
            num_computed_tokens=grant.num_computed,
        )

    def check_invariants(self, running: bool, allocating: bool = False) -> None:
        """Raise AssertionError naming the first relation of the class docstring that fails.
        `allocating`: an AllocateStep that may offer it awaits its Allocation."""
        n, sif = len(self.token_ids), self.samples_in_flight
        checks = [
            ("num_prompt_tokens <= len", self.num_prompt_tokens <= n),
            ("0 <= num_computed <= num_scheduled", 0 <= self.num_computed <= self.num_scheduled),
            ("num_scheduled <= len + samples_in_flight - 1", self.num_scheduled <= n + sif - 1),
            ("a sample in flight: 1 unscheduled", sif == 0 or self.num_unscheduled == 1),
            ("num_computed < len", self.num_computed < n),
            ("0 <= samples_in_flight <= 2", 0 <= sif <= 2),
            ("len + samples_in_flight <= length_limit", n + sif <= self.length_limit),
            ("told_block_manager <= len", 0 <= self.told_block_manager <= n),
        ]
        if running:
            checks += [
                ("running: num_scheduled <= capacity", self.num_scheduled <= self.capacity),
                ("running: not swapped, no fork_of", not self.swapped and self.fork_of is None),
            ]
        else:
            told = self.told_block_manager in ((0, n) if allocating else (0,))
            checks += [
                (
                    "waiting: nothing in flight",
                    sif == 0 and self.num_scheduled == self.num_computed,
                ),
                ("waiting: capacity == 0", self.capacity == 0),
                (
                    "waiting: num_computed == 0 unless swapped",
                    self.swapped or not self.num_computed,
                ),
                ("waiting: told_block_manager == 0 (len while offered)", told),
            ]
        for relation, holds in checks:
            if not holds:
                raise AssertionError(f"request {self.request_id}: {relation} fails in {self!r}")

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, len={len(self.token_ids)}, "
            f"prompt={self.num_prompt_tokens}, computed={self.num_computed}, "
            f"scheduled={self.num_scheduled}, samples_in_flight={self.samples_in_flight}, "
            f"capacity={self.capacity}, told={self.told_block_manager}, "
            f"limit={self.length_limit}, swapped={self.swapped})"
        )
