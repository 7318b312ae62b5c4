"""The CPU engine's two hot loops, written for few operator calls and few bytes: a decode
step of a small model is bound by memory traffic (expert weights, the KV context) and by the
number of PyTorch calls (each a dispatch and, with several threads, a wake-up of the others),
not by arithmetic.

- ``moe_ffn_grouped``: the routed-expert FFN over dense per-expert weights. Token-expert
  pairs are sorted by expert once; each used expert is then one gate-and-up matmul (w1 and w3
  stacked), one activation and one down matmul over a contiguous slice, and the results go
  back to their tokens in one copy and one sum over the k slots. It computes what
  ``kernels.reference.moe_ffn_dense_ref`` computes (the same products, rounded at the same
  points); with k = 2 the sums are the same two terms, so the output is bit-identical.
- ``linear_rows_padded``: a 16-bit ``linear`` whose rows are padded to a few sizes, so that
  oneDNN (PyTorch's CPU matmul for 16-bit dtypes) reuses a kernel instead of building one for
  every new token count; the real rows' results are bit-identical (tested).
- ``paged_decode_sdpa``: one query per request against its paged context, where the compiled
  ``cpu_decode.paged_decode`` does not go (an fp16 cache; a platform without numba): each
  layer's K and V blocks gathered with one ``index_select`` each (when the arena's blocks are
  evenly spaced) and one fused ``scaled_dot_product_attention`` call with grouped-query heads,
  where ``attention.paged_decode_ref`` spells the same softmax out in six calls. Requests of
  very different context lengths go in groups of similar length (``decode_groups``), each
  padded only to its own longest: one group padded to the step's longest context read and
  attended over up to twice the KV a batch of varied lengths holds.

Shape legend: T = tokens, k = top-k, N = T * k token-expert pairs, E = experts, H = hidden
size, F = expert FFN size, B = requests, Hq / Hkv = query / KV heads, D = head dim,
C = context tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F_

from pwgpu.kernels.reference import ACTIVATIONS

# The dense expert copies of the CPU path: 16-bit experts in their own format, which fp32 holds
# exactly (upcast per use, into the cache: cheaper than reading twice the bytes from memory, as
# an fp32 copy of the default model's experts, larger than the L3 cache, made every step do).
DENSE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def dense_dtype(precision: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype of an expert's dense copy on the CPU path. 16-bit experts: their own. Others
    (FP8, INT8, INT4): what the GPU kernel multiplies by, ``w.to(a.dtype)`` after dequantising in
    fp32 (``kernels.tile_io``): the activations' dtype in a 16-bit run, fp32 in an fp32 run. So
    a downgrade reads fewer bytes per step here too; fp32 copies of downgraded experts had
    read twice a 16-bit expert's bytes, and a run that downgraded most experts no longer fit
    the last-level cache (its steps took twice the latency table's time)."""
    own = DENSE_DTYPES.get(precision)
    if own is not None:
        return own
    return compute_dtype if compute_dtype in (torch.bfloat16, torch.float16) else torch.float32


