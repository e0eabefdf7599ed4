"""The Scheduler's gate for structured outputs: a request waits here until its grammar is compiled.

Compiling a grammar against the vocabulary takes many steps' time, and the Worker's step must
never wait for one (every other request of the batch would wait with it). So, as vLLM holds a
request in WAITING_FOR_FSM, the Scheduler parks a structured request before planning it, asks the
Worker to compile its grammar (CompileGrammar, on the Worker's compile thread) and admits it when
the Worker answers GrammarReady. A spec the Worker has answered for is `ready` (an LRU of half the
Worker's cache, so a spec the gate lets through is still in the Worker's cache when the request
is admitted, but for a burst of more distinct specs than that: the Worker then compiles it in
the step, and logs it). A Reset forgets everything: a restarted Worker has an empty cache, and
the Engine re-submits every request, so each is parked again (recovery rebuilds the matchers
from the requests' output tokens, worker/grammar_state.py).
"""

from __future__ import annotations

from collections import OrderedDict

from ...messages.step import AddRequest
from ...messages.structured import GrammarReady, StructuredOutput


class GrammarGate:
    def __init__(self, capacity: int):
        self.capacity = max(1, capacity // 2)
        self.ready: OrderedDict[StructuredOutput, None] = OrderedDict()
        self.parked: dict[StructuredOutput, list[AddRequest]] = {}

    def admits(self, message: AddRequest) -> bool:
        """Whether the request may be planned now (no grammar, or a compiled one)."""
        spec = message.params.structured
        if spec is None:
            return True
        if spec in self.ready:
            self.ready.move_to_end(spec)
            return True
        return False

    def park(self, message: AddRequest) -> StructuredOutput | None:
        """Hold a request whose grammar is not ready: -> its spec when the Worker must be asked
        to compile it (the first request parked for it), else None."""
        spec = message.params.structured
        waiting = self.parked.setdefault(spec, [])
        waiting.append(message)
        return spec if len(waiting) == 1 else None

    def compiled(self, message: GrammarReady) -> list[AddRequest]:
        """The Worker's answer: -> the requests parked for its spec (admit them, or fail them
        when `message.error`)."""
        if message.error is None:
            self.ready[message.spec] = None
            if len(self.ready) > self.capacity:
                self.ready.popitem(last=False)
        return self.parked.pop(message.spec, [])

    def drop(self, request_ids: list[str]) -> None:
        """Remove parked requests (aborted). A spec left with none keeps its (empty) entry: the
        Worker's answer still comes, and finds no one."""
        ids = set(request_ids)
        for spec, waiting in self.parked.items():
            self.parked[spec] = [m for m in waiting if m.request_id not in ids]

    @property
    def num_parked(self) -> int:
        """Requests waiting for their grammar (counted among the waiting in the stats)."""
        return sum(len(waiting) for waiting in self.parked.values())

    def reset(self) -> None:
        self.ready.clear()
        self.parked.clear()
