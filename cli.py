"""`actorserve` command line: serve, generate. The one module that wires supervisor and SDK.

actorserve serve --model DIR [--address tcp://127.0.0.1:PORT | ipc://PATH]
actorserve generate --model DIR --prompt "..." [--max-tokens N --temperature T --top-p P
                    --seed S] [--address ADDR to use a running engine]
actorserve keys DIR   CurveZMQ key pairs for serving on tcp:// (--curve-server-key ...)
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
from .actors.curve import with_own_client
from .actors.runtime import configure_logging
from .actors.supervisor import BackgroundSupervisor, Supervisor, SupervisorError
from .gateway.client import Client, EngineError
from .gateway.curve_keys import client_options, write_keys
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
    ("--max-client-message-bytes", "max_client_message_bytes", int),
    ("--max-request-output-tokens", "max_request_output_tokens", int),
    ("--max-logprob-entries", "max_logprob_entries", int),
    ("--priority-min", "priority_min", int),
    ("--priority-max", "priority_max", int),
    ("--poison-crashes", "poison_crashes", int),
    ("--client-lease-s", "client_lease_s", float),
    ("--client-queue-messages", "client_queue_messages", int),
    ("--fault-crash-on-token-id", "fault_crash_on_token_id", int),
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
    ("--curve-server-key", "curve_server_key", str),
    ("--curve-authorized-clients", "curve_authorized_clients", str),
    ("--insecure-loopback", "insecure_loopback", _flag),
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

    The gateway is a supervised process of its own (gateway_process.py), serving on a socket
    bound here, so a restarted gateway serves on the same port. SIGTERM: the gateway answers
    503 to new requests, the engine drains those in flight (up to drain_timeout_s), the
    gateway closes its connections, the actors stop; exit 0.
    """
    log = logging.getLogger("actorserve")
    try:
        config, own_client = with_own_client(config)  # the gateway's key, for a CURVE engine
        supervisor = Supervisor(config, address)
    except (ValueError, OSError) as exc:
        log.error("cannot serve: %s", exc)
        return 1
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    url = listening = None
    if http is not None:
        try:
            url, listening = supervise_gateway(supervisor, http, own_client)
        except OSError as exc:
            log.error("cannot serve HTTP on %s port %s: %s", http.host, http.port, exc)
            await supervisor.stop("the gateway could not start")
            return 1
    try:
        await supervisor.start()
    except SupervisorError as exc:
        log.error("cannot serve: %s", exc)
        return 1
    print(f"actorserve: serving {config.model} at {supervisor.client_address}", flush=True)
    if url is not None:
        print(f"actorserve: {url}", flush=True)
    waiter = asyncio.ensure_future(supervisor.wait())
    stopper = asyncio.ensure_future(stopping.wait())
    await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
    if waiter.done():
        stopper.cancel()
        try:
            waiter.result()
        except SupervisorError as exc:
            log.error("engine stopped: %s", exc)
            return 1
        return 0
    await supervisor.drain()
    await supervisor.stop("SIGTERM")
    waiter.cancel()
    if listening is not None:
        listening.close()
    return 0


def supervise_gateway(supervisor: Supervisor, http: argparse.Namespace, client: dict):
    """Bind the HTTP port (OSError if taken) and have the supervisor run the gateway on it;
    (its URL, the listening socket: keep it open while serving). The spec, with the SDK's keys,
    goes in a 0600 file in the private run directory, not on a command line anyone may read."""
    import msgspec

    from .actors.supervisor import Child
    from .gateway.server import bind
    from .gateway_process import NAME, GatewaySpec

    sock = bind(http.host, http.port)
    port = sock.getsockname()[1]
    spec = GatewaySpec(
        config=supervisor.config,
        settings=gateway_settings(http, supervisor.config),
        listen_fd=sock.fileno(),
        host=http.host,
        port=port,
        client_options={k: _z85_text(v) for k, v in client.items()},
    )
    path = os.path.join(supervisor.config.addresses.run_dir, "gateway.json")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(msgspec.json.encode(spec))
    supervisor.supervise(Child(NAME, "actorserve.gateway_process", [path], (sock.fileno(),)))
    host = f"[{http.host}]" if ":" in http.host else http.host
    return f"http://{host}:{port}", sock


def _z85_text(value):
    """A key (or key pair) as JSON text."""
    if isinstance(value, tuple | list):
        return [_z85_text(v) for v in value]
    return value.decode() if isinstance(value, bytes) else value


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
        max_connections=args.max_connections,
        keep_alive_s=args.keep_alive_s,
        read_timeout_s=args.read_timeout_s,
        max_header_bytes=args.max_header_bytes,
        send_timeout_s=args.send_timeout_s,
        max_requests_per_socket=args.max_requests_per_socket,
        health_timeout_s=args.health_timeout_s,
        health_interval_s=args.health_interval_s,
        allowed_origins=[o.strip() for o in args.allowed_origins.split(",") if o.strip()],
        allowed_hosts=[h.strip() for h in args.allowed_hosts.split(",") if h.strip()],
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
            config, options = with_own_client(engine_config(args))
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
    """Print each actor's name, PID, state, restarts, heartbeat age and the messages it could not
    handle, and the engine's stats."""
    try:
        options = client_options(args.curve_server_public_key, args.curve_client_key)
        with Client(args.address, **options) as client:
            health = client.health(timeout_s=args.timeout_s)
    except (EngineError, ValueError, OSError) as exc:
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
        help="largest request body accepted, and WebSocket message (default 8 MiB)",
    )
    web.add_argument(
        "--max-connections",
        type=int,
        default=2048,
        help="open HTTP + WebSocket connections; one more gets 503 (default 2048)",
    )
    web.add_argument(
        "--keep-alive-s",
        type=float,
        default=5.0,
        help="close an idle keep-alive connection after this (default 5)",
    )
    web.add_argument(
        "--read-timeout-s",
        type=float,
        default=30.0,
        help="a request's head, then its body, must arrive within this; else 408 (default 30)",
    )
    web.add_argument(
        "--max-header-bytes",
        type=int,
        default=16 * 1024,
        help="longest request line + headers; over it, 431 (default 16 KiB)",
    )
    web.add_argument(
        "--send-timeout-s",
        type=float,
        default=30.0,
        help="drop a connection that takes none of our output for this long, aborting its "
        "requests (default 30)",
    )
    web.add_argument(
        "--max-requests-per-socket",
        type=int,
        default=64,
        help="live requests on one WebSocket; a generate over it gets an error frame (default 64)",
    )
    web.add_argument(
        "--health-timeout-s",
        type=float,
        default=10.0,
        help="how long /health and /ready wait for the engine (default 10)",
    )
    web.add_argument(
        "--health-interval-s",
        type=float,
        default=5.0,
        help="/health and /ready ask the engine at most once per interval (default 5)",
    )
    web.add_argument(
        "--allowed-origins",
        default="",
        help="comma-separated browser origins allowed besides the server's own pages (CORS, "
        "WebSocket handshakes); '*': any (default: the server's own only)",
    )
    web.add_argument(
        "--allowed-hosts",
        default="",
        help="comma-separated Host names accepted ('*.example.com': subdomains); set it on a "
        "private address against DNS rebinding (default: any)",
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

    args = parser.parse_args(argv)
    configure_logging()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
