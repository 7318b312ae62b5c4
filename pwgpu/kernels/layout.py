"""The packed layout of one expert matrix ``W[N, K]``, and the page table that locates it.

This is the one place the byte layout is defined; ``quant.py`` writes it, ``moe_gemm.py`` and
``reference.py`` read it, and its size is exactly ``Precision.matrix_bytes(N, K)``.

Blob of one matrix (sections back to back, no padding, so the size is exact):

    [ data | scales | zeros ]

- data: element ``(n, k)`` is bit-field ``[b*(n*K + k), b*(n*K + k) + b)`` of a little-endian
  bit stream (``b`` = weight bits). Rows start on a byte boundary: ``K * b`` must be a multiple
  of 8 for sub-byte formats, and int3 packs 8 elements into 3 bytes, so int3 needs ``K % 8 == 0``.
  - bf16 / fp16: the raw 2-byte values, row-major.
  - fp8: E4M3 (``float8_e4m3fn``) codes, one byte each; ``w = code * scale[n]``.
  - fp8-b128: E4M3 codes; ``w = code * scale[n // 128, k // 128]``: one scale per 128 x 128
    block, ragged at the edges. Data then scales is exactly a DeepSeek-V3 FP8 checkpoint's
    ``weight`` bytes followed by its ``weight_scale_inv`` bytes.
  - int8: two's-complement int8 codes; ``w = code * scale[n]`` (symmetric, codes in [-127, 127]).
  - int4 / int3 / int2: unsigned codes ``q`` in ``[0, 2**b - 1]``, asymmetric:
    ``w = (q - zero[n, g]) * scale[n, g]`` with ``g = k // group_size``.
- scales: per-channel formats (fp8, int8): ``scale[N]`` float32. Grouped formats:
  ``scale[N, ceil(K / group_size)]`` float16, row-major. fp8-b128:
  ``scale[ceil(N / 128), ceil(K / 128)]`` float32, row-major.
- zeros (grouped formats only): ``zero[N, ceil(K / group_size)]`` uint8, row-major.

Kernels read the scale section through a typed pointer, so the scale section's offset (= data
bytes) must be a multiple of the scale's size: true for every real shape (N, K multiples of 8);
``check_kernel_shape`` says so clearly for the odd ones.

Page table (one per MoE layer, one pool for the whole GPU):

    pool          uint8  [pool_bytes]        the unified page pool (KV blocks and weight pages)
    page_offsets  int64  [num_pages]         byte offset in ``pool`` of each listed page
    first_page    int32  [E, 3]              for expert e, matrix j (w1 gate, w3 up, w2 down):
                                             index into ``page_offsets`` of the matrix's first page

Matrix (e, j)'s logical byte ``L`` lives at
``pool[page_offsets[first_page[e, j] + L // page_bytes] + L % page_bytes]``: its pages are
listed consecutively in ``page_offsets`` but may lie anywhere in ``pool``, in any order.
``page_bytes`` is a power of two and every page offset a multiple of 16 (vector loads).
This matches ``pagedweight.core.pagetable.ExpertPageTable``: each matrix starts on a fresh page,
``page_offsets = pages * page_bytes`` with the expert's pages in matrix order. A precision
change rewrites the expert's row of ``first_page`` (and ``precision_ids``): a table edit.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedweight.core.spec import Precision, get_precision

# Format codes the kernels specialise on (tl.constexpr), one per storage family.
FMT_FP16, FMT_BF16, FMT_FP8, FMT_INT_SYM, FMT_INT_ASYM, FMT_FP8_BLOCK = 0, 1, 2, 3, 4, 5
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_FLOOR = 2.0**-14  # smallest normal fp16: a grouped scale never underflows when stored
AMAX_FLOOR = 1e-12  # all-zero rows get a tiny positive scale instead of a division by zero
MATRIX_NAMES = ("w1", "w3", "w2")  # the order of ``first_page``'s columns (ModelSpec.expert_matrices)


@dataclass(frozen=True)
class MatrixLayout:
    """Where each section of one packed ``W[n, k]`` starts, in bytes from the blob's start."""

    precision: str
    n: int
    k: int
    fmt: int
    bits: int
    group_size: int  # 0 for per-channel scales or no scales
    groups_per_row: int  # scale (and zero) entries per row (per block row for fp8-b128)
    group_rows: int  # rows sharing one scale: 1, or 128 for fp8-b128 (square blocks)
    scale_bytes_each: int  # 4 (fp32), 2 (fp16) or 0
    data_bytes: int
    scale_offset: int
    zero_offset: int
    total_bytes: int

    @property
    def row_bytes(self) -> int:
        return self.k * self.bits // 8

    @property
    def qmax(self) -> int:
        """Largest code of an asymmetric integer format."""
        return (1 << self.bits) - 1


def format_code(p: Precision) -> int:
    if p.name == "fp16":
        return FMT_FP16
    if p.name == "bf16":
        return FMT_BF16
    if p.kind == "float":
        return FMT_FP8_BLOCK if p.group_rows > 1 else FMT_FP8
    return FMT_INT_ASYM if p.zero_bits else FMT_INT_SYM


def matrix_layout(precision: str | Precision, n: int, k: int) -> MatrixLayout:
    p = get_precision(precision) if isinstance(precision, str) else precision
    if p.weight_bits not in (2, 3, 4, 8, 16):
        raise ValueError(f"precision {p.name}: {p.weight_bits}-bit weights have no kernel layout")
    data_bytes = (n * k * p.weight_bits + 7) // 8
    groups_per_row = 0 if p.scale_bits == 0 else (1 if p.group_size is None else -(-k // p.group_size))
    if p.group_rows > 1 and (p.group_rows != p.group_size or p.zero_bits):
        raise ValueError(f"precision {p.name}: only square symmetric blocks have a kernel layout")
    scale_each = p.scale_bits // 8
    scale_offset = data_bytes
    zero_offset = scale_offset + -(-n // p.group_rows) * groups_per_row * scale_each
    total = zero_offset + (n * groups_per_row * p.zero_bits + 7) // 8
    if total != p.matrix_bytes(n, k):
        raise AssertionError(f"layout of {p.name} [{n}, {k}] is {total} bytes, spec says {p.matrix_bytes(n, k)}")
    return MatrixLayout(
        precision=p.name,
        n=n,
        k=k,
        fmt=format_code(p),
        bits=p.weight_bits,
        group_size=p.group_size or 0,
        groups_per_row=groups_per_row,
        group_rows=p.group_rows,
        scale_bytes_each=scale_each,
        data_bytes=data_bytes,
        scale_offset=scale_offset,
        zero_offset=zero_offset,
        total_bytes=total,
    )


def elements_per_word(bits: int) -> int:
    """Elements that fill a whole number of bytes: 2 for int4, 4 for int2, 8 for int3, 1 else."""
    return {2: 4, 3: 8, 4: 2}.get(bits, 1)


def check_kernel_shape(layout: MatrixLayout) -> None:
    """Raise a clear error for the shapes the packed kernels do not address."""
    per_word = elements_per_word(layout.bits)
    if layout.k % per_word:
        raise ValueError(f"{layout.precision} [{layout.n}, {layout.k}]: K must be a multiple of {per_word}")
    if layout.scale_bytes_each and layout.scale_offset % layout.scale_bytes_each:
        raise ValueError(
            f"{layout.precision} [{layout.n}, {layout.k}]: scale section at byte {layout.scale_offset} "
            f"is not {layout.scale_bytes_each}-byte aligned"
        )
