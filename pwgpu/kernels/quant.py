"""Quantise and dequantise kernels for every precision, reading and writing the packed layout
of ``layout.py`` through a page table (the GPU side of a downgrade: quantise the resident copy
straight into fresh pages, then flip the table entry).

Rounding is defined so that these kernels and ``reference.quantize_ref`` produce the same bytes:
IEEE division (``div_rn``), codes rounded half up (``floor(x + 0.5)``), FP8 rounded to nearest
even. Shape legend: N = output rows, K = input columns.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pwgpu.kernels.layout import (
    AMAX_FLOOR,
    FMT_BF16,
    FMT_FP8,
    FMT_FP8_BLOCK,
    FMT_FP16,
    FMT_INT_ASYM,
    FP8_MAX,
    SCALE_FLOOR,
    MatrixLayout,
    check_kernel_shape,
    matrix_layout,
)
from pwgpu.kernels.tile_io import cast_rne, fp8e4m3_encode, load_weight_tile, translate

# Module constants as constexpr: Triton refuses plain globals inside a kernel.
_FP16: tl.constexpr = tl.constexpr(FMT_FP16)
_BF16: tl.constexpr = tl.constexpr(FMT_BF16)
_FP8: tl.constexpr = tl.constexpr(FMT_FP8)
_FP8_BLOCK: tl.constexpr = tl.constexpr(FMT_FP8_BLOCK)
_FP8_MAX: tl.constexpr = tl.constexpr(FP8_MAX)
_AMAX_FLOOR: tl.constexpr = tl.constexpr(AMAX_FLOOR)
_SCALE_FLOOR: tl.constexpr = tl.constexpr(SCALE_FLOOR)
MAX_BLOB_PAGE_SHIFT = 30  # a standalone blob is addressed as one 1 GiB page (logical offsets are int32)


@triton.jit
def _quantize_kernel(
    w_ptr,  # [N, K] float, row stride stride_wn
    stride_wn,
    pool,
    page_tab,
    first_page,
    N,
    K,
    scale_off,
    zero_off,
    groups_per_row,
    FMT: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE_SHIFT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]  # [BN, 1]
    row_ok = n < N
    row_bytes = K * BITS // 8
    if FMT == _FP16 or FMT == _BF16:  # noqa: SIM109 (Triton's frontend has no `in` on constexprs)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)[None, :]
            m = row_ok & (k < K)
            w = tl.load(w_ptr + n * stride_wn + k, mask=m, other=0.0)
            dst = pool + translate(page_tab, first_page, n * row_bytes + k * 2, m, PAGE_SHIFT)
            if FMT == _FP16:
                tl.store(dst.to(tl.pointer_type(tl.float16)), w.to(tl.float16), mask=m)
            else:
                # Round to nearest even by hand: the interpreter's fp32 -> bf16 cast truncates.
                bits = w.to(tl.float32).to(tl.int32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                tl.store(dst.to(tl.pointer_type(tl.int16)), bits.to(tl.int16), mask=m)
    elif FMT == _FP8_BLOCK:  # program (block row, block column); BLOCK_N == BLOCK_K == GROUP
        g = tl.program_id(1)
        k = g * GROUP + tl.arange(0, GROUP)[None, :]
        m = row_ok & (k < K)
        w = tl.load(w_ptr + n * stride_wn + k, mask=m, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(w), axis=1, keep_dims=True), axis=0, keep_dims=True)  # [1, 1]
        scale = tl.math.div_rn(tl.maximum(amax, _AMAX_FLOOR), _FP8_MAX)
        # The block's one scale, stored by the tile's first row only.
        first = (tl.arange(0, BLOCK_N)[:, None] == 0) & row_ok
        s_logical = scale_off + (tl.program_id(0) * groups_per_row + g) * 4 + tl.zeros([BLOCK_N, 1], dtype=tl.int32)
        s_dst = (pool + translate(page_tab, first_page, s_logical, first, PAGE_SHIFT)).to(tl.pointer_type(tl.float32))
        tl.store(s_dst, scale + tl.zeros([BLOCK_N, 1], dtype=tl.float32), mask=first)
        code = fp8e4m3_encode(tl.clamp(tl.math.div_rn(w, scale), -_FP8_MAX, _FP8_MAX))
        tl.store(pool + translate(page_tab, first_page, n * row_bytes + k, m, PAGE_SHIFT), code.to(tl.uint8), mask=m)
    elif GROUP == 0:  # per-channel symmetric: fp8 or int8, two passes over the row
        qmax: tl.constexpr = _FP8_MAX if FMT == _FP8 else 127.0
        amax = tl.zeros([BLOCK_N, 1], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)[None, :]
            w = tl.load(w_ptr + n * stride_wn + k, mask=row_ok & (k < K), other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(w), axis=1, keep_dims=True))
        scale = tl.math.div_rn(tl.maximum(amax, _AMAX_FLOOR), qmax)
        s_dst = (pool + translate(page_tab, first_page, scale_off + n * 4, row_ok, PAGE_SHIFT)).to(
            tl.pointer_type(tl.float32)
        )
        tl.store(s_dst, scale, mask=row_ok)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)[None, :]
            m = row_ok & (k < K)
            w = tl.load(w_ptr + n * stride_wn + k, mask=m, other=0.0).to(tl.float32)
            scaled = tl.clamp(tl.math.div_rn(w, scale), -qmax, qmax)
            if FMT == _FP8:  # noqa: SIM108 (constexpr branch: one format's code is compiled)
                code = fp8e4m3_encode(scaled)
            else:
                code = tl.floor(scaled + 0.5).to(tl.int32) & 0xFF
            tl.store(
                pool + translate(page_tab, first_page, n * row_bytes + k, m, PAGE_SHIFT), code.to(tl.uint8), mask=m
            )
    else:  # asymmetric groups: program (row block, group); BLOCK_K == GROUP
        qmax_i: tl.constexpr = (1 << BITS) - 1
        g = tl.program_id(1)
        k = g * GROUP + tl.arange(0, GROUP)[None, :]
        w = tl.load(w_ptr + n * stride_wn + k, mask=row_ok & (k < K), other=0.0).to(tl.float32)
        lo = tl.minimum(tl.min(w, axis=1, keep_dims=True), 0.0)  # range holds 0: padding is harmless
        hi = tl.maximum(tl.max(w, axis=1, keep_dims=True), 0.0)
        scale16 = tl.maximum(tl.math.div_rn(hi - lo, qmax_i * 1.0), _SCALE_FLOOR).to(tl.float16)
        scale = scale16.to(tl.float32)
        zero = tl.clamp(tl.floor(tl.math.div_rn(-lo, scale) + 0.5), 0.0, qmax_i * 1.0)
        q = tl.clamp(tl.floor(tl.math.div_rn(w, scale) + 0.5) + zero, 0.0, qmax_i * 1.0).to(tl.int32)
        g_idx = n * groups_per_row + g
        s_dst = (pool + translate(page_tab, first_page, scale_off + g_idx * 2, row_ok, PAGE_SHIFT)).to(
            tl.pointer_type(tl.float16)
        )
        tl.store(s_dst, scale16, mask=row_ok)
        z_dst = pool + translate(page_tab, first_page, zero_off + g_idx, row_ok, PAGE_SHIFT)
        tl.store(z_dst, zero.to(tl.uint8), mask=row_ok)
        # Pack PER_WORD codes into WORD_BYTES bytes (int4: 2 -> 1, int2: 4 -> 1, int3: 8 -> 3).
        PER_WORD: tl.constexpr = 8 if BITS == 3 else 8 // BITS
        WORD_BYTES: tl.constexpr = PER_WORD * BITS // 8
        NUM_WORDS: tl.constexpr = GROUP // PER_WORD
        shifts = tl.arange(0, PER_WORD) * BITS
        words = tl.sum(tl.reshape(q, (BLOCK_N, NUM_WORDS, PER_WORD)) << shifts[None, None, :], axis=2)
        w_idx = g * NUM_WORDS + tl.arange(0, NUM_WORDS)[None, :]  # word index in the row
        w_ok = row_ok & (w_idx * PER_WORD < K)
        for j in tl.static_range(WORD_BYTES):
            logical = n * row_bytes + w_idx * WORD_BYTES + j
            dst = pool + translate(page_tab, first_page, logical, w_ok, PAGE_SHIFT)
            tl.store(dst, ((words >> (8 * j)) & 0xFF).to(tl.uint8), mask=w_ok)


@triton.jit
def _dequantize_kernel(
    out_ptr,  # [N, K] out dtype, contiguous
    pool,
    page_tab,
    first_page,
    N,
    K,
    scale_off,
    zero_off,
    groups_per_row,
    FMT: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE_SHIFT: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    EXACT_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    m = (n < N) & (k < K)
    w = load_weight_tile(
        pool, page_tab, first_page, n, k, 0, m, N, K, scale_off, zero_off, groups_per_row,
        FMT, BITS, GROUP, PAGE_SHIFT, False, False, FP8_NATIVE,
    )  # fmt: skip
    tl.store(out_ptr + n * K + k, cast_rne(w, out_ptr.dtype.element_ty, EXACT_BF16), mask=m)


def page_shift(page_bytes: int) -> int:
    if page_bytes <= 0 or page_bytes & (page_bytes - 1) or page_bytes > 1 << MAX_BLOB_PAGE_SHIFT:
        raise ValueError(f"page_bytes(={page_bytes}) must be a power of two <= 1 GiB (in-page offsets are int32)")
    return page_bytes.bit_length() - 1


def interpreting() -> bool:
    """True when kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def fp8_native(device: torch.device) -> bool:
    """Hardware FP8 conversions exist from sm_89 (Ada, Hopper); the interpreter has them too."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _blob_table(num_bytes: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """A page table that maps a standalone blob as one page at offset 0."""
    shift = max(4, (max(num_bytes, 1) - 1).bit_length())
    if shift > MAX_BLOB_PAGE_SHIFT:
        raise ValueError(f"a {num_bytes}-byte blob is too large to address as one page; use quantize_into")
    return torch.zeros(1, dtype=torch.int64, device=device), 1 << shift


def quantize_into(
    w: torch.Tensor,
    precision: str,
    pool: torch.Tensor,
    page_offsets: torch.Tensor,
    first_page: int,
    page_bytes: int,
) -> MatrixLayout:
    """Quantise ``w[N, K]`` into the pages ``page_offsets[first_page:]`` of ``pool`` (uint8)."""
    if w.dim() != 2 or w.stride(1) != 1:
        raise ValueError(f"w must be a row-major 2-D matrix, got shape {tuple(w.shape)} strides {w.stride()}")
    if pool.dtype != torch.uint8 or page_offsets.dtype != torch.int64:
        raise ValueError(f"pool must be uint8 and page_offsets int64, got {pool.dtype} and {page_offsets.dtype}")
    n, k = w.shape
    lay = matrix_layout(precision, n, k)
    check_kernel_shape(lay)
    block_n = 16
    if lay.fmt == FMT_FP8_BLOCK:  # one program per scale block
        block_n = block_k = lay.group_size
        grid = (triton.cdiv(n, block_n), lay.groups_per_row)
    elif lay.fmt == FMT_INT_ASYM:
        grid, block_k = (triton.cdiv(n, block_n), lay.groups_per_row), lay.group_size
    else:
        grid, block_k = (triton.cdiv(n, block_n),), 128
    _quantize_kernel[grid](
        w, w.stride(0), pool, page_offsets, first_page, n, k, lay.scale_offset, lay.zero_offset,
        max(lay.groups_per_row, 1), lay.fmt, lay.bits, lay.group_size, page_shift(page_bytes), block_n, block_k,
    )  # fmt: skip
    return lay


def dequantize_from(
    pool: torch.Tensor,
    page_offsets: torch.Tensor,
    first_page: int,
    page_bytes: int,
    precision: str,
    n: int,
    k: int,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The matrix at ``page_offsets[first_page:]`` -> ``W[n, k]`` in ``dtype``."""
    lay = matrix_layout(precision, n, k)
    check_kernel_shape(lay)
    out = torch.empty(n, k, dtype=dtype, device=pool.device)
    block_n, block_k = 16, 64
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequantize_kernel[grid](
        out, pool, page_offsets, first_page, n, k, lay.scale_offset, lay.zero_offset, max(lay.groups_per_row, 1),
        lay.fmt, lay.bits, lay.group_size or 1, page_shift(page_bytes), fp8_native(pool.device), interpreting(),
        block_n, block_k,
    )  # fmt: skip
    return out


def quantize(w: torch.Tensor, precision: str) -> torch.Tensor:
    """``w[N, K]`` -> a standalone packed blob ``uint8[matrix_bytes(N, K)]``."""
    n, k = w.shape
    num_bytes = matrix_layout(precision, n, k).total_bytes
    blob = torch.empty(num_bytes, dtype=torch.uint8, device=w.device)  # every byte is written
    table, page_bytes = _blob_table(num_bytes, w.device)
    quantize_into(w.contiguous(), precision, blob, table, 0, page_bytes)
    return blob


def dequantize(blob: torch.Tensor, precision: str, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A standalone packed blob -> ``W[n, k]`` in ``dtype``."""
    table, page_bytes = _blob_table(blob.numel(), blob.device)
    return dequantize_from(blob, table, 0, page_bytes, precision, n, k, dtype)
