"""The sampler on the logits' device: greedy rows pick what the CPU sampler picked, drawn rows
follow the filtered softmax (a chi-square test), a seeded row's draw depends on (seed, position)
alone, nothing sorts unless a row asks for top-k or top-p, and only rows that ask get logprobs.

Each behaviour runs on both draw backends (kernels/sampling.py): torch, and the Triton kernel on
CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA); the `gpu` cases
run the kernel on CUDA.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from actorserve.actors.worker.logprobs import start_sample_logprobs
from actorserve.actors.worker.sample_row import SampleRow
from actorserve.actors.worker.sampler import Sampler
from actorserve.messages.common import SamplingParams

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
CHI2_MIN_P_VALUE = 1e-3
DRAWS = 20_000


@pytest.fixture(
    params=[
        pytest.param(("torch", "cpu"), id="torch-cpu"),
        pytest.param(
            ("triton", "cpu"),
            id="triton-interpreter",
            marks=pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1"),
        ),
        pytest.param(("triton", "cuda"), id="triton-cuda", marks=pytest.mark.gpu),
    ]
)
def setup(request) -> tuple[str, str]:
    """(draw backend, device)."""
    return request.param


def sampler_for(setup, seed: int = 0) -> Sampler:
    backend, device = setup
    return Sampler(seed, device=device, backend=backend)


def row(position=10, num_output=0, stops=(), token_ids=None, **params) -> SampleRow:
    """A SampleRow as the runner makes them: its token ids (zeros unless given) up to position."""
    token_ids = [0] * position if token_ids is None else token_ids
    return SampleRow(SamplingParams(**params), position, num_output, list(stops), token_ids)


def reference_greedy(logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
    """The CPU sampler's greedy tokens, one row at a time: stop tokens masked before min_tokens,
    logit bias, repetition, frequency and presence penalties, then the first maximum."""
    tokens = []
    for values, r in zip(logits.double(), rows):
        out, p = values.clone(), r.params
        if r.num_output < p.min_tokens:
            out[r.stop_token_ids] = float("-inf")
        for token, bias in p.logit_bias.items():
            out[token] += bias
        ids = r.token_ids or []
        prompt, output = ids[: r.position - r.num_output], ids[r.position - r.num_output :]
        for token in set(prompt) | set(output):
            rep = p.repetition_penalty
            out[token] = out[token] / rep if out[token] > 0 else out[token] * rep
        for token in set(output):
            out[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
        tokens.append(int(out.argmax()))
    return tokens


def greedy_rows(generator: torch.Generator, vocab: int) -> list[SampleRow]:
    def history(n: int) -> list[int]:
        return torch.randint(0, vocab // 8, (n,), generator=generator).tolist()

    prompt = history(12)
    rows = [
        row(temperature=0.0),
        row(temperature=0.0, logit_bias={3: 4.0, 9: -50.0}),
        row(12 + 6, 6, token_ids=prompt + history(6), temperature=0.0, repetition_penalty=1.8),
        row(
            12 + 9,
            9,
            token_ids=prompt + history(9),
            temperature=0.0,
            frequency_penalty=0.9,
            presence_penalty=0.6,
            logit_bias={1: 2.5},
        ),
        row(num_output=1, stops=[5, 7], temperature=0.0, min_tokens=3),
        row(num_output=3, stops=[5, 7], temperature=0.0, min_tokens=3),  # no longer masked
    ]
    return rows


def test_greedy_rows_pick_the_cpu_samplers_tokens(setup):
    generator = torch.Generator().manual_seed(0)
    vocab = 300
    for _ in range(4):
        rows = greedy_rows(generator, vocab)
        logits = torch.randn(len(rows), vocab, generator=generator) * 3
        logits[4:, 5] = logits[4:, 7] = 50.0  # the stop tokens win unless masked
        expected = reference_greedy(logits, rows)
        assert expected[4] not in (5, 7) and expected[5] in (5, 7)
        device = setup[1]
        assert sampler_for(setup)(logits.to(device), rows) == expected
        # interleaved with rows that draw, each greedy row still gets its own token
        drawn = [row(temperature=0.8, seed=i) for i in range(len(rows))]
        mixed_rows = [r for pair in zip(rows, drawn) for r in pair]
        mixed = logits.repeat_interleave(2, dim=0).to(device)
        assert sampler_for(setup)(mixed, mixed_rows)[::2] == expected


def test_greedy_on_model_dtype_logits_is_their_first_maximum(setup):
    logits = (torch.randn(6, 500) * 4).to(torch.bfloat16)
    logits[2, 10] = logits[2, 20] = logits[2].max() + 1  # a tie: the first index wins
    tokens = sampler_for(setup)(logits.to(setup[1]), [row(temperature=0.0)] * 6)
    assert tokens == logits.float().argmax(dim=-1).tolist() and tokens[2] == 10


# the logits of the statistical test: their filtered distributions by hand (temperature 0.7)
#   token order by probability: 4, 1, 6, 3, 5, 0, 7, 2 with p = .392 .255 .166 .094 .053 ...
#   top-k 3: {4, 1, 6}; top-p 0.8: mass before token 3 is .813 > .8, so {4, 1, 6};
#   min-p 0.2: p / p_max = 1, .651, .424, .240, .135: {4, 1, 6, 3}
STAT_LOGITS = [-0.4, 1.2, -1.8, 0.5, 1.5, 0.1, 0.9, -1.0]
FILTERS = [
    (dict(top_k=3), [4, 1, 6]),
    (dict(top_p=0.8), [4, 1, 6]),
    (dict(min_p=0.2), [4, 1, 6, 3]),
    (dict(), list(range(8))),
]


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against probabilities (both over the same tokens)."""
    expected = probs * counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(counts) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic / 2))


