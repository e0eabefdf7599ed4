"""The sampler: greedy is argmax, filters keep what they promise, seeds ignore the batch."""

from __future__ import annotations

import torch

from actorserve.actors.worker.sample_row import SampleRow, is_plain_greedy
from actorserve.actors.worker.sampler import Sampler
from actorserve.messages.common import SamplingParams


def row(position=10, num_output=0, stops=(), **params):
    return SampleRow(SamplingParams(**params), position, num_output, list(stops))


def test_temperature_zero_is_argmax():
    logits = torch.randn(4, 100)
    assert Sampler()(logits.clone(), [row(temperature=0.0)] * 4) == logits.argmax(-1).tolist()


def test_plain_greedy_means_nothing_between_the_logits_and_the_argmax():
    assert is_plain_greedy(row(temperature=0.0))
    assert is_plain_greedy(row(temperature=0.0, min_tokens=5))  # no stop token to mask
    for params in (
        dict(temperature=0.7),
        dict(temperature=0.0, logprobs=0),
        dict(temperature=0.0, repetition_penalty=1.1),
        dict(temperature=0.0, logit_bias={3: 1.0}),
    ):
        assert not is_plain_greedy(row(**params)), params
    # with a stop token, min_tokens masks it (not plain) until that many tokens are out
    greedy = dict(temperature=0.0, min_tokens=3)
    masked = [is_plain_greedy(row(num_output=n, stops=[2], **greedy)) for n in range(5)]
    assert masked == [False, False, False, True, True]


def test_top_k_one_and_tiny_top_p_both_mean_argmax():
    logits = torch.randn(3, 50)
    rows = [
        row(temperature=1.0, top_k=1),
        row(temperature=1.0, top_p=1e-6),
        row(temperature=1.0, min_p=1.0),
    ]
    assert Sampler(seed=3)(logits.clone(), rows) == logits.argmax(-1).tolist()


def test_top_k_draws_stay_inside_the_k_most_likely():
    logits = torch.randn(1, 64)
    allowed = set(logits[0].topk(5).indices.tolist())
    sampler = Sampler(seed=1)
    draws = {sampler(logits.clone(), [row(temperature=2.0, top_k=5)])[0] for _ in range(200)}
    assert draws <= allowed and len(draws) > 1


def test_min_tokens_masks_stop_tokens_until_reached():
    logits = torch.full((2, 10), -5.0)
    logits[:, 3] = 10.0  # the stop token is by far the likeliest
    rows = [
        row(temperature=0.0, min_tokens=2, max_tokens=5, num_output=1, stops=[3]),
        row(temperature=0.0, min_tokens=2, max_tokens=5, num_output=2, stops=[3]),
    ]
    tokens = Sampler()(logits, rows)
    assert tokens[0] != 3 and tokens[1] == 3


def test_a_seeded_row_draws_the_same_token_whatever_shares_its_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 200)
    seeded = row(position=42, temperature=1.0, seed=77)
    alone = Sampler(seed=0)(logits[:1].clone(), [seeded])[0]
    others = [row(temperature=1.0)] * 4
    for sampler_seed in range(5):
        batch = Sampler(seed=sampler_seed)(logits.clone(), [seeded] + others)
        assert batch[0] == alone
    draws = {
        Sampler()(logits[:1].clone(), [row(position=p, temperature=1.0, seed=77)])[0]
        for p in range(30)
    }
    assert len(draws) > 1  # the position changes the draw
