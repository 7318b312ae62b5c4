"""Triton device functions that read and write the packed layout of ``layout.py`` through the
page table: address translation, FP8 encode/decode, the weight-tile loader shared by the
dequantiser and the MoE GEMM, and the GEMM's inner step (``mma_chunk``).

Index arguments are broadcastable tensors (``n`` output rows, ``k`` input columns); the
functions work elementwise, so the same code loads a ``[BLOCK_N, BLOCK_K]`` tile for the
dequantiser and a ``[BLOCK_K, BLOCK_N]`` (transposed) tile for the GEMM.

ROW_CHUNK: when a row's chunk of ``BLOCK_K`` weights can never straddle a page (the launcher
checks: chunk bytes divide both the row bytes and the page bytes, and a chunk sits inside one
scale group), the page table is consulted once per row per chunk instead of once per element,
and loads inside the chunk are contiguous.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pwgpu.kernels.layout import FMT_BF16, FMT_FP8, FMT_FP8_BLOCK, FMT_FP16, FMT_INT_ASYM, FMT_INT_SYM

_FP16: tl.constexpr = tl.constexpr(FMT_FP16)
_BF16: tl.constexpr = tl.constexpr(FMT_BF16)
_FP8: tl.constexpr = tl.constexpr(FMT_FP8)
_FP8_BLOCK: tl.constexpr = tl.constexpr(FMT_FP8_BLOCK)
_INT_SYM: tl.constexpr = tl.constexpr(FMT_INT_SYM)
_INT_ASYM: tl.constexpr = tl.constexpr(FMT_INT_ASYM)


@triton.jit
def translate(page_tab, first_page, logical, mask, PAGE_SHIFT: tl.constexpr):
    """Logical byte of a matrix -> byte offset in the pool (int64)."""
    base = tl.load(page_tab + first_page + (logical >> PAGE_SHIFT), mask=mask, other=0)
    return base + (logical & ((1 << PAGE_SHIFT) - 1))


@triton.jit
def round_half_even(x):
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    return tl.where(tie & ((r.to(tl.int32) & 1) == 1), r - 1.0, r)


@triton.jit
def cast_rne(x, dtype: tl.constexpr, BY_HAND: tl.constexpr):
    """``x.to(dtype)``, with fp32 -> bf16 rounded to nearest even by hand when BY_HAND: the
    interpreter's own bf16 cast truncates (triton 3.9), which would break bit-exact tests."""
    if BY_HAND and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        out = x.to(dtype)
    return out


