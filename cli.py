"""`actorserve` command line: serve, generate. The one module that wires supervisor and SDK.

actorserve serve --model DIR [--address tcp://127.0.0.1:PORT | ipc://PATH]
actorserve generate --model DIR --prompt "..." [--max-tokens N --temperature T --top-p P
                    --seed S] [--address ADDR to use a running engine]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time

from .actors.config import EngineConfig
from .actors.runtime import configure_logging
from .actors.supervisor import BackgroundSupervisor, Supervisor, SupervisorError
from .gateway.client import Client, EngineError
from .messages.common import SamplingParams

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


async def serve(config: EngineConfig, address: str | None) -> int:
    try:
        supervisor = Supervisor(config, address)
    except (ValueError, OSError) as exc:
        logging.getLogger("actorserve").error("cannot serve: %s", exc)
        return 1
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        await supervisor.start()
    except SupervisorError as exc:
        logging.getLogger("actorserve").error("cannot serve: %s", exc)
        return 1
    print(f"actorserve: serving {config.model} at {supervisor.client_address}", flush=True)
    waiter = asyncio.ensure_future(supervisor.wait())
    stopper = asyncio.ensure_future(stopping.wait())
    await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
    if waiter.done():
        stopper.cancel()
        try:
            waiter.result()
        except SupervisorError as exc:
            logging.getLogger("actorserve").error("engine stopped: %s", exc)
            return 1
        return 0
    await supervisor.stop("SIGTERM")
    waiter.cancel()
    return 0


def run_serve(args: argparse.Namespace) -> int:
    try:
        config = engine_config(args)
    except ValueError as exc:
        print(f"actorserve serve: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        return uvloop.run(serve(config, args.address))
    except ImportError:
        return asyncio.run(serve(config, args.address))


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

    args = parser.parse_args(argv)
    configure_logging()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
