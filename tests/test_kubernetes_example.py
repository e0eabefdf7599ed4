"""The Kubernetes example in docs/operations.md ("On Kubernetes") is one a user can apply: its
YAML parses; every `actorserve` command in it is one the real `actorserve serve` takes (each
flag in `serve --help`, each value of the flag's type); every file a flag names lies on one of
the container's mounts (a Secret's file among the keys the doc's `kubectl create secret`
commands give it); and the gateway's `--replicas` name each engine pod of the StatefulSet.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest

from actorserve.cli.main import build_parser

yaml = pytest.importorskip("yaml", reason="pyyaml is in the dev extra")

DOC = Path(__file__).resolve().parent.parent / "docs" / "operations.md"


def section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


@pytest.fixture(scope="module")
def kubernetes() -> str:
    return section("On Kubernetes")


@pytest.fixture(scope="module")
def manifests(kubernetes) -> list[dict]:
    blocks = re.findall(r"```yaml\n(.*?)```", kubernetes, re.S)
    assert blocks, "no ```yaml block in the Kubernetes section"
    return [doc for block in blocks for doc in yaml.safe_load_all(block) if doc]


@pytest.fixture(scope="module")
def secret_keys(kubernetes) -> dict[str, set[str]]:
    """The keys of each Secret the doc's `kubectl create secret generic` commands make."""
    commands = re.findall(
        r"kubectl create secret generic (\S+)((?:\s+(?:\\\n\s*)?--from-\w+=\S+)+)", kubernetes
    )
    return {name: set(re.findall(r"--from-\w+=([^=\s]+)", sources)) for name, sources in commands}


@pytest.fixture(scope="module")
def serve_flags() -> set[str]:
    out = subprocess.run(
        [sys.executable, "-m", "actorserve.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.stdout))


def workloads(manifests) -> list[dict]:
    return [m for m in manifests if m["kind"] in ("Deployment", "StatefulSet")]


def actorserve_containers(manifests):
    """(workload, container, argv after `actorserve`) for each container running actorserve."""
    for workload in workloads(manifests):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            command = [*container.get("command", []), *container.get("args", [])]
            if command and command[0] == "actorserve":
                yield workload, container, [str(arg) for arg in command[1:]]


def role(argv: list[str]) -> str:
    return argv[argv.index("--role") + 1] if "--role" in argv else "all"


def test_the_example_runs_engine_pods_and_one_gateway(manifests):
    by_role = {}
    for workload, _, argv in actorserve_containers(manifests):
        assert argv[0] == "serve"
        by_role.setdefault(role(argv), []).append(workload)
    assert set(by_role) == {"engine", "gateway"}
    [gateway] = by_role["gateway"]
    assert gateway["kind"] == "Deployment" and gateway["spec"]["replicas"] == 1
    services = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "Service"}
    selected = [s["spec"]["selector"] for s in services.values()]
    assert gateway["spec"]["template"]["metadata"]["labels"] in selected


def test_every_flag_is_one_actorserve_serve_takes(manifests, serve_flags):
    assert "--role" in serve_flags and "--replicas" in serve_flags  # the help was read
    parser = build_parser()
    for _, container, argv in actorserve_containers(manifests):
        flags = [arg for arg in argv if arg.startswith("--")]
        unknown = [flag for flag in flags if flag not in serve_flags]
        assert not unknown, f"{container['name']}: not flags of `actorserve serve`: {unknown}"
        args = parser.parse_args(argv)  # exits (SystemExit) on a value of the wrong type
        assert args.model == "/models/m"


def mounted(path: str, container: dict, volumes: dict, secret_keys: dict) -> bool:
    """Whether `path` is a file or folder the container's mounts provide."""
    for mount in container.get("volumeMounts", []):
        base = PurePosixPath(mount["mountPath"])
        target = PurePosixPath(path)
        if target != base and base not in target.parents:
            continue
        volume = volumes[mount["name"]]
        if "secret" not in volume:
            return True  # a disk: the checkpoint's folder
        secret = volume["secret"]
        keys = secret_keys.get(secret["secretName"], set())
        files = {item["path"]: item["key"] for item in secret.get("items", [])}
        files = files or {key: key for key in keys}
        relative = str(target.relative_to(base))
        if relative in files:
            return files[relative] in keys
        return any(name.startswith(relative + "/") for name in files)  # a folder of them
    return False


def test_every_file_a_flag_names_is_mounted_from_a_volume_or_secret(manifests, secret_keys):
    checked = 0
    for workload, container, argv in actorserve_containers(manifests):
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        for path in (arg for arg in argv if arg.startswith("/")):
            assert mounted(path, container, volumes, secret_keys), (container["name"], path)
            checked += 1
        for variable in container.get("env", []):
            ref = variable.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                assert ref["key"] in secret_keys.get(ref["name"], set()), variable
    assert checked >= 6  # the model twice, the engine's two key paths, the gateway's two


def test_the_gateway_routes_to_each_engine_pod_by_its_own_name(manifests):
    containers = list(actorserve_containers(manifests))
    [(engines, _, engine_argv)] = [c for c in containers if role(c[2]) == "engine"]
    [(_, _, gateway_argv)] = [c for c in containers if role(c[2]) == "gateway"]
    assert engines["kind"] == "StatefulSet"
    port = engine_argv[engine_argv.index("--address") + 1].rpartition(":")[2]
    name, service = engines["metadata"]["name"], engines["spec"]["serviceName"]
    expected = [f"tcp://{name}-{i}.{service}:{port}" for i in range(engines["spec"]["replicas"])]
    assert gateway_argv[gateway_argv.index("--replicas") + 1].split(",") == expected
    [headless] = [
        m for m in manifests if m["kind"] == "Service" and m["metadata"]["name"] == service
    ]
    assert headless["spec"]["clusterIP"] == "None"  # one DNS name per pod
