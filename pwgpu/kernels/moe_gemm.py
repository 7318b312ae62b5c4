"""Fused MoE expert FFN over experts of mixed precision, read through the page table.

    y[t] = sum_j w[t, j] * W2_e (act(W1_e x[t]) * (W3_e x[t])),   e = topk_ids[t, j]

with act SiLU (SwiGLU) or GELU (GeGLU, erf or tanh form; ``ACT`` codes in ACTIVATIONS order).

Steps, as in vLLM's fused MoE: (1) ``align_tokens`` sorts the T*k (token, slot) pairs by expert
and pads each expert's run to a multiple of BLOCK_M; (2) blocks are grouped by the precision of
their expert; (3) per precision class present, one launch of ``_gate_up_kernel`` (w1 and w3 in
one pass, SiLU*mul epilogue) and one of ``_down_kernel`` (routing weight in the epilogue), each
specialised (constexpr) on that format; (4) the k slots of each token are summed.

Shape legend: T = tokens, H = hidden, F = expert FFN size, E = experts, S = T * top_k slots,
P = padded slots, B = blocks of BLOCK_M padded slots, C = precision classes present.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pwgpu.kernels.block_config import BlockConfig, get_config
from pwgpu.kernels.layout import check_kernel_shape, matrix_layout
from pwgpu.kernels.paging import PagedExperts
from pwgpu.kernels.quant import fp8_native, interpreting, page_shift
from pwgpu.kernels.reference import ACTIVATIONS
from pwgpu.kernels.tile_io import cast_rne, mma_chunk


def _count(values: torch.Tensor, num_bins: int) -> torch.Tensor:
    """bincount without its device sync (bincount reads the max to size its output)."""
    ones = torch.ones_like(values, dtype=torch.int64)
    return torch.zeros(num_bins, dtype=torch.int64, device=values.device).scatter_add_(0, values.long(), ones)


@functools.lru_cache(maxsize=4096)  # one entry per precision map seen; a host->device copy syncs
def _expert_class(precisions: tuple[str, ...], classes: tuple[str, ...], device: torch.device) -> torch.Tensor:
    """[E + 1] int64 on ``device``: each expert's class index, then the padding class."""
    codes = [classes.index(p) for p in precisions] + [len(classes)]
    return torch.tensor(codes, dtype=torch.int64, device=device)


