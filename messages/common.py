"""Types shared by several inboxes: sampling parameters, finish reasons, the protocol version."""

from __future__ import annotations

import enum

import msgspec

PROTOCOL_VERSION = 1
MAX_STOP_STRINGS = 16


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # the client asked, or disconnected
    ERROR = "error"  # the engine could not serve it


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What the client asks of one completion. `validate` names the first field out of range.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those filters.
    A `seed` makes the request's draws independent of the other requests in its batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    stop: list[str] = []  # stop strings, checked by the Engine on the detokenized text
    include_stop_str_in_output: bool = False

    def validate(self, vocab_size: int) -> str | None:
        """None when the params are acceptable, else a message naming the field and its limit."""
        if self.n != 1:
            return f"n must be 1 (parallel sampling is not supported yet), got {self.n}"
        if not self.temperature >= 0.0:
            return f"temperature must be >= 0, got {self.temperature}"
        if not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if self.top_k < -1:
            return (
                f"top_k must be -1, 0 (disabled) or a positive number of tokens, got {self.top_k}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            return f"min_p must be in [0, 1], got {self.min_p}"
        if self.max_tokens < 1:
            return f"max_tokens must be >= 1, got {self.max_tokens}"
        if not 0 <= self.min_tokens <= self.max_tokens:
            return f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
        if self.seed is not None and not 0 <= self.seed < 2**63:
            return f"seed must be in [0, 2**63), got {self.seed}"
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            return f"stop_token_ids must be in [0, vocab_size={vocab_size}), got {bad[0]}"
        if len(self.stop) > MAX_STOP_STRINGS or any(not 0 < len(s) <= 256 for s in self.stop):
            return (
                f"stop must hold at most {MAX_STOP_STRINGS} non-empty strings of at most 256 "
                f"characters, got {self.stop!r:.80}"
            )
        return None
