"""One token per row of filtered, temperature-scaled logits z [R, V] (float32, last dim
contiguous), drawn from softmax(z) by the exponential race argmax_i (z_i - log E_i), E_i ~ Exp(1),
each row's noise a function of its int64 key [R] alone (never of the other rows).

Two backends behind one choice (`draw_backend`):
    triton  kernels/sampling_triton.py: Philox noise in registers, one launch for the batch, no
            [R, V] noise tensor; on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (tests).
    torch   a CPU generator seeded with the row's key, its exponential noise for the row: the
            CPU serving path (no interpreter there). Its draws follow the same law, not the same
            bits, as the Triton kernel's.
"""

from __future__ import annotations

import torch

BACKENDS = ("triton", "torch")
MAX_BLOCK = 1024  # vocabulary entries per tile of the Triton program


def draw_backend(device: torch.device | str) -> str:
    """The backend that draws on `device`: Triton on CUDA, torch on the CPU."""
    return "triton" if torch.device(device).type == "cuda" else "torch"


def gumbel_argmax(
    z: torch.Tensor, keys: torch.Tensor, backend: str, min_programs: int = 0
) -> torch.Tensor:
    """z [R, V] float32, keys [R] int64 (same device) -> [R] int64 tokens on z's device.

    `min_programs` (Triton): split each row's vocabulary into ranges until about that many
    programs run (a few per SM), so that a small batch still fills the GPU."""
    if backend not in BACKENDS:
        raise ValueError(f"draw backend must be one of {BACKENDS}, got {backend!r}")
    if z.dim() != 2 or keys.shape != (z.shape[0],) or keys.dtype != torch.int64:
        raise ValueError(
            f"z must be [R, V] and keys [R] int64, got {tuple(z.shape)} and "
            f"{keys.dtype} {tuple(keys.shape)}"
        )
    if backend == "torch":
        return gumbel_argmax_torch(z, keys)
    return gumbel_argmax_triton(z, keys, ranges_per_row(z.shape, min_programs))


def ranges_per_row(shape: torch.Size, min_programs: int) -> int:
    """Vocabulary ranges per row: 1 when the rows alone reach min_programs, else enough for
    about min_programs programs, never more than the row has tiles."""
    rows, vocab = shape
    if rows == 0 or rows >= min_programs:
        return 1
    tiles = -(-vocab // MAX_BLOCK)
    return max(1, min(tiles, -(-min_programs // rows)))


def gumbel_argmax_triton(z: torch.Tensor, keys: torch.Tensor, num_ranges: int = 1) -> torch.Tensor:
    """The Triton backend with each row's vocabulary cut into `num_ranges` contiguous ranges
    (the tokens do not depend on it). A tile holds up to MAX_BLOCK entries: of one row, or of
    several rows where the vocabulary is smaller."""
    import triton

    from .sampling_triton import gumbel_argmax_kernel

    num_rows, vocab = z.shape
    if num_rows == 0:
        return torch.empty(0, dtype=torch.int64, device=z.device)
    if z.stride(1) != 1 and vocab > 1:
        raise ValueError(f"z must be contiguous in its last dim, got strides {z.stride()}")
    range_len = -(-vocab // num_ranges)
    block = min(MAX_BLOCK, triton.next_power_of_2(range_len))
    range_len = -(-range_len // block) * block
    num_ranges = -(-vocab // range_len)
    rows = 1 if num_ranges > 1 else min(MAX_BLOCK // block, triton.next_power_of_2(num_rows))
    best_score = torch.empty((num_rows, num_ranges), dtype=torch.float32, device=z.device)
    best_index = torch.empty((num_rows, num_ranges), dtype=torch.int64, device=z.device)
    grid = (-(-num_rows // rows), num_ranges)
    gumbel_argmax_kernel[grid](
        z, keys, best_score, best_index, num_rows, vocab, z.stride(0), range_len,
        ROWS=rows, BLOCK=block,
    )  # fmt: skip
    if num_ranges == 1:
        return best_index.view(num_rows)
    first_best = best_score.argmax(dim=1, keepdim=True)  # the earliest range on a tie
    return best_index.gather(1, first_best).view(num_rows)


def gumbel_argmax_torch(z: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The torch backend: one CPU generator, re-seeded with each row's key."""
    generator = torch.Generator()
    noise = torch.empty(z.shape, dtype=torch.float32)
    for row, key in enumerate(keys.tolist()):
        noise[row].exponential_(generator=generator.manual_seed(key))
    noise.clamp_(min=torch.finfo(torch.float32).tiny)  # a zero would win with any probability
    return (z - noise.to(z.device).log_()).argmax(dim=-1)