# The host-side work of a launch depends on a handful of small values that repeat every step:
# computed once each, it no longer costs ~80 us per MoE layer (2.7 ms per 32-layer step).
@functools.lru_cache(maxsize=64)
def _classes(precisions: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The precision classes of a layer, sorted, and how many experts each has."""
    classes = tuple(sorted(set(precisions)))
    return classes, tuple(precisions.count(c) for c in classes)


@functools.lru_cache(maxsize=16)
def _device_facts(device: torch.device) -> tuple[str, bool]:
    """(name used by the tuned block configs, hardware fp8 conversions)."""
    return (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"), fp8_native(device)


@functools.lru_cache(maxsize=4096)
def _launch_shape(precision: str, n: int, k: int, tokens_per_expert: int, device_name: str, page_bytes: int):
    """(block config, matrix layout, chunk flags) of one projection's launch."""
    cfg = get_config(precision, n, k, tokens_per_expert, device_name)
    flags = _chunk_flags(precision, n, k, cfg.block_k, page_bytes)
    return cfg, matrix_layout(precision, n, k), flags


def align_tokens(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_slots [P], block_expert [B]) without a device sync.

    sorted_slots lists slot indices (t * k + j) grouped by expert, each expert's run padded to a
    multiple of block_m with the sentinel S; block_expert[b] is the expert of padded rows
    [b * block_m, (b + 1) * block_m), or E for blocks past the last expert's run.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_slots = flat.numel()
    counts = _count(flat, num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # slots sorted by expert
    sorted_e = flat[order]
    rank = torch.arange(num_slots, device=flat.device) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    dest = (pad_end - padded)[sorted_e] + rank
    # At most min(E, S) experts are non-empty, each wasting < block_m rows of padding.
    max_padded = triton.cdiv(num_slots + min(num_experts, num_slots) * (block_m - 1), block_m) * block_m
    sorted_slots = torch.full((max_padded,), num_slots, dtype=torch.int32, device=flat.device)
    sorted_slots[dest] = order.to(torch.int32)
    block_start = torch.arange(0, max_padded, block_m, device=flat.device)
    block_expert = torch.searchsorted(pad_end, block_start, right=True).to(torch.int32)
    return sorted_slots, block_expert


def group_blocks(block_expert: torch.Tensor, expert_class: torch.Tensor, num_classes: int):
    """(class_blocks [B], class_offsets [C + 1]): blocks of class c are
    ``class_blocks[class_offsets[c]:class_offsets[c + 1]]``, in expert order.
    ``expert_class`` is [E + 1], its last entry C marking padding blocks."""
    block_class = expert_class[block_expert.long()]
    class_blocks = torch.argsort(block_class, stable=True).to(torch.int32)
    counts = _count(block_class, num_classes + 1)[:num_classes]
    class_offsets = torch.zeros(num_classes + 1, dtype=torch.int32, device=block_expert.device)
    class_offsets[1:] = torch.cumsum(counts, 0)
    return class_blocks, class_offsets


@triton.jit
def _block_rows(sorted_slots, block_expert, class_blocks, class_offsets, class_idx, pid_m, BLOCK_M: tl.constexpr):
    """Block pid_m of this class -> (valid, expert, slots [BLOCK_M])."""
    start = tl.load(class_offsets + class_idx)
    count = tl.load(class_offsets + class_idx + 1) - start
    blk = tl.load(class_blocks + start + pid_m, mask=pid_m < count, other=0)
    expert = tl.load(block_expert + blk)
    slots = tl.load(sorted_slots + blk * BLOCK_M + tl.arange(0, BLOCK_M))
    return pid_m < count, expert, slots


ACT_CODES = {name: i for i, name in enumerate(ACTIVATIONS)}  # silu 0, gelu 1, gelu_tanh 2
_GELU: tl.constexpr = tl.constexpr(ACT_CODES["gelu"])
_GELU_TANH: tl.constexpr = tl.constexpr(ACT_CODES["gelu_tanh"])


@triton.jit
def _activation(x, ACT: tl.constexpr):
    """fp32 act(x), as torch computes it: silu, gelu (erf) or gelu's tanh approximation, written as
    ``x * sigmoid(2 z)`` (= ``0.5 x (1 + tanh z)``), no tanh needed."""
    if ACT == _GELU:
        out = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == _GELU_TANH:
        out = x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))  # 2 * sqrt(2 / pi)
    else:
        out = x * tl.sigmoid(x)
    return out


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H]
    stride_xt,
    act_ptr,  # [S, F] out: SiLU(gate) * up, x's dtype
    sorted_slots,
    block_expert,
    class_blocks,
    class_offsets,
    class_idx,
    pool,
    page_tab,
    first_page,  # int32 [E, 3]
    num_slots,
    H,
    F,
    scale_off,
    zero_off,
    groups_per_row,
    TOP_K: tl.constexpr,
    ACT: tl.constexpr,
    FMT: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE_SHIFT: tl.constexpr,
    ROW_CHUNK: tl.constexpr,
    CHUNK_ALIGN16: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    num_n = tl.cdiv(F, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    valid, expert, slots = _block_rows(
        sorted_slots, block_expert, class_blocks, class_offsets, class_idx, pid_m, BLOCK_M
    )
    if valid:
        tok_ok = slots < num_slots
        tok = tl.where(tok_ok, slots // TOP_K, 0)
        n = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # [1, BN] rows of W1/W3
        page_gate = tl.load(first_page + expert * 3)
        page_up = tl.load(first_page + expert * 3 + 1)
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        x_rows = x_ptr + tok[:, None] * stride_xt
        for k0 in range(0, H, BLOCK_K):
            acc_gate = mma_chunk(
                acc_gate, x_rows, tok_ok[:, None], k0, pool, page_tab, page_gate, n, F, H, scale_off, zero_off,
                groups_per_row, FMT, BITS, GROUP, PAGE_SHIFT, ROW_CHUNK, CHUNK_ALIGN16, FP8_NATIVE, DOT_FP32, PACKED,
                BLOCK_K,
            )  # fmt: skip
            acc_up = mma_chunk(
                acc_up, x_rows, tok_ok[:, None], k0, pool, page_tab, page_up, n, F, H, scale_off, zero_off,
                groups_per_row, FMT, BITS, GROUP, PAGE_SHIFT, ROW_CHUNK, CHUNK_ALIGN16, FP8_NATIVE, DOT_FP32, PACKED,
                BLOCK_K,
            )  # fmt: skip
        act = _activation(acc_gate, ACT) * acc_up
        out_mask = tok_ok[:, None] & (n < F)
        act = cast_rne(act, act_ptr.dtype.element_ty, DOT_FP32)
        tl.store(act_ptr + slots[:, None].to(tl.int64) * F + n, act, mask=out_mask)


@triton.jit
def _down_kernel(
    act_ptr,  # [S, F]
    y_ptr,  # [S, H] fp32 out: routing weight * W2 act
    topk_weights,  # [S] fp32
    sorted_slots,
    block_expert,
    class_blocks,
    class_offsets,
    class_idx,
    pool,
    page_tab,
    first_page,
    num_slots,
    H,
    F,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    num_n = tl.cdiv(H, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    valid, expert, slots = _block_rows(
        sorted_slots, block_expert, class_blocks, class_offsets, class_idx, pid_m, BLOCK_M
    )
    if valid:
        tok_ok = slots < num_slots
        rows = tl.where(tok_ok, slots, 0).to(tl.int64)
        n = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # [1, BN] rows of W2
        page_down = tl.load(first_page + expert * 3 + 2)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # Split-K: program_id(1) reduces its own slice of F; slices meet in y by atomic adds
        # (y is fp32 and zeroed). Decode needs it: down has few output tiles (H / BLOCK_N per
        # expert) and long K loops, too few programs in flight to keep HBM busy.
        k_per_split = tl.cdiv(tl.cdiv(F, BLOCK_K), SPLIT_K) * BLOCK_K
        k_start = tl.program_id(1) * k_per_split
        k_end = tl.minimum(F, k_start + k_per_split)
        a_rows = act_ptr + rows[:, None] * F
        for k0 in range(k_start, k_end, BLOCK_K):
            acc = mma_chunk(
                acc, a_rows, tok_ok[:, None], k0, pool, page_tab, page_down, n, H, F, scale_off, zero_off,
                groups_per_row, FMT, BITS, GROUP, PAGE_SHIFT, ROW_CHUNK, CHUNK_ALIGN16, FP8_NATIVE, DOT_FP32, PACKED,
                BLOCK_K,
            )  # fmt: skip
        route_w = tl.load(topk_weights + rows, mask=tok_ok, other=0.0)
        acc = acc * route_w[:, None]
        y_mask = tok_ok[:, None] & (n < H)
        if SPLIT_K == 1:
            tl.store(y_ptr + rows[:, None] * H + n, acc, mask=y_mask)
        else:
            tl.atomic_add(y_ptr + rows[:, None] * H + n, acc, mask=y_mask)


def _chunk_flags(precision: str, n: int, k: int, block_k: int, page_bytes: int) -> tuple[bool, bool, bool]:
    """(ROW_CHUNK, CHUNK_ALIGN16, PACKED) for W[n, k]: see ``tile_io``."""
    lay = matrix_layout(precision, n, k)
    check_kernel_shape(lay)
    if (block_k * lay.bits) % 8:
        return False, False, False
    chunk_bytes = block_k * lay.bits // 8
    ok = lay.row_bytes % chunk_bytes == 0 and page_bytes % chunk_bytes == 0
    ok = ok and (lay.group_size == 0 or lay.group_size % block_k == 0)
    # Packed sub-tiles need whole bytes per element group and tl.dot's K >= 16 per sub-tile.
    packed = ok and lay.bits in (2, 4) and block_k // (8 // lay.bits) >= 16
    return ok, ok and chunk_bytes % 16 == 0, packed


def fused_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: PagedExperts,
    config: BlockConfig | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """x [T, H] (bf16/fp16), topk_ids [T, k] int, topk_weights [T, k] -> y [T, H] in x.dtype.

    ``config`` overrides the block sizes of both kernels (tests, tuning); by default they come
    from ``block_config.get_config`` per precision class and tokens-per-expert bucket.
    """
    t, h = x.shape
    top_k = topk_ids.shape[1]
    f, e = experts.ffn_size, experts.num_experts
    if h != experts.hidden_size or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError(
            f"x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, topk_weights {tuple(topk_weights.shape)} "
            f"do not match experts with H={experts.hidden_size}"
        )
    if x.stride(1) != 1:
        raise ValueError("x must have unit stride along the hidden dimension")
    num_slots = t * top_k
    if num_slots == 0:
        return torch.zeros_like(x)
    classes, class_sizes = _classes(tuple(experts.precisions))
    expert_class = _expert_class(tuple(experts.precisions), classes, x.device)
    tokens_per_expert = triton.cdiv(num_slots, e)
    device_name, native = _device_facts(x.device)
    act = torch.empty(num_slots, f, dtype=x.dtype, device=x.device)
    y = torch.zeros(num_slots, h, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    shift = page_shift(experts.page_bytes)
    aligned: dict[int, tuple] = {}  # block_m -> (sorted_slots, block_expert, class_blocks, class_offsets)
    for ci, prec in enumerate(classes):
        num_in_class = class_sizes[ci]
        for is_gate_up, n, k in ((True, f, h), (False, h, f)):
            if config is None:
                cfg, lay, (row_chunk, align16, packed) = _launch_shape(
                    prec, n, k, tokens_per_expert, device_name, experts.page_bytes
                )
            else:
                cfg, lay = config, matrix_layout(prec, n, k)
                row_chunk, align16, packed = _chunk_flags(prec, n, k, cfg.block_k, experts.page_bytes)
            if cfg.block_m not in aligned:
                slots, block_expert = align_tokens(topk_ids, e, cfg.block_m)
                aligned[cfg.block_m] = (slots, block_expert, *group_blocks(block_expert, expert_class, len(classes)))
            slots, block_expert, class_blocks, class_offsets = aligned[cfg.block_m]
            # Upper bound on this class's blocks; programs past the real count exit at once.
            max_blocks = min(block_expert.numel(), triton.cdiv(num_slots, cfg.block_m) + min(num_in_class, num_slots))
            grid = (max_blocks * triton.cdiv(n, cfg.block_n),)
            common = (slots, block_expert, class_blocks, class_offsets, ci, experts.pool, experts.page_offsets,
                      experts.first_page, num_slots, h, f, lay.scale_offset, lay.zero_offset,
                      max(lay.groups_per_row, 1))  # fmt: skip
            consts = dict(
                FMT=lay.fmt, BITS=lay.bits, GROUP=lay.group_size or 1, PAGE_SHIFT=shift, ROW_CHUNK=row_chunk,
                CHUNK_ALIGN16=align16, FP8_NATIVE=native, DOT_FP32=interpreting(), PACKED=packed, BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )  # fmt: skip
            if is_gate_up:
                _gate_up_kernel[grid](x, x.stride(0), act, *common, TOP_K=top_k, ACT=ACT_CODES[activation], **consts)
            else:
                # At least 4 K blocks per split: shorter slices cost more in atomics than they win.
                split_k = max(1, min(cfg.split_k, triton.cdiv(k, 4 * cfg.block_k)))
                _down_kernel[(grid[0], split_k)](act, y, weights, *common, SPLIT_K=split_k, **consts)
    return y.view(t, top_k, h).sum(dim=1).to(x.dtype)
