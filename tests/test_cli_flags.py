"""The CLI's flags are EngineConfig's and GatewaySettings' fields: each user setting is a flag with
the field's help, a flag's value lands in its field, and a bad value is refused naming it."""

from __future__ import annotations

import re

import msgspec
import msgspec.inspect as mi
import pytest

from actorserve.actors.runtime.config import EngineConfig
from actorserve.actors.runtime.model_config import ModelFacts
from actorserve.cli import main as cli
from actorserve.cli.flags import NOT_A_FLAG, as_flags, flag_specs, given_values
from actorserve.cli.serve import gateway_settings
from actorserve.gateway.service import GatewaySettings


def fields_of(struct: type[msgspec.Struct]) -> dict[str, mi.Metadata]:
    return {f.name: f.type for f in mi.type_info(struct).fields}


def serve_help(capsys) -> str:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def serve_args(*flags: str):
    return cli.build_parser().parse_args(["serve", "--model", "/ckpt", *flags])


@pytest.mark.parametrize("struct", [EngineConfig, GatewaySettings])
def test_every_field_says_what_it_is(struct):
    for name, kind in fields_of(struct).items():
        assert isinstance(kind, mi.Metadata), f"{struct.__name__}.{name} has no Meta"
        assert kind.extra_json_schema.get("description"), f"{struct.__name__}.{name}: no help"


def test_the_settings_that_are_not_flags_are_the_resolved_ones():
    resolved = {n for n, k in fields_of(EngineConfig).items() if k.extra == NOT_A_FLAG}
    assert resolved == {"epoch", "curve_gateway_key", "addresses", "facts"}
    resolved = {n for n, k in fields_of(GatewaySettings).items() if k.extra == NOT_A_FLAG}
    assert resolved == {
        "model_id",
        "model_dir",
        "max_model_len",
        "vocab_size",
        "block_size",
        "send_timeout_s",
        "max_client_requests",
        "max_client_output_tokens",
    }


@pytest.mark.parametrize("struct", [EngineConfig, GatewaySettings])
def test_every_user_setting_is_in_serve_help_with_its_help(struct, capsys):
    text = serve_help(capsys)
    specs = flag_specs(struct)
    assert {s.field for s in specs} == {
        n for n, k in fields_of(struct).items() if k.extra != NOT_A_FLAG
    }
    for spec in specs:
        description = fields_of(struct)[spec.field].extra_json_schema["description"]
        assert re.search(re.escape(spec.flag) + r"\b", text), spec.flag
        assert " ".join(description.split()) in text, spec.field


def test_flags_round_trip_into_the_engine_config():
    args = serve_args(
        "--block-size=32",
        "--kv-cache-memory-gb=0.5",
        "--cpu-fast-path=false",
        "--greedy-head-screen=int8",
        "--transparent-huge-pages=off",
        "--step-trace=/tmp/trace",
        "--preemption-mode=swap",
        "--dtype=bfloat16",
        "--seed=7",
    )
    config = cli.engine_config(args)
    given = dict(
        block_size=32,
        kv_cache_memory_gb=0.5,
        cpu_fast_path=False,
        greedy_head_screen="int8",
        transparent_huge_pages=False,
        step_trace="/tmp/trace",
        preemption_mode="swap",
        dtype="bfloat16",
        seed=7,
    )
    assert config == EngineConfig(model="/ckpt", **given)
    assert cli.engine_config(serve_args()) == EngineConfig(model="/ckpt")  # defaults: the struct's


def test_generate_keeps_its_own_seed():
    args = cli.build_parser().parse_args(
        ["generate", "--model", "/ckpt", "--prompt", "hi", "--seed", "3"]
    )
    assert args.seed == 3
    assert cli.engine_config(args, cli.GENERATE_OWN).seed == EngineConfig(model="/ckpt").seed


def test_gateway_flags_round_trip_into_its_settings(monkeypatch):
    monkeypatch.delenv("ACTORSERVE_API_KEY", raising=False)
    config = msgspec.structs.replace(
        EngineConfig(model="/ckpt", max_live_requests=77, max_model_len=128),
        facts=ModelFacts(vocab_size=1000, max_position_embeddings=128, eos_token_ids=[2]),
    )
    args = serve_args(
        "--allowed-origins", "https://a.example, https://b.example", "--keep-alive-s=2"
    )
    settings = gateway_settings(args, config)
    assert settings.allowed_origins == ["https://a.example", "https://b.example"]
    assert settings.keep_alive_s == 2.0
    assert settings.max_concurrent_requests == 77  # unset: the engine's max_live_requests
    assert settings.api_key == []
    monkeypatch.setenv("ACTORSERVE_API_KEY", "k")
    assert gateway_settings(serve_args(), config).api_key == ["k"]
    assert gateway_settings(serve_args("--api-key", "a,b"), config).api_key == ["a", "b"]


