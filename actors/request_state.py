"""The Scheduler's view of one request: its tokens, how far they are computed and scheduled, when
it ends, and (final_only) the output it holds back from the Engine."""

from __future__ import annotations

from collections.abc import Callable

from ..messages.blocks import BlockNeed
from ..messages.common import FinishReason, OutputKind, SamplingParams
from ..messages.step import AddRequest, RequestOutput


class Request:
    """The Scheduler's view of one request. `token_ids` = prompt + sampled tokens."""

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

    def finish_reason(self) -> FinishReason | None:
        """Checked after each sampled token: stop tokens (after min_tokens), then length limits."""
        tokens = self.token_ids
        num_output = len(tokens) - self.num_prompt_tokens
        if tokens[-1] in self.stops and num_output >= self.params.min_tokens:
            return FinishReason.STOP
        if len(tokens) >= self.length_limit:
            return FinishReason.LENGTH
        return None
