"""Structured outputs end to end: real `actorserve serve` processes, the random test checkpoint.

Whatever a random model would write, the grammar leaves it only outputs that parse and validate:
64 JSON-schema requests (greedy and sampled) on a KV cache small enough to preempt, again across a
Worker SIGKILL mid-stream; regexes and choices always match; a constraint that cannot compile is
a 400 naming the field it came in; the official SDK's `parse` helper gets a pydantic object.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pydantic
import pytest
from gateway_support import API_KEY, GatewayServer, call, open_stream, read_events
from websockets.asyncio.client import connect

from actorserve.messages.common import SamplingParams
from actorserve.messages.structured import StructuredKind, StructuredOutput

NAME = {"type": "string", "pattern": "^[a-z]{1,8}$"}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": NAME,
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": NAME, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": NAME, "zip": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "tags", "address", "active"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
}
MAX_TOKENS = 120  # the schema's compact output is well under this
# compact JSON (vLLM's option; any whitespace is the default): greedy on a random model, optional
# whitespace can be the likeliest token at every place it may go, for ever
COMPACT = {"disable_any_whitespace": True}
KV_BLOCKS = 64  # 64 requests of ~5 blocks each: they preempt one another


@pytest.fixture(scope="module")
def server(llama_dir):
    server = GatewayServer(
        llama_dir,
        "--num-kv-blocks", str(KV_BLOCKS),
        "--max-model-len", "256",
        "--max-concurrent-requests", "128",
        "--heartbeat-interval-s", "0.5",
        "--max-restarts", "10",
    )  # fmt: skip
    yield server
    assert server.stop() == 0


def post(server, path: str, body: dict):
    return call(server, "POST", path, {"model": server.model_name, **body})


def json_request(i: int) -> tuple[str, dict]:
    """Request i: chat or completion, greedy or sampled, each way of asking for the schema."""
    sampled = {"temperature": 1.0, "seed": i} if i % 2 else {"temperature": 0.0}
    ask = [
        {"response_format": RESPONSE_FORMAT, "structured_outputs": COMPACT},
        {"structured_outputs": {"json": SCHEMA, **COMPACT}},
        {"guided_json": SCHEMA, "structured_outputs": COMPACT},
    ][i % 3]
    body = {"max_tokens": MAX_TOKENS, **sampled, **ask}
    if i % 4 < 2:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"p{i}"}], **body}
    return "/v1/completions", {"prompt": f"person {i}:", **body}


def texts_of(reply) -> list[str]:
    assert reply.status == 200, reply.body
    choices = reply.json()["choices"]
    return [c["message"]["content"] if "message" in c else c["text"] for c in choices]


def assert_valid(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def preemptions(server) -> int:
    return server.client.health().stats.num_preemptions


@pytest.mark.slow
def test_64_json_schema_requests_all_validate_while_they_preempt_one_another(server):
    before = preemptions(server)
    with ThreadPoolExecutor(64) as pool:
        replies = list(pool.map(lambda i: post(server, *json_request(i)), range(64)))
    texts = [text for reply in replies for text in texts_of(reply)]
    assert len(texts) == 64
    for text in texts:
        assert_valid(text)
    assert all(reply.json()["choices"][0]["finish_reason"] == "stop" for reply in replies)
    assert preemptions(server) > before  # the small KV cache did preempt (recompute)


@pytest.mark.slow
def test_outputs_validate_when_preemption_swaps_them_to_cpu_and_back(llama_dir):
    swapping = GatewayServer(
        llama_dir,
        "--num-kv-blocks", str(KV_BLOCKS),
        "--preemption-mode", "swap",
        "--max-model-len", "256",
        "--max-concurrent-requests", "64",
    )  # fmt: skip
    try:
        with ThreadPoolExecutor(32) as pool:
            replies = list(pool.map(lambda i: post(swapping, *json_request(i)), range(32)))
        for reply in replies:
            for text in texts_of(reply):
                assert_valid(text)
        assert swapping.client.health().stats.num_swaps > 0
    finally:
        assert swapping.stop() == 0


def test_parallel_samples_with_logprobs_each_validate(server):
    reply = post(
        server,
        "/v1/completions",
        {
            "prompt": "x",
            "n": 3,
            "logprobs": 2,
            "max_tokens": MAX_TOKENS,
            "guided_json": SCHEMA,
            "structured_outputs": COMPACT,
        },
    )
    for choice, text in zip(reply.json()["choices"], texts_of(reply)):
        assert_valid(text)
        # logprobs are of the masked distribution: a token the grammar forbade never shows
        assert all(lp is None or lp > -1e30 for lp in choice["logprobs"]["token_logprobs"])


def test_a_stop_string_ends_a_structured_output_early(server):
    reply = post(
        server,
        "/v1/completions",
        {
            "prompt": "x",
            "max_tokens": MAX_TOKENS,
            "guided_json": SCHEMA,
            "structured_outputs": COMPACT,
            "stop": ['"age"'],
        },
    )
    (text,) = texts_of(reply)
    assert text.startswith('{"name":"')
    assert '"age"' not in text and reply.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("field", ["guided_regex", "structured_outputs"])
def test_regex_outputs_all_match(server, field):
    pattern = r"[A-Z]{2}-\d{3}( [a-z]{1,5}){1,3}"
    ask = {field: pattern} if field == "guided_regex" else {field: {"regex": pattern}}
    for seed in range(8):
        body = {"prompt": "id:", "max_tokens": 40, "temperature": 1.0, "seed": seed, **ask}
        (text,) = texts_of(post(server, "/v1/completions", body))
        assert re.fullmatch(pattern, text), text


def test_choice_outputs_are_always_one_of_the_choices(server):
    choices = ["yes", "no", "maybe not", 'a "quoted" one']
    seen = set()
    for seed in range(12):
        body = {
            "messages": [{"role": "user", "content": "ok?"}],
            "temperature": 1.0,
            "seed": seed,
            "guided_choice": choices,
        }
        (text,) = texts_of(post(server, "/v1/chat/completions", body))
        assert text in choices
        seen.add(text)
    assert len(seen) > 1  # sampled: the mask leaves a choice, not one fixed answer


def test_a_streamed_grammar_output_matches(server):
    grammar = 'root ::= "(" [0-9]+ ("," [0-9]+)* ")"'
    body = {
        "model": server.model_name,
        "prompt": "t",
        "max_tokens": 30,
        "stream": True,
        "structured_outputs": {"grammar": grammar},
    }
    _, response = open_stream(server, "/v1/completions", body)
    events = [json.loads(e) for e in read_events(response) if e != "[DONE]"]
    text = "".join(c["text"] for e in events for c in e["choices"])
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    if finish == ["stop"]:
        assert re.fullmatch(r"\(\d+(,\d+)*\)", text), text
    else:  # the budget ran out inside the grammar: still a prefix of its language
        assert re.fullmatch(r"\(\d+(,\d+)*,?", text), text


@pytest.mark.parametrize(
    "field, value",
    [
        ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}),
        ("guided_json", {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}),
        ("structured_outputs", {"regex": "a(("}),
        ("guided_grammar", "root ::= undefined_rule"),
        ("guided_json", "{not json"),
        ("response_format", {"type": "xml"}),
    ],
)
def test_a_constraint_that_cannot_compile_is_a_400_naming_its_field(server, field, value):
    reply = post(server, "/v1/completions", {"prompt": "x", field: value})
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["param"] == field and error["message"].startswith(field), error


def test_two_constraints_at_once_are_a_400(server):
    body = {"prompt": "x", "guided_regex": "a+", "guided_choice": ["a"]}
    reply = post(server, "/v1/completions", body)
    assert reply.status == 400 and reply.json()["error"]["param"] == "guided_choice"


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(pattern="^[a-z]{1,8}$")
    zip: int = pydantic.Field(ge=0, le=999)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(pattern="^[a-z]{1,8}$")
    color: str = pydantic.Field(pattern="^(red|green|blue)$")
    address: Address


def test_the_openai_sdk_parse_helper_returns_a_pydantic_object(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0) as client:
        parse = (
            getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
        )
        completion = parse(
            model=server.model_name,
            messages=[{"role": "user", "content": "a person"}],
            response_format=Person,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"structured_outputs": COMPACT},
        )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and person.color in ("red", "green", "blue")


def worker_pid(server) -> int:
    return next(a.pid for a in server.client.health().actors if a.name == "worker")


@pytest.mark.slow
def test_outputs_validate_across_a_worker_sigkill_mid_stream(server):
    """Matchers are rebuilt from the journal's tokens: the streams resume, still valid."""
    old = worker_pid(server)
    streams = []
    for i in range(16):
        path, body = json_request(i)
        body = {"model": server.model_name, "stream": True, **body}
        streams.append((path, open_stream(server, path, body)[1]))
    first = [read_events(response, 3) for _, response in streams]  # every stream has begun
    os.kill(old, signal.SIGKILL)
    for (path, response), head in zip(streams, first):
        events = [json.loads(e) for e in head + read_events(response) if e != "[DONE]"]
        key = "delta" if "chat" in path else None
        text = "".join(
            (c["delta"].get("content") or "") if key else c["text"]
            for e in events
            for c in e["choices"]
        )
        assert_valid(text)
    deadline = time.monotonic() + 30
    while worker_pid(server) == old and time.monotonic() < deadline:
        time.sleep(0.1)
    assert worker_pid(server) != old  # the kill did land mid-stream


async def test_the_websocket_and_the_sdk_take_the_same_structured_field(server):
    regex = StructuredOutput(StructuredKind.REGEX, "[a-c]{3}-[0-9]{2}")
    params = {"max_tokens": 20, "temperature": 1.0, "seed": 3, "structured": {
        "kind": "regex", "text": regex.text}}  # fmt: skip
    url = server.url.replace("http://", "ws://") + "/v1/stream"
    async with connect(url, additional_headers={"Authorization": f"Bearer {API_KEY}"}) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "r", "prompt": "x", "params": params}))
        text = ""
        while (message := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] == "delta":
            text += message["text"]
    assert message["type"] == "done" and message["finish_reason"] == "stop", message
    assert re.fullmatch(regex.text, text), text
    sdk = await asyncio.to_thread(
        server.client.complete,
        "x",
        SamplingParams(max_tokens=20, temperature=1.0, seed=3, structured=regex),
    )
    assert sdk.text == text  # the same request through the ZeroMQ SDK: the same seeded draw
