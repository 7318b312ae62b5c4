"""The compiled CPU decode attention (``pwgpu.cpu_decode``) against ``paged_decode_ref``: fp32 and
bf16 caches, pages with and without slack, grouped-query heads, contexts that end inside a block
and on its last slot, and NaN everywhere it must not read (past each context, the padding of the
tables, the other layer)."""

import numpy as np
import pytest
import torch
from kv_contexts import write_contexts

from pagedweight.compiled import available
from pwgpu import cpu_decode
from pwgpu.attention import PagedKvCache, paged_decode_ref

pytestmark = pytest.mark.skipif(not available(), reason="numba is not installed: the PyTorch path runs instead")


def nan_cache(dtype, blocks_per_page, slack_bytes, kv_heads, head_dim, num_pages=40, parts=2):
    layers, block_tokens = 2, 4
    elem = torch.tensor([], dtype=dtype).element_size()
    block_bytes = layers * parts * block_tokens * kv_heads * head_dim * elem
    page_bytes = blocks_per_page * block_bytes + slack_bytes
    arena = torch.full((num_pages * page_bytes // elem,), float("nan"), dtype=dtype).view(torch.uint8)
    return PagedKvCache(arena, page_bytes, block_tokens, blocks_per_page, layers, kv_heads, head_dim, dtype, parts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("blocks_per_page, slack_bytes", [(1, 0), (2, 0), (3, 64)])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (6, 2, 8), (2, 2, 32)])
def test_compiled_decode_matches_reference(dtype, blocks_per_page, slack_bytes, heads, kv_heads, head_dim):
    torch.manual_seed(0)
    kv = nan_cache(dtype, blocks_per_page, slack_bytes, kv_heads, head_dim)
    assert kv.compiled_decode
    ctx = [1, 4, 5, 17, 40, 3]  # one token; a whole block; one past it; ...
    tables = write_contexts(kv, ctx)  # layer 0, the tables' padding and every slot past a context: NaN
    q = torch.randn(len(ctx), heads, head_dim).to(dtype)
    lens = torch.tensor(ctx)
    got = cpu_decode.paged_decode(q, kv, 1, tables, lens, head_dim**-0.5)
    want = paged_decode_ref(q, kv, 1, tables, lens, head_dim**-0.5)
    assert got.dtype == dtype and got.shape == q.shape and not got.isnan().any()
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got, want, **tol)