@triton.jit
def fp8e4m3_encode(v):
    """fp32 with |v| <= 448 -> float8_e4m3fn code (int32 in [0, 255]), round to nearest even.

    Done with integer arithmetic rather than a native cast so that it is exact on every device
    and in the interpreter (whose fp8 cast mis-rounds some values, e.g. -31.07 -> -16).
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = tl.abs(v)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # below 2^-6: subnormal
    # a * 2^(3 - e) counts mantissa steps; exact, since it only changes the exponent.
    steps = a * ((127 + 3 - e) << 23).to(tl.float32, bitcast=True)
    # (e + 7) * 8 + (steps - 8) for normals, steps for subnormals; a carry to 16 bumps e.
    code = (e + 6) * 8 + round_half_even(steps).to(tl.int32)
    return code | (sign << 7)


@triton.jit
def fp8e4m3_decode(code, NATIVE: tl.constexpr):
    """float8_e4m3fn code (uint8) -> fp32. NATIVE uses the hardware conversion (sm_89+)."""
    if NATIVE:
        out = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        c = code.to(tl.int32)
        e = (c >> 3) & 15
        m = (c & 7).to(tl.float32)
        pow2 = (tl.maximum(e - 10 + 127, 1) << 23).to(tl.float32, bitcast=True)  # 2^(e - 10)
        mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * pow2)  # subnormal step is 2^-9
        out = tl.where((c & 0x80) != 0, -mag, mag)
    return out


@triton.jit
def load_weight_tile(
    pool,
    page_tab,
    first_page,
    n,
    k,
    k0,
    mask,
    N,
    K,
    scale_off,
    zero_off,
    groups_per_row,
    FMT: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE_SHIFT: tl.constexpr,
    ROW_CHUNK: tl.constexpr,
    CHUNK_ALIGN16: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
):
    """Dequantised weights ``W[n, k]`` of one expert matrix, fp32.

    ``k0`` is the first column of the current chunk (used when ROW_CHUNK). Masked-out elements
    are 0 and never touch memory outside the matrix's pages.
    """
    row_bytes = K * BITS // 8
    row_mask = n < N  # shaped like n: per-row lookups
    if ROW_CHUNK:
        chunk = translate(page_tab, first_page, n * row_bytes + k0 * BITS // 8, row_mask, PAGE_SHIFT)
        if CHUNK_ALIGN16:  # chunk bytes % 16 == 0 and pages 16-aligned: lets loads vectorise
            chunk = tl.multiple_of(chunk, [16, 16])  # index tensors are 2-D
    # One return at the end: the compiler types every `return` of a function alike, constexpr
    # branches included, so each branch leaves an fp32 tile in `w`.
    if FMT == _FP16 or FMT == _BF16:  # noqa: SIM109 (Triton's frontend has no `in` on constexprs)
        dt = tl.float16 if FMT == _FP16 else tl.bfloat16
        if ROW_CHUNK:
            ptr = (pool + chunk).to(tl.pointer_type(dt)) + (k - k0)
        else:
            ptr = (pool + translate(page_tab, first_page, n * row_bytes + k * 2, mask, PAGE_SHIFT)).to(
                tl.pointer_type(dt)
            )
        w = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    elif BITS == 8:
        if ROW_CHUNK:
            code = tl.load(pool + chunk + (k - k0), mask=mask, other=0)
        else:
            code = tl.load(
                pool + translate(page_tab, first_page, n * row_bytes + k, mask, PAGE_SHIFT), mask=mask, other=0
            )
        if FMT == _FP8_BLOCK:
            # One fp32 scale per GROUP x GROUP block: per row per chunk when the chunk lies in
            # one block column (ROW_CHUNK), else per element.
            if ROW_CHUNK:
                s_idx = (n // GROUP) * groups_per_row + k0 // GROUP
                s_mask = row_mask
            else:
                s_idx = (n // GROUP) * groups_per_row + k // GROUP
                s_mask = mask
        else:  # per-channel scale: one fp32 per row, looked up per row whatever the mode
            s_idx = n
            s_mask = row_mask
        s_ptr = (pool + translate(page_tab, first_page, scale_off + s_idx * 4, s_mask, PAGE_SHIFT)).to(
            tl.pointer_type(tl.float32)
        )
        scale = tl.load(s_ptr, mask=s_mask, other=0.0)
        if FMT == _FP8 or FMT == _FP8_BLOCK:  # noqa: SIM109
            w = fp8e4m3_decode(code, FP8_NATIVE) * scale
        else:
            w = code.to(tl.int8, bitcast=True).to(tl.float32) * scale
    else:
        # Sub-byte asymmetric codes: bit field [BITS * k, BITS * k + BITS) of the row.
        bit = k * BITS
        shift = bit & 7
        logical = n * row_bytes + (bit >> 3)
        if ROW_CHUNK:  # noqa: SIM108 (a constexpr branch: `chunk` exists only when ROW_CHUNK)
            addr = chunk + ((k - k0) * BITS >> 3)
        else:
            addr = translate(page_tab, first_page, logical, mask, PAGE_SHIFT)
        word = tl.load(pool + addr, mask=mask, other=0).to(tl.int32)
        if BITS == 3:  # a 3-bit field may spill into the next byte (same 3-byte word, same page chunk)
            spill = mask & (shift > 5)
            if ROW_CHUNK:  # noqa: SIM108 (constexpr branch, as above)
                addr1 = addr + 1
            else:
                addr1 = translate(page_tab, first_page, logical + 1, spill, PAGE_SHIFT)
            word = word | (tl.load(pool + addr1, mask=spill, other=0).to(tl.int32) << 8)
        code = (word >> shift) & ((1 << BITS) - 1)
        if ROW_CHUNK:
            g_idx = n * groups_per_row + k0 // GROUP
            g_mask = row_mask
        else:
            g_idx = n * groups_per_row + k // GROUP
            g_mask = mask
        s_ptr = (pool + translate(page_tab, first_page, scale_off + g_idx * 2, g_mask, PAGE_SHIFT)).to(
            tl.pointer_type(tl.float16)
        )
        scale = tl.load(s_ptr, mask=g_mask, other=0.0).to(tl.float32)
        z_ptr = pool + translate(page_tab, first_page, zero_off + g_idx, g_mask, PAGE_SHIFT)
        zero = tl.load(z_ptr, mask=g_mask, other=0).to(tl.float32)
        w = (code.to(tl.float32) - zero) * scale
    return w


@triton.jit
def mma(a, w, acc, DOT_FP32: tl.constexpr):
    """acc += a @ w with w rounded to a's dtype first (what the tensor cores see)."""
    if DOT_FP32:  # the interpreter's bf16 tl.dot returns garbage (triton 3.9): multiply in fp32
        w = cast_rne(w, a.dtype, True).to(tl.float32)
        out = tl.dot(a.to(tl.float32), w, acc, input_precision="ieee")
    else:
        out = tl.dot(a, w.to(a.dtype), acc)
    return out


