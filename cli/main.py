"""`actorserve` command line: serve, generate. The one module that wires supervisor and SDK.

actorserve serve --model DIR [--address tcp://127.0.0.1:PORT | ipc://PATH]
                 [--role all | engine | gateway --replicas ADDR,...]
actorserve generate --model DIR --prompt "..." [--max-tokens N --temperature T --top-p P
                    --seed S] [--address ADDR to use a running engine]
actorserve keys DIR   CurveZMQ key pairs for serving on tcp:// (--curve-server-key ...)
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

from ..actors.runtime.actor import configure_logging
from ..actors.runtime.config import EngineConfig
from ..actors.runtime.curve import with_own_client
from ..actors.supervisor.background import BackgroundSupervisor
from ..actors.supervisor.supervisor import SupervisorError
from ..gateway.blocking_client import Client
from ..gateway.curve_keys import client_options, write_keys
from ..gateway.errors import EngineError
from ..gateway.service import GatewaySettings
from ..messages.common import SamplingParams
from .flags import add_flags, given_values

ROLES = ("all", "engine", "gateway")  # what `serve` runs (serve.plan decides what each starts)
# `generate`'s --seed is its request's sampling seed, not the engine's
GENERATE_OWN = frozenset({"seed"})


def add_engine_flags(parser: argparse.ArgumentParser, exclude: frozenset[str] = frozenset()):
    """One flag per user setting of EngineConfig (cli/flags.py), `--model` among them."""
    add_flags(parser.add_argument_group("engine (EngineConfig)"), EngineConfig, exclude)


def engine_config(args: argparse.Namespace, exclude: frozenset[str] = frozenset()) -> EngineConfig:
    if not args.model:
        raise ValueError("--model DIR is required to start an engine")
    return EngineConfig(**given_values(args, EngineConfig, exclude))


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )


def run_serve(args: argparse.Namespace) -> int:
    try:
        config = engine_config(args)
    except ValueError as exc:
        print(f"actorserve serve: {exc}", file=sys.stderr)
        return 2
    if config.placement == "ray":  # ray is imported only where it places
        from .ray_serve import serve_on_ray

        serving = serve_on_ray(config, args.address, args, args.role)
    else:
        from .serve import serve  # the gateway's imports (FastAPI) only where it serves

        serving = serve(config, args.address, args, args.role)
    try:
        import uvloop

        return uvloop.run(serving)
    except ImportError:
        return asyncio.run(serving)


# -- generate ---------------------------------------------------------------------------------


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    stack = None
    address = args.address
    try:
        if address is None:
            config, options = with_own_client(engine_config(args, GENERATE_OWN))
            stack = BackgroundSupervisor(config)
            address = stack.start()
        else:
            options = client_options(args.curve_server_public_key, args.curve_client_key)
        with Client(address, timeout_s=args.timeout_s, **options) as client:
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
    except (SupervisorError, EngineError, ValueError, OSError) as exc:
        print(f"actorserve generate: {exc}", file=sys.stderr)
        return 1
    finally:
        if stack is not None:
            stack.stop()


def run_status(args: argparse.Namespace) -> int:
    """Print each actor's name, PID, state and how long it has been in it, restarts, heartbeat
    age, the messages it could not handle and how its last process ended, and the engine's
    stats. Exit 1 unless every actor is ready (a restart in progress, no answer)."""
    try:
        options = client_options(args.curve_server_public_key, args.curve_client_key)
        with Client(args.address, **options) as client:
            health = client.health(timeout_s=args.timeout_s)
    except (EngineError, ValueError, OSError) as exc:
        print(f"actorserve status: {exc}", file=sys.stderr)
        return 1
    print(
        f"{'actor':<14}{'pid':>8}  {'state':<11}{'for':>9}{'restarts':>9}{'heartbeat age':>15}"
        f"  {'last exit':<20}{'errors':>6}"
    )
    for actor in health.actors:
        print(
            f"{actor.name:<14}{actor.pid:>8}  {actor.state:<11}{actor.state_age_s:>8.2f}s"
            f"{actor.restarts:>9}{actor.heartbeat_age_s:>14.2f}s  "
            f"{exit_description(actor.exit_code):<20}{actor.errors:>6}"
        )
    s = health.stats
    print(
        f"requests: {s.num_running} running, {s.num_waiting} waiting; preemptions "
        f"{s.num_preemptions}; KV blocks {s.blocks_used}/{s.blocks_total} used"
    )
    return 0 if health.ok else 1


def exit_description(code: int | None) -> str:
    """A process's exit as `Popen.returncode` gives it: "-", "code 70", "signal 9 (SIGKILL)"."""
    if code is None:
        return "-"
    if code >= 0:
        return f"code {code}"
    try:
        return f"signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"signal {-code}"


