"""A restart costs what the process must load, not its imports (DESIGN.md, Recovery): the
Engine and the gateway run without torch and transformers, and the Worker builds its model
without torch._dynamo.

Two views: the processes of a real `actorserve serve`, after a chat, a streamed completion and
a scored prompt went through them (what their address space maps: torch's libraries, numpy's and
safetensors' extensions, both of which transformers imports); and a subprocess that runs the
same code paths and reads sys.modules.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from gateway_support import AUTH, SHARED_FLAGS, GatewayServer, call

# shared libraries that torch, and transformers (numpy, safetensors), load
HEAVY_LIBRARIES = ("libtorch", "libc10", "_multiarray_umath", "_safetensors_rust")


@pytest.fixture(scope="module")
def gateway(llama_dir):
    """A gateway of its own: the session's shared one may have checked a structured-output
    request, whose first check imports xgrammar (and with it torch) into the Engine."""
    server = GatewayServer(llama_dir, *SHARED_FLAGS)
    yield server
    server.stop()


def mapped_heavy_libraries(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {lib for line in f for lib in HEAVY_LIBRARIES if lib in line}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/maps")
def test_the_engine_and_gateway_processes_load_neither_torch_nor_transformers(gateway):
    model = gateway.model_name
    chat = {"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "héllo"}]}
    assert call(gateway, "POST", "/v1/chat/completions", chat, AUTH).status == 200
    scored = {"model": model, "prompt": "def f(x):", "max_tokens": 0, "echo": True, "logprobs": 2}
    assert call(gateway, "POST", "/v1/completions", scored, AUTH).status == 200
    streamed = {"model": model, "prompt": "import os", "max_tokens": 4, "stream": True}
    assert call(gateway, "POST", "/v1/completions", streamed, AUTH).status == 200
    pids = {actor.name: actor.pid for actor in gateway.client.health().actors}
    assert mapped_heavy_libraries(pids["worker"]) >= {"libtorch"}  # the probe sees them
    assert mapped_heavy_libraries(pids["engine"]) == set()
    assert mapped_heavy_libraries(pids["gateway"]) == set()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/maps")
def test_serve_without_placement_ray_loads_no_ray(gateway):
    """Ray is the `--placement ray` extra's: a server that does not place on Ray never loads it
    (its core library, _raylet, is what `import ray` maps)."""
    pids = [gateway.proc.pid, *(actor.pid for actor in gateway.client.health().actors)]
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            assert not any("_raylet" in line for line in f), pid


ENGINE_AND_GATEWAY_PATHS = """
import json, sys
from actorserve.actors.engine.engine import Engine  # noqa: F401  the Engine's module
from actorserve.actors.engine.live_request import journal_entries
from actorserve.actors.runtime.tokenizer import Tokenizer
from actorserve.gateway.chat_template import ChatTemplate
from actorserve.gateway.openai_logprobs import TokenNames
from actorserve.gateway.process import GatewaySpec  # noqa: F401  the gateway's process module
from actorserve.messages.client import GenerateRequest
from actorserve.messages.common import SamplingParams

model = sys.argv[1]
tokenizer = Tokenizer.from_dir(model)  # Engine.setup
longest = max(len(t) for t in tokenizer.get_vocab())
request = GenerateRequest("r", prompt="def main():", params=SamplingParams(max_tokens=4))
ids = tokenizer.encode(request.prompt)
[live] = journal_entries(b"client", request, ids, tokenizer, "client")  # admission: the detokenizer
live.detokenizer.add(tokenizer.encode(" return 1", add_special_tokens=False))
chat = ChatTemplate(model)  # the gateway's HTTPGateway.prepare
chat_ids = chat.prompt_ids([{"role": "system", "content": "x"}, {"role": "user", "content": "y"}])
TokenNames(chat.tokenizer)(chat_ids[-1])  # logprobs' token names
chat.tokenizer.decode(chat_ids)  # a scored prompt's text
print(json.dumps({name: name in sys.modules for name in ("torch", "transformers", "numpy")}))
"""


def test_what_the_engine_and_gateway_run_imports_neither_torch_nor_transformers(llama_dir):
    out = subprocess.run(
        [sys.executable, "-c", ENGINE_AND_GATEWAY_PATHS, str(llama_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"torch": False, "transformers": False, "numpy": False}


SERVE_PATHS = """
import sys
from actorserve.cli.main import build_parser
from actorserve.cli.serve import plan

args = build_parser().parse_args(["serve", "--model", sys.argv[1], "--placement", "local"])
print("ray" in sys.modules)
"""


def test_the_serve_command_without_placement_ray_imports_no_ray(llama_dir):
    out = subprocess.run(
        [sys.executable, "-c", SERVE_PATHS, str(llama_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


WORKER_LOAD_PATH = """
import json, sys
import torch
from actorserve.actors.worker.loader import load_model
from actorserve.kernels import attention_ops

model, _ = load_model(sys.argv[1], "cpu", torch.float32, attention_ops("cpu", "reference"))
head = model.model.embed_tokens.weight
with open("/proc/self/maps") as f:
    mapped = [line.split() for line in f if line.rstrip().endswith("model.safetensors")]
spans = [[int(x, 16) for x in line[0].split("-")] for line in mapped]
pointer = head.untyped_storage().data_ptr()
print(json.dumps({
    "dynamo": "torch._dynamo" in sys.modules,
    "embedding_mapped_from_file": any(lo <= pointer < hi for lo, hi in spans),
}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_worker_loads_its_model_without_dynamo_and_maps_the_weights(llama_dir):
    """Building the model on the meta device imports no torch._dynamo (torch's Python reference
    kernels would), and a tensor stored in the model's dtype stays a view of the memory-mapped
    safetensors file (no copy, no read until used)."""
    code = textwrap.dedent(WORKER_LOAD_PATH)
    out = subprocess.run(
        [sys.executable, "-c", code, str(llama_dir)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"dynamo": False, "embedding_mapped_from_file": True}
