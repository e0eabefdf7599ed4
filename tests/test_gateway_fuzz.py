"""Fuzzing the gateway's doors on the session's shared gateway (64 KiB bodies): whatever a client
sends, the answer is never a 5xx, every refusal names the field or the limit it broke, and the
gateway serves the next normal request.

(a) the JSON routes, a seeded generator: random bytes, cut-off JSON, nesting past the decoder's
    depth, a wrong type for every field of the request Structs, huge lists, unknown fields;
(b) the same over the WebSocket, frame by frame;
(c) property-based: bodies drawn by hypothesis from the request Structs' own field types (the
    app serves no OpenAPI schema for schemathesis to read; this is its equivalent).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import string

import msgspec
import msgspec.inspect as mi
import pytest
from gateway_support import AUTH, call, shared_gateway
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect

from actorserve.gateway.openai_requests import ChatCompletionRequest, CompletionRequest
from actorserve.messages.common import SamplingParams

SEED = 20240601
BASES = {  # a valid body per route: the fuzz changes one thing at a time
    "completions": {"prompt": "hello", "max_tokens": 2},
    "chat/completions": {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 2,
        "max_completion_tokens": 2,  # a wrong max_tokens alone must not mean 500 tokens
    },
}
STRUCTS = {"completions": CompletionRequest, "chat/completions": ChatCompletionRequest}
WRONG = [None, True, 0, -1, 1.5, -1e308, 1e308, 2**70, "", "x", "9" * 50]
WRONG += [[], [1, "a"], {}, {"a": 1}, [[[]]], [None], {"": None}]
# a refusal with no `param` must still say which limit or what of the body it is about
NAMED = re.compile(
    r"request body|message|max_\w+|Content-Type|prompt|messages|_logprobs|model|stream|"
    r"[a-z_]+ must|Unrecognized",
)


@pytest.fixture(scope="module")
def gateway(pytestconfig, llama_dir):
    return shared_gateway(pytestconfig, llama_dir)


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def decodes(data: bytes | str, kind) -> bool:
    try:
        msgspec.json.decode(data, type=kind)
        return True
    except msgspec.DecodeError:
        return False


def fuzz_bodies(route: str, rng: random.Random) -> list[bytes]:
    base = BASES[route]
    text = json.dumps(base)
    bodies = [rng.randbytes(rng.randrange(0, 2000)) for _ in range(60)]
    bodies += [text[: rng.randrange(len(text))].encode() for _ in range(40)]
    bodies += [
        "".join(rng.choice(string.printable) for _ in range(rng.randrange(1, 200))).encode()
        for _ in range(40)
    ]
    for depth in (1_000, 10_000, 30_000):
        bodies.append(deep(depth).encode())
        for field in ("prompt", "tools", "response_format", "logit_bias", "stop"):
            bodies.append(f'{{{text[1:-1]}, "{field}": {deep(depth)}}}'.encode())
        inner = f'[{{"type": "text", "text": "x", "extra": {deep(depth)}}}]'
        bodies.append(f'{{"messages": [{{"role": "user", "content": {inner}}}]}}'.encode())
    bodies.append(b"[" * 100_000)  # over the body limit too
    for field in msgspec.structs.fields(STRUCTS[route]):
        for value in WRONG:
            body = json.dumps({**base, field.name: value}).encode()
            if not decodes(body, STRUCTS[route]):  # of the field's type after all: not sent
                bodies.append(body)
    ids = [rng.randrange(-5, 50_000) for _ in range(100_000)]
    for n in (2_000, 9_000, 100_000):
        bodies.append(json.dumps({**base, "stop_token_ids": ids[:n]}).encode())
        bodies.append(json.dumps({**base, "logit_bias": {str(i): 1 for i in ids[:n]}}).encode())
        bodies.append(json.dumps({**base, "stop": ["s"] * n}).encode())
    bodies.append(text.replace('"max_tokens": 2', '"max_tokens": 2, "temperature": 1e999').encode())
    for _ in range(30):
        name = "".join(rng.choice(string.ascii_letters + "_") for _ in range(rng.randrange(1, 20)))
        bodies.append(json.dumps({**base, name: rng.choice(WRONG)}).encode())
    return bodies


def check_answer(reply, what) -> None:
    """Below 500; a refusal in OpenAI's error shape naming its field or limit; a stream with
    no server error in it."""
    assert reply.status < 500, (what, reply.status, reply.body[:300])
    if reply.status >= 400:
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["param"] or NAMED.search(error["message"]), (what, error)
    elif reply.headers["content-type"].startswith("text/event-stream"):
        assert b"server_error" not in reply.body, (what, reply.body[-300:])


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_fuzzed_bodies_get_no_5xx_and_refusals_name_their_field(gateway, route):
    rng = random.Random(f"{SEED}-{route}")
    bodies = fuzz_bodies(route, rng)
    assert len(bodies) >= 500
    statuses = []
    for raw in bodies:
        reply = call(gateway, "POST", f"/v1/{route}", headers=AUTH, raw=raw)
        check_answer(reply, raw[:120])
        statuses.append(reply.status)
    assert {400, 413} <= set(statuses)
    assert call(gateway, "POST", f"/v1/{route}", BASES[route], AUTH).status == 200


# -- (b) the WebSocket --------------------------------------------------------------------------


def ws_frames(rng: random.Random) -> list[tuple[str | bytes, str | None]]:
    """(frame, the id its error or done frame carries: None when it has no fit one)."""
    frames: list[tuple[str | bytes, str | None]] = []
    frames += [(rng.randbytes(rng.randrange(1, 500)), None) for _ in range(60)]
    frames += [
        ("".join(rng.choice(string.printable) for _ in range(rng.randrange(1, 100))), None)
        for _ in range(40)
    ]
    for depth in (1_000, 20_000):
        frames.append((deep(depth), None))
        frames.append(
            (f'{{"type": "generate", "id": "deep{depth}", "prompt": {deep(depth)}}}', None)
        )
    count = 0

    def generate(**changes) -> tuple[str, str]:
        nonlocal count
        count += 1
        rid = f"g{count}"
        frame = {"type": "generate", "id": rid, "prompt": "x", "params": {"max_tokens": 2}}
        for key, value in changes.items():
            if key.startswith("params."):
                frame["params"][key.removeprefix("params.")] = value
            else:
                frame[key] = value
        return json.dumps(frame), rid

    for value in WRONG:
        for name in ("type", "prompt", "prompt_token_ids", "messages", "params", "junk"):
            frames.append(generate(**{name: value}))
        frame, rid = generate(id=value)
        frames.append((frame, value if isinstance(value, str) else None))
        for field in SamplingParams.__struct_fields__:
            frame, rid = generate(**{f"params.{field}": value})
            if not decodes(frame, SamplingParamsFrame):  # of the field's type after all: not sent
                frames.append((frame, rid))
    frames.append((json.dumps({"type": "abort", "id": 5}), None))
    frames.append((json.dumps({"type": "abort"}), None))
    return frames


class SamplingParamsFrame(msgspec.Struct):
    params: SamplingParams


async def test_fuzzed_websocket_frames_get_error_frames_and_a_fresh_socket_works(gateway):
    url = gateway.url.replace("http://", "ws://") + "/v1/stream"
    frames = ws_frames(random.Random(SEED))
    assert len(frames) >= 300
    async with connect(url, additional_headers=AUTH) as ws:
        for frame, rid in frames:
            await ws.send(frame)
            while True:
                answer = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if answer["id"] == rid and answer["type"] in ("error", "done"):
                    break
            if answer["type"] == "error":
                assert answer["status"] < 500, (frame[:120], answer)
                assert answer["param"] or NAMED.search(answer["message"]), (frame[:120], answer)
    async with connect(url, additional_headers=AUTH) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "ok", "prompt": "x"}))
        while (answer := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] != "done":
            assert answer["type"] == "delta"
        assert answer["id"] == "ok" and answer["finish_reason"] in ("stop", "length")


# -- (c) property-based, from the request Structs -----------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)
TOKEN = st.integers(0, 31_999)
# Where the field's type alone would almost always draw a refused value: values in its valid
# range too (a valid body is served, so the ones that cost generation stay small). Every
# field's generic values are drawn as well; the ranges only add to them.
IN_RANGE = {
    "prompt": st.text(max_size=20) | st.lists(TOKEN, min_size=1, max_size=8),
    "role": st.sampled_from(["user", "assistant", "system"]),
    "content": st.text(max_size=20),
    "max_tokens": st.integers(0, 4),
    "max_completion_tokens": st.integers(1, 4),
    "n": st.integers(1, 3),
    "min_tokens": st.integers(0, 1),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "min_p": st.floats(0, 1),
    "top_k": st.integers(-1, 50),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "seed": st.integers(0, 2**63 - 1),
    "priority": st.integers(0, 10),
    "logprobs": st.integers(0, 5),
    "top_logprobs": st.integers(0, 5),
    "prompt_logprobs": st.none(),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "stop_token_ids": st.lists(TOKEN, max_size=5),
    "logit_bias": st.dictionaries(TOKEN.map(str), st.floats(-100, 100), max_size=3),
    "skip_special_tokens": st.just(True),
    "echo": st.booleans(),
    "best_of": st.just(1),
    "suffix": st.none(),
    "tools": st.none(),
    "response_format": st.just({"type": "text"}),
    "stream_options": st.none(),
}
COSTLY = {"max_tokens", "max_completion_tokens", "n", "min_tokens"}  # only small values


def of_type(t, name: str = "") -> st.SearchStrategy:
    """Values of the msgspec type `t` (inspect's description of a field), and in its range."""
    if name in COSTLY:
        return IN_RANGE[name]
    typed = _typed(t)
    return st.one_of(IN_RANGE[name], typed) if name in IN_RANGE else typed


def _typed(t) -> st.SearchStrategy:
    if isinstance(t, mi.IntType):
        return st.integers(-3, 40) | st.integers()
    if isinstance(t, mi.FloatType):
        return st.floats(-3, 3) | st.floats(allow_nan=False, allow_infinity=False)
    if isinstance(t, mi.StrType):
        return st.text(max_size=12)
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.ListType):
        return st.lists(of_type(t.item_type), max_size=4)
    if isinstance(t, mi.DictType):
        return st.dictionaries(_typed(t.key_type), of_type(t.value_type), max_size=4)
    if isinstance(t, mi.UnionType):
        return st.one_of(*[_typed(u) for u in t.types])
    if isinstance(t, mi.StructType):
        return struct_bodies(t)
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    return JSON  # Any


