"""FP8 block-scaled checkpoints (``quantization_config: {quant_method: fp8, weight_block_size:
[128, 128]}``, as DeepSeek-V3 and Qwen3-FP8 ship): each quantised linear layer stores ``weight``
as E4M3 codes ``[N, K]`` and ``weight_scale_inv`` as one fp32 per 128 x 128 block
``[ceil(N / 128), ceil(K / 128)]``, with ``W = code * scale_inv`` (the name is DeepSeek's: it is
the dequantisation factor, the inverse of the quantiser's scale).

Routed experts keep these bytes: their weight followed by their scales *is* the ``fp8-b128``
layout (``pwgpu.kernels.layout``), so the host master copy is the checkpoint and an upgrade
restores it byte for byte. Everything else (attention, dense layers, shared experts) is
dequantised to the compute dtype at load.

Shape legend: N = output rows, K = input columns, BN / BK = scale blocks along them.
"""

from __future__ import annotations

import torch

from pwgpu.kernels.layout import matrix_layout
from pwgpu.kernels.reference import dequantize_ref

PRECISION = "fp8-b128"
BLOCK = 128
SCALE_SUFFIX = "_scale_inv"  # "x.weight" -> "x.weight_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    n, k = shape
    return -(-n // BLOCK), -(-k // BLOCK)


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in FP8_DTYPES


def check(
    tensors: dict[str, torch.Tensor], scales: dict[str, torch.Tensor], quantized: bool, matrices: set[str]
) -> list[str]:
    """Problems of the FP8 weights in ``tensors`` (name -> tensor) and ``scales`` (scale name ->
    tensor): every E4M3 weight is a matrix with its scales of the right shape, the config says the
    checkpoint is quantised, and no scale belongs to a weight that is not FP8."""
    problems = []
    for name, t in tensors.items():
        if not is_fp8(t):
            continue
        if not quantized:
            problems.append(f"{name} is {t.dtype} but config.json has no quantization_config")
        elif t.dtype != torch.float8_e4m3fn:
            problems.append(f"{name} is {t.dtype}; FP8 checkpoints must be float8_e4m3fn")
        elif name not in matrices:
            problems.append(f"{name} is FP8 but only linear-layer weights may be")
        elif scale_name(name) not in scales:
            problems.append(f"{name} is FP8 but its scales {scale_name(name)} are missing")
        else:
            s = scales[scale_name(name)]
            want = scale_shape(tuple(t.shape))
            if tuple(s.shape) != want or not s.is_floating_point() or is_fp8(s):
                problems.append(
                    f"{scale_name(name)} is {s.dtype} {list(s.shape)}, expected float32 {list(want)} "
                    f"(one scale per {BLOCK} x {BLOCK} block)"
                )
    for name in scales:
        weight = name.removesuffix(SCALE_SUFFIX)
        if weight in tensors and not is_fp8(tensors[weight]):
            problems.append(f"{name} scales {weight}, which is {tensors[weight].dtype}, not FP8")
    return problems


def to_blob(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The checkpoint's E4M3 codes and scales as one ``fp8-b128`` blob, uint8 [N * K + 4 * BN * BK]."""
    n, k = weight.shape
    codes = weight.contiguous().view(torch.uint8).reshape(-1)
    blob = torch.cat([codes, scale.float().contiguous().view(torch.uint8).reshape(-1)])
    if blob.numel() != matrix_layout(PRECISION, n, k).total_bytes:
        raise AssertionError(f"fp8-b128 blob of [{n}, {k}] has {blob.numel()} bytes")
    return blob


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E4M3 codes [N, K] and block scales -> W [N, K] in ``dtype`` (computed in fp32)."""
    n, k = weight.shape
    return dequantize_ref(to_blob(weight, scale), PRECISION, n, k, dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (E4M3 codes [N, K], fp32 scales [BN, BK]): what DeepSeek's quantiser writes
    (``scale = amax / 448`` per block). For building test checkpoints."""
    from pwgpu.kernels.reference import quantize_ref

    n, k = w.shape
    blob = quantize_ref(w, PRECISION)
    lay = matrix_layout(PRECISION, n, k)
    codes = blob[: lay.data_bytes].view(torch.float8_e4m3fn).view(n, k)
    scales = blob[lay.scale_offset : lay.zero_offset].view(torch.float32).view(scale_shape((n, k)))
    return codes.clone(), scales.clone()
