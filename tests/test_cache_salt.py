"""Prefix-cache isolation: blake2b block hashes chained from a per-request cache salt. Requests
share cached blocks only within one salt (or among those without one), in the pool and through a
real server; the salt's length is checked, and the OpenAI routes take it as vLLM does."""

from __future__ import annotations

import random

import pytest
from gateway_support import AUTH, call, shared_gateway

from actorserve.actors.block_manager.block_pool import BlockPool
from actorserve.actors.runtime.block_hash import NO_SALT, block_hash, chain_hashes, chain_root
from actorserve.messages.blocks import BlockNeed
from actorserve.messages.common import MAX_CACHE_SALT, SamplingParams

BS = 16


def salted(rid: str, tokens: list[int], salt: str | None) -> BlockNeed:
    return BlockNeed(rid, 0, len(tokens), True, list(tokens), cache_salt=salt)


def fresh_prompt(seed: int, length: int = 3 * BS + 5) -> list[int]:
    """Token ids no other test sends (so none of them is cached already)."""
    rng = random.Random(f"cache-salt-{seed}")
    return [rng.randrange(100, 30000) for _ in range(length)]


def test_equal_tokens_hash_apart_under_different_parents_and_salts():
    tokens = list(range(BS))
    first = block_hash(NO_SALT, tokens)
    assert block_hash(first, tokens) != first
    assert block_hash(chain_root("tenant-a"), tokens) != first
    assert block_hash(chain_root("tenant-a"), tokens) != block_hash(chain_root("tenant-b"), tokens)
    assert block_hash(chain_root("tenant-a"), tokens) == block_hash(chain_root("tenant-a"), tokens)
    assert chain_root(None) == NO_SALT and chain_root("") != NO_SALT
    assert len(first) == 16
    # ids are packed as int64, not truncated nor spelled out: 2**32 + 1 is not 1
    assert block_hash(NO_SALT, [1] * BS) != block_hash(NO_SALT, [2**32 + 1] + [1] * (BS - 1))


def test_a_chain_is_block_hash_block_after_block_and_ignores_a_partial_last_block():
    tokens = list(range(1000, 1000 + 3 * BS + 7))
    parent, expected = chain_root("t"), []
    for i in range(3):
        parent = block_hash(parent, tokens[i * BS : (i + 1) * BS])
        expected.append(parent)
    assert list(chain_hashes(chain_root("t"), tokens, BS)) == expected


def test_the_pool_shares_blocks_only_within_one_salt():
    pool = BlockPool(40, BS)
    prompt = list(range(500, 500 + 3 * BS + 2))  # 3 full blocks
    pool.allocate_step([salted("a", prompt, "tenant-a")])
    pool.free("a")
    hits = {}
    for rid, salt in [("b", "tenant-b"), ("none", None), ("a2", "tenant-a")]:
        hits[salt] = pool.allocate_step([salted(rid, prompt, salt)]).granted[0].num_computed
        pool.free(rid)
    assert hits == {"tenant-b": 0, None: 0, "tenant-a": 3 * BS}


def test_a_salted_forks_own_blocks_stay_in_its_salts_chain():
    """A fork hashes the blocks it fills itself from its salt's root: an unsalted request that
    shares the prompt's first block (cached unsalted by another) still cannot reach them."""
    pool = BlockPool(20, BS)
    prompt = list(range(700, 700 + BS + 1))
    pool.allocate_step([salted("u", prompt, None)])  # the first block, cached without a salt
    pool.free("u")
    pool.allocate_step([salted("p", prompt, "t")])
    pool.allocate_step([BlockNeed("c", BS, 1, True, prompt, fork_of="p", cache_salt="t")])
    sampled = list(range(900, 900 + BS - 1))
    pool.allocate_step([BlockNeed("c", BS + 1, BS - 1, False, sampled)])  # its 2nd block fills
    tokens = prompt + sampled + [1]
    hits = {}
    for rid, salt in [("x", None), ("y", "t")]:
        hits[salt] = pool.allocate_step([salted(rid, tokens, salt)]).granted[0].num_computed
    assert hits == {None: BS, "t": 2 * BS}


@pytest.mark.parametrize("salt", ["", "x" * (MAX_CACHE_SALT + 1)])
def test_a_cache_salt_must_be_one_to_256_characters(salt):
    error = SamplingParams(cache_salt=salt).validate(32000)
    assert error is not None and error.startswith("cache_salt must be")
    assert SamplingParams(cache_salt="x" * MAX_CACHE_SALT).validate(32000) is None


@pytest.fixture(scope="module")
def gateway(pytestconfig, llama_dir):
    return shared_gateway(pytestconfig, llama_dir)


def cached_tokens(server, prompt: list[int], salt: str | None) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=2, cache_salt=salt)
    return list(server.client.generate(prompt, params))[-1].cached_tokens


def test_a_server_hits_the_prefix_cache_only_for_the_same_salt(gateway):
    prompt = fresh_prompt(1)
    assert cached_tokens(gateway, prompt, "tenant-a") == 0
    assert cached_tokens(gateway, prompt, "tenant-b") == 0  # same prompt, another tenant
    assert cached_tokens(gateway, prompt, None) == 0
    assert cached_tokens(gateway, prompt, "tenant-a") == 3 * BS
    assert cached_tokens(gateway, prompt, None) == 3 * BS  # the unsalted chain, cached above


def test_the_openai_routes_take_cache_salt_and_check_its_length(gateway):
    body = {"model": gateway.model_name, "prompt": fresh_prompt(2), "max_tokens": 2}
    ok = call(gateway, "POST", "/v1/completions", {**body, "cache_salt": "tenant-a"}, AUTH)
    assert ok.status == 200, ok.body
    long = {**body, "cache_salt": "x" * (MAX_CACHE_SALT + 1)}
    refused = call(gateway, "POST", "/v1/completions", long, AUTH)
    assert refused.status == 400 and "cache_salt" in refused.json()["error"]["message"]
    chat = {
        "model": gateway.model_name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "cache_salt": "tenant-a",
    }
    assert call(gateway, "POST", "/v1/chat/completions", chat, AUTH).status == 200
