"""Decode graphs (actors/worker/graph_runner.py) over the persistent step buffers
(step_buffers.py). On the CPU the graphs replay eagerly (`capture_decode_graphs(eager_replay=
True)`): the same buffers, padding and slicing as on CUDA, so a step of B decodes runs padded to
the next captured size and must give the plain runner's greedy tokens; the `gpu` tests record real
CUDA graphs and hold them to the eager CUDA runner."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from actorserve.actors.runtime.config import EngineConfig
from actorserve.actors.runtime.config_resolution import resolve_model
from actorserve.actors.worker.block_tables import BlockTables
from actorserve.actors.worker.flat_step import flat_step
from actorserve.actors.worker.graph_runner import DecodeGraphs, graph_batch_sizes
from actorserve.actors.worker.step_buffers import DeviceBlockTables
from actorserve.actors.worker.worker import build_runner
from actorserve.messages.common import SamplingParams
from actorserve.messages.step import NewRequest, RunningUpdate, StepPlan

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 10, ignore_eos=True)


def runner_for(model_dir, device: str = "cpu", num_cpu_blocks: int = 0, **settings):
    """A Worker's runner in plain torch (no CPU fast path), as build_runner makes it."""
    config = EngineConfig(
        model=str(model_dir), device=device, torch_threads=1, cpu_fast_path=False, **settings
    )
    config = resolve_model(config)
    config = msgspec.structs.replace(config, num_kv_blocks=512, num_cpu_blocks=num_cpu_blocks)
    return build_runner(config)


class Schedule:
    """A scheduler's part for one runner: `rows` requests prefilled in one step (prompts of
    varied lengths, blocks from a shuffled pool), then decoded, each step handing a request a
    new block when its next token crosses into one."""

    def __init__(self, rows: int, seed: int = 0):
        rng = random.Random(seed)
        self.pool = list(range(512))
        rng.shuffle(self.pool)
        self.lengths = {f"r{i}": rng.randint(5, 40) for i in range(rows)}
        self.blocks: dict[str, int] = {}
        self.step_id = 0

    def _take(self, count: int) -> list[int]:
        taken, self.pool = self.pool[:count], self.pool[count:]
        return taken

    def prefill(self) -> StepPlan:
        new = []
        for rid, length in self.lengths.items():
            blocks = -(-length // BLOCK_SIZE)
            self.blocks[rid] = blocks
            prompt = [(7 * len(new) + 3 * i) % 1000 + 10 for i in range(length)]
            new.append(NewRequest(rid, prompt, length, self._take(blocks), length, GREEDY))
            self.lengths[rid] = length + 1  # the token it samples
        self.step_id += 1
        return StepPlan(0, self.step_id, [], [], new)

    def decode(self, removed: list[str] = ()) -> StepPlan:
        for rid in removed:
            del self.lengths[rid]
        running = []
        for rid, length in self.lengths.items():
            need = -(-length // BLOCK_SIZE) - self.blocks[rid]  # position length - 1 computes
            self.blocks[rid] += need
            running.append(RunningUpdate(rid, self._take(need), 1))
            self.lengths[rid] = length + 1
        self.step_id += 1
        return StepPlan(0, self.step_id, list(removed), running, [])


def greedy_run(runner, rows: int, steps: int, drop_at: int | None = None) -> list[list[int]]:
    """Every step's sampled tokens: a prefill of `rows` requests, then `steps` decode steps
    (one request removed before step `drop_at`)."""
    schedule = Schedule(rows)
    out = [runner.execute(schedule.prefill()).token_ids]
    for step in range(steps):
        removed = ["r0"] if step == drop_at else []
        out.append(runner.execute(schedule.decode(removed)).token_ids)
    return out


def count_replays(runner) -> dict[int, int]:
    """Count each captured size's replays from now on."""
    counts: dict[int, int] = {}
    replay = runner.decode_graphs.replay

    def counted(size: int) -> torch.Tensor:
        counts[size] = counts.get(size, 0) + 1
        return replay(size)

    runner.decode_graphs.replay = counted
    return counts


def test_captured_sizes_are_nano_vllms_list_cut_at_max_num_seqs():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 32]
    assert graph_batch_sizes(256)[-2:] == [240, 256] and len(graph_batch_sizes(256)) == 20
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]  # max_num_seqs itself: every batch fits
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(1) == [1]


def test_a_batch_is_padded_to_the_next_captured_size():
    graphs = DecodeGraphs(None, [], None, graph_batch_sizes(64), record=False)
    padded = {rows: graphs.padded_size(rows) for rows in (1, 3, 5, 16, 17, 33, 64, 65)}
    assert padded == {1: 1, 3: 4, 5: 8, 16: 16, 17: 32, 33: 48, 64: 64, 65: None}


