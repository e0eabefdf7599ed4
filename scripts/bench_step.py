"""The Worker's decode step alone, op by op: what the model costs with no other actor around.

    python scripts/bench_step.py [--model demo] [--num-requests 64] [--steps 30] [--json PATH]

Builds the Worker's own runner in this process (its build_runner: model, KV cache,
ModelRunner; no other actor, no message), prefills `--num-requests` prompts of the throughput
workload's lengths, then times `--steps` decode steps of all of them at once. Each op is timed by
wrapping its call in time.perf_counter (the C kernels are opaque to torch's profiler): decode
attention, the LM head (with greedy sampling fused in, kernels/cpu/csrc/cpu_panel_gemm.c, where
it serves), the projection GEMMs, the fused norms, RoPE, SiLU x up, store_kv, input preparation,
sampling (where not fused); "rest" is the step less all of them (embedding, Python between ops,
bookkeeping). That breakdown needs the model's layer-by-layer path; as served, the CPU fast path
runs a step of decodes through the whole decoder in one C call (kernels/cpu/csrc/
cpu_decode_stack.c, the same kernels), so the step is then timed both ways, alternating blocks of
steps, in the "served" table.

The LM head and greedy sampling are then timed both ways on the same hidden states: fused, and
as the GEMM (`compute_logits`) followed by the argmax over the logits (`argmax_rows`). The
projections run on their packed panels (kernels/cpu/panels.py), as served; with
`--mkl-projections` on MKL instead, for comparison; with `--quantization int8` or `bf16`
(EngineConfig.quantization) on int8 or bf16-weight panels, as served with that setting.

Decode attention reads every context's K/V once a layer, so it is also reported as bytes a step
and the bandwidth they imply, next to a plain read of as many bytes from memory (not in cache),
measured in the same run. The served step is compared with its memory floor: the weights (in the
model's dtype, the projections' in their quantized one: a byte a weight for int8, two for bf16)
and the step's K/V read once at that speed.
Compare the step with bench_overhead.py's step period: the difference is what the other actors'
CPU and the messages cost on this machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402


class OpTimer:
    """Seconds spent in each named op, summed over the calls made while timing is on."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - start
            return out

        return timed


def instrument(runner, timer: OpTimer) -> None:
    """Wrap the model's ops, the LM head's greedy pick and the runner's phases (this process)."""
    model = runner.model
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qk_norm_rope = timer.wrap("q/k norm + RoPE", attn.qk_norm_rope)
        mlp.silu_mul = timer.wrap("SiLU x up", mlp.silu_mul)
        attn.ops = attn.ops._replace(
            store_kv=timer.wrap("store_kv", attn.ops.store_kv),
            paged_attention=timer.wrap("decode attention", attn.ops.paged_attention),
        )
        for name, linear in (
            ("qkv_proj", attn.qkv_proj),
            ("o_proj", attn.o_proj),
            ("gate_up_proj", mlp.gate_up_proj),
            ("down_proj", mlp.down_proj),
        ):
            linear.forward = timer.wrap(f"GEMM {name}", linear.forward)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.forward = timer.wrap("RMSNorm (+ residual)", norm.forward)
    model.model.norm.forward = timer.wrap("RMSNorm (+ residual)", model.model.norm.forward)
    step = runner.step_sampler  # the step's LM head and sampler (step_sampling.py)
    step.compute_logits = timer.wrap("lm_head", step.compute_logits)
    step.greedy_tokens = timer.wrap("lm_head + greedy argmax (as served)", step.greedy_tokens)
    step.sampler.sample = timer.wrap("sampling", step.sampler.sample)
    runner.prepare = timer.wrap("input preparation", runner.prepare)


