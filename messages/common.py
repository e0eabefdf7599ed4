"""Types shared by several inboxes: sampling parameters, finish reasons, the protocol version."""

from __future__ import annotations

import enum

import msgspec

from .structured import StructuredOutput

PROTOCOL_VERSION = 2
MAX_STOP_STRINGS = 16
MAX_N = 64  # parallel samples of one request
MAX_LOGPROBS = 20  # top alternatives per token (logprobs, prompt_logprobs)
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_CACHE_SALT = 256  # characters of cache_salt
MAX_STOP_TOKEN_IDS = 1024  # entries of stop_token_ids
MAX_TOKENS = 1 << 20  # max_tokens of one sample (a request also stops at max_model_len)
MAX_STRUCTURED_CHARS = 1 << 20  # a schema's, regex's or grammar's text (EngineConfig lowers it)


def max_prompt_chars(longest_token_chars: int, max_model_len: int) -> int:
    """More characters than any prompt of fewer than max_model_len tokens can have, for a
    vocabulary whose longest token string has `longest_token_chars` characters: each token
    stands for at most that many (byte-level BPE: one a byte; a character is at least a byte),
    with a factor 2 of slack for normalizers. A longer prompt is refused before it is
    tokenized (seconds of CPU for a few MB of text)."""
    return 2 * max(longest_token_chars, 16) * max_model_len


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # the client asked, or disconnected
    ERROR = "error"  # the engine could not serve it


class OutputKind(str, enum.Enum):
    """How a request's output reaches its client (vLLM's RequestOutputKind)."""

    DELTA = "delta"  # a delta after every step that samples for it
    FINAL_ONLY = "final_only"  # held until it finishes (see SamplingParams.output_kind)


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """One token's log-probability under the raw model distribution (log_softmax of the logits
    before any penalty, bias, temperature or filter), its rank (1 + the number of tokens with a
    strictly higher logprob), and the `k` most likely tokens as (token id, logprob), best first
    (so `top[i]` has rank i + 1, ties aside). `top` is empty when k is 0."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = []


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What the client asks of one completion. `validate` names the first field out of range.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those filters.
    A `seed` makes the request's draws independent of the other requests in its batch.
    `n` > 1: the Engine runs n samples of the prompt (seeds seed, seed + 1, ... when seeded).
    Penalties (vLLM's semantics, applied after `logit_bias`): `presence_penalty` subtracts p from
    every token already in the output, `frequency_penalty` f times its count there;
    `repetition_penalty` r divides the positive logits (multiplies the negative ones) of every
    token in the prompt or the output. `logit_bias` adds its value to a token's logit.
    `logprobs` k: each sampled token's logprob and rank, with the top k alternatives;
    `prompt_logprobs` k: the same for every prompt token but the first (such a request computes
    its whole prompt: no prefix-cache hits).
    `output_kind` final_only (whole completions: the offline API, non-streamed OpenAI requests):
    the Scheduler holds the tokens and sends them when the request finishes, and once every
    EngineConfig.final_only_flush_s while it runs, so the client hears of it; a request with
    `stop` strings still goes token by token to the Engine, which checks them, and is delivered
    the same way.
    `cache_salt` (vLLM's): requests share prefix-cache blocks only with requests of the same
    salt (or, without one, with the others without one): one secret salt per tenant keeps a
    tenant from learning, by timing, what another's prompts hold.
    `structured`: the whole output matches a JSON schema, a regex, one of some choices or a
    grammar (messages/structured.py); it ends where the grammar does (EOS), so it takes no
    min_tokens.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: OutputKind = OutputKind.DELTA
    cache_salt: str | None = None
    structured: StructuredOutput | None = None

    def stop_token_set(self, eos_token_ids: list[int]) -> frozenset[int]:
        """The tokens that end a sample: stop_token_ids, and EOS unless ignore_eos (neither
        counts before min_tokens). A structured output's grammar ends with EOS, so EOS stops it
        even under ignore_eos."""
        if self.ignore_eos and self.structured is None:
            return frozenset(self.stop_token_ids)
        return frozenset(self.stop_token_ids).union(eos_token_ids)

    def validate(
        self, vocab_size: int, max_structured_chars: int = MAX_STRUCTURED_CHARS
    ) -> str | None:
        """None when the params are acceptable, else a message naming the field and its limit."""
        if not 1 <= self.n <= MAX_N:
            return f"n must be in [1, {MAX_N}], got {self.n}"
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
        if not 1 <= self.max_tokens <= MAX_TOKENS:
            return f"max_tokens must be in [1, {MAX_TOKENS}], got {self.max_tokens}"
        if not 0 <= self.min_tokens <= self.max_tokens:
            return f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
        if self.seed is not None and not 0 <= self.seed < 2**63:
            return f"seed must be in [0, 2**63), got {self.seed}"
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            return (
                f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, "
                f"got {len(self.stop_token_ids)}"
            )
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            return f"stop_token_ids must be in [0, vocab_size={vocab_size}), got {bad[0]}"
        if len(self.stop) > MAX_STOP_STRINGS or any(not 0 < len(s) <= 256 for s in self.stop):
            return (
                f"stop must hold at most {MAX_STOP_STRINGS} non-empty strings of at most 256 "
                f"characters, got {self.stop!r:.80}"
            )
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= MAX_CACHE_SALT:
            return (
                f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters, "
                f"got {len(self.cache_salt)} characters"
            )
        if self.structured is not None:
            error = self.structured.validate(max_structured_chars)
            if error is None and self.min_tokens:
                error = "structured: min_tokens must be 0 (the grammar decides where it ends)"
            if error is not None:
                return error
        return self._validate_logits_params(vocab_size)

    def _validate_logits_params(self, vocab_size: int) -> str | None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                return f"{name} must be in [-2, 2], got {value}"
        if not 0.0 < self.repetition_penalty < float("inf"):
            return f"repetition_penalty must be > 0, got {self.repetition_penalty}"
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            return (
                f"logit_bias must hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}"
            )
        for token, bias in self.logit_bias.items():
            if not 0 <= token < vocab_size:
                return f"logit_bias token ids must be in [0, vocab_size={vocab_size}), got {token}"
            if not -100.0 <= bias <= 100.0:
                return f"logit_bias values must be in [-100, 100], got {bias} for token {token}"
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                return f"{name} must be in [0, {MAX_LOGPROBS}] (or null), got {value}"
        return None

    @property
    def processes_logits(self) -> bool:
        """Whether penalties or a logit bias change this request's logits before sampling."""
        return self.penalises or bool(self.logit_bias)

    @property
    def penalises(self) -> bool:
        """Whether presence, frequency or repetition penalties apply."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )
