"""Paged attention: the Triton decode kernel against its PyTorch reference, and the reference
against plain attention over a contiguous copy of the context."""

import pytest
import torch
import torch.nn.functional as F_

from pwgpu.attention import PagedKvCache, build_batch, paged_attention, paged_decode_ref

DEVICES = [pytest.param("cpu", id="interp"), pytest.param("cuda", id="gpu", marks=pytest.mark.gpu)]


def make_cache(device, num_layers, kv_heads, head_dim, block_tokens, dtype, num_pages=12, blocks_per_page=2):
    elem = torch.tensor([], dtype=dtype).element_size()
    block_bytes = num_layers * 2 * block_tokens * kv_heads * head_dim * elem
    page_bytes = blocks_per_page * block_bytes + 64  # slack at the end of each page, as in the pool
    arena = torch.randn(num_pages * page_bytes // elem, device=device, dtype=dtype).view(torch.uint8)
    return PagedKvCache(arena, page_bytes, block_tokens, blocks_per_page, num_layers, kv_heads, head_dim, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, block_tokens, ctx_lens",
    [
        (4, 2, 32, 16, [1, 17, 40]),  # GQA, a context of one token, partial last blocks
        (6, 6, 24, 8, [8, 33]),  # MHA, head_dim not a power of two (masked lanes)
        (8, 1, 64, 4, [23]),  # MQA, many small blocks
    ],
)
def test_triton_decode_matches_reference(device, heads, kv_heads, head_dim, block_tokens, ctx_lens):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pwgpu.kernels.attention import paged_decode_triton

    torch.manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    kv = make_cache(device, 2, kv_heads, head_dim, block_tokens, dtype)
    num_blocks = kv.view.shape[0] * kv.blocks_per_page
    perm = torch.randperm(num_blocks)  # blocks scattered over the arena, in no order
    width = max(-(-c // block_tokens) for c in ctx_lens)
    tables = torch.stack([perm[i * width : (i + 1) * width] for i in range(len(ctx_lens))]).to(device)
    ctx = torch.tensor(ctx_lens, device=device)
    q = torch.randn(len(ctx_lens), heads, head_dim, device=device, dtype=dtype)
    ref = paged_decode_ref(q, kv, 1, tables, ctx, head_dim**-0.5)
    out = paged_decode_triton(q, kv, 1, tables, ctx, head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_reference_matches_contiguous_attention():
    """Write a prompt through ``build_batch`` (prefill) then decode one more token: both equal
    SDPA over the contiguous K/V."""
    torch.manual_seed(1)
    kv = make_cache("cpu", 1, 2, 16, 4, torch.float32)
    n = 11
    q, k, v = torch.randn(n + 1, 4, 16), torch.randn(n + 1, 2, 16), torch.randn(n + 1, 2, 16)
    blocks = [7, 2, 19]
    batch, _ = build_batch([(blocks, 0, n)], 4, torch.device("cpu"))
    kv.write(0, batch.slot_blocks, batch.slot_offsets, k[:n], v[:n])
    pre = paged_attention(q[:n], kv, 0, batch, 0.25)
    batch, _ = build_batch([(blocks, n, 1)], 4, torch.device("cpu"))
    kv.write(0, batch.slot_blocks, batch.slot_offsets, k[n:], v[n:])
    dec = paged_attention(q[n:], kv, 0, batch, 0.25)
    kk, vv = k.repeat_interleave(2, dim=1).transpose(0, 1), v.repeat_interleave(2, dim=1).transpose(0, 1)
    want = F_.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True, scale=0.25).transpose(0, 1)
    torch.testing.assert_close(torch.cat([pre, dec]), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_equals_each_request_alone(device):
    """A step mixing decodes and prefill chunks (decodes batched into one call, also when they
    sit between chunks) gives each request what it gets when run alone."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(2)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    kv = make_cache(device, 1, 2, 16, 4, dtype, num_pages=16)
    # (blocks, tokens cached, new tokens): decode, chunk at offset 0, decode, chunk after 5 cached.
    seqs = [([3, 9], 6, 1), ([0, 1, 2], 0, 9), ([5], 2, 1), ([11, 12, 13], 5, 6)]
    total = sum(n for _, _, n in seqs)
    q = torch.randn(total, 4, 16, device=device, dtype=dtype)
    batch, _ = build_batch(seqs, 4, torch.device(device))
    assert batch.decode_seqs == [0, 2] and not batch.all_decode
    mixed = paged_attention(q, kv, 0, batch, 0.25)
    start = 0
    for blocks, cached, n in seqs:
        alone, _ = build_batch([(blocks, cached, n)], 4, torch.device(device))
        want = paged_attention(q[start : start + n], kv, 0, alone, 0.25)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(mixed[start : start + n], want, rtol=tol, atol=tol)
        start += n


@pytest.mark.parametrize("device", DEVICES)
def test_decode_ignores_nan_past_the_context(device):
    """A KV page may have held an expert's weights before (after a precision change frees it),
    whose bytes read as NaN; slots past a request's context must not reach its output."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(2)
    kv = make_cache(device, 1, 2, 16, 8, torch.float32)
    kv.view.fill_(float("nan"))
    ctx = 5  # one block of 8 slots, three of them never written
    k, v = torch.randn(ctx, 2, 16, device=device), torch.randn(ctx, 2, 16, device=device)
    batch, _ = build_batch([([3], 0, ctx)], 8, torch.device(device))
    kv.write(0, batch.slot_blocks, batch.slot_offsets, k, v)
    q = torch.randn(1, 4, 16, device=device)
    tables, lens = torch.tensor([[3]], device=device), torch.tensor([ctx], device=device)
    want = F_.scaled_dot_product_attention(
        q.transpose(0, 1)[:, None], k.repeat_interleave(2, 1).transpose(0, 1)[:, None],
        v.repeat_interleave(2, 1).transpose(0, 1)[:, None], scale=0.25,
    )[:, 0].transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(paged_decode_ref(q, kv, 0, tables, lens, 0.25), want, rtol=1e-5, atol=1e-5)
    from pwgpu.cpu_kernels import paged_decode_sdpa  # the CPU engine's fast path

    torch.testing.assert_close(paged_decode_sdpa(q, kv, 0, tables, lens, 0.25), want, rtol=1e-5, atol=1e-5)
    if device == "cuda":
        from pwgpu.kernels.attention import paged_decode_triton

        torch.testing.assert_close(paged_decode_triton(q, kv, 0, tables, lens, 0.25), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slack", (64, 0), ids=("slack", "back-to-back"))
@pytest.mark.parametrize("parts", (2, 1), ids=("k-v", "latent"))
def test_kv_copied_out_and_into_other_blocks_gathers_the_same(device, slack, parts):
    """A request's KV copied to the host (``copy_out``) and into other blocks (``copy_in``)
    gathers to the same tokens in every layer and part; nothing else in the arena changes (the
    slots past its last token in the last block neither). Pages with slack at their end index
    by (page, slot), pages without by whole rows: both paths."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    layers, heads, dim, bt, bpp, pages, dtype = 3, 2, 8, 16, 2, 12, torch.float32
    elem = torch.tensor([], dtype=dtype).element_size()
    block_bytes = layers * parts * bt * heads * dim * elem
    page_bytes = bpp * block_bytes + slack
    arena = torch.randn(pages * page_bytes // elem, device=device, dtype=dtype).view(torch.uint8)
    kv = PagedKvCache(arena, page_bytes, bt, bpp, layers, heads, dim, dtype, parts)
    assert (kv.rows is None) == bool(slack)
    src, dst, tokens = [3, 7, 1], [10, 4, 9, 0], 37  # the last block holds 5 tokens
    host = kv.copy_out(src, tokens)
    assert host.device.type == "cpu" and host.is_pinned() == (device == "cuda")
    assert tokens * kv.token_bytes == tokens * layers * parts * heads * dim * elem
    before = arena.clone()
    kv.copy_in(host, dst, tokens)
    for layer in range(layers):
        for part in range(parts):
            want = kv.gather_part(layer, torch.tensor([src], device=device), part)[0, :tokens]
            got = kv.gather_part(layer, torch.tensor([dst], device=device), part)[0, :tokens]
            assert torch.equal(got, want)
    # Only the destination's first 37 tokens changed: put back what was there and compare.
    was = PagedKvCache(before, page_bytes, bt, bpp, layers, heads, dim, dtype, parts).copy_out(dst, tokens)
    assert was.shape[0] == 3
    kv.copy_in(was, dst, tokens)
    assert torch.equal(arena, before)
    with pytest.raises(ValueError, match="need 3 KV blocks"):
        kv.copy_out(src[:2], tokens)
