"""A JSON schema's string rules, made into ones xgrammar keeps valid JSON, before it sees them.

JSON strings never hold a raw control character (U+0000-U+001F), a raw `"` or a lone `\\`
(RFC 8259 section 7), whatever the schema says. xgrammar (checked on 0.2.9 and its main branch)
keeps that promise for a plain `{"type": "string"}` and for a `pattern` it compiles to an
automaton that leaves those characters out; not for these, which are open upstream as
mlc-ai/xgrammar#800 (PRs #822, #880):

- `minLength` / `maxLength` without a pattern lower to a repetition of `[^"\\\\\\r\\n]`, which
  admits every other control character raw (`"a\\x06b"` finished by `stop` and failed
  `json.loads`: issue 36). Here such a string becomes the pattern `^.{min,max}$`, which xgrammar
  compiles on its JSON-string path (length in code points, as JSON Schema counts it).
- A `pattern` holding a character outside printable ASCII (`é`, a raw tab), or one that can
  match only strings with a character JSON must escape, falls back to an expansion without that
  exclusion: `^é.{0,3}$` lets `"é"x"` through. Here every character outside printable ASCII is
  spelled `\\uXXXX` (xgrammar's regex reads it), and a pattern that still does not take the
  JSON-string path is refused, saying why.
- `pattern` (or a `format` xgrammar knows) together with `minLength` / `maxLength`: xgrammar
  compiles the pattern and drops the length (vLLM refuses the same schema for xgrammar). Refused:
  the client can put the length in the pattern.

What such strings lose is escapes: a bounded or patterned string holds no `"`, `\\` or control
character at all (xgrammar's own choice for those paths). `prepared` never changes what the
client's schema accepts beyond that; its output is what the grammar is compiled from.
"""

from __future__ import annotations

import json
from typing import Any

SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SCHEMA_VALUES = (
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "items",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
)
LENGTHS = ("minLength", "maxLength")
# the formats xgrammar turns into a grammar (json_schema_converter.cc, JSONFormatToRegexPattern);
# any other format it ignores, and the string is a plain (or length-bounded) one
XGRAMMAR_FORMATS = frozenset(
    {
        "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
        "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip


def prepared(schema: Any) -> Any:
    """The schema to compile: `schema` (parsed JSON) with its string rules rewritten as above.
    Raises ValueError naming the place (`$.properties.name`) of a rule that cannot be kept."""
    return _schema(schema, "$", implied_string=False)


def prepared_text(text: str) -> str:
    """`prepared` of a schema's JSON text, as JSON text."""
    return json.dumps(prepared(json.loads(text)), ensure_ascii=False)


def _schema(schema: Any, where: str, implied_string: bool) -> Any:
    if not isinstance(schema, dict):
        return schema  # true / false, or something xgrammar will refuse itself
    out = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {
                (_pattern(name, f"{where}.{key}") if key == "patternProperties" else name): (
                    _schema(sub, f"{where}.{key}.{name}", False)
                )
                for name, sub in out[key].items()
            }
    for key in (*SCHEMA_LISTS, *SCHEMA_VALUES):
        if isinstance(out.get(key), list):  # also draft 4's tuple `items`
            out[key] = [_schema(s, f"{where}.{key}[{i}]", False) for i, s in enumerate(out[key])]
        elif key in out:
            names = key == "propertyNames"  # a schema of the keys: strings, typed or not
            out[key] = _schema(out[key], f"{where}.{key}", names)
    return _string(out, where, implied_string)


def _is_string_schema(schema: dict, implied: bool) -> bool:
    kind = schema.get("type")
    if kind is None:
        return implied or any(k in schema for k in ("pattern", *LENGTHS))
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _string(schema: dict, where: str, implied: bool) -> dict:
    if not _is_string_schema(schema, implied) or "enum" in schema or "const" in schema:
        return schema  # an enum's or const's strings are written escaped by xgrammar
    lengths = [k for k in LENGTHS if k in schema]
    shaped = "pattern" in schema or schema.get("format") in XGRAMMAR_FORMATS
    if shaped and lengths:
        what = "pattern" if "pattern" in schema else f"format {schema['format']!r}"
        raise ValueError(
            f"{where}: a string with both {what} and {'/'.join(lengths)} is not supported "
            f"(the grammar engine would drop the length bound); put the length in the pattern"
        )
    if "pattern" in schema:
        schema["pattern"] = _pattern(schema["pattern"], f"{where}.pattern")
    elif lengths and all(_count(schema[k]) for k in lengths):
        low, high = schema.pop("minLength", 0), schema.pop("maxLength", "")
        schema["pattern"] = f"^.{{{low},{high}}}$"
    return schema


def _count(value: Any) -> bool:
    """A length xgrammar would take (anything else is left for it to refuse)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _pattern(pattern: Any, where: str) -> Any:
    """`pattern` with every character outside printable ASCII spelled \\uXXXX, checked to
    compile on xgrammar's JSON-string path."""
    if not isinstance(pattern, str):
        return pattern
    spelled = ascii_pattern(pattern)
    if not takes_json_string_path(spelled):
        raise ValueError(
            f"{where}: pattern {pattern!r:.80} can only match strings holding a character JSON "
            "must escape (a quote, a backslash or a control character), which structured "
            "outputs cannot write escaped; match other characters"
        )
    return spelled


def ascii_pattern(pattern: str) -> str:
    """The same regex in printable ASCII: each other character (raw, or escaped as `\\é`)
    becomes `\\uXXXX` (`\\u{XXXXX}` past the BMP)."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            escaped = pattern[i + 1]
            out.append(_spelled(escaped) if not _printable(escaped) else char + escaped)
            i += 2
            continue
        out.append(char if _printable(char) else _spelled(char))
        i += 1
    return "".join(out)


def _printable(char: str) -> bool:
    return 0x20 <= ord(char) <= 0x7E


def _spelled(char: str) -> str:
    code = ord(char)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\u{{{code:x}}}"


def takes_json_string_path(pattern: str) -> bool:
    """Whether xgrammar compiles a string of this pattern to its JSON-string regex, the one that
    leaves out what JSON must escape (else it falls back to an expansion that does not). Read
    off the grammar it prints (`Regex("...", json_string=true)`): should that text change in a
    later xgrammar, every pattern is refused, loudly, rather than one let through."""
    import xgrammar as xgr

    schema = json.dumps({"type": "string", "pattern": pattern})
    grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    root = [line for line in grammar.splitlines() if line.startswith("root")]
    return any("json_string=true" in line for line in root)
