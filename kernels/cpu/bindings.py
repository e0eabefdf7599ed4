"""The C library's ctypes signatures, and one typed wrapper per kernel.

`load()` builds (build.py) and loads the library once per process, declaring every function's
argument and result types; None where there is no compiler, the build fails or the platform is
not Linux, with the reason logged once (the fast path then stays off: kernels/cpu/fast_path.py).
Each wrapper below (those of the panel products: panel_bindings.py) takes torch tensors, checks
nothing the caller already guarantees (its docstring says what it expects) and raises on a
kernel's error status.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess

import torch

from . import build

log = logging.getLogger(__name__)


@functools.cache
def load(march: str = "native") -> ctypes.CDLL | None:
    """The compiled library, or None (no compiler, a failed build, not Linux), said once.
    `march`: what it is compiled for (build.build; tests load an x86-64-v3 build to run the
    AVX2 paths of an AVX-512 CPU)."""
    try:
        path = build.build(march)
        if path is None:
            log.warning("no C compiler: the CPU kernels stay on their torch paths")
            return None
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("CPU kernels in C unavailable (%s): using the torch paths", exc)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for attention in (lib.decode_attention, lib.decode_attention_bf16, lib.prefill_attention):
        attention.restype = ctypes.c_int
        attention.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr] + [i64] * 5
        attention.argtypes += [ctypes.c_float, ptr]
    lib.argmax_rows.restype = None
    lib.argmax_rows.argtypes = [ptr, i64, i64, i64, ptr]
    lib.greedy_head.restype = ctypes.c_int
    lib.greedy_head.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr]
    lib.screened_argmax.restype = i64
    lib.screened_argmax.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64, i64, ptr]
    lib.screened_argmax.argtypes += [ctypes.c_float, ptr]
    lib.int8_screen_available.restype = i64
    lib.int8_screen_available.argtypes = []
    lib.int8_screened_argmax.restype = i64
    lib.int8_screened_argmax.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, ptr]
    lib.int8_screened_argmax.argtypes += [ctypes.c_float, ctypes.c_float, ptr, i64, i64, ptr]
    lib.panel_linear.restype = ctypes.c_int
    lib.panel_linear.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr]
    lib.panel_width.restype = i64
    lib.panel_width.argtypes = []
    lib.panel_linear_bf16.restype = ctypes.c_int
    lib.panel_linear_bf16.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr]
    lib.greedy_head_bf16.restype = ctypes.c_int
    lib.greedy_head_bf16.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr]
    for width in (
        lib.panel_width_bf16, lib.panel_bf16_native, lib.panel_width_int8,
        lib.panel_width_bf16_weights, lib.panel_int8_dot, lib.panel_max_k_int8,
    ):  # fmt: skip
        width.restype = i64
        width.argtypes = []
    for size in (lib.panel_bytes_int8, lib.panel_bytes_bf16_weights):
        size.restype = i64
        size.argtypes = [i64]
    for narrow in (lib.panel_linear_int8, lib.panel_linear_bf16_weights):
        narrow.restype = ctypes.c_int
        narrow.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr]
    for rms_norm in (lib.rms_norm, lib.rms_norm_bf16):
        rms_norm.restype = None
        rms_norm.argtypes = [ptr, i64, ptr, ptr, ctypes.c_float, i64, i64, ptr, ptr]
    for store in (lib.store_kv, lib.store_kv_bf16):
        store.restype = ctypes.c_int
        store.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, ptr, ptr]
    for silu_mul in (lib.silu_mul, lib.silu_mul_bf16):
        silu_mul.restype = None
        silu_mul.argtypes = [ptr, i64, i64, ptr]
    for rope in (lib.rope, lib.rope_bf16):
        rope.restype = None
        rope.argtypes = [ptr] + [i64] * 5 + [ptr, ptr, ptr]
    lib.decode_stack.restype = ctypes.c_int
    lib.decode_stack.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr]
    lib.decode_inputs.restype = i64
    lib.decode_inputs.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr]
    return lib


def library_for(
    *tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)
) -> ctypes.CDLL | None:
    """The C library when every tensor is a CPU matrix with contiguous rows, all of one dtype
    among `dtypes` (the elementwise kernels take fp32 or bf16), else None."""
    for t in tensors:
        if t.device.type != "cpu" or t.dtype not in dtypes or t.dim() != 2 or t.stride(-1) != 1:
            return None
    if any(t.dtype != tensors[0].dtype for t in tensors):
        return None
    return load()


def paged_attention(
    lib: ctypes.CDLL,
    rows: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Fill out's rows of one kind; the others are untouched. rows="decode": sequences of one
    query token (cpu_decode.c; over a bf16 cache cpu_decode_bf16.c, which rounds q to bf16);
    rows="prefill": sequences computing a chunk of more than one token, causal over the cache
    (cpu_prefill.c).

    Takes fp32 CPU tensors (for rows="decode" the caches may be bf16); q, out, caches
    contiguous; the int32 metadata contiguous."""
    if rows == "decode" and k_cache.dtype == torch.bfloat16:
        function = lib.decode_attention_bf16
    else:
        function = {"decode": lib.decode_attention, "prefill": lib.prefill_attention}[rows]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    status = function(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        query_start_loc.data_ptr(),
        seq_lens.numel(),
        block_size,
        q.shape[1],
        num_kv_heads,
        head_dim,
        scale,
        out.data_ptr(),
    )
    if status != 0:
        raise MemoryError(f"{rows} attention could not allocate its score buffer")


def argmax_rows(lib: ctypes.CDLL, logits: torch.Tensor) -> torch.Tensor:
    """[N, V] fp32 CPU logits (rows may be strided, columns contiguous) -> [N] int64: the first
    maximum of each row, as logits.max(dim=-1).indices."""
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.argmax_rows(
        logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr()
    )
    return out


def screened_argmax(
    lib: ctypes.CDLL,
    hidden: torch.Tensor,
    approx: torch.Tensor,
    weight: torch.Tensor,
    col_norms: torch.Tensor,
    factor: float,
) -> tuple[torch.Tensor, int]:
    """hidden [N, H] fp32 (rows may be strided, columns contiguous), approx [N, V] bf16
    (contiguous), weight [V, H] fp32 (any strides), col_norms [V] fp32 -> ([N] int64: each row's
    token, or -1 where the row needs the exact head; how many rows got -1) (see cpu_screen.c)."""
    out = torch.empty(hidden.shape[0], dtype=torch.int64)
    unsettled = lib.screened_argmax(
        hidden.data_ptr(),
        hidden.shape[0],
        hidden.shape[1],
        hidden.stride(0),
        approx.data_ptr(),
        approx.shape[1],
        weight.data_ptr(),
        weight.stride(0),
        weight.stride(1),
        col_norms.data_ptr(),
        factor,
        out.data_ptr(),
    )
    return out, unsettled


def int8_screened_argmax(
    lib: ctypes.CDLL,
    hidden: torch.Tensor,
    packed: torch.Tensor,
    vocab: int,
    column_terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    largest: tuple[float, float],
    weight: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """hidden [N, H] fp32 (rows may be strided, columns contiguous), packed [blocks, kpad / 64,
    16, 16, 4] int8, column_terms three [>= vocab] fp32 (scales, residual norms, int8 norms) and
    `largest` the largest residual and int8 norms, weight [vocab, H] fp32 (any strides) -> ([N]
    int64 tokens, -1 where a row needs the exact head; how many rows got -1) (see
    cpu_screen_int8.c). Call only where lib.int8_screen_available()."""
    out = torch.empty(hidden.shape[0], dtype=torch.int64)
    scale, res, norm = column_terms
    unsettled = lib.int8_screened_argmax(
        hidden.data_ptr(),
        hidden.shape[0],
        hidden.shape[1],
        hidden.stride(0),
        packed.data_ptr(),
        vocab,
        packed.shape[1] * 64,
        scale.data_ptr(),
        res.data_ptr(),
        norm.data_ptr(),
        *largest,
        weight.data_ptr(),
        weight.stride(0),
        weight.stride(1),
        out.data_ptr(),
    )
    if unsettled < 0:
        raise RuntimeError("this build or process has no AMX (check int8_screen_available)")
    return out, unsettled


def rms_norm(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [N, D] fp32 (rows may be strided), residual [N, D] contiguous or None, weight [D] ->
    (weight * normalized s, s) with s = x + residual, or (weight * normalized x, None). Or all
    three bf16 (contiguous weight): rounded as torch rounds them (cpu_elementwise_bf16.c)."""
    rows, dim = x.shape
    out = torch.empty((rows, dim), dtype=x.dtype)
    summed = None if residual is None else torch.empty((rows, dim), dtype=x.dtype)
    function = lib.rms_norm_bf16 if x.dtype == torch.bfloat16 else lib.rms_norm
    function(
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        eps,
        rows,
        dim,
        out.data_ptr(),
        None if summed is None else summed.data_ptr(),
    )
    return out, summed


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] fp32 or bf16 contiguous (rows: gate, then up) -> silu(gate) * up [N, I]
    in its dtype."""
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
    function = lib.silu_mul_bf16 if gate_up.dtype == torch.bfloat16 else lib.silu_mul
    function(gate_up.data_ptr(), rows, width // 2, out.data_ptr())
    return out


def rope(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] fp32 (D even and contiguous, tokens and heads at any stride), cos and sin
    [T, D] contiguous -> the rotated x [T, H, D], contiguous (see cpu_elementwise.c). Or all
    three bf16 (cpu_elementwise_bf16.c)."""
    tokens, heads, dim = x.shape
    out = torch.empty((tokens, heads, dim), dtype=x.dtype)
    function = lib.rope_bf16 if x.dtype == torch.bfloat16 else lib.rope
    function(
        x.data_ptr(),
        x.stride(0),
        x.stride(1),
        tokens,
        heads,
        dim,
        cos.data_ptr(),
        sin.data_ptr(),
        out.data_ptr(),
    )
    return out


def store_kv(
    lib: ctypes.CDLL,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v [T, Hkv, D] fp32 (each token's Hkv x D contiguous), caches contiguous, slot_mapping
    [T] int64 contiguous; as kernels.reference.store_kv. Or all four bf16."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    function = lib.store_kv_bf16 if k_cache.dtype == torch.bfloat16 else lib.store_kv
    status = function(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        slot_mapping.data_ptr(),
        slot_mapping.numel(),
        num_kv_heads * head_dim,
        k_cache.shape[0] * block_size,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
    )
    if status != 0:
        raise IndexError(f"store_kv: a slot lies past the cache's {k_cache.shape[0]} blocks")
