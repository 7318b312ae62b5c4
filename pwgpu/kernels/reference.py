"""Pure-PyTorch references for every kernel op: the oracle of the tests and benchmarks, and the
path the engine takes on a CPU. They follow the layout of ``layout.py`` bit for bit: the Triton
quantiser must produce the same bytes, the dequantiser the same values.

Shape legend: T = tokens, H = hidden size, F = expert FFN size, E = experts, k = top-k,
N = output rows, K = input columns of one matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F_

from pwgpu.kernels.layout import (
    AMAX_FLOOR,
    FMT_BF16,
    FMT_FP8,
    FMT_FP8_BLOCK,
    FMT_FP16,
    FMT_INT_ASYM,
    FMT_INT_SYM,
    FP8_MAX,
    SCALE_FLOOR,
    check_kernel_shape,
    elements_per_word,
    matrix_layout,
)

# The gated FFN's activation, by MoeArch.hidden_act; the MoE kernel's ACT codes follow this order.
# transformers' names: silu = swish; gelu (erf); gelu_tanh = gelu_pytorch_tanh = gelu_new.
ACTIVATIONS = {
    "silu": F_.silu,
    "gelu": F_.gelu,
    "gelu_tanh": lambda x: F_.gelu(x, approximate="tanh"),
}


def _round_half_up(x: torch.Tensor) -> torch.Tensor:
    # floor(x + 0.5), not torch.round (half to even): the Triton kernels do the same in fp32.
    return torch.floor(x + 0.5)


def _pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``q[N, K]`` in ``[0, 2**bits)`` -> the little-endian bit stream, one row after another."""
    n, k = q.shape
    per_word = elements_per_word(bits)
    word_bytes = per_word * bits // 8
    shifts = torch.arange(per_word, device=q.device, dtype=torch.int64) * bits
    words = (q.to(torch.int64).view(n, k // per_word, per_word) << shifts).sum(-1)
    byte_shifts = torch.arange(word_bytes, device=q.device, dtype=torch.int64) * 8
    return ((words.unsqueeze(-1) >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)


def _unpack_codes(data: torch.Tensor, bits: int, n: int, k: int) -> torch.Tensor:
    per_word = elements_per_word(bits)
    word_bytes = per_word * bits // 8
    byte_shifts = torch.arange(word_bytes, device=data.device, dtype=torch.int64) * 8
    words = (data.to(torch.int64).view(n, k // per_word, word_bytes) << byte_shifts).sum(-1)
    shifts = torch.arange(per_word, device=data.device, dtype=torch.int64) * bits
    return ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(n, k)


def _grouped(w32: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[N, K]`` -> ``[N, G, group_size]``, the last group zero-padded."""
    n, k = w32.shape
    groups = -(-k // group_size)
    return F_.pad(w32, (0, groups * group_size - k)).view(n, groups, group_size)


def _blocks(w32: torch.Tensor, b: int) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N / b), ceil(K / b), b, b]``, the edge blocks zero-padded."""
    n, k = w32.shape
    bn, bk = -(-n // b), -(-k // b)
    padded = F_.pad(w32, (0, bk * b - k, 0, bn * b - n))
    return padded.view(bn, b, bk, b).transpose(1, 2)


def _expand_blocks(scale: torch.Tensor, b: int, n: int, k: int) -> torch.Tensor:
    """One value per ``b x b`` block ``[BN, BK]`` -> one per element ``[n, k]``."""
    return scale.repeat_interleave(b, dim=0)[:n].repeat_interleave(b, dim=1)[:, :k]


def quantize_ref(w: torch.Tensor, precision: str) -> torch.Tensor:
    """``w[N, K]`` (any float dtype) -> its packed blob, ``uint8[matrix_bytes(N, K)]``."""
    n, k = w.shape
    lay = matrix_layout(precision, n, k)
    check_kernel_shape(lay)
    if lay.fmt in (FMT_FP16, FMT_BF16):
        dtype = torch.float16 if lay.fmt == FMT_FP16 else torch.bfloat16
        return w.to(dtype).contiguous().view(torch.uint8).reshape(-1)
    w32 = w.float()
    if lay.fmt == FMT_FP8_BLOCK:
        blocks = _blocks(w32, lay.group_size)  # [BN, BK, b, b], edge blocks zero-padded
        scale = blocks.abs().amax(dim=(2, 3)).clamp_min(AMAX_FLOOR) / FP8_MAX  # [BN, BK] fp32
        scaled = (w32 / _expand_blocks(scale, lay.group_size, n, k)).clamp(-FP8_MAX, FP8_MAX)
        data = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
        return torch.cat([data.reshape(-1), scale.contiguous().view(torch.uint8).reshape(-1)])
    if lay.fmt in (FMT_FP8, FMT_INT_SYM):
        qmax = FP8_MAX if lay.fmt == FMT_FP8 else 127.0
        scale = w32.abs().amax(dim=1).clamp_min(AMAX_FLOOR) / qmax  # [N] fp32
        scaled = (w32 / scale[:, None]).clamp(-qmax, qmax)
        if lay.fmt == FMT_FP8:
            data = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            data = _round_half_up(scaled).to(torch.int8).view(torch.uint8)
        return torch.cat([data.reshape(-1), scale.view(torch.uint8)])
    # Asymmetric groups; the range always includes 0 so that zero-padding the tail is harmless.
    g = _grouped(w32, lay.group_size)
    lo = g.amin(dim=2).clamp_max(0.0)
    hi = g.amax(dim=2).clamp_min(0.0)
    scale16 = ((hi - lo) / lay.qmax).clamp_min(SCALE_FLOOR).to(torch.float16)  # [N, G]
    scale = scale16.float()
    zero = _round_half_up(-lo / scale).clamp(0, lay.qmax)
    q = (_round_half_up(g / scale[:, :, None]) + zero[:, :, None]).clamp(0, lay.qmax)
    q = q.reshape(n, -1)[:, :k]
    parts = [_pack_codes(q, lay.bits), scale16.contiguous().view(torch.uint8).reshape(-1)]
    parts.append(zero.to(torch.uint8).reshape(-1))
    return torch.cat(parts)


def dequantize_ref(blob: torch.Tensor, precision: str, n: int, k: int, dtype=torch.bfloat16) -> torch.Tensor:
    """A packed blob -> ``W[n, k]`` in ``dtype`` (computed in fp32, rounded once at the end)."""
    lay = matrix_layout(precision, n, k)
    check_kernel_shape(lay)
    if blob.numel() != lay.total_bytes:
        raise ValueError(f"{precision} [{n}, {k}] blob has {blob.numel()} bytes, layout needs {lay.total_bytes}")
    blob = blob.contiguous()
    data = blob[: lay.data_bytes]
    if lay.fmt in (FMT_FP16, FMT_BF16):
        src = torch.float16 if lay.fmt == FMT_FP16 else torch.bfloat16
        return data.view(src).view(n, k).to(dtype)
    if lay.fmt == FMT_FP8_BLOCK:
        scale = blob[lay.scale_offset : lay.zero_offset].view(torch.float32).view(-1, lay.groups_per_row)
        codes = data.view(torch.float8_e4m3fn).view(n, k).float()
        return (codes * _expand_blocks(scale, lay.group_size, n, k)).to(dtype)
    if lay.fmt in (FMT_FP8, FMT_INT_SYM):
        scale = blob[lay.scale_offset : lay.zero_offset].view(torch.float32)
        codes = data.view(torch.float8_e4m3fn if lay.fmt == FMT_FP8 else torch.int8).view(n, k).float()
        return (codes * scale[:, None]).to(dtype)
    assert lay.fmt == FMT_INT_ASYM
    groups = lay.groups_per_row
    scale = blob[lay.scale_offset : lay.zero_offset].view(torch.float16).float().view(n, groups)
    zero = blob[lay.zero_offset :].float().view(n, groups)
    q = _unpack_codes(data, lay.bits, n, k).float()
    gidx = torch.arange(k, device=blob.device) // lay.group_size
    return ((q - zero[:, gidx]) * scale[:, gidx]).to(dtype)


def gather_pages_ref(
    pool: torch.Tensor, page_offsets: torch.Tensor, first_page: int, num_bytes: int, page_bytes: int
) -> torch.Tensor:
    """The ``num_bytes`` logical bytes of one matrix, read page by page from the pool."""
    num_pages = -(-num_bytes // page_bytes)
    offsets = page_offsets[first_page : first_page + num_pages].tolist()
    chunks = [pool[off : off + page_bytes] for off in offsets]
    return torch.cat(chunks)[:num_bytes] if chunks else pool[:0]


def moe_ffn_dense_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: list[torch.Tensor],
    w3: list[torch.Tensor],
    w2: list[torch.Tensor],
    activation: str = "silu",
) -> torch.Tensor:
    """Routed-expert FFN, one expert at a time: ``y[t] = sum_j weight[t, j] * FFN_{id[t, j]}(x[t])``.

    x [T, H], topk_ids/topk_weights [T, k], w1[e]/w3[e] [F, H], w2[e] [H, F] -> y [T, H] in x.dtype.
    Matmuls accumulate in fp32 and the act(gate)*up product is rounded to x.dtype, as the kernel does.
    """
    act_fn = ACTIVATIONS[activation]
    t, h = x.shape
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    x32 = x.float()
    for e in range(len(w1)):
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x32[tok]
        gate = xe @ w1[e].float().T
        up = xe @ w3[e].float().T
        act = (act_fn(gate) * up).to(x.dtype).float()
        y = (act @ w2[e].float().T) * topk_weights[tok, slot].float()[:, None]
        out.index_add_(0, tok, y)
    return out.to(x.dtype)


def moe_ffn_paged_ref(x, topk_ids, topk_weights, experts, activation: str = "silu") -> torch.Tensor:
    """The same FFN reading each routed expert through the page table (``paging.PagedExperts``).

    Only experts that received tokens are dequantised: the CPU engine's path.
    """
    used = set(torch.unique(topk_ids).tolist())
    w1, w3, w2 = [], [], []
    for e in range(experts.num_experts):
        mats = [experts.dequantize_matrix(e, j, x.dtype) if e in used else None for j in range(3)]
        w1.append(mats[0])
        w3.append(mats[1])
        w2.append(mats[2])
    return moe_ffn_dense_ref(x, topk_ids, topk_weights, w1, w3, w2, activation)