def test_compiled_decode_widens_bf16_exactly():
    """bf16 K and V read as their bits: the same as reading them as bf16 and converting, for
    negative values, zeros, the largest finite one and subnormals too."""
    torch.manual_seed(1)
    kv = nan_cache(torch.bfloat16, 1, 0, 1, 8)
    special = torch.tensor([-0.0, 0.0, -3.5, 3.3895e38, 9.2e-41, -1.0e-39, 1.0, -2.0])
    k = torch.stack([special.roll(i) for i in range(4)])[:, None, :].bfloat16()  # [4 tokens, 1, 8]
    v = torch.randn(4, 1, 8).bfloat16()
    kv.write(0, torch.tensor([2] * 4), torch.arange(4), k, v)
    q = torch.zeros(1, 1, 8)  # equal scores: the output is the mean of V
    got = cpu_decode.paged_decode(q, kv, 0, torch.tensor([[2]]), torch.tensor([4]), 1.0)
    torch.testing.assert_close(got[0, 0], v[:, 0].float().mean(0), rtol=1e-6, atol=1e-6)
    q = torch.ones(1, 1, 8) * 1e-38  # finite scores from every bit pattern above
    got = cpu_decode.paged_decode(q, kv, 0, torch.tensor([[2]]), torch.tensor([4]), 1.0)
    want = paged_decode_ref(q, kv, 0, torch.tensor([[2]]), torch.tensor([4]), 1.0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_caches_the_compiled_decode_does_not_take(monkeypatch):
    """fp16 (numba reads no half floats), MLA's single latent part and a platform without numba
    take the PyTorch way."""
    assert nan_cache(torch.float32, 1, 0, 2, 16).compiled_decode
    assert nan_cache(torch.bfloat16, 1, 0, 2, 16).compiled_decode
    assert not nan_cache(torch.float16, 1, 0, 2, 16).compiled_decode
    assert not nan_cache(torch.float32, 1, 0, 1, 24, parts=1).compiled_decode
    monkeypatch.setattr(cpu_decode, "available", lambda: False)
    assert not nan_cache(torch.float32, 1, 0, 2, 16).compiled_decode


def test_the_loop_is_compiled_ahead_per_kv_dtype():
    """``warm_up`` (which an engine on a CPU calls when built) compiles or loads the loop for a
    KV dtype with the argument types ``paged_decode`` passes, once per dtype."""
    cpu_decode.warm_up.cache_clear()
    for dtype in (torch.float32, torch.bfloat16):
        cpu_decode.warm_up(dtype)
    assert cpu_decode.warm_up.cache_info().currsize == 2


def test_compiled_decode_refuses_what_would_read_outside_the_arena():
    """The loop reads the arena without bounds checks, so its inputs are checked first."""
    kv = nan_cache(torch.float32, 2, 0, 2, 16, num_pages=4)  # 8 blocks of 4 tokens
    q = torch.randn(1, 4, 16)
    for table, ctx, what in (
        ([[8]], 3, "block id"), ([[-1]], 3, "block id"), ([[1, 9]], 5, "block id"),
        ([[1]], 5, "context length"), ([[1]], 0, "context length"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=what):
            cpu_decode.paged_decode(q, kv, 0, torch.tensor(table), torch.tensor([ctx]), 0.25)
    cpu_decode.paged_decode(q, kv, 0, torch.tensor([[7, 0]]), torch.tensor([4]), 0.25)  # padding not read


def test_a_batch_cut_across_threads_gives_the_same_bits(monkeypatch):
    """With several torch threads, ranges of requests run on a pool: each request is computed
    as on one thread, so the output is bit-identical; an error in any range reaches the caller."""
    torch.manual_seed(5)
    kv = nan_cache(torch.bfloat16, 2, 0, 2, 16)
    ctx = [40, 3, 17, 45, 1, 30, 22, 9]
    tables = write_contexts(kv, ctx)
    q = torch.randn(len(ctx), 4, 16).bfloat16()
    lens = torch.tensor(ctx)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_decode.paged_decode(q, kv, 1, tables, lens, 0.25)
        torch.set_num_threads(3)
        monkeypatch.setattr(cpu_decode, "MIN_TOKENS_PER_THREAD", 10)
        assert len(cpu_decode.ranges(lens.numpy(), 3)) == 3
        assert torch.equal(cpu_decode.paged_decode(q, kv, 1, tables, lens, 0.25), one)
        bad = tables.clone()
        bad[-1, 0] = 10_000  # in the last range, which a pool thread runs
        with pytest.raises(ValueError, match="block id"):
            cpu_decode.paged_decode(q, kv, 1, bad, lens, 0.25)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "ctx, threads, want",
    [([1000] * 32, 2, [(0, 16), (16, 32)]), ([100] * 8, 4, [(0, 8)]), ([5000, 10, 10, 5000], 2, [(0, 2), (2, 4)]),
     ([9000, 1], 4, [(0, 2)]), ([5000] * 3, 8, [(0, 1), (1, 2), (2, 3)])],
)  # fmt: skip
def test_ranges_of_about_equal_context(ctx, threads, want):
    assert cpu_decode.ranges(np.array(ctx), threads) == want


def test_a_forked_child_gets_its_own_pool(monkeypatch):
    """A process forked after the pool started has none of the pool's threads: it makes its own
    (the parent's, had it been reused, would never run the child's ranges)."""
    import multiprocessing

    threads = torch.get_num_threads()
    monkeypatch.setattr(cpu_decode, "MIN_TOKENS_PER_THREAD", 10)
    try:
        torch.set_num_threads(2)
        kv = nan_cache(torch.float32, 1, 0, 2, 16, num_pages=320)
        lens = torch.tensor([150] * 8)
        tables = write_contexts(kv, lens.tolist())
        q = torch.randn(8, 4, 16)
        want = cpu_decode.paged_decode(q, kv, 1, tables, lens, 0.25)  # the parent's pool runs
        with multiprocessing.get_context("fork").Pool(1) as child:
            got = child.apply_async(cpu_decode.paged_decode, (q, kv, 1, tables, lens, 0.25)).get(timeout=120)
        assert torch.equal(got, want)
    finally:
        torch.set_num_threads(threads)


def test_a_steps_decode_requests_are_selected_and_cut_once(monkeypatch):
    """A mixed step's decode requests (their tables, context lengths and thread ranges) are the
    same in every layer: made on the first layer's call, not again per layer."""
    from pwgpu.attention import build_batch, paged_attention

    torch.manual_seed(6)
    kv = nan_cache(torch.float32, 1, 0, 2, 16, num_pages=60)
    kv.typed.copy_(torch.randn(kv.typed.shape))  # every layer of every block holds K and V
    tables = [[b for b in row if b] for row in write_contexts(kv, [9, 14, 6]).tolist()]
    # request 1 is a prefill chunk of 5 tokens after 9 cached; requests 0 and 2 decode one token
    seqs = [(tables[0], 8, 1), (tables[1], 9, 5), (tables[2], 5, 1)]
    batch, _ = build_batch(seqs, kv.block_tokens, torch.device("cpu"))
    calls = []
    real = cpu_decode.ranges
    monkeypatch.setattr(cpu_decode, "ranges", lambda *a: calls.append(a) or real(*a))
    q = torch.randn(7, 4, 16)
    for layer in (0, 1):
        out = paged_attention(q, kv, layer, batch, 0.25)
        want = paged_decode_ref(q[[0, 6]], kv, layer, batch.block_tables[[0, 2]], torch.tensor([9, 6]), 0.25)
        torch.testing.assert_close(out[[0, 6]], want, rtol=1e-5, atol=1e-6)
    assert len(calls) == 1
    assert batch.decode_context[0] is batch.decode_context[0]  # cached, not selected again


@pytest.mark.e2e
def test_the_compiled_loop_is_loaded_from_numbas_cache_in_another_process(tmp_path):
    """The loop's signature holds only arrays and numbers (the row reader is chosen by the arena's
    type, not passed in): a second process finds it in numba's cache instead of compiling it and
    adding an entry (with the reader passed in, every process added one, and writing the cache
    index eventually failed with "underlying object has vanished")."""
    import os
    import sys

    import proc

    code = (
        "import torch\nfrom pwgpu import cpu_decode\n"
        "cpu_decode.warm_up(torch.bfloat16)\ncpu_decode.warm_up(torch.float32)\n"
        "print(len(cpu_decode._compiled()[0].signatures), sorted(cpu_decode._compiled()[0].stats.cache_hits.values()))"
    )
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))

    def entries() -> list[str]:
        return sorted(p.name for p in tmp_path.rglob("cpu_decode._decode_loop-*.nbc"))

    first = proc.run([sys.executable, "-c", code], quiet_s=30, check=True, env=env)
    assert first.stdout.split()[0] == "2" and len(entries()) == 2, (first.stdout, entries())
    second = proc.run([sys.executable, "-c", code], quiet_s=10, check=True, env=env)
    assert second.stdout.strip() == "2 [1, 1]" and len(entries()) == 2, (second.stdout, entries())
