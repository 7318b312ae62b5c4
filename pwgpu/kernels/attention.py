"""Paged decode attention in Triton: one query token per request, K/V read from the unified
arena through each request's KV block table (layout in ``pwgpu.attention``).

One program per (request, query head) walks the request's blocks with an online softmax
(running max and sum in fp32), so no context-length-sized buffer is materialised. The
reference is ``pwgpu.attention.paged_decode_ref``; both are compared in
``tests/gpu_engine/test_attention.py`` (interpreter on CPU, compiled on a GPU).

Shape legend: B = requests, Hq / Hkv = query / KV heads, D = head dim, M = max blocks per
request, T_blk = tokens per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedweight.errors import ConfigError


@triton.jit
def _paged_decode_kernel(
    q_ptr, kv_ptr, out_ptr, block_off_ptr, ctx_ptr, scale, max_blocks, v_offset,
    q_stride_b, q_stride_h, o_stride_b, o_stride_h,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + b * q_stride_b + h * q_stride_h + d, mask=d_ok, other=0.0).to(tl.float32)
    ctx = tl.load(ctx_ptr + b)
    t = tl.arange(0, BLOCK_T)
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(0, tl.cdiv(ctx, BLOCK_T)):
        base = tl.load(block_off_ptr + b * max_blocks + j)  # int64 element offset of the block's K
        t_ok = j * BLOCK_T + t < ctx
        offs = base + t[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
        mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(kv_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.where(t_ok, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(kv_ptr + offs + v_offset, mask=mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + b * o_stride_b + h * o_stride_h + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def paged_decode_triton(q, kv, layer: int, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float):
    """q [B, Hq, D] -> [B, Hq, D]; every ``context_lens[b] >= 1``."""
    b, num_heads, head_dim = q.shape
    if kv.block_tokens & (kv.block_tokens - 1):
        raise ConfigError(f"the Triton decode kernel needs a power-of-two block size, got {kv.block_tokens} tokens")
    if num_heads % kv.num_kv_heads or head_dim != kv.head_dim:
        raise ConfigError(f"q {tuple(q.shape)} does not match a cache of {kv.num_kv_heads} KV heads of {kv.head_dim}")
    q = q.contiguous()
    out = torch.empty_like(q)
    offsets = kv.block_offsets(layer, block_tables).contiguous()
    _paged_decode_kernel[(b, num_heads)](
        q, kv.typed, out, offsets, context_lens.contiguous(), scale, offsets.shape[1],
        kv.block_tokens * kv.num_kv_heads * kv.head_dim, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        NUM_KV_HEADS=kv.num_kv_heads, GROUP=num_heads // kv.num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_T=kv.block_tokens,
    )  # fmt: skip
    return out
