"""Structured-output fields of the OpenAI routes, as one SamplingParams.structured.

Accepted, on /v1/completions and /v1/chat/completions alike (as vLLM does):
- OpenAI's `response_format`: {"type": "text"}, {"type": "json_object"}, or {"type":
  "json_schema", "json_schema": {"name", "schema", "strict", "description"}} (the SDK's
  `chat.completions.parse(response_format=PydanticModel)` sends this one). `strict` false is
  honoured as true: the output is always constrained.
- vLLM's `structured_outputs`: {"json": schema, "regex", "choice", "grammar", "json_object"}, one
  of them, and its option `disable_any_whitespace` (compact JSON; by default whitespace may go
  between JSON tokens, as in vLLM). As in vLLM, an object with the option alone may go with
  `response_format` or a guided field, which then gives the constraint.
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
At most one of these may constrain a request. An error about the constraint names the field the
request used (`structured_param`), so a schema that does not compile is a 400 naming
`response_format` or `guided_json`, whichever was sent.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..messages.structured import StructuredKind, StructuredOutput
from .openai_errors import invalid


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: str = "text"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` object."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")
CONSTRAINTS = "exactly one of json, regex, choice, grammar, json_object"
JSON_KINDS = (StructuredKind.JSON_SCHEMA, StructuredKind.JSON_OBJECT)


class StructuredFields(msgspec.Struct, kw_only=True):
    """The request fields that ask for a structured output (a base of the request Structs)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def structured_param(self) -> str:
        """The request field a constraint came from ("structured" when none), for the errors
        the Engine sends back about it; without building the constraint again."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        options = self.structured_outputs
        if options is not None and any(
            getattr(options, name) not in (None, False) for name in CONSTRAINT_FIELDS
        ):
            return "structured_outputs"
        for name in GUIDED_FIELDS:
            if getattr(self, name) is not None:
                return name
        return "structured_outputs" if options is not None else "structured"

    def structured(self) -> tuple[StructuredOutput | None, str]:
        """-> (the constraint or None, the request field it came from). A 400 when several
        fields ask for one, or the one asked for is malformed."""
        found: list[tuple[StructuredOutput, str]] = []
        if self.response_format is not None:
            spec = response_format_spec(self.response_format)
            if spec is not None:
                found.append((spec, "response_format"))
        options = self.structured_outputs
        if options is not None:
            spec = structured_outputs_spec(options)
            if spec is not None:
                found.append((spec, "structured_outputs"))
        for name in GUIDED_FIELDS:
            value = getattr(self, name)
            if value is not None:
                found.append((guided_spec(name, value), name))
        if len(found) > 1:
            names = ", ".join(name for _, name in found)
            raise invalid(f"only one structured output may be asked for, got {names}", found[1][1])
        if not found:
            if options is not None:  # options alone: nothing to apply them to
                raise invalid(f"structured_outputs must set {CONSTRAINTS}", "structured_outputs")
            return None, "structured"
        spec, field = found[0]
        if options is not None and options.disable_any_whitespace and spec.kind in JSON_KINDS:
            spec = msgspec.structs.replace(spec, any_whitespace=False)
        return spec, field


def schema_text(schema: Any, field: str) -> str:
    """A JSON schema (an object, or its JSON text) as JSON text."""
    if isinstance(schema, str):
        try:
            schema = msgspec.json.decode(schema)
        except msgspec.DecodeError as exc:
            raise invalid(f"{field}: the schema is not valid JSON: {exc}", field) from None
    if not isinstance(schema, (dict, bool)):
        raise invalid(f"{field}: the schema must be a JSON object", field)
    return msgspec.json.encode(schema).decode()


def response_format_spec(fmt: ResponseFormat) -> StructuredOutput | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput(StructuredKind.JSON_OBJECT)
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise invalid(
                "response_format: type json_schema needs json_schema.schema", "response_format"
            )
        text = schema_text(fmt.json_schema.schema, "response_format")
        return StructuredOutput(StructuredKind.JSON_SCHEMA, text)
    raise invalid(
        f"response_format.type must be text, json_object or json_schema, got {fmt.type!r:.40}",
        "response_format",
    )


def structured_outputs_spec(params: StructuredOutputsParams) -> StructuredOutput | None:
    """The constraint vLLM's object sets; None when it sets none but options (then another
    field must give it: StructuredFields.structured)."""
    field = "structured_outputs"
    asked = [
        (name, getattr(params, name))
        for name in CONSTRAINT_FIELDS
        if getattr(params, name) not in (None, False)
    ]
    if not asked and params.disable_any_whitespace:
        return None
    if len(asked) != 1:
        raise invalid(f"{field} must set {CONSTRAINTS}; got {[name for name, _ in asked]}", field)
    name, value = asked[0]
    if name == "json":
        return StructuredOutput(StructuredKind.JSON_SCHEMA, schema_text(value, field))
    if name == "json_object":
        return StructuredOutput(StructuredKind.JSON_OBJECT)
    return guided_spec(f"guided_{name}", value)


def guided_spec(name: str, value: Any) -> StructuredOutput:
    if name == "guided_json":
        return StructuredOutput(StructuredKind.JSON_SCHEMA, schema_text(value, name))
    if name == "guided_choice":
        return StructuredOutput(StructuredKind.CHOICE, choices=tuple(value))
    kind = StructuredKind.REGEX if name == "guided_regex" else StructuredKind.GRAMMAR
    return StructuredOutput(kind, value)