def add_client_key_flags(parser: argparse.ArgumentParser) -> None:
    """The SDK's CurveZMQ keys, for an engine serving on tcp:// with --curve-server-key."""
    group = parser.add_argument_group("CurveZMQ (an --address served with keys)")
    group.add_argument(
        "--curve-server-public-key", default=None, help="the engine's server.key (public)"
    )
    group.add_argument(
        "--curve-client-key",
        default=None,
        help="this client's .key_secret (needed when the engine has authorized clients)",
    )


def run_keys(args: argparse.Namespace) -> int:
    """Write a server and a client key pair, and say which flag takes which file."""
    try:
        paths = write_keys(args.dir)
    except (OSError, ValueError) as exc:
        print(f"actorserve keys: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote CurveZMQ keys to {args.dir} (files 0600)\n"
        f"  serve:   --curve-server-key {paths['server_secret']} "
        f"--curve-authorized-clients {paths['authorized_client'].parent}\n"
        f"  clients: --curve-server-public-key {paths['server_public']} "
        f"--curve-client-key {paths['client_secret']}\n"
        f"  (SDK: Client(address, **curve_keys.client_options(server.key, client.key_secret)))"
    )
    return 0


BENCHMARKS = (
    "throughput",
    "serving",
    "overhead",
    "step",
    "prefix",
    "preemption",
    "kernels",
    "chaos",
    "dp_routing",
)


def run_bench(args: argparse.Namespace) -> int:
    """Run scripts/bench_NAME.py (or scripts/chaos.py) from the source tree with the rest of
    the arguments: `actorserve bench throughput --json out.json`, as `python PATH ...` would."""
    import runpy
    from pathlib import Path

    scripts = Path(__file__).resolve().parent.parent / "scripts"
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="actorserve", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("serve", help="run the engine in the foreground for SDK clients")
    p.add_argument(
        "--role",
        choices=ROLES,
        default="all",
        help="all: the engine and the HTTP gateway; engine: the engine only (a replica for "
        "gateways elsewhere); gateway: HTTP only, routing across --replicas (default: all)",
    )
    add_engine_flags(p)
    p.add_argument(
        "--address",
        default=None,
        help="client address (tcp://HOST:PORT or ipc://PATH); default ipc:// in the run directory",
    )
    web = p.add_argument_group("gateway (HTTP + WebSocket)")
    web.add_argument("--host", default="127.0.0.1", help="HTTP address (default: 127.0.0.1)")
    web.add_argument(
        "--port", type=int, default=8000, help="HTTP port; 0 picks a free one (default: 8000)"
    )
    add_flags(web, GatewaySettings)
    p.set_defaults(func=run_serve)

    p = commands.add_parser("generate", help="stream one completion to stdout")
    add_engine_flags(p, GENERATE_OWN)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--address", default=None, help="use an engine already serving there")
    p.add_argument("--timeout-s", type=float, default=300.0)
    add_client_key_flags(p)
    p.set_defaults(func=run_generate)

    p = commands.add_parser("bench", help="run a benchmark script (see scripts/)")
    p.add_argument("name", choices=BENCHMARKS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.set_defaults(func=run_bench)

    p = commands.add_parser("status", help="list the actors of a running engine")
    p.add_argument("--address", required=True)
    p.add_argument("--timeout-s", type=float, default=5.0)
    add_client_key_flags(p)
    p.set_defaults(func=run_status)

    p = commands.add_parser("keys", help="write CurveZMQ key pairs for serving on tcp://")
    p.add_argument("dir", help="directory for the key files (made 0700 if new)")
    p.set_defaults(func=run_keys)

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