def build(model_dir: Path, prompts: list[list[int]], decode_steps: int, quantization: str):
    """The Worker's own runner (actors/worker/worker.py build_runner), on the CPU, with a KV
    cache that holds every prompt plus its decode steps and EngineConfig.quantization
    `quantization` -> (runner, blocks per prompt)."""
    import msgspec

    from actorserve.actors.runtime.config import EngineConfig
    from actorserve.actors.runtime.config_resolution import resolve_model
    from actorserve.actors.worker.worker import build_runner

    config = EngineConfig(model=str(model_dir), device="cpu", quantization=quantization)
    config = resolve_model(config)
    bs = config.block_size
    blocks = [(len(p) + decode_steps + 1 + bs - 1) // bs for p in prompts]
    config = msgspec.structs.replace(config, num_kv_blocks=sum(blocks), num_cpu_blocks=0)
    runner = build_runner(config)
    if runner.fast_path is None:
        raise SystemExit("bench_step: the CPU fast path does not serve here (no C compiler?)")
    return runner, blocks


def use_decode_stack(runner, on: bool) -> None:
    """Steps of decodes through the fast path's decode stack (as served) or layer by layer."""
    fast = runner.fast_path
    if on:
        fast.__dict__.pop("forward", None)
    else:
        fast.forward = lambda *args: None  # the model serves every step


def projections_on_mkl(model) -> None:
    """Each packed projection back to a plain Linear over the same weight (F.linear: MKL)."""
    from torch import nn

    from actorserve.kernels.cpu.panels import PackedLinear

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, PackedLinear):
                    shape = (child.in_features, child.out_features)
                    plain = nn.Linear(*shape, bias=False, device="meta")
                    plain.weight = child.weight
                    setattr(parent, name, plain)


def prefill(runner, prompts: list[list[int]], blocks: list[int], budget: int) -> list[str]:
    """Every prompt computed (and its first token sampled), in steps of at most `budget` tokens."""
    from actorserve.messages.common import SamplingParams
    from actorserve.messages.step import NewRequest, StepPlan

    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    rids, batch, tokens, first_block, step_id = [], [], 0, 0, 0
    for i, (prompt, n) in enumerate(zip(prompts, blocks)):
        if batch and tokens + len(prompt) > budget:
            step_id += 1
            runner.execute(StepPlan(0, step_id, [], [], batch))
            batch, tokens = [], 0
        rid = f"req-{i}"
        block_ids = list(range(first_block, first_block + n))
        batch.append(NewRequest(rid, prompt, len(prompt), block_ids, len(prompt), params))
        rids.append(rid)
        tokens += len(prompt)
        first_block += n
    runner.execute(StepPlan(0, step_id + 1, [], [], batch))
    return rids


