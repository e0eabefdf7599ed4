"""How long this replica's steps take, fit to the steps it ran (messages/client.py StepCost), for
the gateways' routing (gateway/kv_routing.py): pure.

The model is linear in what a step computes:

    seconds ~= step_s + prefill_token_s x prefill tokens + decode_row_s x decode rows

A request's row of one token in a step is a decode row (a decode, or a prefill's last token
after a prefix-cache hit: it costs what a decode does), the tokens of longer rows are prefill
tokens. The seconds are the Worker's own measure of the step (StepResult.forward_s: from
receiving the plan to the sampled tokens), which is what the step costs whoever waits on it.

The fit is least squares over the steps seen, each step's weight decaying by 1 - 1/WINDOW_STEPS
with every later step (so it follows a replica whose load or neighbours change), ridge-regularized
toward the prior (StepCost's defaults) with the weight of PRIOR_STEPS steps. It is solved on the
features scaled to 0..1 (prefill tokens / token budget, decode rows / max_num_seqs), so that one
weight suits all three coefficients; the weight is small, as a step of a few decodes or a short
prefill is far from those maxima and must still outweigh it. So before any step the fit is the
prior, and along a direction the steps seen do not tell apart (every step with the same decode
rows cannot separate the fixed cost from a row's) it stays at the prior, whatever the steps say
about the others. Coefficients are reported at least 0.
"""

from __future__ import annotations

from collections.abc import Iterable

from ...messages.client import StepCost

WINDOW_STEPS = 64  # a step's weight falls to 1/e after this many later steps
PRIOR_STEPS = 1e-4  # the prior weighs as much as 1/10000 of a step at the maxima


class StepCostFit:
    def __init__(self, token_budget: int, max_rows: int):
        self.token_budget = token_budget
        self.scale = (1.0, float(max(1, token_budget)), float(max(1, max_rows)))
        prior = StepCost()
        self.prior = (  # in the scaled features' units: seconds for a full one
            prior.step_s,
            prior.prefill_token_s * self.scale[1],
            prior.decode_row_s * self.scale[2],
        )
        self.xx = [[0.0] * 3 for _ in range(3)]  # decayed sum of x x^T
        self.xy = [0.0] * 3  # decayed sum of x * seconds
        self.steps = 0

    def observe_step(self, row_tokens: Iterable[int], seconds: float) -> None:
        """A step ran rows of `row_tokens` tokens each in `seconds`."""
        prefill = decodes = 0
        for count in row_tokens:
            if count == 1:
                decodes += 1
            elif count > 1:
                prefill += count
        self.observe(prefill, decodes, seconds)

    def observe(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        if seconds <= 0.0 or prefill_tokens + decode_rows == 0:
            return  # a step that computed nothing (only dropped requests or swapped)
        keep = 1.0 - 1.0 / WINDOW_STEPS
        x = (1.0, prefill_tokens / self.scale[1], decode_rows / self.scale[2])
        for i in range(3):
            self.xy[i] = keep * self.xy[i] + x[i] * seconds
            row = self.xx[i]
            for j in range(3):
                row[j] = keep * row[j] + x[i] * x[j]
        self.steps += 1

    def estimate(self) -> StepCost:
        """The fit: (XᵀWX + λI) θ = XᵀWy + λ θ_prior, λ = PRIOR_STEPS, unscaled."""
        a = [
            [self.xx[i][j] + (PRIOR_STEPS if i == j else 0.0) for j in range(3)]
            + [self.xy[i] + PRIOR_STEPS * self.prior[i]]
            for i in range(3)
        ]
        theta = _solve3(a)
        return StepCost(
            step_s=max(0.0, theta[0]),
            prefill_token_s=max(0.0, theta[1] / self.scale[1]),
            decode_row_s=max(0.0, theta[2] / self.scale[2]),
            token_budget=self.token_budget,
            steps=self.steps,
        )


def _solve3(a: list[list[float]]) -> list[float]:
    """Solve the 3x3 system given as augmented rows [A | b] (A symmetric positive definite, as
    a ridge's is: Gaussian elimination needs no pivoting)."""
    n = 3
    for k in range(n):
        for i in range(k + 1, n):
            f = a[i][k] / a[k][k]
            for j in range(k, n + 1):
                a[i][j] -= f * a[k][j]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (a[i][n] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return x
