"""Quantise / dequantise kernels against the PyTorch reference, byte for byte, plus the error
bound each format promises and the layout's exact size. Shapes are small (interpreter)."""

import pytest
import torch
import triton
import triton.language as tl

from pagedweight.core.spec import PRECISIONS, load_model
from pwgpu.kernels import quant, reference
from pwgpu.kernels.layout import check_kernel_shape, matrix_layout
from pwgpu.kernels.tile_io import fp8e4m3_decode, fp8e4m3_encode

ALL = ["bf16", "fp16", "fp8-b128", "fp8", "int8", "int4", "int3", "int2"]
SHAPES = [
    (1, 128),  # one row
    (16, 264),  # K not a multiple of the group: a partial last group
    (33, 64),  # N not a multiple of BLOCK_N; K smaller than int4's group
    (6, 8),  # tiny K: one int3 word per row (6 rows keep int3's scale section 2-byte aligned)
    (136, 200),  # fp8-b128: 2 x 2 blocks, both ragged at the edge
]


def _shape_ok(precision: str, n: int, k: int) -> bool:
    try:
        check_kernel_shape(matrix_layout(precision, n, k))
    except ValueError:
        return False
    return True


def _weights(n: int, k: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, : min(k, 5)] = torch.tensor([0.0, -0.0, 1e-9, 3.0, -2.5])[: min(k, 5)]  # zeros, tiny, outliers
    return w.to(device)


@pytest.mark.parametrize("precision", ALL)
def test_layout_size_is_the_spec_size(precision):
    shapes = [(n, k) for n, k in SHAPES] + [(3, 5), (4096, 14336), (14336, 4096), (768, 2048)]
    for name in ("mixtral-8x7b", "qwen3-30b-a3b", "tiny-moe"):
        shapes += [(n, k) for _, n, k in load_model(name).expert_matrices]
    for n, k in shapes:
        assert matrix_layout(precision, n, k).total_bytes == PRECISIONS[precision].matrix_bytes(n, k)
        if n * k <= 1 << 16 and _shape_ok(precision, n, k):  # the reference packer, on small shapes
            assert reference.quantize_ref(torch.zeros(n, k), precision).numel() == PRECISIONS[precision].matrix_bytes(
                n, k
            )


@pytest.mark.parametrize("precision", ALL)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_quantize_matches_reference_bytes(device, precision, shape):
    n, k = shape
    if not _shape_ok(precision, n, k):
        pytest.skip(f"{precision} does not address [{n}, {k}]")
    w = _weights(n, k, device)
    blob = quant.quantize(w, precision)
    ref = reference.quantize_ref(w.cpu(), precision)
    assert blob.numel() == PRECISIONS[precision].matrix_bytes(n, k)
    assert torch.equal(blob.cpu(), ref)
    # Dequantise: same fp32 values as the reference.
    out = quant.dequantize(blob, precision, n, k, torch.float32)
    torch.testing.assert_close(out.cpu(), reference.dequantize_ref(ref, precision, n, k, torch.float32), rtol=0, atol=0)


