"""The runner's flat inputs for a step of decodes come from the CPU fast path
(kernels/cpu/csrc/cpu_step_inputs.c): the same tensors, field by field, as its numpy path, which
serves every other step; and a step over the same decodes as the one before takes them from that
step's numbers (DecodeBatch), still the same tensors and the same tokens."""

from __future__ import annotations

import msgspec
import pytest
import torch

from actorserve.actors.runtime.config import EngineConfig
from actorserve.actors.runtime.config_resolution import resolve_model
from actorserve.actors.worker.block_tables import BlockTables
from actorserve.actors.worker.worker import build_runner
from actorserve.messages.common import SamplingParams
from actorserve.messages.step import NewRequest, RunningUpdate, StepPlan

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def new_runner(llama_dir, num_kv_blocks: int = 32):
    config = EngineConfig(model=str(llama_dir), device="cpu", torch_threads=1)
    config = msgspec.structs.replace(
        resolve_model(config), num_kv_blocks=num_kv_blocks, num_cpu_blocks=0
    )
    runner = build_runner(config)
    assert runner.fast_path is not None, "the CPU kernels could not be built (no C compiler?)"
    return runner


@pytest.fixture(scope="module")
def runner(llama_dir):
    """A Worker's runner with three requests in its batch after one step: `done` (prefilled,
    its first token sampled), `long` (prefilled over more blocks, in a shuffled order) and
    `partial` (7 of its 40 prompt tokens computed)."""
    runner = new_runner(llama_dir)
    new = [
        NewRequest("done", list(range(1, 21)), 20, [5, 2], 20, GREEDY),
        NewRequest("long", list(range(3, 53)), 50, [9, 1, 30, 4], 50, GREEDY),
        NewRequest("partial", list(range(7, 47)), 40, [11, 12, 13], 7, GREEDY),
    ]
    runner.execute(StepPlan(0, 1, [], [], new))
    return runner


def prepared(runner, scheduled, native: bool):
    """The step's inputs through the fast path's hook (`native`) or the numpy path."""
    return (runner.prepare if native else numpy_prepare(runner))(scheduled)


def numpy_prepare(runner, prepare=None):
    """runner.prepare with the fast path hidden from it alone (the step itself still runs
    through the fast path): the numpy input path."""
    prepare = prepare or runner.prepare

    def numpy_only(scheduled):
        fast_path, runner.fast_path = runner.fast_path, None
        try:
            return prepare(scheduled)
        finally:
            runner.fast_path = fast_path

    return numpy_only


