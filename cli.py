"""`actorserve` command line: serve, generate. The one module that wires supervisor and SDK.

actorserve serve --model DIR [--address tcp://127.0.0.1:PORT | ipc://PATH]
actorserve generate --model DIR --prompt "..." [--max-tokens N --temperature T --top-p P
                    --seed S] [--address ADDR to use a running engine]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

from .actors.config import EngineConfig
from .actors.runtime import configure_logging
from .actors.supervisor import BackgroundSupervisor, Supervisor, SupervisorError
from .gateway.client import Client, EngineError
from .messages.common import SamplingParams


def _flag(value: str) -> bool:
    """An on/off flag's value: 1/true/yes/on or 0/false/no/off, anything else an error."""
    word = value.lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


ENGINE_FLAGS = [  # (flag, EngineConfig field, type)
    ("--block-size", "block_size", int),
    ("--num-kv-blocks", "num_kv_blocks", int),
    ("--kv-cache-memory-gb", "kv_cache_memory_gb", float),
    ("--max-num-seqs", "max_num_seqs", int),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int),
    ("--max-model-len", "max_model_len", int),
    ("--max-live-requests", "max_live_requests", int),
    ("--device", "device", str),
    ("--dtype", "dtype", str),
    ("--attention-backend", "attention_backend", str),
    ("--torch-threads", "torch_threads", int),
    ("--heartbeat-interval-s", "heartbeat_interval_s", float),
    ("--ready-timeout-s", "ready_timeout_s", float),
    ("--max-restarts", "max_restarts", int),
    ("--restart-window-s", "restart_window_s", float),
    ("--drain-timeout-s", "drain_timeout_s", float),
    ("--enable-prefix-caching", "enable_prefix_caching", _flag),
    ("--async-scheduling", "async_scheduling", _flag),
    ("--final-only-flush-s", "final_only_flush_s", float),
    ("--preemption-mode", "preemption_mode", str),
    ("--preemption-victim", "preemption_victim", str),
    ("--num-cpu-blocks", "num_cpu_blocks", int),
]


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="Hugging Face checkpoint directory")
    group = parser.add_argument_group("engine")
    for flag, field, kind in ENGINE_FLAGS:
        group.add_argument(flag, dest=field, type=kind, default=None)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    if not args.model:
        raise ValueError("--model DIR is required to start an engine")
    given = {
        field: getattr(args, field)
        for _, field, _ in ENGINE_FLAGS
        if getattr(args, field) is not None
    }
    return EngineConfig(model=args.model, **given)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )


# -- serve ------------------------------------------------------------------------------------


async def serve(
    config: EngineConfig, address: str | None, http: argparse.Namespace | None = None
) -> int:
    """Run the engine (and, with `http`, the gateway on it) until SIGTERM/SIGINT; the exit code.

    SIGTERM: the gateway answers 503 to new requests, the engine drains those in flight (up to
    drain_timeout_s), the gateway closes its connections, the actors stop; exit 0.
    """
    try:
        supervisor = Supervisor(config, address)
    except (ValueError, OSError) as exc:
        logging.getLogger("actorserve").error("cannot serve: %s", exc)
        return 1
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    gateway = None
    if http is not None:
        from .gateway.server import HTTPGateway  # FastAPI and uvicorn: only `serve` needs them

        settings = gateway_settings(http, supervisor.config)
        gateway = HTTPGateway(supervisor.client_address, settings, http.host, http.port)
        try:
            gateway.prepare()  # binds now; loads the tokenizer while the actors start
        except OSError as exc:
            log = logging.getLogger("actorserve")
            log.error("cannot serve HTTP on %s port %s: %s", http.host, http.port, exc)
            await supervisor.stop("the gateway could not start")
            return 1
    try:
        await supervisor.start()
    except SupervisorError as exc:
        logging.getLogger("actorserve").error("cannot serve: %s", exc)
        return 1
    print(f"actorserve: serving {config.model} at {supervisor.client_address}", flush=True)
    if gateway is not None:
        try:
            url = await gateway.start()
        except Exception as exc:
            logging.getLogger("actorserve").exception("cannot start the gateway: %s", exc)
            await supervisor.stop("the gateway could not start")
            return 1
        print(f"actorserve: {url}", flush=True)
    waiter = asyncio.ensure_future(supervisor.wait())
    stopper = asyncio.ensure_future(stopping.wait())
    watched = [waiter, stopper] + ([gateway.task] if gateway else [])
    await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
    if gateway is not None and not stopper.done() and not waiter.done():
        logging.getLogger("actorserve").error("the HTTP gateway stopped; stopping the engine")
        await gateway.stop(0)
        await supervisor.stop("the gateway stopped")
        return 1
    if waiter.done():
        stopper.cancel()
        if gateway is not None:
            await gateway.stop(0)
        try:
            waiter.result()
        except SupervisorError as exc:
            logging.getLogger("actorserve").error("engine stopped: %s", exc)
            return 1
        return 0
    if gateway is not None:
        gateway.refuse_new()
    await supervisor.drain()
    if gateway is not None:
        await gateway.stop()
    await supervisor.stop("SIGTERM")
    waiter.cancel()
    return 0


