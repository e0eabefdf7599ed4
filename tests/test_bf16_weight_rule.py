"""`dtype auto`'s measured rule for a bf16 checkpoint on a CPU without bf16 arithmetic
(actors/worker/dtypes.py, kernels/cpu/bf16_weight_rule.py): bf16-weight panels (quantization
bf16) where they are faster than fp32 panels at every decode row count timed, else the fp32
upcast as before, the choice logged with the times; nothing is timed where the CPU has bf16
arithmetic, on CUDA, or where the settings could not run quantization bf16. Timings are
injected: what is checked is the decision, never a speed."""

from __future__ import annotations

import pytest
import torch

from actorserve.actors.runtime.config import EngineConfig
from actorserve.actors.runtime.config_resolution import resolve_model
from actorserve.actors.worker import dtypes
from actorserve.actors.worker.worker import build_runner
from actorserve.kernels.cpu import bf16_weight_rule, bindings
from actorserve.kernels.cpu.bf16_weight_rule import (
    DECODE_ROWS,
    MAX_WEIGHT_BYTES,
    PanelTimes,
    bf16_weights_win,
    timed_shape,
)
from actorserve.kernels.cpu.panels import PackedLinear
from actorserve.weights.checkpoints import ensure_checkpoint
from model_support import torch_threads

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
MS = 1e-3
NARROW_WINS = PanelTimes(
    DECODE_ROWS, (2.0 * MS, 2.2 * MS, 3.0 * MS), (1.1 * MS, 1.3 * MS, 2.5 * MS)
)
NARROW_LOSES_AT_16 = PanelTimes(
    DECODE_ROWS, (2.0 * MS, 2.2 * MS, 3.0 * MS), (1.1 * MS, 1.3 * MS, 3.4 * MS)
)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


class Timer:
    """An injected measurement: gives `times` and counts its calls."""

    def __init__(self, times: PanelTimes | None):
        self.times, self.calls = times, 0

    def __call__(self, *args) -> PanelTimes | None:
        self.calls += 1
        return self.times


def test_bf16_weights_win_only_where_faster_at_every_decode_row_count():
    assert DECODE_ROWS == (1, 4, 16)
    assert bf16_weights_win(NARROW_WINS)
    assert not bf16_weights_win(NARROW_LOSES_AT_16)  # faster in total, slower at 16 rows
    tie = PanelTimes(DECODE_ROWS, (1 * MS, 2 * MS, 3 * MS), (1 * MS, 2 * MS, 3 * MS))
    assert not bf16_weights_win(tie)
    slower = PanelTimes(DECODE_ROWS, (1 * MS,) * 3, (2 * MS,) * 3)
    assert not bf16_weights_win(slower)


def test_the_times_are_described_per_row_count_in_ms():
    assert NARROW_WINS.describe() == (
        "1 row: fp32 2.00 ms, bf16 weights 1.10 ms; 4 rows: fp32 2.20 ms, bf16 weights 1.30 ms; "
        "16 rows: fp32 3.00 ms, bf16 weights 2.50 ms"
    )


def test_the_timed_weight_is_the_largest_projection_capped_in_bytes():
    assert timed_shape(512, 64) == (512, 64)
    rows, cols = timed_shape(28672, 4096)  # an 8B model's gate_up: 470 MB in fp32
    assert cols == 4096 and rows * cols * 4 <= MAX_WEIGHT_BYTES < (rows + 1) * cols * 4


def test_measure_times_both_formats_at_each_row_count():
    """Only that it runs and reports each row count: no assertion on which is faster."""
    lib = bindings.load()
    assert lib is not None
    times = bf16_weight_rule.measure(lib, (200, 96), huge=False)
    assert times.rows == DECODE_ROWS
    assert len(times.fp32_s) == len(times.bf16_weights_s) == len(DECODE_ROWS)
    assert all(t > 0 for t in times.fp32_s + times.bf16_weights_s)


def _config(**settings) -> EngineConfig:
    return EngineConfig(model="m", **settings)