@triton.jit
def mma_chunk(
    acc,
    a_rows,  # [BM, 1] pointers to the activation rows
    a_ok,  # [BM, 1] valid rows
    k0,
    pool,
    page_tab,
    first_page,
    n,  # [1, BN] output rows of W
    N,
    K,
    scale_off,
    zero_off,
    groups_per_row,
    FMT: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE_SHIFT: tl.constexpr,
    ROW_CHUNK: tl.constexpr,
    CHUNK_ALIGN16: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """acc[BM, BN] += A[:, k0:k0 + BLOCK_K] @ W[n, k0:k0 + BLOCK_K]^T.

    PACKED (int4/int2 with ROW_CHUNK): load the chunk's packed bytes as one contiguous
    [BLOCK_K / PER, BN] tile and split it into PER sub-tiles, the p-th holding columns
    k0 + PER * j + p, each multiplied with the matching strided columns of A. The unpacked
    path addresses every weight's byte separately: compiled for sm_90 that is one 1-byte load
    per weight (no vector loads), against 16-byte async copies here.
    """
    if PACKED:
        PER: tl.constexpr = 8 // BITS
        j = tl.arange(0, BLOCK_K // PER)[:, None]  # [BK / PER, 1]: byte within the row chunk
        row_mask = n < N
        chunk = translate(page_tab, first_page, n * (K * BITS // 8) + k0 * BITS // 8, row_mask, PAGE_SHIFT)
        if CHUNK_ALIGN16:
            chunk = tl.multiple_of(chunk, [16, 16])
        # ROW_CHUNK implies K % BLOCK_K == 0, so the chunk is whole: a row mask only, constant
        # along j, which lets the compiler issue 16-byte loads (a mask on k0 + j * PER does not).
        byte = tl.load(pool + chunk + j, mask=row_mask, other=0).to(tl.int32)
        g_idx = n * groups_per_row + k0 // GROUP  # the chunk lies inside one scale group
        s_ptr = (pool + translate(page_tab, first_page, scale_off + g_idx * 2, row_mask, PAGE_SHIFT)).to(
            tl.pointer_type(tl.float16)
        )
        scale = tl.load(s_ptr, mask=row_mask, other=0.0).to(tl.float32)
        zero = tl.load(pool + translate(page_tab, first_page, zero_off + g_idx, row_mask, PAGE_SHIFT), mask=row_mask)
        zero = zero.to(tl.float32)
        for p in tl.static_range(PER):
            w = (((byte >> (p * BITS)) & ((1 << BITS) - 1)).to(tl.float32) - zero) * scale
            kk = k0 + tl.arange(0, BLOCK_K // PER)[None, :] * PER + p
            a = tl.load(a_rows + kk, mask=a_ok & (kk < K), other=0)
            acc = mma(a, w, acc, DOT_FP32)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + kk[None, :], mask=a_ok & (kk[None, :] < K), other=0)
        k = kk[:, None]  # [BK, 1]: the weight tile is W^T
        w = load_weight_tile(
            pool, page_tab, first_page, n, k, k0, (k < K) & (n < N), N, K, scale_off, zero_off, groups_per_row,
            FMT, BITS, GROUP, PAGE_SHIFT, ROW_CHUNK, CHUNK_ALIGN16, FP8_NATIVE,
        )  # fmt: skip
        acc = mma(a, w, acc, DOT_FP32)
    return acc
