"""Paged decode attention on a CPU, compiled: one query per request read against its context
straight from the KV arena, through its block table.

The PyTorch way (``cpu_kernels.paged_decode_sdpa``) first gathers every request's K and V blocks
into a padded copy (one ``index_select`` each), then runs ATen's fused attention over it: each
context crosses memory three times (read, written, read again), padding included. A decode step
of a small model at long contexts spent more than half its time there (``benchmarks/RESULTS.md``).
Here each request's K and V rows are read once, in place, only up to its own context length, so
slots past it (which may hold an expert's bytes, NaN as floats) never reach an output and requests
of different lengths need no grouping. Per request and KV head: the scores of its G query heads
(each key row read once for all G), an fp32 softmax, then the weighted sum of the value rows.

fp32 K and V rows are read in place; bf16 rows are read as their bits (int16), which are the upper
half of an fp32's, and widened exactly into a buffer a block's 16-token section at a time (the
slots past a context only copied). The loop is compiled once per KV dtype; ``_widen`` picks the
row reader (``_row_fp32`` or ``_row_bf16``) by the arena's type when numba compiles it. Passed
in as an argument, the reader's identity (an address) entered the compiled loop's signature, so
numba's cache never matched in another process: every engine compiled the loop again (~2 s) and
added a file to the cache, until writing the cache index failed ("underlying object has
vanished") and the engine could not start. Other KV dtypes (fp16, which numba cannot read) and
platforms without numba take the PyTorch way.
``tests/gpu_engine/test_cpu_decode.py`` checks it against ``attention.paged_decode_ref``.

Shape legend: B = requests, Hq / Hkv = query / KV heads, G = Hq / Hkv, D = head dim,
M = block-table width.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from pagedweight.compiled import available, numba_module


def _decode_loop(q, arena, table, ctx, geometry, scale, out):
    """q [B, Hq, D] fp32, arena the KV elements (``_widen(arena, at, n, buffer)``: the n of them
    from ``at`` as fp32), table [B, M] KV block ids, ctx [B] context lengths; ``geometry``:
    (blocks per page, elements per page, per block, the layer's offset inside a block, tokens
    per block, Hkv); out [B, Hq, D] fp32."""
    blocks_per_page, page_elems, block_elems, layer_elems, block_tokens, hkv = geometry
    b_n, hq, d = q.shape
    g = hq // hkv
    row = hkv * d  # one token's K (or V) of one layer
    section = block_tokens * row  # a block's K for one layer; its V follows
    # Checked before any read: the loop reads the arena unchecked (a bad id would read past it).
    num_blocks = arena.shape[0] // page_elems * blocks_per_page
    widest = 1
    for b in range(b_n):
        if ctx[b] < 1 or ctx[b] > table.shape[1] * block_tokens:
            raise ValueError("paged_decode: a context length is below 1 or beyond its block table")
        for i in range((ctx[b] + block_tokens - 1) // block_tokens):
            if table[b, i] < 0 or table[b, i] >= num_blocks:
                raise ValueError("paged_decode: a block id is outside the KV arena")
        widest = max(widest, ctx[b])
    scores = np.empty((hq, widest), dtype=np.float32)
    acc = np.empty((hq, d), dtype=np.float32)
    qs = np.empty((hq, d), dtype=np.float32)
    buffer = np.empty(section, dtype=np.int32)  # a bf16 section widened
    for b in range(b_n):
        n = ctx[b]
        for hh in range(hq):
            for e in range(d):
                qs[hh, e] = q[b, hh, e] * scale
        for part in range(2):  # K: the scores; V: the weighted sum
            if part == 1:
                acc[:, :] = 0.0
            for i in range(0, (n + block_tokens - 1) // block_tokens):
                block = table[b, i]
                at = (block // blocks_per_page) * page_elems + (block % blocks_per_page) * block_elems
                rows = _widen(arena, at + layer_elems + part * section, section, buffer)
                for t in range(min(block_tokens, n - i * block_tokens)):
                    j = i * block_tokens + t
                    for h in range(hkv):
                        vec = rows[t * row + h * d : t * row + h * d + d]
                        for gi in range(g):
                            hh = h * g + gi
                            if part == 0:
                                qh = qs[hh]
                                dot = np.float32(0.0)
                                for e in range(d):
                                    dot += qh[e] * vec[e]
                                scores[hh, j] = dot
                            else:
                                p = scores[hh, j]
                                a = acc[hh]
                                for e in range(d):
                                    a[e] += p * vec[e]
            if part == 0:
                for hh in range(hq):
                    top = scores[hh, 0]
                    for j in range(1, n):
                        top = max(top, scores[hh, j])
                    total = np.float32(0.0)
                    for j in range(n):
                        p = np.exp(scores[hh, j] - top)
                        scores[hh, j] = p
                        total += p
                    inv = np.float32(1.0) / total
                    for j in range(n):
                        scores[hh, j] *= inv
        for hh in range(hq):
            for e in range(d):
                out[b, hh, e] = acc[hh, e]


def _row_fp32(arena, at, n, buffer):
    return arena[at : at + n]


def _row_bf16(arena, at, n, buffer):
    bits = arena[at : at + n]  # a slice first: indexing the arena by at + e defeated vectorisation
    for e in range(n):
        buffer[e] = np.int32(bits[e]) << 16  # int16 bits, sign-extended: the shift drops that
    return buffer.view(np.float32)


def _widen(arena, at, n, buffer):
    """The n KV elements from ``at`` as fp32: ``_row_bf16`` for an int16 (bf16 bits) arena, else
    ``_row_fp32``. Compiled, numba chooses by the arena's type (``_compiled``)."""
    return (_row_bf16 if arena.dtype == np.int16 else _row_fp32)(arena, at, n, buffer)


