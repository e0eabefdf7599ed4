"""What `actorserve serve --role ...` accepts, without starting anything: each replica's CurveZMQ
keys from the gateway's flags (gateway/replica_keys.py), and the flags each role refuses, every
error naming its flag."""

from __future__ import annotations

import pytest

from actorserve.actors.runtime.config import EngineConfig
from actorserve.actors.runtime.model_config import ModelFacts
from actorserve.cli import main as cli
from actorserve.cli.flags import given_values
from actorserve.cli.serve import check_role, gateway_settings, replica_config
from actorserve.gateway.curve_keys import ClientKeys, load_client_keys, load_server_public_key
from actorserve.gateway.curve_keys import write_keys as write_key_files
from actorserve.gateway.replica_keys import replica_keys
from actorserve.gateway.service import GatewaySettings

B, C = "tcp://10.0.0.2:5555", "tcp://10.0.0.3:5555"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("replica-keys")
    return {name: write_key_files(root / name) for name in ("a", "b", "c")}


def serve_args(*flags: str):
    return cli.build_parser().parse_args(["serve", "--model", "/ckpt", *flags])


def keys_of(*flags: str, insecure_loopback: bool = False) -> list[ClientKeys | None]:
    given = given_values(serve_args(*flags), GatewaySettings)
    made = GatewaySettings(model_id="m", model_dir="m", max_model_len=8, vocab_size=8, **given)
    return replica_keys(made, insecure_loopback)


def test_each_replica_gets_its_own_server_key_and_the_gateways_client_key(keys):
    server_keys = f"{keys['b']['server_public']},{keys['c']['server_public']}"
    client = keys["a"]["client_secret"]
    flags = ["--replicas", f"{B},{C}", "--replica-server-keys", server_keys]
    got = keys_of(*flags, "--curve-client-key", str(client))
    public, secret = load_client_keys(client)
    for key, name in zip(got, "bc", strict=True):
        assert key.server_public_key == load_server_public_key(keys[name]["server_public"]).decode()
        assert (key.client_public_key, key.client_secret_key) == (public.decode(), secret.decode())
        assert key.options()["client_keys"] == (public.decode(), secret.decode())


def test_one_server_key_is_every_replicas_and_no_client_key_is_a_fresh_pair(keys):
    got = keys_of(
        "--replicas", f"{B},{C}", "--replica-server-keys", str(keys["b"]["server_public"])
    )
    assert got[0] == got[1] and got[0].client_public_key is None
    assert got[0].options()["client_keys"] is None


def test_a_key_count_that_does_not_match_the_replicas_is_refused_naming_the_flag(keys):
    three = ",".join(str(keys[n]["server_public"]) for n in "abc")
    with pytest.raises(ValueError, match="--replica-server-keys names 3 key files for 2"):
        keys_of("--replicas", f"{B},{C}", "--replica-server-keys", three)


def test_a_missing_key_file_is_refused_naming_the_flag_and_the_file(keys, tmp_path):
    missing = tmp_path / "nowhere" / "server.key"
    with pytest.raises(ValueError, match=r"--replica-server-keys: cannot read .*nowhere"):
        keys_of("--replicas", B, "--replica-server-keys", str(missing))
    server = str(keys["b"]["server_public"])
    with pytest.raises(ValueError, match="--curve-client-key"):
        keys_of("--replicas", B, "--replica-server-keys", server, "--curve-client-key", server)


def test_tcp_without_keys_only_on_loopback_with_insecure_loopback(keys):
    with pytest.raises(ValueError, match="--replicas: refusing to reach tcp://10.0.0.2"):
        keys_of("--replicas", B, insecure_loopback=True)
    with pytest.raises(ValueError, match="--insecure-loopback true"):
        keys_of("--replicas", "tcp://127.0.0.2:5555")
    assert keys_of("--replicas", "tcp://127.0.0.2:5555", insecure_loopback=True) == [None]
    assert keys_of("--replicas", "ipc:///tmp/x/client.sock") == [None]


def test_key_flags_without_what_they_key_are_refused(keys):
    with pytest.raises(ValueError, match="--replica-server-keys needs --replicas"):
        keys_of("--replica-server-keys", str(keys["b"]["server_public"]))
    with pytest.raises(ValueError, match="--curve-client-key needs --replica-server-keys"):
        keys_of("--replicas", "ipc:///x", "--curve-client-key", str(keys["a"]["client_secret"]))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--role", "gateway"], "--role gateway needs --replicas"),
        (["--role", "gateway", "--replicas", B, "--address", B], "starts no engine"),
        (["--role", "engine", "--data-parallel-size", "2"], "start one per replica"),
        (["--role", "engine", "--replicas", B], "--role engine serves no HTTP"),
        (["--placement", "ray", "--role", "engine"], "--placement ray places the engine"),
        (["--placement", "ray", "--address", B], "Ray gives each its address"),
        (["--placement", "ray", "--replicas", B], "no --address or --replicas"),
    ],
)
def test_flags_a_role_does_not_run_are_refused_naming_them(flags, message):
    args = serve_args(*flags)
    with pytest.raises(ValueError, match=message):
        check_role(args.role, cli.engine_config(args), args.address, args)


def test_a_gateway_over_replicas_admits_as_many_requests_as_they_take_together():
    facts = ModelFacts(vocab_size=8, max_position_embeddings=64, eos_token_ids=[0])
    config = EngineConfig(model="/ckpt", max_model_len=64, facts=facts, max_live_requests=10)
    made = gateway_settings(serve_args("--replicas", f"{B},{C},ipc:///x"), config)
    assert made.max_concurrent_requests == 30


@pytest.mark.parametrize(
    ("device", "devices"),
    [
        ("cuda", ["cuda", "cuda:2", "cuda:4"]),
        ("cuda:1", ["cuda:1", "cuda:3", "cuda:5"]),
        ("cpu", ["cpu", "cpu", "cpu"]),
        ("auto", ["auto", "auto", "auto"]),
    ],
)
def test_data_parallel_replicas_on_cuda_take_disjoint_devices(device, devices):
    """Three replicas of two tensor-parallel ranks each: replica i's ranks start at B + 2i."""
    config = EngineConfig(
        model="/ckpt", device=device, tensor_parallel_size=2, data_parallel_size=3
    )
    assert [replica_config(config, i).device for i in range(3)] == devices
