"""The offline API: `LLM(model).generate(prompts, params)` runs the real actor processes.

from actorserve import LLM, SamplingParams
with LLM(model_dir) as llm:
    for out in llm.generate(["def f(x):", "import os"], SamplingParams(max_tokens=32)):
        print(out.text)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec

from .actors.runtime.config import EngineConfig
from .actors.supervisor.background import BackgroundSupervisor
from .gateway.blocking_client import Client
from .gateway.client import AsyncClient
from .messages.common import FinishReason, SamplingParams


@dataclass
class Sample:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None


@dataclass
class Completion:
    """One prompt's result: `samples` holds all n of them; text etc. are sample 0's."""

    prompt: str | list[int]
    samples: list[Sample]
    prompt_tokens: int
    cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.samples[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.samples[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.samples[0].finish_reason


class LLM:
    """An engine (supervisor + four actor processes) for the life of this object."""

    def __init__(self, model: str, **engine_settings):
        """`engine_settings`: any EngineConfig field (max_num_seqs, num_kv_blocks, ...)."""
        config = EngineConfig(model=str(model), **engine_settings)
        if config.max_client_requests is None:  # this object is its engine's only client
            config = msgspec.structs.replace(config, max_client_requests=config.max_live_requests)
        self.config = config
        self._stack = BackgroundSupervisor(self.config)
        self.address = self._stack.start()
        self._client = Client(self.address)

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[Completion]:
        """Submit every prompt at once (the engine batches them); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"params must be one SamplingParams or one per prompt "
                f"({len(prompts)}), got {len(params)}"
            )
        return self._client._call(self._generate_all(prompts, params, use_tqdm))

    async def _generate_all(self, prompts, params, use_tqdm: bool) -> list[Completion]:
        from tqdm import tqdm

        client: AsyncClient = self._client._async
        bar = tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm)

        async def one(prompt, p: SamplingParams) -> Completion:
            joined = await client.complete_all(prompt, p)
            bar.update(1)
            samples = [Sample(d.text, d.token_ids, d.finish_reason) for d in joined]
            return Completion(prompt, samples, joined[0].prompt_tokens, joined[0].cached_tokens)

        try:
            return await asyncio.gather(*[one(x, p) for x, p in zip(prompts, params)])
        finally:
            bar.close()

    def health(self):
        return self._client.health()

    def shutdown(self) -> None:
        self._client.close()
        self._stack.stop()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
