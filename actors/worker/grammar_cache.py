"""The Worker's compiled grammars: an LRU keyed by the StructuredOutput (kind, text), each compiled
once, on a thread of its own.

Why the Worker compiles: it is where each structured request's matcher lives, and a compiled
grammar (for every grammar state, the tokens that may follow) is large: shipping one from the
Engine with each request would cost more than compiling it once here. Why a thread: a compile
takes many steps' time, and xgrammar releases the GIL while it compiles, so the forward thread's
steps go on meanwhile. The Scheduler asks for a grammar (CompileGrammar) before it plans the
request and plans it once the answer came (actors/scheduler/grammar_gate.py), so a step
normally finds the grammar compiled; `get` waits for it only where the Scheduler's gate let a
request through whose grammar this cache has since evicted (and says so in the log).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ...messages.structured import StructuredOutput
from ..runtime import grammars

log = logging.getLogger("worker")


class GrammarCache:
    def __init__(
        self,
        model_dir: str,
        vocab_size: int,
        eos_token_ids: list[int],
        capacity: int,
        max_whitespace: int = grammars.MAX_WHITESPACE,
    ):
        """`vocab_size`: the model's (its logits' width, which may pad the tokenizer's);
        `max_whitespace`: EngineConfig.structured_max_whitespace."""
        self.model_dir = model_dir
        self.max_whitespace = max_whitespace
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.capacity = capacity
        self.entries: OrderedDict[StructuredOutput, Future] = OrderedDict()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiler = None  # made on the compile thread by its first compile

    def request(self, spec: StructuredOutput) -> Future:
        """The future CompiledGrammar of `spec`, its compile started if it is not cached."""
        future = self.entries.get(spec)
        if future is not None:
            self.entries.move_to_end(spec)
            return future
        future = self.executor.submit(self._compile, spec)
        self.entries[spec] = future
        if len(self.entries) > self.capacity:
            self.entries.popitem(last=False)  # its requests' matchers keep their own reference
        return future

    def when_compiled(self, spec: StructuredOutput, done: Callable[[str | None], None]) -> None:
        """Call done(None) once `spec` is compiled, done(reason) if it cannot be (on the
        compile thread, or at once when it is cached)."""

        def finished(future: Future) -> None:
            exc = future.exception()
            done(None if exc is None else grammars.first_line(exc))

        self.request(spec).add_done_callback(finished)

    def get(self, spec: StructuredOutput):
        """The CompiledGrammar of `spec`, for a request the step admits (normally ready)."""
        future = self.request(spec)
        if not future.done():
            log.warning("a step waits for a grammar the cache had evicted: %s", spec.kind.value)
        return future.result()

    def _compile(self, spec: StructuredOutput):
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
            )
            # one compile thread: the cores belong to the forward; this cache is the only cache
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return grammars.compile(self._compiler, spec, self.max_whitespace)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