def gateway_settings(args: argparse.Namespace, config: EngineConfig):
    """The gateway's limits from the flags and the resolved engine config."""
    from .gateway.service import GatewaySettings

    return GatewaySettings(
        model_id=config.model,
        model_dir=config.model,
        max_model_len=config.max_model_len,
        vocab_size=config.facts.vocab_size,
        api_key=args.api_key or None,
        max_concurrent_requests=args.max_concurrent_requests or config.max_live_requests,
        max_body_bytes=args.max_body_bytes,
    )


def run_serve(args: argparse.Namespace) -> int:
    try:
        config = engine_config(args)
    except ValueError as exc:
        print(f"actorserve serve: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        return uvloop.run(serve(config, args.address, args))
    except ImportError:
        return asyncio.run(serve(config, args.address, args))


# -- generate ---------------------------------------------------------------------------------


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    stack = None
    address = args.address
    try:
        if address is None:
            stack = BackgroundSupervisor(engine_config(args))
            address = stack.start()
        with Client(address, timeout_s=args.timeout_s) as client:
            started = time.perf_counter()
            first = None
            last = None
            for last in client.generate(args.prompt, params):
                first = first or time.perf_counter()
                sys.stdout.write(last.text)
                sys.stdout.flush()
            elapsed = time.perf_counter() - started
        sys.stdout.write("\n")
        n = last.completion_tokens if last else 0
        rate = (n - 1) / (elapsed - (first - started)) if n > 1 and first else 0.0
        print(
            f"[{n} tokens in {elapsed:.2f} s, first after {(first or started) - started:.3f} s, "
            f"{rate:.1f} tokens/s after it; finish: "
            f"{last.finish_reason.value if last and last.finish_reason else '-'}]",
            file=sys.stderr,
        )
        return 0
    except (SupervisorError, EngineError, ValueError) as exc:
        print(f"actorserve generate: {exc}", file=sys.stderr)
        return 1
    finally:
        if stack is not None:
            stack.stop()


def run_status(args: argparse.Namespace) -> int:
    """Print each actor's name, PID, state, restarts, heartbeat age and the messages it could not
    handle, and the engine's stats."""
    try:
        with Client(args.address) as client:
            health = client.health(timeout_s=args.timeout_s)
    except EngineError as exc:
        print(f"actorserve status: {exc}", file=sys.stderr)
        return 1
    print(
        f"{'actor':<14}{'pid':>8}  {'state':<11}{'restarts':>9}{'heartbeat age':>15}{'errors':>8}"
    )
    for actor in health.actors:
        print(
            f"{actor.name:<14}{actor.pid:>8}  {actor.state:<11}{actor.restarts:>9}"
            f"{actor.heartbeat_age_s:>14.2f}s{actor.errors:>8}"
        )
    s = health.stats
    print(
        f"requests: {s.num_running} running, {s.num_waiting} waiting; preemptions "
        f"{s.num_preemptions}; KV blocks {s.blocks_used}/{s.blocks_total} used"
    )
    return 0 if health.ok else 1


BENCHMARKS = (
    "throughput",
    "serving",
    "overhead",
    "step",
    "prefix",
    "preemption",
    "kernels",
    "chaos",
)


def run_bench(args: argparse.Namespace) -> int:
    """Run scripts/bench_NAME.py (or scripts/chaos.py) from the source tree with the rest of
    the arguments: `actorserve bench throughput --json out.json`, as `python PATH ...` would."""
    import runpy
    from pathlib import Path

    scripts = Path(__file__).resolve().parent / "scripts"
    path = scripts / ("chaos.py" if args.name == "chaos" else f"bench_{args.name}.py")
    if not path.is_file():
        print(
            f"actorserve bench: {path} not found (benchmarks run from a source checkout)",
            file=sys.stderr,
        )
        return 2
    sys.argv = [str(path), *args.rest]
    runpy.run_path(str(path), run_name="__main__")  # the script's sys.exit(main()) ends it
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="actorserve", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("serve", help="run the engine in the foreground for SDK clients")
    add_engine_flags(p)
    p.add_argument(
        "--address",
        default=None,
        help="client address (tcp://HOST:PORT or ipc://PATH); default ipc:// in the run directory",
    )
    web = p.add_argument_group("gateway (HTTP + WebSocket)")
    web.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    web.add_argument("--port", type=int, default=8000, help="HTTP port; 0 picks a free one")
    web.add_argument(
        "--api-key",
        default=os.environ.get("ACTORSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $ACTORSERVE_API_KEY)",
    )
    web.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        help="answer 429 over this many requests in flight (default: max_live_requests)",
    )
    web.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 * 1024 * 1024,
        help="largest request body accepted (default 8 MiB)",
    )
    p.set_defaults(func=run_serve)

    p = commands.add_parser("generate", help="stream one completion to stdout")
    add_engine_flags(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--address", default=None, help="use an engine already serving there")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.set_defaults(func=run_generate)

    p = commands.add_parser("bench", help="run a benchmark script (see scripts/)")
    p.add_argument("name", choices=BENCHMARKS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.set_defaults(func=run_bench)

    p = commands.add_parser("status", help="list the actors of a running engine")
    p.add_argument("--address", required=True)
    p.add_argument("--timeout-s", type=float, default=5.0)
    p.set_defaults(func=run_status)

    args = parser.parse_args(argv)
    configure_logging()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