@functools.cache
def _compiled():
    """(the loop, {KV dtype: what its arena is read as}), compiled (or loaded from numba's cache)
    on first use."""
    numba = numba_module()
    from numba.extending import overload

    @overload(_widen, inline="always")
    def _widen_for(arena, at, n, buffer):
        return _row_bf16 if arena.dtype == numba.types.int16 else _row_fp32

    # Reassociation (and contraction into FMAs) lets the dot products and the weighted sums
    # vectorise; no-NaN/no-inf assumptions are left out: nothing past a context is read, but a
    # model may still produce an inf.
    # Without the GIL, so that slices of a batch run on several threads at once (``paged_decode``).
    flags = {"reassoc", "contract", "arcp", "nsz"}
    loop = numba.njit(cache=True, nogil=True, fastmath=flags, error_model="numpy")(_decode_loop)
    return loop, {torch.float32: torch.float32, torch.bfloat16: torch.int16}


_KV_DTYPES = (torch.float32, torch.bfloat16)


def supports(kv) -> bool:
    """Whether ``paged_decode`` takes this cache: numba installed, K and V in an fp32 or bf16
    arena on the CPU (MLA's one latent goes through ``pwgpu.mla``)."""
    return kv.num_parts == 2 and kv.dtype in _KV_DTYPES and kv.typed.device.type == "cpu" and available()


@functools.cache
def warm_up(dtype: torch.dtype) -> None:
    """Compile (or load from numba's cache) the loop for a KV dtype on a one-token context, so
    that a server's first request does not wait ~2 s for it."""
    loop, read_as = _compiled()
    arena = torch.zeros(2, dtype=dtype).view(read_as[dtype]).numpy()
    one = np.ones((1, 1, 1), dtype=np.float32)
    table, ctx = np.zeros((1, 1), dtype=np.int64), np.ones(1, dtype=np.int64)
    loop(one, arena, table, ctx, (1, 2, 2, 0, 1, 1), np.float32(1.0), np.empty_like(one))


# Context tokens (summed over the batch) below which one thread does the whole batch: a slice
# handed to another thread costs ~20-50 us, what ~4,000 tokens of one KV head's rows take.
MIN_TOKENS_PER_THREAD = 4096


@functools.cache
def _pool(num_threads: int, pid: int) -> ThreadPoolExecutor:
    """Per process (``pid``): a child forked after the pool started has none of its threads."""
    return ThreadPoolExecutor(num_threads, thread_name_prefix="pwgpu-decode")


def ranges(ctx: np.ndarray, num_threads: int) -> list[tuple[int, int]]:
    """Contiguous request ranges of about equal context tokens, at most ``num_threads`` of
    them and none of fewer than ``MIN_TOKENS_PER_THREAD`` tokens (one range: do it here).
    The same for every layer of a step: ``attention.AttentionBatch.decode_ranges`` cuts them once."""
    if num_threads <= 1:
        return [(0, len(ctx))]
    total = int(ctx.sum())
    parts = max(1, min(num_threads, len(ctx), total // MIN_TOKENS_PER_THREAD))
    if parts == 1:
        return [(0, len(ctx))]
    cut = np.searchsorted(np.cumsum(ctx), total * np.arange(1, parts) / parts, side="right")
    bounds = [0, *sorted({int(c) for c in cut if 0 < c < len(ctx)}), len(ctx)]
    return list(zip(bounds[:-1], bounds[1:], strict=False))


def paged_decode(q, kv, layer: int, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, slices=None):
    """``attention.paged_decode_ref``'s contract: q [B, Hq, D] -> [B, Hq, D], each request
    attending to the first ``context_lens[b]`` (>= 1) tokens of its blocks; fp32 softmax and
    sums, the result in q's dtype. The cache must be one ``supports`` accepts. ``slices``:
    ``ranges(context_lens, torch threads)`` if the caller has them (None: cut here).

    With several torch threads, a batch of enough context is cut into ranges of requests of
    about equal context, run at once on as many threads (each writes its own rows of the
    output). A second pool of spinning workers (numba's ``parallel``) made torch's own ops after
    it twice as slow on two cores; these threads sleep on a queue between calls."""
    loop, read_as = _compiled()
    elem = kv.typed.element_size()
    geometry = (
        kv.blocks_per_page,
        kv.page_bytes // elem,
        kv.block_bytes // elem,
        layer * kv.num_parts * kv.block_tokens * kv.num_kv_heads * kv.head_dim,
        kv.block_tokens,
        kv.num_kv_heads,
    )
    out = torch.empty(q.shape, dtype=torch.float32)
    qs, arena, out_np = q.float().contiguous().numpy(), kv.typed.view(read_as[kv.dtype]).numpy(), out.numpy()
    table, ctx = block_tables.contiguous().numpy(), context_lens.contiguous().numpy()
    threads = torch.get_num_threads()
    if slices is None:
        slices = ranges(ctx, threads)
    if len(slices) == 1:
        loop(qs, arena, table, ctx, geometry, np.float32(scale), out_np)
        return out.to(q.dtype)
    pool = _pool(threads, os.getpid())
    jobs = [
        pool.submit(loop, qs[a:b], arena, table[a:b], ctx[a:b], geometry, np.float32(scale), out_np[a:b])
        for a, b in slices[1:]
    ]
    a, b = slices[0]
    loop(qs[a:b], arena, table[a:b], ctx[a:b], geometry, np.float32(scale), out_np[a:b])
    for job in jobs:
        job.result()  # re-raises a range's error here
    return out.to(q.dtype)