@pytest.mark.parametrize(
    "model, rows, padded",
    [("llama_dir", 3, 4), ("llama_dir", 5, 8), ("llama_dir", 17, 32), ("qwen3_dir", 5, 8)],
)
def test_padded_decode_graphs_give_the_plain_runners_greedy_tokens(request, model, rows, padded):
    model_dir = request.getfixturevalue(model)
    plain = runner_for(model_dir)
    assert plain.buffers is None  # the CPU's own path: host tensors, no graphs
    graphs = runner_for(model_dir)
    assert graphs.capture_decode_graphs(eager_replay=True) == graph_batch_sizes(64)
    replays = count_replays(graphs)
    with torch.inference_mode():
        expected = greedy_run(plain, rows, steps=24, drop_at=12)
        got = greedy_run(graphs, rows, steps=24, drop_at=12)
    assert got == expected
    # 12 decode steps of `rows`, then 12 of rows - 1 (the same graph, or the one below it)
    after = graphs.decode_graphs.padded_size(rows - 1)
    assert sum(replays.values()) == 24 and replays[padded] == (24 if after == padded else 12)
    # the prompts end short of a block's end: decoding grew every block table
    assert all(request.num_blocks >= 2 for request in graphs.requests.values())


def test_a_padded_step_stages_the_host_inputs_and_pads_harmlessly(llama_dir):
    runner = runner_for(llama_dir)
    runner.capture_decode_graphs(eager_replay=True)
    schedule = Schedule(3)
    with torch.inference_mode():
        runner.execute(schedule.prefill())
        plan = schedule.decode()
        scheduled = runner.apply(plan)
        inputs = runner.prepare(scheduled)
    assert inputs.decode_graph == 4
    host = flat_step(scheduled, runner.requests, runner.block_tables, BLOCK_SIZE)
    host = host.host_tensors(runner.block_tables)
    assert torch.equal(inputs.input_ids, host.input_ids)
    assert torch.equal(inputs.positions, host.positions)
    for name in ("slot_mapping", "seq_lens", "query_start_loc"):
        assert torch.equal(getattr(inputs.meta, name), getattr(host.meta, name)), name
    width = host.meta.block_tables.shape[1]  # the host gathers the step's width, graphs 128
    assert torch.equal(inputs.meta.block_tables[:, :width], host.meta.block_tables)
    assert not inputs.meta.block_tables[:, width:].any()
    buffers = runner.buffers
    assert buffers.graph_tables.shape[1] == 2048 // BLOCK_SIZE  # ceil(max_model_len / bs)
    # row 3 pads: token 0 at position 0, no cache slot, a context of 1, one query
    assert buffers.input_ids.device[3] == 0 and buffers.positions.device[3] == 0
    assert buffers.slot_mapping.device[3] == -1 and buffers.seq_lens.device[3] == 1
    assert buffers.query_start_loc.device[:5].tolist() == [0, 1, 2, 3, 4]


def test_a_padded_row_writes_nothing_to_the_kv_cache(llama_dir):
    runner = runner_for(llama_dir)
    runner.capture_decode_graphs(eager_replay=True)
    schedule = Schedule(3)
    with torch.inference_mode():
        runner.execute(schedule.prefill())
        plan = schedule.decode()
        slots = {r: runner.requests[r] for r in schedule.lengths}
        before = [k.clone() for k, _ in runner.kv_caches]
        runner.execute(plan)
    written = sorted(r.num_computed - 1 for r in slots.values())  # one position each
    assert len(written) == 3
    for (k, _), old in zip(runner.kv_caches, before):
        changed = (k != old).flatten(2).any(-1).nonzero().tolist()  # (block, offset) pairs
        assert len(changed) == 3  # the three real tokens' slots, none for the padded row


def test_prefill_and_mixed_steps_stay_eager(llama_dir):
    runner = runner_for(llama_dir)
    runner.capture_decode_graphs(eager_replay=True)
    schedule = Schedule(3)
    with torch.inference_mode():
        prefill = runner.prepare(runner.apply(schedule.prefill()))
        assert prefill.decode_graph is None
        runner.forget_all()
        runner.execute(schedule.prefill())
        mixed = schedule.decode()
        late = NewRequest("late", list(range(10, 30)), 20, [500, 501], 20, GREEDY)
        inputs = runner.prepare(runner.apply(msgspec.structs.replace(mixed, new=[late])))
    assert inputs.decode_graph is None and inputs.input_ids.shape[0] == 3 + 20