# Largest |w - dequant(quant(w))| allowed, as a multiple of the format's step: symmetric
# rounding is within half a step; asymmetric can be one step off at the range ends, where the
# zero point's own rounding shifts the grid by up to half a step.
@pytest.mark.parametrize("precision", ["fp8-b128", "fp8", "int8", "int4", "int3", "int2"])
def test_dequantized_error_is_within_the_format_bound(device, precision):
    n, k = (136, 200) if precision == "fp8-b128" else (16, 256)
    w = _weights(n, k, device, seed=1).float()
    blob = quant.quantize(w, precision)
    err = (quant.dequantize(blob, precision, n, k, torch.float32) - w).abs().cpu()
    lay = matrix_layout(precision, n, k)
    blob = blob.cpu()
    if precision in ("fp8", "fp8-b128"):
        scale = blob[lay.scale_offset : lay.zero_offset].view(torch.float32)
        if precision == "fp8":
            scale = scale[:, None]
        else:  # one scale per 128 x 128 block
            rows, cols = torch.arange(n)[:, None] // 128, torch.arange(k)[None, :] // 128
            scale = scale.view(-1, lay.groups_per_row)[rows, cols]
        # Half an ulp of a 3-bit mantissa (2^-4 relative), or half the subnormal step 2^-9.
        bound = torch.maximum(w.abs().cpu() * 2.0**-4, scale * 2.0**-10)
    elif precision == "int8":
        bound = blob[lay.scale_offset : lay.zero_offset].view(torch.float32)[:, None].expand(n, k) * 0.5
    else:
        scale = blob[lay.scale_offset : lay.zero_offset].view(torch.float16).float().view(n, -1)
        bound = scale[:, torch.arange(k) // lay.group_size]
    assert (err <= bound * (1 + 1e-5) + 1e-12).all(), f"worst excess {(err - bound).max().item()}"


@pytest.mark.parametrize("precision", ALL)
def test_quantize_into_scattered_pages(device, precision):
    """Pages of 64 bytes, shuffled over a larger pool: writes and reads go through the table."""
    n, k, page_bytes = 24, 128, 64
    w = _weights(n, k, device, seed=2)
    num_bytes = PRECISIONS[precision].matrix_bytes(n, k)
    num_pages = triton.cdiv(num_bytes, page_bytes)
    order = torch.randperm(num_pages + 6, generator=torch.Generator().manual_seed(0))[:num_pages]
    pool = torch.full(((num_pages + 6) * page_bytes,), 0xAB, dtype=torch.uint8, device=device)
    # The table lists a few unrelated pages first: the matrix starts at entry 3.
    offsets = torch.cat([torch.tensor([0, 64, 128]), order * page_bytes]).to(torch.int64).to(device)
    quant.quantize_into(w, precision, pool, offsets, 3, page_bytes)
    got = reference.gather_pages_ref(pool.cpu(), offsets.cpu(), 3, num_bytes, page_bytes)
    assert torch.equal(got, reference.quantize_ref(w.cpu(), precision))
    out = quant.dequantize_from(pool, offsets, 3, page_bytes, precision, n, k, torch.bfloat16)
    assert torch.equal(out.cpu(), reference.dequantize_ref(got, precision, n, k, torch.bfloat16))


@triton.jit
def _fp8_roundtrip_kernel(x_ptr, code_ptr, dec_ptr, dec_native_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    code = fp8e4m3_encode(tl.load(x_ptr + i))
    tl.store(code_ptr + i, code.to(tl.uint8))
    stored = tl.load(code_ptr + i)
    tl.store(dec_ptr + i, fp8e4m3_decode(stored, False))
    tl.store(dec_native_ptr + i, fp8e4m3_decode(stored, True))


def test_fp8_codec_matches_torch_on_every_code_and_tie(device):
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # drop the two NaN codes
    values = codes.view(torch.float8_e4m3fn).float()
    # Midpoints between neighbouring codes exercise round-half-to-even; plus random values.
    pos = values[(values > 0) & (values.isfinite())].sort().values
    mids = (pos[1:] + pos[:-1]) / 2
    rand = (torch.rand(256, generator=torch.Generator().manual_seed(3)) * 2 - 1) * 448
    x = torch.cat([values, mids, -mids, rand, torch.tensor([31.0676, -31.0676, 2.0**-10, 448.0])])
    size = 1 << (x.numel() - 1).bit_length()
    x = torch.cat([x, torch.zeros(size - x.numel())])
    want = x.to(torch.float8_e4m3fn)
    code = torch.empty(size, dtype=torch.uint8, device=device)
    dec = torch.empty(size, device=device)
    dec_native = torch.empty(size, device=device)
    _fp8_roundtrip_kernel[(1,)](x.to(device), code, dec, dec_native, N=size)
    assert torch.equal(code.cpu().view(torch.float8_e4m3fn).float(), want.float())
    assert torch.equal(dec.cpu(), want.float())
    if quant.fp8_native(torch.device(device)):
        assert torch.equal(dec_native.cpu(), want.float())


def test_fp8_block_scales_are_per_block():
    """Each 128 x 128 block gets its own scale: a block of large weights does not coarsen its
    neighbours (one scale per row would)."""
    w = torch.full((130, 260), 0.01)
    w[:128, 128:256] = 3.0  # block (0, 1) alone is large
    lay = matrix_layout("fp8-b128", 130, 260)
    blob = reference.quantize_ref(w, "fp8-b128")
    scales = blob[lay.scale_offset : lay.zero_offset].view(torch.float32).view(2, 3)
    torch.testing.assert_close(scales, torch.tensor([[0.01, 3.0, 0.01], [0.01, 0.01, 0.01]]) / 448)
    assert torch.equal(reference.dequantize_ref(blob, "fp8-b128", 130, 260, torch.float32), w)


def test_bad_shapes_and_pages_say_what_is_wrong():
    with pytest.raises(ValueError, match="multiple of 8"):
        reference.quantize_ref(torch.zeros(4, 12), "int3")
    with pytest.raises(ValueError, match="power of two"):
        quant.page_shift(3000)
    with pytest.raises(ValueError, match="not 2-byte aligned"):
        check_kernel_shape(matrix_layout("int3", 5, 200))
