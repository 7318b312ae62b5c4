"""The CPU engine's fast paths against the references they replace: the grouped MoE FFN against
``moe_ffn_dense_ref`` (bit-identical with top-2 routing, also over the dense copies the
engine keeps: bf16 experts in bf16, others in fp32), the SDPA paged decode against
``paged_decode_ref`` (one group of requests or several of similar context length), and the
whole-block KV gather against indexing by (page, slot)."""

import pytest
import torch
import torch.nn.functional as F_
from kv_contexts import write_contexts

from pwgpu.attention import PagedKvCache, paged_decode_ref
from pwgpu.cpu_kernels import decode_groups, dense_expert, moe_ffn_grouped, paged_decode_sdpa
from pwgpu.kernels.paging import PagedExperts
from pwgpu.kernels.reference import moe_ffn_dense_ref


def routed(t, e, k, seed, unused=()):
    """Top-k ids (distinct per token, never in ``unused``) and softmax-like weights."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([i for i in range(e) if i not in unused])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    return ids, w / w.sum(-1, keepdim=True)


@pytest.mark.parametrize(
    "t, k, dtype, activation",
    [(8, 2, torch.float32, "silu"), (1, 2, torch.float32, "gelu"), (33, 4, torch.float32, "silu"),
     (16, 2, torch.bfloat16, "gelu_tanh")],
)  # fmt: skip
def test_grouped_moe_matches_reference(t, k, dtype, activation):
    torch.manual_seed(0)
    e, h, f = 6, 32, 48
    w1, w3, w2 = torch.randn(e, f, h) * 0.2, torch.randn(e, f, h) * 0.2, torch.randn(e, h, f) * 0.2
    x = torch.randn(t, h).to(dtype)
    ids, w = routed(t, e, k, seed=t, unused=(3,))  # one expert gets no token
    w = w.to(dtype)
    want = moe_ffn_dense_ref(x, ids, w, list(w1), list(w3), list(w2), activation)
    w13 = list(torch.cat([w1, w3], dim=1))
    w13[3] = None  # an expert without tokens is never read
    counts = torch.bincount(ids.reshape(-1), minlength=e).tolist()
    got = moe_ffn_grouped(x, ids, w, w13, list(w2), counts, activation)
    assert got.dtype == dtype
    if k == 2 and dtype == torch.float32:
        assert torch.equal(got, want)  # the same two products summed: bit-identical
    else:
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("precision", ["bf16", "int4"])
def test_dense_experts_from_pages_give_the_reference(precision):
    """The engine's CPU copies: a bf16 expert kept in bf16 (upcast exactly per use), an int4
    one dequantised to fp32; both give the reference over the same dequantised weights, bit
    for bit."""
    torch.manual_seed(3)
    e, h, f = 4, 64, 128
    mats = [list(torch.randn(e, *shape).bfloat16()) for shape in ((f, h), (f, h), (h, f))]
    experts = PagedExperts.from_dense(*mats, [precision] * e, page_bytes=1 << 12, scatter_seed=1)
    w13, w2 = zip(*(dense_expert(experts, i) for i in range(e)), strict=True)
    assert w13[0].dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
    x = torch.randn(5, h)
    ids, w = routed(5, e, 2, seed=4)
    counts = torch.bincount(ids.reshape(-1), minlength=e).tolist()
    ref = [[experts.dequantize_matrix(i, j, torch.float32) for i in range(e)] for j in range(3)]
    assert torch.equal(moe_ffn_grouped(x, ids, w, w13, w2, counts), moe_ffn_dense_ref(x, ids, w, *ref))


@pytest.mark.parametrize("precision", ["fp8", "int8", "int4"])
def test_quantised_experts_in_a_bf16_run_are_copied_as_the_gpu_kernel_multiplies_them(precision):
    """In a bf16 run an FP8/INT8/INT4 expert's dense copy is its fp32 dequantisation rounded
    once to bf16, the ``w.to(a.dtype)`` of the GPU kernel: half an fp32 copy's bytes, the same
    rounding, and with bf16 activations the same products (upcast exactly to fp32 per use)."""
    torch.manual_seed(5)
    e, h, f = 4, 64, 128
    mats = [list(torch.randn(e, *shape).bfloat16()) for shape in ((f, h), (f, h), (h, f))]
    experts = PagedExperts.from_dense(*mats, [precision] * e, page_bytes=1 << 12, scatter_seed=1)
    w13, w2 = zip(*(dense_expert(experts, i, torch.bfloat16) for i in range(e)), strict=True)
    assert w13[0].dtype == w2[0].dtype == torch.bfloat16
    fp32 = [[experts.dequantize_matrix(i, j, torch.float32) for i in range(e)] for j in range(3)]
    assert torch.equal(w2[1], fp32[2][1].bfloat16())
    assert torch.equal(w13[2], torch.cat([fp32[0][2], fp32[1][2]]).bfloat16())
    x = torch.randn(5, h).bfloat16()
    ids, w = routed(5, e, 2, seed=6)
    counts = torch.bincount(ids.reshape(-1), minlength=e).tolist()
    rounded = [[m.bfloat16().float() for m in mat] for mat in fp32]
    got = moe_ffn_grouped(x, ids, w.bfloat16(), w13, w2, counts)
    torch.testing.assert_close(got, moe_ffn_dense_ref(x, ids, w.bfloat16(), *rounded), rtol=0, atol=0)
    # an fp32 run keeps fp32 copies: exact dequantisation
    assert dense_expert(experts, 0, torch.float32)[1].dtype == torch.float32


def make_cache(blocks_per_page, slack_bytes, dtype=torch.float32, num_pages=10):
    layers, kv_heads, head_dim, block_tokens = 2, 2, 16, 4
    elem = torch.tensor([], dtype=dtype).element_size()
    block_bytes = layers * 2 * block_tokens * kv_heads * head_dim * elem
    page_bytes = blocks_per_page * block_bytes + slack_bytes
    arena = torch.randn(num_pages * page_bytes // elem, dtype=dtype).view(torch.uint8)
    return PagedKvCache(arena, page_bytes, block_tokens, blocks_per_page, layers, kv_heads, head_dim, dtype)


@pytest.mark.parametrize("blocks_per_page, slack_bytes", [(1, 0), (2, 0), (2, 64)])
def test_block_gather_and_sdpa_decode_match_reference(blocks_per_page, slack_bytes):
    """Evenly spaced blocks (no slack) are gathered whole and written through one block view;
    with slack at the end of each page both index by (page, slot). Both give the reference's
    K, V and attention."""
    torch.manual_seed(1)
    kv = make_cache(blocks_per_page, slack_bytes)
    assert (kv.blocks is not None) == (slack_bytes == 0)
    num_blocks = kv.view.shape[0] * blocks_per_page
    tables = torch.randperm(num_blocks)[:9].view(3, 3)  # scattered, in no order
    ctx = torch.tensor([1, 7, 12])
    page, slot = tables // blocks_per_page, tables % blocks_per_page
    for part in (0, 1):
        want = kv.view[page, slot, 1, part].reshape(3, 12, 2, 16)
        assert torch.equal(kv.gather_part(1, tables, part), want)
    blocks, offsets = tables[:, 1], torch.tensor([0, 3, 1])
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    kv.write(1, blocks, offsets, k, v)  # whole-block view or (page, slot): the same places
    page, slot = blocks // blocks_per_page, blocks % blocks_per_page
    assert torch.equal(kv.view[page, slot, 1, 0, offsets], k) and torch.equal(kv.view[page, slot, 1, 1, offsets], v)
    q = torch.randn(3, 4, 16)
    want = paged_decode_ref(q, kv, 1, tables, ctx, 0.25)
    torch.testing.assert_close(paged_decode_sdpa(q, kv, 1, tables, ctx, 0.25), want, rtol=1e-5, atol=1e-5)


def test_sdpa_decode_in_bf16_keeps_fp32_softmax():
    torch.manual_seed(2)
    kv = make_cache(1, 0, torch.bfloat16)
    tables, ctx = torch.tensor([[4, 1, 7]]), torch.tensor([10])
    q = torch.randn(1, 4, 16).to(torch.bfloat16)
    got = paged_decode_sdpa(q, kv, 0, tables, ctx, 0.25)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, paged_decode_ref(q, kv, 0, tables, ctx, 0.25), rtol=1e-2, atol=1e-2)


def test_sdpa_decode_zeroes_every_slot_past_each_context():
    """Requests of different lengths in one batch: each one's last block has slots past its
    context, and the shorter ones' tables are padded with block 0. All of those read NaN here
    (a page that held weights); only the written tokens may reach each output."""
    torch.manual_seed(3)
    kv = make_cache(1, 0)
    kv.view.fill_(float("nan"))
    tables = torch.tensor([[5, 2, 0], [7, 0, 0], [1, 8, 3]])  # block 0 is padding only
    ctx = [6, 3, 10]
    ks, vs = [], []
    for table, n in zip(tables.tolist(), ctx, strict=True):
        k, v = torch.randn(n, 2, 16), torch.randn(n, 2, 16)
        pos = torch.arange(n)
        kv.write(1, torch.tensor(table)[pos // kv.block_tokens], pos % kv.block_tokens, k, v)
        ks.append(k)
        vs.append(v)
    q = torch.randn(3, 4, 16)
    got = paged_decode_sdpa(q, kv, 1, tables, torch.tensor(ctx), 0.25)
    for i in range(3):
        k, v = (x.repeat_interleave(2, 1).transpose(0, 1) for x in (ks[i], vs[i]))  # [Hq, C, D]
        want = F_.scaled_dot_product_attention(q[i][:, None], k, v, scale=0.25)[:, 0]
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


def test_decode_groups_split_only_where_padding_is_spared():
    """Longest first; a group starts where the requests left are spared more than the threshold
    in padding blocks; uniform or nearly uniform lengths stay one group."""
    assert decode_groups([]) == []
    assert decode_groups([20, 20, 20]) == [[0, 1, 2]]
    assert decode_groups([19, 21, 20, 22], min_saving_blocks=16) == [[3, 1, 2, 0]]  # 3 x 1 block at most
    # what counts is the padding spared, not how far apart the lengths are: one block less for
    # 40 requests is worth a group, five blocks less for 3 requests is not
    assert decode_groups([22] + [21] * 40, min_saving_blocks=16) == [[0], list(range(1, 41))]
    assert decode_groups([22] + [17] * 3, min_saving_blocks=16) == [[0, 1, 2, 3]]
    # 100 and 98 blocks, then four of 10-12: the short ones are spared (4 x 86) blocks each layer
    assert decode_groups([10, 100, 12, 98, 11, 10], min_saving_blocks=16) == [[1, 3], [2, 4, 0, 5]]
    # one long request among many short ones: split right after it
    assert decode_groups([5] * 8 + [40], min_saving_blocks=16) == [[8], list(range(8))]
    # a saving of exactly the threshold is not enough (a split costs about that much)
    assert decode_groups([3, 1], min_saving_blocks=2) == [[0, 1]]
    assert decode_groups([4, 1], min_saving_blocks=2) == [[0], [1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_decode_in_groups_equals_one_group(dtype):
    """Requests of very different lengths attended in groups (each as wide as its longest, the
    tables' other columns never read) give each request what one group over the whole table
    gives, to rounding (the attention kernel blocks a shorter context differently), with NaN
    in every slot past each context."""
    torch.manual_seed(4)
    kv = make_cache(1, 0, dtype, num_pages=48)
    kv.view.fill_(float("nan"))
    ctx = [40, 3, 17, 45, 1, 30]  # 4-token blocks: 10, 1, 5, 12, 1 and 8 of them
    need = [-(-n // kv.block_tokens) for n in ctx]
    tables = write_contexts(kv, ctx)  # padded with block 0 (NaN)
    q = torch.randn(len(ctx), 4, 16).to(dtype)
    lens = torch.tensor(ctx)
    whole = paged_decode_sdpa(q, kv, 1, tables, lens, 0.25)
    assert not whole.isnan().any()
    found = decode_groups(need, min_saving_blocks=0)
    assert len(found) > 2, found
    groups = [(torch.tensor(g), need[g[0]]) for g in found]
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(paged_decode_sdpa(q, kv, 1, tables, lens, 0.25, groups), whole, **tol)
    assert torch.equal(paged_decode_sdpa(q, kv, 1, tables, lens, 0.25, [(None, max(need))]), whole)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_row_padded_linear_is_bit_identical(dtype):
    """Padding a 16-bit matmul's rows (so that oneDNN reuses a kernel per padded size) leaves the
    real rows' results bit-identical, with and without a bias; fp32 and GPUs are left alone."""
    from pwgpu.cpu_kernels import cpu_linear, linear_rows_padded, padded_rows

    assert [padded_rows(m) for m in (1, 16, 17, 250, 256, 257, 1000, 1024)] == [1, 16, 32, 256, 256, 320, 1024, 1024]
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    for m in (1, 5, 16, 17, 31, 100, 255, 257, 300, 1000):
        x = torch.randn(m, 64, generator=gen).to(dtype)
        for bias in (None, b):
            out = linear_rows_padded(x, w, bias)
            assert out.shape == (m, 96) and torch.equal(out, F_.linear(x, w, bias)), (m, bias is None)
    assert cpu_linear(torch.device("cpu"), dtype) is linear_rows_padded
    assert cpu_linear(torch.device("cpu"), torch.float32) is F_.linear
    assert cpu_linear(torch.device("cuda"), dtype) is F_.linear
