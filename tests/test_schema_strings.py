"""A JSON schema's string rules as the grammar sees them (actors/runtime/schema_strings.py):
what xgrammar alone lets into a JSON string, and what the prepared schema lets in, string by
string, through xgrammar's own acceptor (no model, no tokenizer)."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from actorserve.actors.runtime import grammars
from actorserve.actors.runtime.schema_strings import ascii_pattern, prepared, prepared_text
from actorserve.messages.structured import StructuredKind, StructuredOutput

BOUNDED = {"type": "string", "maxLength": 8}
NAME = {"type": "object", "properties": {"name": BOUNDED}, "required": ["name"]}


def accepts(schema, text: str, prepare: bool = True, any_whitespace: bool = False) -> bool:
    source = prepared_text(json.dumps(schema)) if prepare else json.dumps(schema)
    grammar = xgr.Grammar.from_json_schema(source, any_whitespace=any_whitespace)
    return _is_grammar_accept_string(grammar, text)


def test_xgrammar_alone_lets_a_raw_control_character_into_a_bounded_string():
    """mlc-ai/xgrammar#800, as issue 36 met it: if this starts failing, xgrammar fixed it and
    schema_strings' rewrite of length bounds may go."""
    assert accepts(NAME, '{"name": "yP\x06 Py"}', prepare=False)
    assert accepts({"type": "string", "pattern": "^é.{0,3}$"}, '"é"x"', prepare=False)


CASES = [
    # (schema, text, accepted after prepared)
    (BOUNDED, '"a\x06b"', False),
    (BOUNDED, '"a\tb"', False),
    (BOUNDED, '"abcdefgh"', True),
    (BOUNDED, '"abcdefghi"', False),
    ({"type": "string", "minLength": 2}, '"a"', False),
    ({"type": "string", "minLength": 2}, '"ab\x01"', False),
    ({"type": "string", "minLength": 2, "maxLength": 3}, '"éü"', True),  # code points
    ({"type": "string", "minLength": 1, "maxLength": 2}, '"😀😀"', True),
    (NAME, '{"name": "yP\x06 Py"}', False),
    (NAME, '{"name": "yP Py"}', True),
    ({"type": "string", "pattern": "^é.{0,3}$"}, '"é\x06"', False),
    ({"type": "string", "pattern": "^é.{0,3}$"}, '"é"x"', False),
    ({"type": "string", "pattern": "^é.{0,3}$"}, '"éab"', True),
    ({"type": "string", "pattern": "^[^é]+$"}, '"a"b"', False),
    ({"type": "string", "pattern": "^[^é]+$"}, '"ab"', True),
    ({"type": "string", "pattern": "^.{1,4}$"}, '"a\\"b"', False),  # escapes are not written
    ({"type": "object", "propertyNames": {"maxLength": 3}}, '{"a\x01": 1}', False),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, '{"ab": 1}', True),
    ({"type": "array", "items": BOUNDED, "maxItems": 2}, '["a\x02"]', False),
    ({"type": "array", "items": BOUNDED, "maxItems": 2}, '["a", "b"]', True),
    ({"anyOf": [BOUNDED, {"type": "integer"}]}, '"\x1f"', False),
    ({"$defs": {"s": BOUNDED}, "$ref": "#/$defs/s"}, '"\x1f"', False),
    ({"type": "object", "patternProperties": {"^é+$": {"type": "integer"}}}, '{"é": 1}', True),
    ({"type": "object", "patternProperties": {"^é+$": {"type": "integer"}}}, '{"é"": 1}', False),
    ({"enum": ["a\x01b", 'q"'], "maxLength": 9}, '"a\\u0001b"', True),  # enums are escaped
]


@pytest.mark.parametrize("schema, text, accepted", CASES)
def test_a_prepared_schema_admits_only_valid_json_strings(schema, text, accepted):
    assert accepts(schema, text) is accepted
    if accepted:  # whatever it admits parses (strictly) and validates
        import jsonschema

        jsonschema.validate(json.loads(text), schema)


def test_the_rewrite_keeps_property_names_and_leaves_other_schemas_as_they_are():
    schema = {
        "type": "object",
        "properties": {"pattern": {"type": "integer"}, "maxLength": BOUNDED},
        "required": ["pattern"],
    }
    out = prepared(schema)
    assert out["properties"]["pattern"] == {"type": "integer"}  # a property, not a keyword
    assert out["properties"]["maxLength"] == {"type": "string", "pattern": "^.{0,8}$"}
    assert schema["properties"]["maxLength"] == BOUNDED  # the client's schema is not touched
    assert prepared({"type": "string", "minLength": 3}) == {"type": "string", "pattern": "^.{3,}$"}


@pytest.mark.parametrize(
    "schema, says",
    [
        ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "$: a string with both"),
        ({"type": "string", "format": "date", "minLength": 3}, "format 'date' and minLength"),
        ({"properties": {"q": {"type": "string", "pattern": '^a"b$'}}}, "$.properties.q.pattern"),
        ({"type": "string", "pattern": "^\\t$"}, "must escape"),
    ],
)
def test_a_string_rule_that_cannot_stay_valid_json_is_refused_naming_its_place(schema, says):
    with pytest.raises(ValueError) as caught:
        prepared(schema)
    assert says in str(caught.value)
    spec = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema))
    with pytest.raises(ValueError, match="invalid json_schema"):
        grammars.check(spec)  # what the Engine answers with a 400


def test_a_pattern_is_spelled_in_printable_ascii():
    assert ascii_pattern("^é\\é[^ü]😀\t$") == "^\\u00e9\\u00e9[^\\u00fc]\\u{1f600}\\u0009$"
    assert ascii_pattern("^\\d\\.[a-z]$") == "^\\d\\.[a-z]$"


def test_whitespace_between_tokens_is_any_unless_compact_is_asked_for():
    text = '{ "name" :\n "ab" }'
    assert accepts(NAME, text, any_whitespace=True)
    assert not accepts(NAME, text, any_whitespace=False)
    spec = StructuredOutput(StructuredKind.JSON_OBJECT, any_whitespace=False)
    assert spec.validate(100) is None
    regex = StructuredOutput(StructuredKind.REGEX, "a+", any_whitespace=False)
    assert "any_whitespace is only for JSON" in regex.validate(100)


def test_a_json_object_is_an_object():
    source = grammars.schema_of(StructuredOutput(StructuredKind.JSON_OBJECT))
    grammar = xgr.Grammar.from_json_schema(source, any_whitespace=True)
    assert _is_grammar_accept_string(grammar, '{"a": [1, "x"]}')
    assert not _is_grammar_accept_string(grammar, "[1]")
    assert not _is_grammar_accept_string(grammar, '{"a": "\x07"}')