def dense_expert(experts, e: int, compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``e`` of a ``kernels.paging.PagedExperts`` layer, dequantised from its pages as
    ``moe_ffn_grouped`` takes it for activations in ``compute_dtype``: (w1 over w3 [2F, H],
    w2 [H, F]) in ``dense_dtype``."""
    dtype = dense_dtype(experts.precisions[e], compute_dtype)
    w1, w3, w2 = (experts.dequantize_matrix(e, j, dtype) for j in range(3))
    return torch.cat([w1, w3]), w2


def moe_ffn_grouped(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: Sequence[torch.Tensor | None],
    w2: Sequence[torch.Tensor | None],
    counts: list[int],
    activation: str = "silu",
) -> torch.Tensor:
    """x [T, H], topk_ids / topk_weights [T, k], per expert e w13[e] [2F, H] (w1 over w3) and
    w2[e] [H, F] (``dense_expert``'s: fp32, or a 16-bit dtype upcast exactly to fp32 per use),
    ``counts[e]``: pairs routed to expert e -> y [T, H] in x.dtype. Experts with no pairs are
    never read (they may be None or stale)."""
    act_fn = ACTIVATIONS[activation]
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    xs = x.float().index_select(0, torch.div(order, k, rounding_mode="floor"))  # [N, H]
    ys = torch.empty_like(xs)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        gate_up = F_.linear(xs[start : start + c], w13[e].float())  # [c, 2F]
        ffn = gate_up.shape[1] // 2
        # The activation over a contiguous gate: ATen's vectorised exp / erf and its scalar
        # tail differ in the last bit, so the layout decides which elements get which.
        act = act_fn(gate_up[:, :ffn].contiguous()) * gate_up[:, ffn:]
        if x.dtype != torch.float32:
            act = act.to(x.dtype).float()  # rounded where the fused kernel rounds it
        torch.mm(act, w2[e].float().t(), out=ys[start : start + c])
        start += c
    ys.mul_(topk_weights.reshape(-1).float().index_select(0, order)[:, None])
    out = torch.empty_like(ys).index_copy_(0, order, ys)  # back to (token, slot) order
    return out.view(t, k, -1).sum(dim=1).to(x.dtype)


# oneDNN builds (JIT-compiles) a kernel for every new row count of a 16-bit matmul and caches
# it: on the 2-core CPU VM a layer's projections for a prefill chunk of a token count not seen
# before took 9.8 ms for the default model's four layers, against 6.8 ms for one seen before (a
# prefill step's token count is new almost every time), and an expert FFN's two matmuls at a new
# row count 2.5x their time at a known one. Padded to multiples of 64 rows, the projections took
# 5.5 ms once each size was known (multiples of 64 run faster still), and a run sees a dozen
# sizes. Up to 16 rows (decode batches, few sizes, where a padded row would cost as much as a
# real one) stay as they are; up to 256, multiples of 16.
def padded_rows(num_rows: int) -> int:
    if num_rows <= 16:
        return num_rows
    step = 16 if num_rows <= 256 else 64
    return -(-num_rows // step) * step


def linear_rows_padded(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of x [M, K] (16-bit, on the CPU) with M padded by zero rows to
    ``padded_rows(M)``; the first M rows of the result, bit-identical to ``F.linear(x, ...)``'s
    (a row's products and sums do not depend on the other rows)."""
    m = x.shape[0]
    size = padded_rows(m)
    if size == m:
        return F_.linear(x, weight, bias)
    padded = x.new_zeros(size, x.shape[1])
    padded[:m] = x
    return F_.linear(padded, weight, bias)[:m]


def cpu_linear(device: torch.device, dtype: torch.dtype):
    """The ``linear`` for a model's projections: row-padded for 16-bit activations on a CPU."""
    on_cpu = torch.device(device).type == "cpu"
    return linear_rows_padded if on_cpu and dtype in (torch.bfloat16, torch.float16) else F_.linear


# A group of decode requests costs a few more calls per layer (gather, fill, attention):
# ~60-100 us on the 2-core CPU of benchmarks/RESULTS.md, about what gathering and attending over
# 8 padding blocks costs. A group is split off only when it saves twice that in padding.
SPLIT_SAVING_BLOCKS = 16


def decode_groups(num_blocks: Sequence[int], min_saving_blocks: int = SPLIT_SAVING_BLOCKS) -> list[list[int]]:
    """Decode requests (their KV block counts) in groups of similar length, longest first:
    each group is gathered and attended over as wide as its longest request, so that a short
    context is not padded to the step's longest. Going down the requests by length, a new group
    starts where it spares the requests left more than ``min_saving_blocks`` padding blocks
    (whatever the lengths: the rule weighs padding saved against a group's calls only).
    Uniform lengths stay one group."""
    order = sorted(range(len(num_blocks)), key=num_blocks.__getitem__, reverse=True)
    if not order:
        return []
    groups: list[list[int]] = []
    start, top = 0, num_blocks[order[0]]
    for pos in range(1, len(order)):
        n = num_blocks[order[pos]]
        if (len(order) - pos) * (top - n) > min_saving_blocks:
            groups.append(order[start:pos])
            start, top = pos, n
    groups.append(order[start:])
    return groups


def paged_decode_sdpa(
    q, kv, layer: int, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, groups=None
):
    """q [B, Hq, D] -> [B, Hq, D], attending to ``context_lens`` tokens of each request's
    blocks (``attention.paged_decode_ref``'s contract; fp32 softmax whatever the KV dtype).
    ``groups``: (rows [b] int64 or None for all, blocks) per group of requests, each attended
    over its first ``blocks`` table columns (``attention.AttentionBatch.decode_groups``);
    None: one group of every request over the whole table."""
    if groups is None:
        return _decode_group(q, kv, layer, block_tables, context_lens, scale)
    if len(groups) == 1 and groups[0][0] is None:
        return _decode_group(q, kv, layer, block_tables[:, : groups[0][1]], context_lens, scale)
    out = torch.empty_like(q)
    for rows, blocks in groups:
        part = _decode_group(q[rows], kv, layer, block_tables[rows, :blocks], context_lens[rows], scale)
        out.index_copy_(0, rows, part)
    return out


def _decode_group(q, kv, layer: int, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float):
    b, m = block_tables.shape
    k, v = kv.gather(layer, block_tables)  # [B, C, Hkv, D]
    c = m * kv.block_tokens
    valid = torch.arange(c, device=q.device)[None, :] < context_lens[:, None]  # [B, C]
    # Slots past the context hold whatever their page held before (an expert's weights, which
    # read as bf16 can be NaN or inf): masked scores and zero weights still carry a NaN through
    # the products, so those slots are zeroed first.
    # Only those slots are written (an index over the step's few padded slots): a masked fill
    # broadcast over the whole [B, C, Hkv, D] context took 5x as long as gathering it.
    past = (~valid).view(-1).nonzero().view(-1)
    k, v = k.float(), v.float()
    if len(past):
        k.view(b * c, -1).index_fill_(0, past, 0.0)
        v.view(b * c, -1).index_fill_(0, past, 0.0)
    out = F_.scaled_dot_product_attention(
        q.float()[:, :, None, :],
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )  # [B, Hq, 1, D]
    return out[:, :, 0].to(q.dtype)