def test_no_graphs_with_enforce_eager_the_fast_path_or_a_cpu_device(llama_dir):
    eager = runner_for(llama_dir, enforce_eager=True)
    assert eager.capture_decode_graphs(eager_replay=True) == []
    assert eager.decode_graphs is None
    with torch.inference_mode():
        schedule = Schedule(3)
        eager.execute(schedule.prefill())
        assert eager.prepare(eager.apply(schedule.decode())).decode_graph is None
    assert runner_for(llama_dir).capture_decode_graphs() == []  # nothing to record on a CPU
    config = EngineConfig(model=str(llama_dir), device="cpu", torch_threads=1)
    fast = build_runner(msgspec.structs.replace(resolve_model(config), num_kv_blocks=64))
    if fast.fast_path is not None:
        assert fast.capture_decode_graphs(eager_replay=True) == []


def test_the_device_block_table_copies_only_the_rows_that_changed():
    tables = BlockTables(rows=4, columns=2)
    device = DeviceBlockTables(tables, min_width=8, device=torch.device("cpu"))
    a, b = tables.take_row(), tables.take_row()
    tables.write(a, 0, [7, 8, 9])
    tables.write(b, 0, [3])
    device.sync()
    assert device.table[:, :4].tolist() == [[7, 8, 9, 0], [3, 0, 0, 0], [0] * 4, [0] * 4]
    device.table[a, 7] = 99  # a row that does not change now is not copied again
    tables.write(b, 1, [4, 5])
    device.sync()
    assert device.table[a].tolist() == [7, 8, 9, 0, 0, 0, 0, 99]
    assert device.table[b].tolist() == [3, 4, 5, 0, 0, 0, 0, 0]
    tables.release(b, 3)
    c = tables.take_row()
    tables.write(c, 0, [6])
    device.sync()
    assert device.table[b].tolist() == ([6] if c == b else [0]) + [0] * 7
    rows = [tables.take_row() for _ in range(3)]  # past 4 rows: the tables grow and move
    tables.write(rows[-1], 0, list(range(1, 11)))  # past 8 columns too
    device.sync()
    assert device.table.shape == (8, 10)
    assert torch.equal(device.table, torch.from_numpy(tables.table))
    tables.clear()
    device.sync()
    assert not device.table.any()


def cuda_runner(model_dir, **settings):
    return runner_for(model_dir, device="cuda", **settings)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, padded", [(3, 4), (5, 8), (17, 32)])
def test_cuda_graphs_give_the_eager_cuda_runners_greedy_tokens(llama_dir, rows, padded):
    eager = cuda_runner(llama_dir, enforce_eager=True)
    assert eager.capture_decode_graphs() == []
    graphs = cuda_runner(llama_dir)
    assert graphs.capture_decode_graphs() == graph_batch_sizes(64)
    assert all(isinstance(g, torch.cuda.CUDAGraph) for g in graphs.decode_graphs.graphs.values())
    replays = count_replays(graphs)
    with torch.inference_mode():
        expected = greedy_run(eager, rows, steps=24, drop_at=12)
        got = greedy_run(graphs, rows, steps=24, drop_at=12)
    assert got == expected
    assert sum(replays.values()) == 24 and padded in replays


@pytest.mark.gpu
def test_a_cuda_graph_replay_matches_the_eager_forward_on_the_same_inputs(qwen3_dir):
    runner = cuda_runner(qwen3_dir)
    runner.capture_decode_graphs()
    schedule = Schedule(5)
    with torch.inference_mode():
        runner.execute(schedule.prefill())
        for _ in range(3):
            runner.execute(schedule.decode())
        with torch.cuda.stream(runner.compute_stream):  # the stream prepare orders for
            inputs = runner.prepare(runner.apply(schedule.decode()))
            assert inputs.decode_graph == 8
            replayed = runner.decode_graphs.replay(8)[:5].clone()
            eager = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
        torch.cuda.synchronize()
    torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_a_swap_out_and_back_between_graph_steps_keeps_the_tokens(llama_dir):
    """A request's blocks swapped out, overwritten on the device, swapped back in: the copy
    stream orders each swap after the compute stream's work and the forward after the swaps,
    so the graph steps after it give the tokens of a run without swaps."""
    out = {}
    for swapping in (False, True):
        runner = cuda_runner(llama_dir, num_cpu_blocks=64)
        runner.capture_decode_graphs()
        schedule = Schedule(3)
        with torch.inference_mode():
            tokens = [runner.execute(schedule.prefill()).token_ids]
            for step in range(12):
                plan = schedule.decode()
                if swapping and step == 6:
                    r0, r1 = runner.requests["r0"], runner.requests["r1"]
                    blocks = runner.block_tables.table[r1.row, : r1.num_blocks].tolist()
                    out_pairs = [(block, i) for i, block in enumerate(blocks)]
                    clobber = [(int(runner.block_tables.table[r0.row, 0]), blocks[0])]
                    runner.execute(StepPlan(0, 0, [], [], [], out_pairs, [], clobber))
                    plan = msgspec.structs.replace(plan, swap_in=[(i, b) for b, i in out_pairs])
                tokens.append(runner.execute(plan).token_ids)
        out[swapping] = tokens
    assert out[True] == out[False]
