"""lm-evaluation-harness, unchanged, against the server (issue 24, test 4): its `local-completions`
model runs a loglikelihood task and a generate_until task from a local file (tests/lm_eval_task/,
no download), and what it records equals transformers (fp32) on the same checkpoint; with
`--batch_size 8` (a list of prompts per request, issue 36) it records the same as with 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gateway_support import API_KEY, GatewayServer, call

from support import hf_greedy, hf_model, tokenizer

pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra")

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASKS = ("actorserve_tiny_mc", "actorserve_tiny_gen")
ATOL_PER_TOKEN = 1e-4
BATCH = 8


@pytest.fixture(scope="module")
def gateway(llama_dir):
    """Its own server: a batch of BATCH prompts is BATCH requests in flight, over the shared
    gateway's max_concurrent_requests."""
    server = GatewayServer(
        llama_dir,
        "--api-key", API_KEY,
        "--max-model-len", "512",
        "--max-concurrent-requests", str(2 * BATCH),
        "--max-batch-prompts", str(BATCH),
    )  # fmt: skip
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def batch_one(gateway, llama_dir, tmp_path_factory) -> dict[str, list[dict]]:
    return run_lm_eval(gateway, llama_dir, tmp_path_factory.mktemp("batch1"), 1)


def model_args(gateway, llama_dir) -> str:
    return ",".join(
        [
            f"model={gateway.model_name}",
            f"base_url={gateway.url}/v1/completions",
            f"tokenizer={llama_dir}",
            "tokenizer_backend=huggingface",
            "num_concurrent=1",
            "max_retries=1",
        ]
    )


def run_lm_eval(gateway, llama_dir, output: Path, batch_size: int) -> dict[str, list[dict]]:
    """`lm_eval --model local-completions ...` as a user runs it; its logged samples by task."""
    command = [
        sys.executable, "-m", "lm_eval",
        "--model", "local-completions",
        "--model_args", model_args(gateway, llama_dir),
        "--tasks", ",".join(TASKS),
        "--include_path", str(TASK_DIR),
        "--output_path", str(output),
        "--batch_size", str(batch_size),
        "--log_samples",
    ]  # fmt: skip
    env = {
        **os.environ,
        "OPENAI_API_KEY": API_KEY,  # local-completions sends it as the bearer token
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    done = subprocess.run(
        command, cwd=TASK_DIR, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    samples = {}
    for task in TASKS:
        [path] = output.rglob(f"samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return samples


def transformers_loglikelihood(model_dir, context: list[int], continuation: list[int]):
    """(sum of the continuation's logprobs given the context, whether each token is greedy)."""
    ids = context + continuation
    with torch.inference_mode():
        logits = hf_model(model_dir)(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    rows = logprobs[len(context) - 1 : len(ids) - 1]
    picked = rows[torch.arange(len(continuation)), torch.tensor(continuation)]
    greedy = bool((rows.argmax(-1) == torch.tensor(continuation)).all())
    return picked.sum().item(), greedy


@pytest.mark.slow
def test_lm_eval_scores_and_generates_as_transformers_does(llama_dir, gateway, batch_one):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    samples = batch_one
    # lm-eval's own tokenization of each (context, continuation) pair: what it sent
    lm = LocalCompletionsAPI(
        base_url=f"{gateway.url}/v1/completions",
        model=gateway.model_name,
        tokenizer=str(llama_dir),
        tokenizer_backend="huggingface",
    )

    scored = samples["actorserve_tiny_mc"]
    assert len(scored) == 5
    for sample in scored:
        for args, [[loglikelihood, is_greedy]] in zip(
            sample["arguments"].values(), sample["resps"]
        ):
            context, continuation = lm._encode_pair(args["arg_0"], args["arg_1"])
            expected, greedy = transformers_loglikelihood(llama_dir, context, continuation)
            tolerance = ATOL_PER_TOKEN * len(continuation)
            assert float(loglikelihood) == pytest.approx(expected, abs=tolerance), args
            assert (is_greedy == "True") == greedy

    generated = samples["actorserve_tiny_gen"]
    assert len(generated) == 5
    tok = tokenizer(llama_dir)
    for sample in generated:
        context = sample["arguments"]["gen_args_0"]["arg_0"]
        ids = lm.tok_encode(context)
        expected = tok.decode(hf_greedy(llama_dir, ids, 8), skip_special_tokens=True)
        assert sample["resps"][0][0] == expected.split("\n")[0]


def recorded(samples: dict[str, list[dict]]) -> dict[tuple[str, int], list]:
    return {(task, s["doc_id"]): s["resps"] for task, rows in samples.items() for s in rows}


@pytest.mark.slow
def test_lm_eval_with_batch_size_8_records_what_batch_size_1_does(
    llama_dir, gateway, batch_one, tmp_path
):
    batched = recorded(run_lm_eval(gateway, llama_dir, tmp_path, BATCH))
    alone = recorded(batch_one)
    assert batched.keys() == alone.keys()
    for key, resps in alone.items():
        if key[0] == "actorserve_tiny_gen":
            assert batched[key] == resps, key
            continue
        for [[together, greedy_together]], [[single, greedy_single]] in zip(batched[key], resps):
            assert float(together) == pytest.approx(float(single), abs=ATOL_PER_TOKEN * 8), key
            assert greedy_together == greedy_single, key
    many = {"model": gateway.model_name, "prompt": ["x"] * (BATCH + 1), "max_tokens": 1}
    reply = call(gateway, "POST", "/v1/completions", many, {"Authorization": f"Bearer {API_KEY}"})
    assert reply.status == 400 and f"max_batch_prompts={BATCH}" in reply.json()["error"]["message"]