def test_auto_picks_bf16_weights_on_a_cpu_without_bf16_where_they_win(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_bf16_feature", lambda: None)
    timer = Timer(NARROW_WINS)
    choice = dtypes.auto_quantization(_config(), "bfloat16", CPU, timer)
    assert choice.quantization == "bf16" and timer.calls == 1
    assert "faster than fp32 panels at every decode row count" in choice.reason
    assert NARROW_WINS.describe() in choice.reason  # the log says why, with the times
    timer = Timer(NARROW_LOSES_AT_16)
    choice = dtypes.auto_quantization(_config(), "bfloat16", CPU, timer)
    assert choice.quantization == "none" and timer.calls == 1
    assert "not faster" in choice.reason and NARROW_LOSES_AT_16.describe() in choice.reason
    choice = dtypes.auto_quantization(_config(), "bfloat16", CPU, Timer(None))  # no C kernels
    assert choice == ("none", None)


@pytest.mark.parametrize(
    "checkpoint, device, settings, feature",
    [
        ("bfloat16", CPU, {}, "avx512_bf16"),  # bf16 arithmetic: native bf16 stays
        ("bfloat16", CPU, {}, "amx_bf16"),
        ("bfloat16", CUDA, {}, None),
        ("float32", CPU, {}, None),  # an fp32 checkpoint stays fp32
        ("float16", CPU, {}, None),
        (None, CPU, {}, None),
        ("bfloat16", CPU, dict(dtype="float32"), None),  # an explicit dtype is as asked
        ("bfloat16", CPU, dict(quantization="int8"), None),
        ("bfloat16", CPU, dict(cpu_fast_path=False), None),
        ("bfloat16", CPU, dict(tensor_parallel_size=2), None),
    ],
)
def test_nothing_is_timed_and_nothing_changes_elsewhere(
    monkeypatch, checkpoint, device, settings, feature
):
    monkeypatch.setattr(dtypes, "cpu_bf16_feature", lambda: feature)
    timer = Timer(NARROW_WINS)
    config = _config(**settings)
    choice = dtypes.auto_quantization(config, checkpoint, device, timer)
    assert choice == (config.quantization, None) and timer.calls == 0


def _runner(monkeypatch, times: PanelTimes, caplog):
    """build_runner for the bf16 demo checkpoint with dtype auto on a CPU reported as lacking
    bf16 arithmetic, the measurement injected."""
    monkeypatch.setattr(dtypes, "cpu_bf16_feature", lambda: None)
    timer = Timer(times)
    monkeypatch.setattr(bf16_weight_rule, "measure_model", timer)
    config = EngineConfig(model=str(ensure_checkpoint("demo-bf16")), num_kv_blocks=8)
    with caplog.at_level("INFO"):
        runner = build_runner(resolve_model(config))
    assert timer.calls == 1
    return runner


def _projections(runner) -> list[PackedLinear]:
    return [
        p
        for layer in runner.model.model.layers
        for p in (layer.self_attn.qkv_proj, layer.mlp.down_proj)
    ]


def test_a_worker_on_a_cpu_without_bf16_takes_bf16_weights_where_they_win(monkeypatch, caplog):
    runner = _runner(monkeypatch, NARROW_WINS, caplog)
    assert runner.model.lm_head_weight().dtype == torch.float32  # fp32 activations
    assert runner.fast_path.serves_decode_stack
    assert all(p.panel.bf16_weights and p.weight is None for p in _projections(runner))
    assert "quantization bf16 (auto: the bf16 checkpoint's weights in bf16-weight panels" in (
        caplog.text
    )
    assert NARROW_WINS.describe() in caplog.text


def test_a_worker_on_a_cpu_without_bf16_keeps_fp32_panels_where_bf16_weights_lose(
    monkeypatch, caplog
):
    runner = _runner(monkeypatch, NARROW_LOSES_AT_16, caplog)
    assert runner.model.lm_head_weight().dtype == torch.float32
    projections = _projections(runner)
    assert all(not p.panel.only_copy and p.weight.dtype == torch.float32 for p in projections)
    assert "quantization none (auto: fp32 panels" in caplog.text
