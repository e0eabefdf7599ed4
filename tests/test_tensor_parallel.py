"""Tensor parallelism (issue 26): `--tensor-parallel-size 2` on gloo, two Worker ranks of one
thread each, serves the tokens one Worker serves and transformers computes (fp32), under chunked
prefill and preemption; SIGKILL of either rank mid-stream restarts the whole group and every
stream completes as in an undisturbed run; no rank outlives the server."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from actorserve.actors.runtime.config import EngineConfig
from actorserve.actors.runtime.config_resolution import resolve_device, resolve_model
from actorserve.actors.worker.tp_group import rank_device
from actorserve.messages.common import SamplingParams
from actorserve.messages.structured import StructuredKind, StructuredOutput
from support import (
    EngineServer,
    generate_concurrently,
    hf_generate,
    hf_greedy,
    hf_model,
    prompts_of_lengths,
)
from tp_processes import group_pids, is_alive, streams_with_fault, worker_status

GROUP_OF_TWO = ("--tensor-parallel-size", "2", "--torch-threads", "1")
# 48 blocks x 16 = 768 tokens: one 500-token prompt fits, the sixteen together do not (requests
# are preempted); a 64-token step budget prefills every prompt over 64 tokens in chunks.
PRESSURE = ("--num-kv-blocks", "48", "--max-model-len", "768", "--max-num-batched-tokens", "64")
SUPERVISION = ("--heartbeat-interval-s", "0.5", "--max-restarts", "10")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
STREAMED = SamplingParams(temperature=0.0, max_tokens=48)


def test_tensor_parallel_size_below_one_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        EngineConfig(model="m", tensor_parallel_size=0).validate()


def test_cpu_ranks_share_the_cores_and_serve_without_the_cpu_fast_path():
    cores = os.cpu_count() or 1
    cpu = resolve_device(EngineConfig(model="m", tensor_parallel_size=2), "cpu")
    assert cpu.torch_threads == max(1, cores // 2) and not cpu.cpu_fast_path
    assert resolve_device(EngineConfig(model="m"), "cpu").cpu_fast_path  # one rank keeps it
    given = resolve_device(EngineConfig(model="m", tensor_parallel_size=2, torch_threads=3), "cpu")
    assert given.torch_threads == 3  # each rank's, as set
    replicas = EngineConfig(model="m", tensor_parallel_size=2, data_parallel_size=2)
    assert resolve_device(replicas, "cpu").torch_threads == max(1, cores // 4)
    cuda = resolve_device(EngineConfig(model="m", tensor_parallel_size=2), "cuda")
    assert cuda.torch_threads == 1 and cuda.cpu_fast_path  # not the CPU's to turn off there


def test_rank_r_serves_on_the_r_th_cuda_device_and_a_missing_one_is_named():
    import torch

    on_cpu = EngineConfig(model="m", device="cpu", tensor_parallel_size=2)
    assert rank_device(on_cpu, 1) == torch.device("cpu")
    group = EngineConfig(model="m", device="cuda", tensor_parallel_size=2)
    if torch.cuda.device_count() >= 2:
        assert [rank_device(group, r).index for r in (0, 1)] == [0, 1]
    else:
        with pytest.raises(ValueError, match="tensor_parallel_size 2 .* needs cuda:1"):
            rank_device(group, 1)


@pytest.fixture(scope="module")
def llama_group(llama_dir):
    """One group of two ranks for the module's tests (those that kill a rank included: the
    group comes back); the last test stops it."""
    server = EngineServer(llama_dir, *GROUP_OF_TWO, *PRESSURE, *SUPERVISION)
    yield server
    if server.proc.poll() is None:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def streamed_prompts(llama_dir):
    """Prompts whose every greedy step has a clear winner (a resumed stream recomputes its
    prefix in another order: smallest_greedy_margin's rule), with their undisturbed output
    (transformers', computed once with the margins)."""
    prompts = prompts_of_lengths(llama_dir, [12, 20, 33, 44, 50, 63, 70, 88])
    undisturbed = []
    for prompt in prompts:
        out = hf_generate(
            hf_model(llama_dir), prompt, STREAMED.max_tokens, output_scores=True,
            return_dict_in_generate=True,
        )  # fmt: skip
        assert min(float(s[0].topk(2).values.diff().abs()) for s in out.scores) > 1e-3
        ids = out.sequences[0, len(prompt) :].tolist()
        undisturbed.append((ids, "length" if len(ids) == STREAMED.max_tokens else "stop"))
    return prompts, undisturbed


def greedy_tokens(address: str, prompts, params: SamplingParams) -> list[list[int]]:
    return [ids for _, ids, _ in generate_concurrently(address, prompts, params)]


def assert_group_equals_one_worker_and_transformers(model_dir, group: EngineServer):
    prompts = prompts_of_lengths(model_dir)
    grouped = greedy_tokens(group.address, prompts, GREEDY)
    stats = group.wait_blocks_free()
    assert stats.num_preemptions > 0 and stats.num_partial_prefills > 0
    single = EngineServer(model_dir, *PRESSURE)
    try:
        alone = greedy_tokens(single.address, prompts, GREEDY)
    finally:
        assert single.stop() == 0
    for prompt, ids, reference in zip(prompts, grouped, alone):
        assert ids == reference, f"{len(prompt)}-token prompt: the group and one Worker differ"
        assert ids == hf_greedy(model_dir, prompt, GREEDY.max_tokens), f"{len(prompt)} tokens"


@pytest.mark.slow
def test_two_ranks_serve_llama_greedy_tokens_equal_to_one_worker_and_transformers(
    llama_dir, llama_group
):
    worker, followers = group_pids(llama_group)
    assert len(followers) == 1  # rank 1, a child of rank 0 (the supervised Worker)
    assert_group_equals_one_worker_and_transformers(llama_dir, llama_group)


@pytest.mark.slow
def test_a_structured_request_on_two_ranks_matches_its_regex_and_its_seed(llama_group):
    """Each rank compiles the grammar (rank 0 answers GrammarReady) and masks the same rows."""
    regex = StructuredOutput(StructuredKind.REGEX, "[a-c]{3}-[0-9]{2}")
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=3, structured=regex)
    first, again = (llama_group.client.complete("x", params) for _ in range(2))
    assert re.fullmatch(regex.text, first.text) and first.finish_reason.value == "stop"
    assert again.text == first.text


@pytest.mark.slow
def test_two_ranks_serve_qwen3_greedy_tokens_equal_to_one_worker_and_transformers(qwen3_dir):
    group = EngineServer(qwen3_dir, *GROUP_OF_TWO, *PRESSURE)
    try:
        assert_group_equals_one_worker_and_transformers(qwen3_dir, group)
    finally:
        assert group.stop() == 0


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["follower", "rank 0"])
def test_sigkill_of_a_rank_mid_stream_restarts_the_group_and_streams_complete_identical(
    llama_group, streamed_prompts, victim
):
    prompts, undisturbed = streamed_prompts
    restarts = worker_status(llama_group).restarts
    worker, (follower,) = group_pids(llama_group)
    target = follower if victim == "follower" else worker
    results = streams_with_fault(
        llama_group.address, prompts, STREAMED, lambda: os.kill(target, signal.SIGKILL)
    )
    assert results == undisturbed
    assert worker_status(llama_group).restarts == restarts + 1
    new_worker, (new_follower,) = group_pids(llama_group)
    assert {new_worker, new_follower}.isdisjoint({worker, follower})
    deadline = time.monotonic() + 10  # the survivor's exit: at once, by the group's rule
    while (is_alive(worker) or is_alive(follower)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_alive(worker) and not is_alive(follower)


@pytest.mark.slow
def test_stopping_the_server_leaves_no_rank_behind(llama_group):
    worker, (follower,) = group_pids(llama_group)
    with open(llama_group.log_path) as log:  # stop() removes the file; this reads it still
        assert llama_group.stop() == 0
        assert not is_alive(worker) and not is_alive(follower)
        assert "did not stop: killing it" not in log.read()  # the follower stopped on Stop


def test_a_model_that_does_not_split_is_refused_before_any_rank_starts(llama_dir):
    """tiny-llama's 2 query heads do not split across 3 ranks: the config says so, naming the
    config.json field, before the supervisor starts a process."""
    config = EngineConfig(model=str(llama_dir), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="num_attention_heads.*tensor_parallel_size"):
        resolve_model(config)
