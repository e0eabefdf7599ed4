"""Structured outputs on the wire: what a request's output must match, and the Scheduler's and
Worker's exchange that compiles its grammar before the request runs
(actors/scheduler/grammar_gate.py)."""

from __future__ import annotations

import enum

import msgspec

MAX_CHOICES = 256  # alternatives of a `choice` constraint
MAX_CHOICE_CHARS = 1024  # characters of one alternative


class StructuredKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"  # text: a JSON schema (OpenAI's json_schema, vLLM's json)
    JSON_OBJECT = "json_object"  # any JSON object; no text
    REGEX = "regex"  # text: a regular expression the whole output matches
    CHOICE = "choice"  # choices: the output is exactly one of them
    GRAMMAR = "grammar"  # text: an EBNF grammar (xgrammar's dialect, GBNF-like, rule `root`)


class StructuredOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A constraint on a request's whole output. Frozen (hashable): it is itself the key of the
    compiled-grammar caches, so two requests with the same schema text share one compile.

    The output ends where the grammar does: the grammar's end is the model's EOS token, which
    then stops the request even under `ignore_eos` (SamplingParams.stop_token_set).

    `any_whitespace` (JSON kinds only): whitespace may go between JSON tokens, vLLM's default;
    False writes compact JSON (vLLM's `disable_any_whitespace`), which leaves a weak model no
    whitespace to spend its budget on."""

    kind: StructuredKind
    text: str = ""
    choices: tuple[str, ...] = ()
    any_whitespace: bool = True

    def validate(self, max_chars: int) -> str | None:
        """None when well formed (whether it compiles is the Engine's check), else a message
        naming the field and its limit."""
        json_kinds = (StructuredKind.JSON_SCHEMA, StructuredKind.JSON_OBJECT)
        if not self.any_whitespace and self.kind not in json_kinds:
            return f"structured: any_whitespace is only for JSON constraints, not {self.kind.value}"
        if self.kind is StructuredKind.CHOICE:
            if self.text:
                return "structured: a choice constraint takes choices, not text"
            if not 0 < len(self.choices) <= MAX_CHOICES:
                return (
                    f"structured: choice must hold 1 to {MAX_CHOICES} strings, "
                    f"got {len(self.choices)}"
                )
            if any(not 0 < len(c) <= MAX_CHOICE_CHARS for c in self.choices):
                return (
                    f"structured: each choice must be a non-empty string of at most "
                    f"{MAX_CHOICE_CHARS} characters"
                )
            return None
        if self.choices:
            return f"structured: choices are only for a choice constraint, not {self.kind.value}"
        if self.kind is StructuredKind.JSON_OBJECT:
            return "structured: a json_object constraint takes no text" if self.text else None
        if not 0 < len(self.text) <= max_chars:
            return (
                f"structured: the {self.kind.value} must be a non-empty string of at most "
                f"{max_chars} characters (max_structured_chars), got {len(self.text)}"
            )
        return None


class CompileGrammar(msgspec.Struct, tag=True, array_like=True):
    """Scheduler -> Worker's forward thread (in order with the plans and Resets): compile this
    grammar (off the step, on the Worker's compile thread) and say when it is ready."""

    epoch: int
    spec: StructuredOutput


class GrammarReady(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Worker -> Scheduler: `spec` is compiled (error None) or cannot be (error says why)."""

    epoch: int
    spec: StructuredOutput
    error: str | None = None
