"""Structured outputs always parse (issue 36): JSON schemas drawn by hypothesis, sampled at
temperature 1.0 on random checkpoints through real `actorserve serve` processes.

Strings with and without maxLength / minLength / pattern / enum (enum values and property names
with quotes, backslashes, control characters and non-ASCII), integers and numbers with and
without bounds, booleans, nulls, nested objects with optional fields, arrays; whitespace any (the
default) or compact. Every output that finishes by `stop` must pass a strict `json.loads` and
`jsonschema.validate`; a random model writes what no trained one would, which is the point.
Then the same through the official openai SDK's `parse` with a pydantic model whose strings are
bounded only by max_length: the shape of the schema issue 36 met raw control characters in.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import jsonschema
import openai
import pydantic
import pytest
from gateway_support import API_KEY, GatewayServer, call
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from actorserve.weights.checkpoints import ensure_checkpoint

CHECKPOINTS = ("tiny-llama", "tiny-qwen3")  # two random models, two tokenizers' vocabularies
# schemas per checkpoint, each sampled N times: without schema_strings' rewrite, these draws
# meet a raw control character on tiny-llama
EXAMPLES = 16
N = 6
MAX_TOKENS = 160
SPECIAL = list('ab é"\\/\x00\x06\x1f\n\t😀')  # what a JSON string must escape, and some that not
PATTERNS = (
    "^[a-z]{1,6}$",
    "^[A-Z][a-z]{0,4}$",
    "^\\d{2,3}-\\d{2}$",
    "^.{0,5}$",
    "^[^,;]{1,6}$",
    "^[àéîõü]{1,4}$",
    "^(yes|no|maybe)$",
    "^\\S{1,5}$",
    "^[a-z]+( [a-z]+){0,2}$",
)


@pytest.fixture(scope="module", params=CHECKPOINTS)
def server(request):
    server = GatewayServer(
        ensure_checkpoint(request.param),
        "--max-model-len", "512",
        "--max-concurrent-requests", "16",
        "--heartbeat-interval-s", "1",
    )  # fmt: skip
    yield server
    assert server.stop() == 0


def bounded(lowest: int, highest: int):
    return st.integers(lowest, highest)


def string_schemas():
    def length(high, low):
        schema = {"type": "string", "maxLength": high}
        return schema if low is None else {**schema, "minLength": min(low, high)}

    return st.one_of(
        st.just({"type": "string"}),
        st.builds(length, bounded(1, 12), st.none() | bounded(0, 4)),
        st.builds(length, bounded(4, 16), st.none()),
        st.builds(lambda low: {"type": "string", "minLength": low}, bounded(1, 3)),
        st.sampled_from(PATTERNS).map(lambda p: {"type": "string", "pattern": p}),
        st.lists(st.text(st.sampled_from(SPECIAL), max_size=5), min_size=1, max_size=4, unique=True)
        .map(lambda values: {"enum": values}),
    )  # fmt: skip


def number_schemas(kind: str):
    return st.fixed_dictionaries(
        {"type": st.just(kind)},
        optional={"minimum": bounded(-50, 0), "maximum": bounded(1, 1000)},
    )


LEAVES = st.one_of(
    string_schemas(),
    string_schemas(),  # strings are where JSON breaks: drawn twice as often as the rest
    number_schemas("integer"),
    number_schemas("number"),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
)
KEYS = st.text(st.sampled_from(list("abcxyz_é") + SPECIAL[4:9]), min_size=1, max_size=6)


def objects(children):
    def with_required(properties):
        names = st.lists(st.sampled_from(sorted(properties)), unique=True)  # the rest: optional
        return names.map(
            lambda required: {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            }
        )

    return st.dictionaries(KEYS, children, min_size=1, max_size=5).flatmap(with_required)


def arrays(children):
    return st.builds(
        lambda items, low, more: {
            "type": "array", "items": items, "minItems": low, "maxItems": low + more
        },
        children, bounded(0, 1), bounded(0, 2),
    )  # fmt: skip


SCHEMAS = objects(st.recursive(LEAVES, lambda c: objects(c) | arrays(c), max_leaves=6))
STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
MAX_WHITESPACE = 8  # EngineConfig.structured_max_whitespace's default


def request(schema: dict, compact: bool, seed: int, chat: bool) -> tuple[str, dict]:
    """Completions with vLLM's `structured_outputs`, or chat with OpenAI's `response_format`."""
    common = {"n": N, "temperature": 1.0, "seed": seed, "max_tokens": MAX_TOKENS}
    options = {"disable_any_whitespace": True} if compact else {}
    if not chat:
        body = {"prompt": f"record {seed}:", "structured_outputs": {"json": schema, **options}}
        return "/v1/completions", {**common, **body}
    body = {
        "messages": [{"role": "user", "content": f"record {seed}"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "record", "schema": schema, "strict": True},
        },
    }
    if compact:
        body["structured_outputs"] = options
    return "/v1/chat/completions", {**common, **body}


def test_every_output_that_stops_parses_strictly_and_validates(server):
    seen = {"stop": 0, "length": 0, "loose": 0}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,  # the same schemas every run
        database=None,
        phases=(Phase.explicit, Phase.generate),  # a failure as drawn: shrinking re-samples
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(schema=SCHEMAS, compact=st.booleans(), seed=bounded(0, 2**31), chat=st.booleans())
    def property(schema, compact, seed, chat):
        path, body = request(schema, compact, seed, chat)
        reply = call(server, "POST", path, {"model": server.model_name, **body})
        assert reply.status == 200, (reply.body, schema)
        for choice in reply.json()["choices"]:
            text = choice["message"]["content"] if chat else choice["text"]
            seen[choice["finish_reason"]] += 1
            if choice["finish_reason"] != "stop":
                continue  # the budget ran out: a prefix of the language, not a whole value
            value = json.loads(text)  # strict: no raw control character in a string
            jsonschema.validate(value, schema)
            between = STRINGS.sub('""', text)  # what lies between the strings
            if compact:
                assert not re.search(r"\s", between), text
            assert not re.search(rf"\s{{{MAX_WHITESPACE + 1},}}", between), text
            seen["loose"] += bool(re.search(r"\s", between))

    property()
    assert set(seen) == {"stop", "length", "loose"}, seen  # no other finish reason
    # the property held on many finished outputs, not a handful; any whitespace was written
    assert seen["stop"] >= EXAMPLES * N // 3, seen
    assert seen["loose"] > 0, seen


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    zip: int | None = pydantic.Field(default=None, ge=0, le=99999)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    title: str = pydantic.Field(min_length=1, max_length=16)
    role: Literal["admin", "user", 'a "quoted\\" one']
    score: float = pydantic.Field(ge=0, le=10)
    tags: list[Annotated[str, pydantic.Field(max_length=8)]] = pydantic.Field(max_length=3)
    address: Address
    note: Annotated[str, pydantic.Field(max_length=10)] | None = None


def test_the_sdk_parse_helper_gets_a_valid_object_from_every_sampled_completion(server):
    """Issue 36's case: 2 of 14 such completions held a raw control character in a string
    bounded by maxLength. Each completion that stops is parsed by the SDK (pydantic's strict
    JSON); every string is bounded, so a random model mostly gets to the end."""
    parsed, ran_out = [], 0
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0) as client:
        parse = (
            getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
        )
        for seed in range(12):
            try:
                completion = parse(
                    model=server.model_name,
                    messages=[{"role": "user", "content": f"person {seed}"}],
                    response_format=Person,
                    max_tokens=200,
                    temperature=1.0,
                    seed=seed,
                )
            except openai.LengthFinishReasonError:
                ran_out += 1  # the client's budget (an unbounded string or list), not a fault
                continue
            parsed.append(completion.choices[0].message.parsed)
    assert all(isinstance(p, Person) for p in parsed)
    assert len(parsed) >= 6, f"{len(parsed)} parsed, {ran_out} ran out of max_tokens"


def test_options_alone_are_a_400_and_compact_applies_to_any_json_field(server):
    body = {"model": server.model_name, "prompt": "x", "max_tokens": 40}
    reply = call(server, "POST", "/v1/completions", {**body, "structured_outputs": {
        "disable_any_whitespace": True}})  # fmt: skip
    assert reply.status == 400 and reply.json()["error"]["param"] == "structured_outputs"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    compact = {"guided_json": schema, "structured_outputs": {"disable_any_whitespace": True}}
    for seed in range(4):
        reply = call(server, "POST", "/v1/completions", {
            **body, **compact, "temperature": 1.0, "seed": seed})  # fmt: skip
        [choice] = reply.json()["choices"]
        if choice["finish_reason"] == "stop":
            assert re.fullmatch(r'\{"a":-?\d+\}', choice["text"]), choice["text"]