def served_both_ways(runner, rids: list[str], warmup: int, steps: int) -> list[dict]:
    """Mean ms of a decode step of every request through the decode stack (one C call, as
    served, where it serves) and layer by layer, in alternating blocks of up to 5 steps (the
    contexts grow as they go)."""
    from actorserve.messages.step import RunningUpdate, StepPlan

    ways = {"layer by layer": False, "decode stack (one C call, served)": True}
    if not runner.fast_path.serves_decode_stack:
        ways.popitem()
    seconds = dict.fromkeys(ways, 0.0)
    size = max(1, min(5, steps))
    blocks = max(1, steps // size)
    step_id = 10_000
    for block in range(-1, blocks):
        for name, way in ways.items():
            use_decode_stack(runner, way)
            for _ in range(size if block >= 0 else warmup):
                step_id += 1
                plan = StepPlan(0, step_id, [], [RunningUpdate(rid, [], 1) for rid in rids], [])
                start = time.perf_counter()
                runner.execute(plan)
                if block >= 0:
                    seconds[name] += time.perf_counter() - start
    use_decode_stack(runner, True)
    timed = blocks * size
    layered = seconds["layer by layer"]
    return [
        {"table": "served", "way": name, "ms": s / timed * 1e3, "speedup": layered / s}
        for name, s in seconds.items()
    ]


def head_both_ways(runner, rows: int, repeat: int) -> list[dict]:
    """Mean ms of the LM head and greedy sampling over `rows` hidden states: behind the int8
    screen (served where the CPU has AMX), behind the bf16 screen (served where it has bf16
    arithmetic but no AMX), the fused fp32 head alone (a bf16 model: the fused bf16 head), and
    unfused; each where this machine has it, alternated so that all see the same machine. Every
    way must give the unfused way's tokens (random hidden states: no ties)."""
    import torch

    from actorserve.kernels.cpu.attention import argmax_rows
    from actorserve.kernels.cpu.screened_head import ScreenedGreedyHead
    from actorserve.kernels.cpu.screened_head_int8 import Int8ScreenedHead

    model, compute_logits = runner.model, runner.compute_logits
    weight = model.lm_head_weight()
    hidden = torch.randn(rows, model.config.hidden_size, dtype=weight.dtype)
    served = runner.fast_path.greedy_head
    exact = getattr(served, "exact", served)
    ways = {}
    if exact is not None and weight.dtype == torch.float32:
        screens = {
            "int8 screen + exact fp32 (screened_head_int8.py)": Int8ScreenedHead,
            "bf16 screen + exact fp32 (screened_head.py)": ScreenedGreedyHead,
        }
        for name, screen in screens.items():
            head = served if isinstance(served, screen) else screen.for_weight(weight, exact)
            if head is not None:
                ways[name] = head
        ways["fused fp32 (cpu_panel_gemm.c)"] = exact
    elif exact is not None:
        ways["fused bf16 (cpu_panel_gemm_bf16.c)"] = exact
    ways["GEMM + argmax_rows"] = lambda h: argmax_rows(compute_logits(h))
    tokens = ways["GEMM + argmax_rows"](hidden)
    for name, way in ways.items():
        if not torch.equal(way(hidden), tokens):
            raise SystemExit(f"{name}: not the unfused head's tokens")
    seconds = dict.fromkeys(ways, 0.0)
    for _ in range(repeat):
        for name, way in ways.items():
            start = time.perf_counter()
            way(hidden)
            seconds[name] += time.perf_counter() - start
    unfused = seconds["GEMM + argmax_rows"]
    return [
        {"table": "head", "way": name, "rows": rows, "ms": s / repeat * 1e3, "speedup": unfused / s}
        for name, s in seconds.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_step", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="checkpoint kind or directory")
    parser.add_argument("--num-requests", type=int, default=64, help="the batch (default 64)")
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mkl-projections",
        action="store_true",
        help="the projections on MKL (F.linear) instead of their packed panels, to compare",
    )
    parser.add_argument(
        "--quantization",
        choices=("none", "int8", "bf16"),
        default="none",
        help="EngineConfig.quantization: the projections in int8 or bf16-weight panels",
    )
    bc.add_common_flags(parser)
    args = parser.parse_args(argv)

    import torch

    threads = args.threads or bc.default_threads()
    torch.set_num_threads(threads)
    model_dir = bc.resolve_model(args.model)
    shape = bc.ModelShape.read(model_dir)
    vocab = shape.vocab
    workload = bc.make_workload(
        args.num_requests, args.seed, (16, args.max_prompt_len), (1, 1), vocab
    )
    prompts = [r.prompt_ids for r in workload]
    runner, blocks = build(model_dir, prompts, 3 * (args.warmup + args.steps), args.quantization)
    if args.mkl_projections:
        projections_on_mkl(runner.model)
    timer = OpTimer()
    instrument(runner, timer)

    from actorserve.messages.step import RunningUpdate, StepPlan

    with torch.inference_mode():
        rids = prefill(runner, prompts, blocks, runner.config.max_num_batched_tokens)
        use_decode_stack(runner, False)  # the ops one by one, for the timer
        kv_bytes_per_token = sum(k[0, 0].nbytes + v[0, 0].nbytes for k, v in runner.kv.layers)
        step_times, kv_bytes = [], []
        for i in range(args.warmup + args.steps):
            timer.on = i >= args.warmup
            contexts = sum(len(runner.requests[rid].token_ids) for rid in rids)
            plan = StepPlan(0, 1000 + i, [], [RunningUpdate(rid, [], 1) for rid in rids], [])
            start = time.perf_counter()
            runner.execute(plan)
            if timer.on:
                step_times.append(time.perf_counter() - start)
                kv_bytes.append(contexts * kv_bytes_per_token)

    step = statistics.fmean(step_times)
    rows = [
        {"table": "step", "op": name, "ms": s / args.steps * 1e3, "share": s / args.steps / step}
        for name, s in sorted(timer.seconds.items(), key=lambda kv: -kv[1])
    ]
    rest = step - sum(timer.seconds.values()) / args.steps
    rows.append({"table": "step", "op": "rest (embedding, Python between ops)", "ms": rest * 1e3,
                 "share": rest / step})  # fmt: skip
    rows.append({"table": "step", "op": f"step ({args.num_requests} decodes)", "ms": step * 1e3,
                 "share": 1.0, "p50_ms": bc.percentile(step_times, 50) * 1e3})  # fmt: skip
    timer.on = False
    with torch.inference_mode():
        served_rows = served_both_ways(runner, rids, args.warmup, args.steps)
        head_rows = head_both_ways(runner, args.num_requests, args.steps)
    attention_s = timer.seconds["decode attention"] / args.steps
    mean_kv = statistics.fmean(kv_bytes)
    read_gb_s = bc.streaming_read_gb_s(int(mean_kv))
    kv_row = {
        "table": "kv",
        "kv_mb_per_step": mean_kv / 1e6,
        "attention_gb_s": mean_kv / attention_s / 1e9,
        "streaming_read_gb_s": read_gb_s,
    }
    # The memory floor of a decode step: its weights (projections and LM head, in the model's
    # dtype) and its K/V, each read once at the measured read speed.
    dtype_bytes = runner.model.lm_head_weight().element_size()
    projection_bytes = {"int8": 1, "bf16": 2}.get(args.quantization, dtype_bytes)
    weight_bytes = projection_bytes * shape.layer_matmul_params + dtype_bytes * shape.lm_head_params
    floor_ms = (weight_bytes + mean_kv) / (read_gb_s * 1e9) * 1e3
    for row in served_rows:
        row["floor_ms"], row["x_floor"] = floor_ms, row["ms"] / floor_ms
    label = bc.model_label(args.model)
    title = (
        f"The Worker's decode step alone, {label}, {args.num_requests} requests (mean of "
        f"{args.steps} steps after {args.warmup}; p50 step {rows[-1]['p50_ms']:.2f} ms):"
    )
    ms = bc.Column("ms", "ms", "{:.2f}")
    tables = [
        (rows, [bc.Column("op", "op"), bc.Column("ms", "ms / step", "{:.2f}"),
                bc.Column("share", "share of step", "{:.1%}")], title),
        ([kv_row], [bc.Column("kv_mb_per_step", "K/V read a step (MB)", "{:.1f}"),
                    bc.Column("attention_gb_s", "decode attention GB/s", "{:.1f}"),
                    bc.Column("streaming_read_gb_s", "reading as many bytes from memory, GB/s",
                              "{:.1f}")], ""),
        (served_rows, [bc.Column("way", "decode step"), ms,
                       bc.Column("speedup", "x layer by layer", "{:.2f}"),
                       bc.Column("floor_ms", "memory floor ms", "{:.2f}"),
                       bc.Column("x_floor", "x floor", "{:.2f}")], ""),
        (head_rows, [bc.Column("way", "LM head + greedy sampling"), bc.Column("rows", "rows"), ms,
                     bc.Column("speedup", "x unfused", "{:.2f}")], ""),
    ]  # fmt: skip
    for table_rows, columns, table_title in tables:
        print()
        print(bc.format_table(table_rows, columns, title=table_title))
    print(f"\nMachine: {bc.machine_line(threads)}.")
    bc.write_json(args.json, rows + [kv_row] + served_rows + head_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
