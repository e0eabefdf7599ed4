"""The int8-screened greedy head (kernels/cpu/screened_head_int8.py, csrc/cpu_screen_int8.c):
integer products on AMX screen the columns, the survivors are computed exactly, and the tokens
are the exact fp32 head's to the bit: with ties and near-ties, with rows the screen cannot
settle, at every batch size, across the threads' column split."""

import logging

import pytest
import torch

from actorserve.kernels.cpu import bindings
from actorserve.kernels.cpu.panels import GreedyHead
from actorserve.kernels.cpu.screened_head_int8 import Int8ScreenedHead, quantize_columns
from support import tied_columns


def heads(weight: torch.Tensor) -> tuple[GreedyHead, Int8ScreenedHead]:
    exact = GreedyHead.for_weight(weight)
    assert exact is not None, "the C kernels failed to build here"
    if not bindings.load().int8_screen_available():
        pytest.skip("no AMX-INT8 here (CPU, compiler or kernel)")
    screened = Int8ScreenedHead.for_weight(weight, exact)
    assert screened is not None
    return exact, screened


@pytest.mark.parametrize("hidden_size", [16, 72, 256])
def test_the_column_terms_bound_the_int8_copys_error(hidden_size):
    """Unpacked from the kernel's tile layout, s_j q_j is within r_j of w_j (and r_j is that
    distance, rounded up), m_j bounds |s_j q_j|, and each q_j uses the int8 range."""
    gen = torch.Generator().manual_seed(hidden_size)
    weight = torch.randn(53, hidden_size, generator=gen) * torch.logspace(-3, 3, 53)[:, None]
    packed, terms = quantize_columns(weight)
    assert packed.shape == (4, -(-hidden_size // 64), 16, 16, 4)
    unpacked = packed.permute(0, 3, 1, 2, 4).reshape(64, -1)  # [columns, k] padded
    assert (unpacked[53:] == 0).all() and (unpacked[:, hidden_size:] == 0).all()
    q = unpacked[:53, :hidden_size].double()
    scale, residual, norm = terms.double()[:, :53]
    approx = q * scale[:, None]
    distance = (weight.double() - approx).norm(dim=1)
    assert (distance <= residual).all() and (residual <= distance * (1 + 1e-5)).all()
    assert (approx.norm(dim=1) <= norm).all()
    assert (q.abs().amax(dim=1) == 127).all()
    assert (terms[:, 53:] == 0).all()


@pytest.mark.parametrize("rows", [1, 7, 64, 65, 130])
@pytest.mark.parametrize(("vocab", "hidden_size"), [(1, 64), (47, 72), (5000, 256)])
def test_the_screened_tokens_are_the_exact_heads(rows, vocab, hidden_size):
    gen = torch.Generator().manual_seed(rows * vocab)
    weight = torch.randn(vocab, hidden_size, generator=gen) / 16
    exact, screened = heads(weight)
    hidden = torch.randn(rows, hidden_size, generator=gen) * 4
    tokens, unsettled = screened.screen(hidden)
    assert unsettled == 0 and torch.equal(tokens, exact(hidden))
    column_major = Int8ScreenedHead.for_weight(weight.t().contiguous().t(), exact)
    assert torch.equal(column_major(hidden), exact(hidden))  # as the Linear layers store it
    wide = torch.randn(rows, hidden_size + 3, generator=gen)
    strided = wide[:, 2 : hidden_size + 2]
    assert torch.equal(screened(strided), exact(strided))


def test_ties_at_the_maximum_go_to_the_first_column():
    weight, hidden = tied_columns()
    exact, screened = heads(weight)
    tokens = screened(hidden)
    assert torch.equal(tokens, exact(hidden)) and (tokens == 3).all()


def test_columns_closer_than_int8_can_tell_apart_go_to_the_exact_logits():
    """40 columns spread over the vocabulary differ from one another by 1e-6 of their size: the
    int8 products cannot order them, only the exact fp32 logits can; any bound too tight to keep
    them all would drop the maximum for some of the 64 rows."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(4000, 256, generator=gen) / 16
    base = weight[0].clone()
    close = torch.linspace(5, 3995, 40).long()
    weight[close] = base + torch.randn(40, 256, generator=gen) * 1e-6 * base.abs().mean()
    exact, screened = heads(weight)
    hidden = base.repeat(64, 1) * 20 + torch.randn(64, 256, generator=gen) * 1e-3
    expected = exact(hidden)
    assert len(set(expected.tolist()) & set(close.tolist())) > 5  # the maximum moves around
    tokens, unsettled = screened.screen(hidden)
    assert unsettled == 0 and torch.equal(tokens, expected)


def test_logits_rising_along_the_vocabulary_keep_the_candidate_lists_bounded():
    """The logits of these rows rise 4% from each 64-column chunk to the next, and the 64 of a
    chunk are within the bound of one another: every chunk adds 64 candidates, and a thread's
    list (256) holds its 64 chunks only by dropping those the rising threshold has passed."""
    gen = torch.Generator().manual_seed(4)
    direction = torch.randn(128, generator=gen)
    levels = 1.04 ** (torch.arange(128 * 64) // 64).double()
    noise = torch.randn(128 * 64, 128, generator=gen) * 1e-4
    weight = (levels[:, None] * direction * (1 + noise)).float()
    exact, screened = heads(weight)
    hidden = direction.repeat(4, 1) + torch.randn(4, 128, generator=gen) * 1e-3
    tokens, unsettled = screened.screen(hidden)
    assert unsettled == 0 and torch.equal(tokens, exact(hidden))
    assert (tokens >= 127 * 64).all()


def test_rows_the_screen_cannot_settle_get_the_exact_heads_token():
    """A zero row, rows past 2^60 or under 2^-60 in size, rows with inf or NaN, and a row along
    400 near-equal columns (more than a list keeps) go to the exact head, among ordinary rows
    (which point away from those columns, so they pass them below the threshold)."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(64, generator=gen)
    weight = torch.randn(2000, 64, generator=gen)
    weight[590:990] = base + torch.randn(400, 64, generator=gen) * 1e-7  # thread 0's half
    exact, screened = heads(weight)
    hidden = torch.randn(8, 64, generator=gen)
    hidden[[0, 7]] -= base * 2 * (hidden[[0, 7]] @ base / base.dot(base)).clamp(min=0)[:, None]
    hidden[1] = 0.0
    hidden[2] *= 2.0**62
    hidden[3] *= 2.0**-62
    hidden[4, 5] = float("inf")
    hidden[5, 9] = float("nan")
    hidden[6] = base
    tokens, unsettled = screened.screen(hidden)
    assert (tokens[1:7] == -1).all() and unsettled == 6
    assert torch.equal(tokens[[0, 7]], exact(hidden[[0, 7]]))
    assert torch.equal(screened(hidden), exact(hidden))


def test_it_serves_only_where_the_machine_and_the_weight_allow(monkeypatch, caplog):
    weight = torch.randn(100, 32)
    exact, _ = heads(weight)
    assert Int8ScreenedHead.for_weight(weight, None) is None
    for value in (float("inf"), float("nan"), 2.0**61, 2.0**-61):
        bad = weight.clone()
        bad[7, 3] = value
        assert Int8ScreenedHead.for_weight(bad, exact) is None
    assert Int8ScreenedHead.for_weight(weight.double(), exact) is None
    monkeypatch.setattr(Int8ScreenedHead, "agrees_with_exact", lambda self: False)
    with caplog.at_level(logging.WARNING):
        assert Int8ScreenedHead.for_weight(weight, exact) is None
    assert "disagreed" in caplog.text
    monkeypatch.undo()

    lib = bindings.load()

    class NoAmx:  # the C library as built where the compiler or CPU has no AMX-INT8
        def __getattr__(self, name):
            return getattr(lib, name)

        def int8_screen_available(self):
            return 0

    monkeypatch.setattr(bindings, "load", lambda: NoAmx())
    assert Int8ScreenedHead.for_weight(weight, exact) is None