def test_a_step_of_decodes_gets_the_numpy_paths_inputs(runner):
    # `partial` computes one more prompt token (it does not sample); the others decode
    scheduled = [("long", 1), ("partial", 1), ("done", 1)]
    fast, slow = prepared(runner, scheduled, True), prepared(runner, scheduled, False)
    for name in ("input_ids", "positions", "sample_index"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    assert fast.sample_index.tolist() == [0, 2]
    for name in fast.meta._fields:
        a, b = getattr(fast.meta, name), getattr(slow.meta, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fast.sample_ids == slow.sample_ids == ["long", "done"]
    assert [row.position for row in fast.sample_rows] == [51, 21]
    assert fast.meta.block_tables.tolist()[0] == [9, 1, 30, 4]


def test_a_step_where_every_row_samples_has_no_sample_index(runner):
    scheduled = [("long", 1), ("done", 1)]
    for native in (True, False):
        inputs = prepared(runner, scheduled, native)
        assert inputs.sample_index is None
        assert inputs.sample_ids == ["long", "done"]
        assert inputs.input_ids.tolist() == [runner.requests[r].token_ids[-1] for r, _ in scheduled]


def test_a_decode_past_its_blocks_is_refused_as_on_the_numpy_path(runner):
    done = runner.requests["done"]
    done.num_computed += 12  # token 33 of 2 blocks of 16
    done.token_ids += [0] * 12
    try:
        for native in (True, False):
            with pytest.raises(ValueError, match="done computes up to token 33 but holds 2"):
                prepared(runner, [("long", 1), ("done", 1)], native)
    finally:
        done.num_computed -= 12
        del done.token_ids[-12:]


def decode_plans(runner, request_ids: list[str], steps: int, first_step: int = 2):
    """StepPlans of one token for each request, each given a new block when its next token
    needs one (block ids counted up from 40, shuffled among the requests)."""
    next_block = 40
    for step in range(first_step, first_step + steps):
        running = []
        for rid in request_ids:
            r = runner.requests[rid]
            blocks = []
            if r.num_computed + 1 > r.num_blocks * runner.block_size:
                blocks, next_block = [next_block], next_block + 1
            running.append(RunningUpdate(rid, blocks, 1))
        yield StepPlan(0, step, [], running, [])


def started(llama_dir, params: list[SamplingParams], table_columns: int | None = None):
    """A runner whose batch holds one request per params, prompts of 20, 50 and 35 tokens, each
    prefilled and its first token sampled (`table_columns`: its block tables start that narrow,
    so they grow while the requests decode)."""
    runner = new_runner(llama_dir, num_kv_blocks=128)
    if table_columns is not None:
        runner.block_tables = BlockTables(4, table_columns)
    prompts, blocks = [list(range(1, 21)), list(range(3, 53)), list(range(9, 44))], [2, 4, 3]
    new, first = [], 0
    for i, (prompt, n, p) in enumerate(zip(prompts, blocks, params)):
        new.append(
            NewRequest(f"r{i}", prompt, len(prompt), list(range(first, first + n)), len(prompt), p)
        )
        first += n
    runner.execute(StepPlan(0, 1, [], [], new))
    return runner


@pytest.mark.parametrize("columns", [None, 4], ids=["tables-wide", "tables-grow"])
def test_decoding_the_same_requests_again_advances_the_last_steps_numbers(llama_dir, columns):
    """Forty decode steps of three requests, crossing block boundaries (and, from 4 columns,
    widening the block tables): each step after the first takes its inputs from the last step's
    (DecodeBatch), field by field what the numpy path makes from the requests themselves."""
    runner = started(llama_dir, [GREEDY] * 3, columns)
    prepare, reused = runner.prepare, []

    def checked(scheduled):
        last, runner.decodes = runner.decodes, None
        try:
            slow = numpy_prepare(runner, prepare)(scheduled)
        finally:
            runner.decodes = last
        fast = prepare(scheduled)
        reused.append(last is not None and fast.decodes is last)
        assert fast.input_ids.tolist() == slow.input_ids.tolist()
        assert fast.positions.tolist() == slow.positions.tolist()
        for name in fast.meta._fields:
            a, b = getattr(fast.meta, name), getattr(slow.meta, name)
            assert a.dtype == b.dtype and a.tolist() == b.tolist(), name
        assert fast.sample_index is slow.sample_index is None
        assert fast.sample_ids == slow.sample_ids
        return fast

    runner.prepare = checked
    for plan in decode_plans(runner, ["r0", "r1", "r2"], 40):
        runner.execute(plan)
    assert reused == [False] + [True] * 39
    assert [runner.requests[r].num_blocks for r in ("r0", "r1", "r2")] == [4, 6, 5]


def test_a_step_that_changes_the_batch_starts_its_numbers_afresh(llama_dir):
    runner = started(llama_dir, [GREEDY] * 3)
    plans = decode_plans(runner, ["r0", "r1", "r2"], 2)
    for plan in plans:
        runner.execute(plan)
    assert runner.decodes is not None and len(runner.decodes.requests) == 3
    runner.execute(
        StepPlan(0, 9, ["r1"], [RunningUpdate("r0", [], 1), RunningUpdate("r2", [], 1)], [])
    )
    assert [r.new.request_id for r in runner.decodes.requests] == ["r0", "r2"]
    runner.forget("r2")
    assert runner.decodes is None


SAMPLED = [
    SamplingParams(temperature=0.8, seed=3, max_tokens=64, ignore_eos=True),  # draws by position
    SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=64),  # reads the tokens
    # token 7 wins every step, but is masked for the first 30 outputs
    SamplingParams(temperature=0.0, logit_bias={7: 100.0}, stop_token_ids=[7], min_tokens=30),
]


@pytest.mark.parametrize("params", [[GREEDY] * 3, SAMPLED], ids=["greedy", "sampled"])
def test_the_kept_numbers_sample_what_the_numpy_path_does(llama_dir, params):
    """Seeded sampling draws by position, penalties read the tokens so far, min_tokens counts the
    output: the same tokens whether each step starts from the last one's numbers or the numpy
    path makes its inputs afresh from the requests."""
    outputs = []
    for native in (True, False):
        runner = started(llama_dir, params)
        if not native:
            runner.prepare = numpy_prepare(runner)
        outputs.append(
            [
                runner.execute(plan).token_ids
                for plan in decode_plans(runner, ["r0", "r1", "r2"], 40)
            ]
        )
    assert outputs[0] == outputs[1]
    if params is SAMPLED:
        assert [step[2] for step in outputs[0]].index(7) == 29  # output 30 (the prefill sampled 1)