def test_the_gateway_takes_the_engines_limits_on_one_client():
    config = msgspec.structs.replace(
        EngineConfig(model="/ckpt", max_live_requests=77, max_model_len=128),
        facts=ModelFacts(vocab_size=1000, max_position_embeddings=128, eos_token_ids=[2]),
    )
    settings = gateway_settings(serve_args(), config)
    assert settings.max_client_requests == 38  # unset: half of max_live_requests
    assert settings.max_client_output_tokens is None
    flags = ("--max-client-requests", "5", "--max-client-output-tokens", "900")
    config = msgspec.structs.replace(cli.engine_config(serve_args(*flags)), facts=config.facts)
    settings = gateway_settings(serve_args(*flags), config)
    assert (settings.max_client_requests, settings.max_client_output_tokens) == (5, 900)


def test_one_send_timeout_holds_for_every_door():
    """--send-timeout-s: the Engine's, for SDK clients, and the gateway's, for HTTP and
    WebSocket ones."""
    args = serve_args("--send-timeout-s", "2.5")
    config = msgspec.structs.replace(
        cli.engine_config(args),
        facts=ModelFacts(vocab_size=1000, max_position_embeddings=128, eos_token_ids=[2]),
    )
    assert config.send_timeout_s == 2.5
    assert gateway_settings(args, config).send_timeout_s == 2.5
    with pytest.raises(ValueError, match="send_timeout_s must be > 0"):
        EngineConfig(model="/ckpt", send_timeout_s=0).validate()


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--block-size", "x"),
        ("--kv-cache-memory-gb", "lots"),
        ("--cpu-fast-path", "maybe"),
        ("--preemption-mode", "evict"),
        ("--greedy-head-screen", "fp8"),
    ],
)
def test_a_value_of_the_wrong_kind_is_refused_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exit:
        serve_args(flag, value)
    assert exit.value.code == 2
    assert flag in capsys.readouterr().err


def test_a_value_out_of_range_is_refused_naming_the_field(capfd):
    assert cli.main(["serve", "--model", "/nonexistent", "--block-size", "7"]) == 1
    assert "block_size must be one of 8, 16, 32, 64, got 7" in capfd.readouterr().err
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_num_seqs"):
        EngineConfig(model="/ckpt", max_num_seqs=8, max_num_batched_tokens=4).validate()


@pytest.mark.parametrize(
    "flag, value, error",
    [
        ("--max-connections", "0", "max_connections must be >= 1, got 0"),
        ("--read-timeout-s", "-1", "read_timeout_s must be > 0, got -1.0"),
        ("--route-kv-high", "1.5", "route_kv_high must be in (0, 1], got 1.5"),
        ("--max-body-bytes", "10", "max_body_bytes must be >= 1024, got 10"),
    ],
)
def test_a_gateway_setting_out_of_range_is_refused_naming_the_field(
    flag, value, error, demo_dir, capfd
):
    """Before anything starts: the server exits 1 with the field and the limit."""
    assert cli.main(["serve", "--model", str(demo_dir), "--port", "0", flag, value]) == 1
    assert error in capfd.readouterr().err


def test_as_flags_gives_back_the_command_line_of_the_values_given():
    """What a placement hands each replica's `serve --role engine` (cli/ray_placement.py): the
    values the user gave, as flags that parse to the same values."""
    flags = ["--block-size", "32", "--enable-prefix-caching", "false", "--kv-cache-memory-gb"]
    given = given_values(serve_args(*flags, "0.5", "--seed", "7"), EngineConfig)
    again = given_values(cli.build_parser().parse_args(["serve", *as_flags(given)]), EngineConfig)
    assert again == given == {
        "model": "/ckpt", "block_size": 32, "kv_cache_memory_gb": 0.5,
        "enable_prefix_caching": False, "seed": 7,
    }  # fmt: skip
