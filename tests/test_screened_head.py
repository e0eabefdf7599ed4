"""The screened greedy head (kernels/cpu/screened_head.py): a bf16 product screens the columns, the
survivors are computed exactly, and the tokens are the exact fp32 head's to the bit: with ties,
with rows the screen cannot settle, at every batch size."""

import pytest
import torch

from actorserve.kernels.cpu import bindings, screened_head
from actorserve.kernels.cpu.panels import GreedyHead
from actorserve.kernels.cpu.screened_head import FACTOR, ScreenedGreedyHead
from support import tied_columns


def heads(weight: torch.Tensor) -> tuple[GreedyHead, ScreenedGreedyHead]:
    exact = GreedyHead.for_weight(weight)
    assert exact is not None, "the C kernels failed to build here"
    screened = ScreenedGreedyHead.for_weight(weight, exact, force=True)
    if screened is None:  # oneDNN's bf16 ops want AVX-512 (or AVX-NE-CONVERT) at least
        pytest.skip("torch's oneDNN has no bf16 linear ops on this CPU")
    return exact, screened


@pytest.mark.parametrize("hidden_size", [16, 256, 768])
def test_the_bf16_logits_are_within_the_bound_of_the_exact_ones(hidden_size):
    """The derivation's bound without the exact head's own rounding (0.0118 of |a| |w_j|), held
    by oneDNN's bf16 product on logits far from zero and near it."""
    gen = torch.Generator().manual_seed(hidden_size)
    weight = torch.randn(3000, hidden_size, generator=gen) * 0.05
    _, screened = heads(weight)
    hidden = torch.randn(64, hidden_size, generator=gen) * torch.logspace(-3, 3, 64)[:, None]
    approx = screened.approx_logits(hidden).double()
    true = hidden.double() @ weight.double().T
    bound = 0.0118 * hidden.double().norm(dim=1, keepdim=True) * weight.double().norm(dim=1)
    assert ((approx - true).abs() <= bound).all()
    assert 0.0118 < screened_head.BOUND < FACTOR
    assert screened.holds_its_bound()


@pytest.mark.parametrize("rows", [1, 7, 64, 100])
@pytest.mark.parametrize("vocab", [1, 47, 5000])
def test_the_screened_tokens_are_the_exact_heads(rows, vocab):
    gen = torch.Generator().manual_seed(rows * vocab)
    weight = torch.randn(vocab, 256, generator=gen) / 16
    exact, screened = heads(weight)
    hidden = torch.randn(rows, 256, generator=gen) * 4
    assert torch.equal(screened(hidden), exact(hidden))
    column_major = ScreenedGreedyHead.for_weight(weight.t().contiguous().t(), exact, force=True)
    assert torch.equal(column_major(hidden), exact(hidden))  # as the Linear layers store it
    wide = torch.randn(rows, 259, generator=gen)
    assert torch.equal(screened(wide[:, 2:258]), exact(wide[:, 2:258]))  # strided rows


def test_the_screen_reads_the_weight_through_its_strides():
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(999, 64, generator=gen)
    _, screened = heads(weight)
    hidden = torch.randn(9, 64, generator=gen)
    approx = screened.approx_logits(hidden)
    lib, norms = bindings.load(), screened._col_norms
    row_major, unsettled = bindings.screened_argmax(lib, hidden, approx, weight, norms, FACTOR)
    column_major = weight.t().contiguous().t()
    assert torch.equal(
        bindings.screened_argmax(lib, hidden, approx, column_major, norms, FACTOR)[0], row_major
    )
    assert (row_major >= 0).all() and unsettled == 0


def test_ties_at_the_maximum_go_to_the_first_column():
    weight, hidden = tied_columns()
    exact, screened = heads(weight)
    tokens = screened(hidden)
    assert torch.equal(tokens, exact(hidden)) and (tokens == 3).all()


def test_rows_the_screen_cannot_settle_get_the_exact_heads_token():
    """A zero row (every column ties: all are candidates), a huge row (the bf16 product overflows)
    and rows with inf or NaN go to the exact head, among ordinary rows."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(2000, 64, generator=gen)
    exact, screened = heads(weight)
    hidden = torch.randn(6, 64, generator=gen)
    hidden[1] = 0.0
    hidden[2] = 3e37
    hidden[3, 5] = float("inf")
    hidden[4, 9] = float("nan")
    assert torch.equal(screened(hidden), exact(hidden))
    approx = screened.approx_logits(hidden)
    tokens, unsettled = bindings.screened_argmax(
        bindings.load(), hidden, approx, weight, screened._col_norms, FACTOR
    )
    assert unsettled == int((tokens < 0).sum()) and (tokens[[1, 3, 4]] == -1).all()


def test_a_row_with_more_candidates_than_the_screen_keeps_gets_the_exact_heads_token():
    """3000 columns within the bound of each other, the maximum late among them (column 2500):
    every column is a candidate, past what the screen keeps, and the row goes to the exact head."""
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(256, generator=gen)
    weight = base.repeat(3000, 1) + torch.randn(3000, 256, generator=gen) * 1e-4
    weight[2500] += base * 1e-3
    exact, screened = heads(weight)
    hidden = base.repeat(3, 1)
    assert (exact(hidden) == 2500).all()
    assert torch.equal(screened(hidden), exact(hidden))


def test_it_serves_only_where_the_bound_and_the_machine_allow(monkeypatch):
    weight = torch.randn(100, 32)
    exact, _ = heads(weight)
    assert ScreenedGreedyHead.for_weight(weight, None, force=True) is None
    bad = weight.clone()
    bad[7, 3] = float("inf")
    assert ScreenedGreedyHead.for_weight(bad, exact, force=True) is None
    wide = torch.randn(4, screened_head.MAX_HIDDEN + 1)
    assert ScreenedGreedyHead.for_weight(wide, GreedyHead.for_weight(wide), force=True) is None
    monkeypatch.setattr(screened_head, "cpu_has_bf16", lambda: False)
    assert ScreenedGreedyHead.for_weight(weight, exact) is None
    monkeypatch.setattr(screened_head, "cpu_has_bf16", lambda: True)
    assert ScreenedGreedyHead.for_weight(weight, exact) is not None
    monkeypatch.setattr(ScreenedGreedyHead, "holds_its_bound", lambda self: False)
    assert ScreenedGreedyHead.for_weight(weight, exact, force=True) is None