@pytest.mark.parametrize("filters, kept", FILTERS, ids=["top_k", "top_p", "min_p", "none"])
def test_draws_follow_the_filtered_softmax(setup, filters, kept):
    logits = torch.tensor(STAT_LOGITS).expand(DRAWS, -1).contiguous().to(setup[1])
    rows = [row(temperature=0.7, **filters)] * DRAWS  # unseeded: keys from the generator
    tokens = torch.tensor(sampler_for(setup, seed=1)(logits, rows))
    counts = torch.bincount(tokens, minlength=len(STAT_LOGITS)).double()
    dropped = [t for t in range(len(STAT_LOGITS)) if t not in kept]
    assert counts[dropped].sum() == 0, f"dropped tokens drawn: {counts.tolist()}"
    probs = torch.softmax(torch.tensor(STAT_LOGITS, dtype=torch.float64)[kept] / 0.7, dim=0)
    p_value = chi_square_p_value(counts[kept], probs)
    assert p_value > CHI2_MIN_P_VALUE, (counts[kept] / DRAWS, probs, p_value)


def test_a_seeded_draw_depends_on_its_seed_and_position_alone(setup):
    device = setup[1]
    generator = torch.Generator().manual_seed(5)
    vocab = 1000
    logits = torch.randn(9, vocab, generator=generator) * 2
    seeded = row(position=42, temperature=0.9, min_p=0.01, seed=77)
    alone = sampler_for(setup)(logits[:1].to(device), [seeded])[0]
    others = [
        row(temperature=1.0),
        row(temperature=0.0),
        row(temperature=0.5, top_k=20),
        row(temperature=1.3, top_p=0.9, seed=3),
        row(temperature=1.0, seed=77, position=43),
        row(3, temperature=0.7, repetition_penalty=1.2, token_ids=[1, 2, 3]),
        row(temperature=2.0, min_p=0.3),
        row(temperature=1.0, seed=78, position=42),
    ]
    shuffler = random.Random(0)
    for trial in range(4):
        order = list(range(9))
        shuffler.shuffle(order)  # the seeded row (index 0) lands anywhere in the batch
        rows = [([seeded] + others)[i] for i in order]
        batch = logits[order].to(device)
        tokens = sampler_for(setup, seed=trial)(batch, rows)  # a new Sampler, another seed
        assert tokens[order.index(0)] == alone, f"order {order}"
    draws = {
        sampler_for(setup)(
            logits[:1].to(device), [row(position=p, temperature=0.9, min_p=0.01, seed=77)]
        )[0]
        for p in range(30)
    }
    assert len(draws) > 5  # the position changes the draw


class SortCounter:
    """Counts every sort-like call on torch and tensors while installed."""

    NAMES = ("sort", "argsort", "topk", "msort")

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for owner in (torch, torch.Tensor):
            for name in self.NAMES:
                if hasattr(owner, name):
                    monkeypatch.setattr(owner, name, self.counted(name, getattr(owner, name)))

    def counted(self, name, fn):
        def wrapper(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)

        return wrapper


def test_nothing_sorts_unless_a_row_asks_for_top_k_or_top_p(setup, monkeypatch):
    counter = SortCounter(monkeypatch)
    logits = torch.randn(6, 400).to(setup[1])
    rows = [
        row(temperature=0.8, min_p=0.1),
        row(2, temperature=1.2, seed=4, repetition_penalty=1.3, token_ids=[4, 5]),
        row(temperature=0.0, logit_bias={3: 1.0}),
        row(temperature=0.6, num_output=0, stops=[2], min_tokens=1),
        row(temperature=1.0, top_k=0, top_p=1.0),  # both filters off
    ]
    sampler_for(setup)(logits[:5].clone(), rows)
    assert counter.calls == []
    sampler_for(setup)(logits.clone(), rows + [row(temperature=1.0, top_k=5)])
    assert counter.calls == ["topk"]  # top-k alone: the k largest, no full sort
    counter.calls.clear()
    sampler_for(setup)(logits.clone(), rows + [row(temperature=1.0, top_p=0.5)])
    assert counter.calls == ["sort"]


def test_only_rows_that_ask_get_logprobs(setup):
    logits = torch.randn(5, 64).to(setup[1])
    rows = [
        row(temperature=0.0),
        row(temperature=0.0, logprobs=2),
        row(temperature=1.0, seed=1),
        row(temperature=1.0, seed=2, logprobs=0),
        row(temperature=0.0, logit_bias={6: 9.0}),
    ]
    assert start_sample_logprobs(logits, [rows[0], rows[2]]) is None
    pending = start_sample_logprobs(logits, rows)
    assert pending.logprobs.shape == (2, 64)  # the two asking rows, no other
    torch.testing.assert_close(pending.logprobs, torch.log_softmax(logits[[1, 3]], dim=-1))
    sampled = sampler_for(setup).sample(logits, rows)
    entries = pending.finish(sampled.device)
    assert [e is not None for e in entries] == [False, True, False, True, False]
    assert [entries[i].token_id for i in (1, 3)] == [sampled.tolist()[i] for i in (1, 3)]
    assert entries == pending.finish(sampled.tolist())
