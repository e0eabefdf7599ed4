"""vLLM's logprobs-close criterion (check_logprobs_close) between a served engine and
transformers on the same checkpoint: both greedy with the top-5 logprobs; where the two token
sequences first differ, each side's token must be in the other's top-5 at that position, and the
prompt is compared no further. For engines whose arithmetic differs from transformers' by more
than the order of fp32 sums (bf16, int8 weights), where a near tie may flip a greedy token.
scripts/gpu_check_serving.py runs it on CUDA through test_bf16_matches_transformers.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import torch

from actorserve.gateway.client import AsyncClient
from actorserve.messages.common import SamplingParams
from support import PROMPT_LENGTHS, hf_generate, prompts_of_lengths

MAX_TOKENS = 48
TOP = 5
GREEDY_TOP5 = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP)


@functools.cache
def hf_model_in(model_dir: Path, device: str = "cpu", dtype: torch.dtype = torch.bfloat16):
    """transformers' model of the checkpoint in `dtype` on `device`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(device).eval()


def hf_greedy_top(
    model_dir: Path, prompt: list[int], device: str = "cpu", dtype: torch.dtype = torch.bfloat16
) -> tuple[list[int], list[set[int]]]:
    """Transformers' greedy continuation in `dtype` (on `device`) and the top-5 token ids at
    each position (log_softmax of its logits, as the engine reports them)."""
    out = hf_generate(
        hf_model_in(model_dir, device, dtype),
        prompt,
        MAX_TOKENS,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    tops = [
        set(torch.log_softmax(step[0].float(), -1).topk(TOP).indices.tolist())
        for step in out.logits
    ]
    return tokens, tops


def engine_greedy_top(address: str, prompts) -> list[tuple[list[int], list[set[int]]]]:
    """The engine's greedy tokens and each position's top-5 ids, every prompt at once."""

    async def run():
        async with AsyncClient(address, timeout_s=300) as client:
            joined = await asyncio.gather(*[client.complete_all(p, GREEDY_TOP5) for p in prompts])
        return [
            (d.token_ids, [{token for token, _ in lp.top} for lp in d.logprobs]) for (d,) in joined
        ]

    return asyncio.run(run())


def identical_prefix(
    model_dir: Path,
    engine,
    device: str = "cpu",
    lengths: list[int] = PROMPT_LENGTHS,
    dtype: torch.dtype = torch.bfloat16,
) -> list[int]:
    """Check a prompt of each length by the criterion (module docstring) against transformers
    in `dtype` on `device` -> each one's identical prefix. `engine`: what serves at
    `engine.address` (an EngineServer; an offline LLM: scripts/gpu_check.py runs this on
    CUDA)."""
    prompts = prompts_of_lengths(model_dir, lengths)
    assert len(prompts) == len(lengths) >= 1
    prefixes = []
    for prompt, (ours, our_tops) in zip(prompts, engine_greedy_top(engine.address, prompts)):
        theirs, their_tops = hf_greedy_top(model_dir, prompt, device, dtype)
        assert all(len(top) == TOP for top in our_tops)
        same = 0
        while same < min(len(ours), len(theirs)) and ours[same] == theirs[same]:
            same += 1
        if same < min(len(ours), len(theirs)):
            where = f"prompt of {len(prompt)} tokens, output position {same}"
            assert ours[same] in their_tops[same], f"{where}: ours not in transformers' top-5"
            assert theirs[same] in our_tops[same], f"{where}: transformers' not in our top-5"
        else:  # one stopped (EOS) where the other did too, or both ran to max_tokens
            assert len(ours) == len(theirs), f"prompt of {len(prompt)} tokens: lengths differ"
        prefixes.append(same)
    mean = sum(prefixes) / len(prefixes)
    print(f"\n{model_dir.name}: mean identical prefix {mean:.1f} of {MAX_TOKENS}: {prefixes}")
    return prefixes
