"""The pieces of structured outputs in one process: the Worker's matchers and masks, and the
Scheduler's gate (the end-to-end behaviour: test_structured_outputs.py)."""

from __future__ import annotations

import json

import pytest
import torch

from actorserve.actors.runtime.model_config import ModelFacts
from actorserve.actors.scheduler.grammar_gate import GrammarGate
from actorserve.actors.worker.grammar_cache import GrammarCache
from actorserve.actors.worker.grammar_masks import advance_grammars, mask_grammar_rows
from actorserve.actors.worker.grammar_state import GrammarState
from actorserve.actors.worker.sample_row import SampleRow
from actorserve.messages.common import SamplingParams
from actorserve.messages.step import AddRequest
from actorserve.messages.structured import GrammarReady, StructuredKind, StructuredOutput

SCHEMA = StructuredOutput(
    StructuredKind.JSON_SCHEMA,
    json.dumps({"type": "object", "properties": {"a": {"enum": ["x", "yz"]}}, "required": ["a"]}),
)
REGEX = StructuredOutput(StructuredKind.REGEX, "[0-9]{2,4}")


@pytest.fixture(scope="module")
def cache(llama_dir):
    facts = ModelFacts.read(llama_dir)
    cache = GrammarCache(str(llama_dir), facts.vocab_size, facts.eos_token_ids, 4)
    yield cache
    cache.close()


def rows_of(cache, *specs):
    rows = []
    for spec in specs:
        row = SampleRow(SamplingParams(temperature=0.0, structured=spec), 1, 0, [2])
        if spec is not None:
            row.grammar = GrammarState(cache.get(spec), [])
        rows.append(row)
    return rows


def masked_tokens(logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits).logical_not().nonzero().flatten().tolist())


def test_a_matcher_rebuilt_from_the_output_tokens_masks_as_the_one_that_sampled_them(cache):
    """What preemption and recovery rely on: replaying the tokens is the whole state."""
    (row,) = rows_of(cache, SCHEMA)
    torch.manual_seed(0)
    tokens = []
    while row.grammar.live:
        logits = torch.randn(1, 32000)
        mask_grammar_rows(logits, [row])
        rebuilt = rows_of(cache, None)[0]
        rebuilt.grammar = GrammarState(cache.get(SCHEMA), tokens)
        again = torch.zeros(1, 32000)
        mask_grammar_rows(again, [rebuilt])
        assert masked_tokens(logits) == masked_tokens(again)
        token = int(logits.argmax())
        advance_grammars([row], [token], [0])
        tokens.append(token)
    assert tokens[-1] == 2  # the grammar's end is EOS


def test_only_the_structured_rows_are_masked(cache):
    rows = rows_of(cache, None, REGEX, None)
    logits = torch.randn(3, 32000)
    before = logits.clone()
    assert mask_grammar_rows(logits, rows) == [1]
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert 0 < len(allowed) < 1000  # digit tokens only


def add(rid: str, spec: StructuredOutput | None) -> AddRequest:
    return AddRequest(rid, [1, 2], SamplingParams(structured=spec))


def test_the_gate_asks_once_per_spec_and_admits_when_the_worker_answers():
    gate = GrammarGate(capacity=8)
    assert gate.admits(add("plain", None))
    first, second, other = add("a", SCHEMA), add("b", SCHEMA), add("c", REGEX)
    assert not gate.admits(first)
    assert gate.park(first) == SCHEMA and gate.park(second) is None  # one CompileGrammar
    assert gate.park(other) == REGEX
    assert gate.num_parked == 3  # counted among the waiting requests
    gate.drop(["b"])  # aborted while it waited
    assert gate.compiled(GrammarReady(0, SCHEMA)) == [first]
    assert gate.admits(add("d", SCHEMA))  # compiled: no more waiting
    assert gate.compiled(GrammarReady(0, REGEX, "cannot")) == [other]
    assert not gate.admits(add("e", REGEX))  # a failed compile is not remembered as ready
    gate.reset()  # a restarted Worker has compiled nothing
    assert not gate.admits(add("f", SCHEMA))


def test_output_tokens_off_the_grammar_end_only_their_own_request(cache):
    """A hostile resumption's tokens break one matcher: that row can only take EOS next."""
    rows = rows_of(cache, REGEX, REGEX)
    probe = torch.zeros(1, 32000)
    mask_grammar_rows(probe, rows[:1])
    forbidden = int(torch.isinf(probe[0]).nonzero()[0])  # not a digit: off the grammar
    rows[0].grammar = GrammarState(cache.get(REGEX), [forbidden])
    assert rows[0].grammar.broken and not rows[1].grammar.broken
    logits = torch.randn(2, 32000)
    mask_grammar_rows(logits, rows)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [2]  # EOS alone
    assert torch.isfinite(logits[1]).sum() > 1
