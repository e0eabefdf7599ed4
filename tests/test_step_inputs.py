"""The runner's flat inputs for a step of decodes come from kernels/cpu_step_inputs.c on CPU: the
same tensors, field by field, as its numpy path, which serves every other step."""

from __future__ import annotations

import msgspec
import pytest
import torch

from actorserve.actors.config import EngineConfig
from actorserve.actors.worker.worker import build_runner
from actorserve.messages.common import SamplingParams
from actorserve.messages.step import NewRequest, StepPlan

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def runner(llama_dir):
    """A Worker's runner with three requests in its batch after one step: `done` (prefilled,
    its first token sampled), `long` (prefilled over more blocks, in a shuffled order) and
    `partial` (7 of its 40 prompt tokens computed)."""
    config = EngineConfig(model=str(llama_dir), device="cpu", torch_threads=1)
    config = msgspec.structs.replace(config.resolve_model(), num_kv_blocks=32, num_cpu_blocks=0)
    runner = build_runner(config)
    assert runner.native is not None, "the CPU kernels could not be built (no C compiler?)"
    new = [
        NewRequest("done", list(range(1, 21)), 20, [5, 2], 20, GREEDY),
        NewRequest("long", list(range(3, 53)), 50, [9, 1, 30, 4], 50, GREEDY),
        NewRequest("partial", list(range(7, 47)), 40, [11, 12, 13], 7, GREEDY),
    ]
    runner.execute(StepPlan(0, 1, [], [], new))
    return runner


def prepared(runner, scheduled, native: bool):
    keep = runner.native
    runner.native = keep if native else None
    try:
        return runner.prepare(scheduled)
    finally:
        runner.native = keep


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
