"""Requests' contexts written into scattered blocks of a paged KV cache, for the decode tests."""

import torch


def write_contexts(kv, ctx: list[int], layer: int = 1) -> torch.Tensor:
    """Random K and V for ``ctx[i]`` tokens of each request, in blocks drawn at random (never
    block 0) and written into ``layer`` only; returns the block tables [B, M], padded with
    block 0."""
    num_blocks = kv.view.shape[0] * kv.view.shape[1]
    need = [-(-n // kv.block_tokens) for n in ctx]
    ids = torch.randperm(num_blocks - 1)[: sum(need)] + 1
    tables = torch.zeros(len(ctx), max(need), dtype=torch.int64)
    at = 0
    for i, (n, b) in enumerate(zip(ctx, need, strict=True)):
        tables[i, :b] = ids[at : at + b]
        at += b
        pos = torch.arange(n)
        k, v = torch.randn(n, kv.num_kv_heads, kv.head_dim), torch.randn(n, kv.num_kv_heads, kv.head_dim)
        kv.write(layer, tables[i][pos // kv.block_tokens], pos % kv.block_tokens, k, v)
    return tables
