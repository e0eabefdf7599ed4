"""The Triton program behind kernels/sampling.py's draw: one token per row of filtered,
temperature-scaled logits z [R, V], by the exponential race, with its noise made in registers.

The race in log form: with E_i ~ Exp(1) independent, argmax_i (z_i - log E_i) is distributed as
softmax(z) (it is the Gumbel-max trick, -log E_i being a standard Gumbel variable). A token that
the filters dropped has z_i = -inf and never wins.

The noise of vocabulary index i in row r is a function of (keys[r], i) alone: Philox-4x32 (10
rounds, triton.language.random) with the row's 64-bit key as its key and i as its counter. So a
row's draw depends on nothing but its key and its logits: not on its place in the batch, the batch
size or the tiling below. (The bits are tl.randint's; each row of a tile has its own key here.)

E = -log(1 - u) for u uniform in (0, 1) from all 32 random bits: near u = 0, where the race's
winners lie (the smallest E), u keeps its full relative precision and E is taken from its series,
as 1 - u would round away the low bits there (Triton's interpreter has no log1p).

Work decomposition: program (t, s) scans the contiguous vocabulary range s of rows
[t * ROWS, t * ROWS + ROWS) in tiles of [ROWS, BLOCK] (ROWS > 1 only where a row's vocabulary fits
one tile), keeping per lane the best score and its first index; per row it writes the range's best
score and the smallest index that reaches it. With one range per row that index is the token; with
more (a small batch over a large vocabulary), the caller takes, per row, the first range of the
highest score (kernels/sampling.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

TWO_TO_MINUS_32: tl.constexpr = tl.constexpr(2.3283064365386963e-10)
# 2**-6: below it the series' first omitted term, u**4 / 5 relative, is under float32's epsilon
SERIES_BELOW: tl.constexpr = tl.constexpr(0.015625)
ROUND_A: tl.constexpr = tl.constexpr(0xD2511F53)
ROUND_B: tl.constexpr = tl.constexpr(0xCD9E8D57)
KEY_A: tl.constexpr = tl.constexpr(0x9E3779B9)
KEY_B: tl.constexpr = tl.constexpr(0xBB67AE85)


@triton.jit
def exponential_of_uniform(u):
    """-log(1 - u), u in (0, 1): the series u + u^2/2 + u^3/3 + u^4/4 for small u."""
    series = u * (1.0 + u * (0.5 + u * (0.3333333333333333 + u * 0.25)))
    return tl.where(u < SERIES_BELOW, series, -tl.log(1.0 - u))


@triton.jit
def philox_bits(key_lo, key_hi, counter):
    """Philox-4x32-10 (Salmon et al., 2011), the rounds of triton.language.random: the first word
    of the block of counter (counter, 0, 0, 0) under key (key_lo, key_hi), all uint32 blocks that
    broadcast together. tl.randint gives the same bits for a scalar seed key_hi * 2**32 + key_lo;
    here each row of a tile brings its own key."""
    c0 = counter
    c1 = counter * 0
    c2 = c1
    c3 = c1
    k0 = key_lo
    k1 = key_hi
    for _ in tl.static_range(10):
        prev0, prev2 = c0, c2
        c0 = tl.umulhi(ROUND_B, prev2) ^ c1 ^ k0
        c2 = tl.umulhi(ROUND_A, prev0) ^ c3 ^ k1
        c1 = ROUND_B * prev2
        c3 = ROUND_A * prev0
        k0 = k0 + KEY_A
        k1 = k1 + KEY_B
    return c0


@triton.jit(do_not_specialize=["num_rows"])  # one compiled variant whatever the batch size
def gumbel_argmax_kernel(
    z_ptr,
    keys_ptr,
    best_score_ptr,
    best_index_ptr,
    num_rows,
    vocab,
    stride_z,
    range_len,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (tile, range): rows [tile * ROWS, tile * ROWS + ROWS) over vocabulary range `range`;
    writes best_score[row, range] and best_index[row, range] (int64), both [R, num_ranges]
    contiguous. range_len is a multiple of BLOCK; ROWS > 1 only with one range per row."""
    part = tl.program_id(1)
    num_parts = tl.num_programs(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < num_rows
    key = tl.load(keys_ptr + rows, mask=live, other=0).to(tl.uint64, bitcast=True)
    key_lo = low_word_column(key & 0xFFFFFFFF)
    key_hi = low_word_column(key >> 32)
    start = part * range_len
    end = tl.minimum(start + range_len, vocab)
    lanes = tl.arange(0, BLOCK)
    row_z = z_ptr + rows.to(tl.int64)[:, None] * stride_z
    best = tl.full([ROWS, BLOCK], float("-inf"), tl.float32)
    best_index = tl.zeros([ROWS, BLOCK], tl.int32) + (start + lanes)[None, :]
    for tile in range(start, end, BLOCK):
        index = tile + lanes
        inside = live[:, None] & (index < end)[None, :]
        z = tl.load(row_z + index[None, :], mask=inside, other=float("-inf")).to(tl.float32)
        bits = philox_bits(key_lo, key_hi, index.to(tl.uint32)[None, :])
        u = (bits.to(tl.float32) + 0.5) * TWO_TO_MINUS_32
        score = z - tl.log(exponential_of_uniform(u))
        better = score > best  # strict: on a tie the lane keeps its earlier (smaller) index
        best = tl.where(better, score, best)
        best_index = tl.where(better, index[None, :], best_index)
    top = tl.max(best, axis=1)
    first = tl.min(tl.where(best == top[:, None], best_index, vocab), axis=1)
    out = rows * num_parts + part
    tl.store(best_score_ptr + out, top, mask=live)
    tl.store(best_index_ptr + out, first.to(tl.int64), mask=live)


@triton.jit
def low_word_column(word):
    """A uint64 block [ROWS] -> its low 32 bits as a uint32 column [ROWS, 1]."""
    return word.to(tl.uint32)[:, None]
