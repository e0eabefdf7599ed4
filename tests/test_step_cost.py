"""A replica's fit of its own step times (actors/scheduler/step_cost.py), which its stats carry to
the gateways' kv_events routing: seconds ~= step_s + prefill_token_s x prefill tokens +
decode_row_s x decode rows."""

from __future__ import annotations

import random

import pytest

from actorserve.actors.scheduler.step_cost import WINDOW_STEPS, StepCostFit
from actorserve.messages.client import StepCost

BUDGET, ROWS = 2048, 64


def true_seconds(prefill: int, decodes: int, a=0.05, b=0.004, c=0.0015) -> float:
    return a + b * prefill + c * decodes


def test_before_any_step_the_fit_is_the_prior():
    prior = StepCost()
    assert StepCostFit(BUDGET, ROWS).estimate() == StepCost(
        step_s=pytest.approx(prior.step_s),
        prefill_token_s=pytest.approx(prior.prefill_token_s),
        decode_row_s=pytest.approx(prior.decode_row_s),
        token_budget=BUDGET,
        steps=0,
    )


def test_steps_of_every_mix_recover_the_three_costs():
    fit, rng = StepCostFit(BUDGET, ROWS), random.Random(0)
    for _ in range(4 * WINDOW_STEPS):
        prefill = rng.choice([0, 0, 0, rng.randrange(2, 600)])
        decodes = rng.randrange(0 if prefill else 1, 20)
        fit.observe(prefill, decodes, true_seconds(prefill, decodes))
    cost = fit.estimate()
    assert cost.steps == 4 * WINDOW_STEPS
    assert cost.step_s == pytest.approx(0.05, rel=0.02)
    assert cost.prefill_token_s == pytest.approx(0.004, rel=0.02)
    assert cost.decode_row_s == pytest.approx(0.0015, rel=0.05)


def test_what_the_steps_cannot_tell_apart_stays_near_the_prior():
    """Only steps of 8 decodes: their time is known, not how it splits into the fixed cost and
    a row's, and nothing is known of a prefill token's."""
    fit = StepCostFit(BUDGET, ROWS)
    for _ in range(2 * WINDOW_STEPS):
        fit.observe(0, 8, true_seconds(0, 8))
    cost = fit.estimate()
    assert cost.step_s + 8 * cost.decode_row_s == pytest.approx(true_seconds(0, 8), rel=0.02)
    assert cost.prefill_token_s == pytest.approx(StepCost().prefill_token_s, rel=0.05)


def test_it_follows_a_replica_whose_steps_got_slower():
    fit, rng = StepCostFit(BUDGET, ROWS), random.Random(1)
    for slow in (1.0, 3.0):
        for _ in range(8 * WINDOW_STEPS):
            prefill, decodes = rng.choice([0, rng.randrange(2, 300)]), rng.randrange(1, 16)
            fit.observe(prefill, decodes, slow * true_seconds(prefill, decodes))
    cost = fit.estimate()
    assert cost.prefill_token_s == pytest.approx(3 * 0.004, rel=0.05)
    assert cost.step_s == pytest.approx(3 * 0.05, rel=0.05)


def test_rows_of_one_token_are_decodes_and_longer_rows_prefill_tokens():
    by_rows, by_counts = StepCostFit(BUDGET, ROWS), StepCostFit(BUDGET, ROWS)
    by_rows.observe_step([1, 1, 40, 1, 17], 0.3)
    by_counts.observe(57, 3, 0.3)
    assert by_rows.estimate() == by_counts.estimate()


def test_steps_that_computed_nothing_or_took_no_time_are_not_counted():
    fit = StepCostFit(BUDGET, ROWS)
    fit.observe_step([], 0.2)
    fit.observe(10, 2, 0.0)
    assert fit.estimate() == StepCostFit(BUDGET, ROWS).estimate()


def test_no_coefficient_is_reported_below_zero():
    fit = StepCostFit(BUDGET, ROWS)
    for decodes in range(1, 60):  # more rows, less time: a negative row cost fits best
        fit.observe(0, decodes, 0.1 - 0.001 * decodes)
    cost = fit.estimate()
    assert cost.decode_row_s == 0.0 and cost.step_s > 0.0 and cost.prefill_token_s >= 0.0
