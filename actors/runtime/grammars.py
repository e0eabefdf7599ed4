"""A StructuredOutput as an xgrammar grammar: checked by the Engine, compiled by the Worker.

Two processes, two costs. Parsing a spec into a grammar (`check`) needs no tokenizer and is
cheap: the Engine does it at admission, so a schema, regex or grammar that cannot be compiled is
refused with a 400 before the request is journaled. Compiling it against the vocabulary (`compile`:
for every grammar state, which tokens may follow) is the expensive part and needs the tokenizer;
the Worker does it on a thread of its own (worker/grammar_cache.py), since the Worker is where the
per-step matchers live.

A JSON schema's string rules go through schema_strings.prepared first (both here and in the
Worker, so what is checked is what is compiled): xgrammar lets some of them write raw control
characters into a JSON string. Whitespace between JSON tokens is any (`spec.any_whitespace`, as
vLLM's default), each run of it at most EngineConfig.structured_max_whitespace characters: a
model that likes whitespace otherwise writes it until max_tokens (vLLM issue 38696, whose open
fix bounds it the same way). A request that asks for compact JSON (vLLM's
`structured_outputs.disable_any_whitespace`) gets none at all. A json_object is the schema
{"type": "object"}, as vLLM compiles it (an object, not any JSON value, the same whitespace).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

from ...messages.structured import StructuredKind, StructuredOutput
from .schema_strings import prepared_text

CHECKED_SPECS = 256  # specs the Engine remembers as valid (one parse each)
JSON_OBJECT_SCHEMA = '{"type": "object"}'
MAX_WHITESPACE = 8  # EngineConfig.structured_max_whitespace's default
COMPACT = (",", ":")  # separators of compact JSON: no whitespace at all


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes are EBNF's)."""
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return f"root ::= {alternatives}"


def check(spec: StructuredOutput) -> None:
    """Parse the spec into an xgrammar Grammar; raise ValueError saying why it cannot be."""
    import xgrammar as xgr

    try:
        if spec.kind in (StructuredKind.JSON_SCHEMA, StructuredKind.JSON_OBJECT):
            xgr.Grammar.from_json_schema(schema_of(spec), **json_layout(spec, MAX_WHITESPACE))
        elif spec.kind is StructuredKind.REGEX:
            xgr.Grammar.from_regex(spec.text)
        elif spec.kind is StructuredKind.GRAMMAR:
            xgr.Grammar.from_ebnf(spec.text)
        elif spec.kind is StructuredKind.CHOICE:
            xgr.Grammar.from_ebnf(choice_ebnf(spec.choices))
    except Exception as exc:  # whatever xgrammar raises, the spec is the client's to fix
        raise ValueError(f"invalid {spec.kind.value}: {first_line(exc)}") from None


def json_layout(spec: StructuredOutput, max_whitespace: int) -> dict:
    """xgrammar's whitespace arguments: any whitespace, at most `max_whitespace` characters
    between two tokens; or none at all (xgrammar's any_whitespace=False alone would still
    require ", " and ": ", which vLLM documents as compact but is not)."""
    if not spec.any_whitespace:
        return {"any_whitespace": False, "separators": COMPACT}
    return {"any_whitespace": True, "max_whitespace_cnt": max_whitespace or None}


def schema_of(spec: StructuredOutput) -> str:
    """The JSON schema a json_schema or json_object spec is compiled from. Broken JSON raises
    json's ValueError (a clearer message than xgrammar's)."""
    if spec.kind is StructuredKind.JSON_OBJECT:
        return JSON_OBJECT_SCHEMA
    return prepared_text(spec.text)


def compile(compiler, spec: StructuredOutput, max_whitespace: int = MAX_WHITESPACE):
    """The xgrammar CompiledGrammar of `spec` (compiler: an xgrammar GrammarCompiler);
    `max_whitespace` bounds each run of whitespace between JSON tokens (0: unbounded)."""
    if spec.kind in (StructuredKind.JSON_SCHEMA, StructuredKind.JSON_OBJECT):
        return compiler.compile_json_schema(schema_of(spec), **json_layout(spec, max_whitespace))
    if spec.kind is StructuredKind.REGEX:
        return compiler.compile_regex(spec.text)
    if spec.kind is StructuredKind.CHOICE:
        return compiler.compile_grammar(choice_ebnf(spec.choices))
    return compiler.compile_grammar(spec.text)


def first_line(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix, on one line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and ": " in text:  # "[02:25:56] /project/cpp/x.cc:94: message"
        text = text.split(": ", 1)[1]
        if ": " in text and text.split(": ", 1)[0].endswith(tuple("0123456789")):
            text = text.split(": ", 1)[1]
    return text[:300]


class CheckedSpecs:
    """The Engine's memory of specs that parsed (LRU): a repeated schema is parsed once.

    `check` runs on a thread (the Engine's off-loop admission path), never on the event loop:
    the first call imports xgrammar, which takes seconds (its native library, torch,
    transformers) and should cost nothing to an Engine that never sees a structured request;
    a large schema's parse, too, must not hold up the heartbeats. Hence the lock."""

    def __init__(self, capacity: int = CHECKED_SPECS):
        self.capacity = capacity
        self.valid: OrderedDict[StructuredOutput, None] = OrderedDict()
        self.lock = threading.Lock()

    def check(self, spec: StructuredOutput) -> None:
        """Raise ValueError when `spec` cannot be compiled."""
        with self.lock:
            if spec in self.valid:
                self.valid.move_to_end(spec)
                return
        check(spec)
        with self.lock:
            self.valid[spec] = None
            if len(self.valid) > self.capacity:
                self.valid.popitem(last=False)