def struct_bodies(t: mi.StructType, always: tuple[str, ...] = ()) -> st.SearchStrategy:
    """A dict of the Struct's fields: the required ones and `always`, some of the others."""
    required = {f.encode_name: of_type(f.type, f.name) for f in t.fields if f.required}
    required |= {f.encode_name: of_type(f.type, f.name) for f in t.fields if f.name in always}
    optional = {f.encode_name: of_type(f.type, f.name) for f in t.fields if f.name not in required}
    return st.fixed_dictionaries(required, optional=optional)


@st.composite
def request_bodies(draw, kind):
    """A body of the request Struct `kind`, and in one of two a wrong value in one field."""
    # both length fields of a chat: one set to null must not leave it to run to max_model_len
    body = draw(struct_bodies(mi.type_info(kind), always=("max_tokens", "max_completion_tokens")))
    if draw(st.booleans()):
        body[draw(st.sampled_from(sorted(body)))] = draw(st.sampled_from(WRONG))
    return body


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_bodies_drawn_from_the_request_structs_never_get_a_5xx(gateway, route):
    statuses = []

    @settings(
        max_examples=100,
        deadline=None,
        derandomize=True,  # the same bodies every run
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(body=request_bodies(STRUCTS[route]))
    def property(body):
        reply = call(gateway, "POST", f"/v1/{route}", body, AUTH)
        check_answer(reply, body)
        statuses.append(reply.status)

    property()
    assert 200 in statuses and 400 in statuses  # both doors of the route were tried
    assert call(gateway, "POST", f"/v1/{route}", BASES[route], AUTH).status == 200
