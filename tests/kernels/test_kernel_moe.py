"""The fused mixed-precision MoE kernel against the PyTorch reference that reads the same
pages (``moe_ffn_paged_ref``), over the shapes where fused MoE kernels have gone wrong.

Weights are dequantised to identical values on both sides, so what remains is accumulation
order and the rounding of the SiLU*up activations to the activation dtype: the tolerance
depends on that dtype, not on the weight precision (the precision's own error is bounded in
test_kernel_quant.py).
"""

import pytest
import torch

from pagedweight.core.spec import PRECISIONS
from pwgpu.kernels import moe_gemm
from pwgpu.kernels.block_config import BlockConfig, get_config
from pwgpu.kernels.moe_gemm import align_tokens, fused_moe
from pwgpu.kernels.paging import PagedExperts
from pwgpu.kernels.reference import moe_ffn_dense_ref, moe_ffn_paged_ref

ALL = ["bf16", "fp16", "fp8-b128", "fp8", "int8", "int4", "int3", "int2"]
# Relative L2 error of the kernel vs the reference, by activation dtype (8 and 11 mantissa bits).
REL_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3}
SMALL = BlockConfig(16, 32, 32)  # tl.dot's smallest tiles: many programs, all edge paths


def _experts(num_experts, hidden, ffn, precisions, device, page_bytes=256, seed=0, spare_pages=7):
    g = torch.Generator().manual_seed(seed)

    def mat(n, k):
        return (torch.randn(n, k, generator=g) / k**0.5).to(device)

    w1 = [mat(ffn, hidden) for _ in range(num_experts)]
    w3 = [mat(ffn, hidden) for _ in range(num_experts)]
    w2 = [mat(hidden, ffn) for _ in range(num_experts)]
    return PagedExperts.from_dense(
        w1, w3, w2, precisions, page_bytes=page_bytes, scatter_seed=seed, spare_pages=spare_pages
    )


def _routing(num_tokens, num_experts, top_k, device, allowed=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if allowed is not None:  # experts outside `allowed` receive no tokens
        mask = torch.full((num_experts,), float("-inf"))
        mask[list(allowed)] = 0.0
        logits = logits + mask
    weights, ids = torch.topk(logits.softmax(-1), top_k)
    return ids.to(device), weights.to(device)


def _check(x, ids, weights, experts, config=SMALL):
    experts.check()
    got = fused_moe(x, ids, weights, experts, config)
    want = moe_ffn_paged_ref(x.cpu(), ids.cpu(), weights.cpu(), _on_cpu(experts))
    assert got.shape == want.shape and got.dtype == x.dtype
    err = (got.cpu().float() - want.float()).norm() / want.float().norm()
    assert err < REL_TOL[x.dtype], f"relative error {err:.2e}"
    return got


def _on_cpu(ex: PagedExperts) -> PagedExperts:
    return PagedExperts(
        ex.pool.cpu(), ex.page_offsets.cpu(), ex.first_page.cpu(), ex.precisions, ex.hidden_size, ex.ffn_size,
        ex.page_bytes,
    )  # fmt: skip


def test_align_tokens_sorts_pads_and_skips_empty_experts():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 0]])  # expert 2 gets nothing; S = 8 slots
    slots, block_expert = align_tokens(ids, num_experts=5, block_m=4)
    assert slots.numel() % 4 == 0 and block_expert.numel() == slots.numel() // 4
    valid = slots[slots < 8]
    assert sorted(valid.tolist()) == list(range(8))  # every slot exactly once
    for b, e in enumerate(block_expert.tolist()):
        rows = slots[4 * b : 4 * b + 4]
        rows = rows[rows < 8]
        if e == 5:  # past the last expert: padding only
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and (ids.reshape(-1)[rows.long()] == e).all()
    assert 2 not in block_expert.tolist() and 4 not in block_expert.tolist()


@pytest.mark.parametrize("precision", ALL)
def test_tokens_fewer_than_block(device, precision):
    """T * k = 6 < BLOCK_M = 16; pages of 256 bytes shuffled over the pool."""
    ex = _experts(4, 64, 96, [precision] * 4, device)
    ids, w = _routing(3, 4, 2, device)
    _check(torch.randn(3, 64, device=device).bfloat16(), ids, w, ex)


@pytest.mark.parametrize("precision", ["bf16", "fp8", "int4"])
def test_prime_experts_some_with_zero_tokens(device, precision):
    """E = 7 (prime); only experts 0, 3, 5 receive tokens."""
    ex = _experts(7, 64, 64, [precision] * 7, device, seed=1)
    ids, w = _routing(11, 7, 2, device, allowed=(0, 3, 5), seed=1)
    _check(torch.randn(11, 64, device=device).bfloat16(), ids, w, ex)


def test_top_k_equals_experts(device):
    ex = _experts(3, 64, 64, ["int8", "int4", "fp16"], device, seed=2)
    ids, w = _routing(5, 3, 3, device, seed=2)
    _check(torch.randn(5, 64, device=device).bfloat16(), ids, w, ex)


@pytest.mark.parametrize("page_bytes", [16, 4096], ids=["page<chunk", "page>matrix"])
def test_mixed_precisions_in_one_call(device, page_bytes):
    """All eight formats in one layer; tiny pages force per-element translation, big ones the
    per-row-chunk path. Blocks of 20 tokens span two BLOCK_M blocks for some experts."""
    ex = _experts(8, 64, 128, ALL, device, page_bytes=page_bytes, seed=3)
    ids, w = _routing(20, 8, 2, device, seed=3)
    _check(torch.randn(20, 64, device=device).bfloat16(), ids, w, ex)


@pytest.mark.parametrize("page_bytes", [64, 65536], ids=["per-element", "row-chunk"])
def test_fp8_blocks_across_block_rows_and_columns(device, page_bytes):
    """H = 256 and F = 160: two 128 x 128 scale blocks along each side of every matrix, the last
    ones ragged; each tile must find its own block's scale."""
    ex = _experts(3, 256, 160, ["fp8-b128", "int4", "fp8-b128"], device, page_bytes=page_bytes, seed=5)
    ids, w = _routing(6, 3, 2, device, seed=5)
    _check(torch.randn(6, 256, device=device).bfloat16(), ids, w, ex)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_gelu_epilogues(device, activation):
    """GeGLU experts (hidden_act gelu / gelu_pytorch_tanh): the kernel's epilogue against torch's."""
    ex = _experts(4, 64, 96, ["bf16", "int8", "int4", "fp8-b128"], device, seed=6)
    ids, w = _routing(9, 4, 2, device, seed=6)
    x = torch.randn(9, 64, device=device).bfloat16()
    got = fused_moe(x, ids, w, ex, SMALL, activation=activation)
    want = moe_ffn_paged_ref(x.cpu(), ids.cpu(), w.cpu(), _on_cpu(ex), activation)
    silu = moe_ffn_paged_ref(x.cpu(), ids.cpu(), w.cpu(), _on_cpu(ex))
    err = (got.cpu().float() - want.float()).norm() / want.float().norm()
    assert err < REL_TOL[x.dtype] and (silu - want).float().norm() / want.float().norm() > 10 * err


def test_k_tail_and_fp16_activations(device):
    """H = 80 and F = 40 are not multiples of BLOCK_K = 32: masked tails, per-element pages."""
    ex = _experts(5, 80, 40, ["fp16", "fp8", "int8", "int4", "int2"], device, seed=4)
    ids, w = _routing(9, 5, 2, device, seed=4)
    _check(torch.randn(9, 80, device=device).half(), ids, w, ex)


def test_split_k_down_projection(device):
    """F = 320 in 10 K blocks over 3 splits (4, 4, 2 blocks), partial sums meeting by atomics."""
    ex = _experts(4, 64, 320, ["bf16", "int8", "int4", "int3"], device, page_bytes=512, seed=10)
    ids, w = _routing(13, 4, 2, device, seed=10)
    _check(torch.randn(13, 64, device=device).bfloat16(), ids, w, ex, config=BlockConfig(16, 32, 32, split_k=3))


@pytest.mark.parametrize("precision", ["int4", "int2"])
def test_packed_sub_byte_tiles(device, precision):
    """BLOCK_K = 64 puts int4 and int2 on the packed path (one byte load, 2 or 4 sub-tile dots)."""
    assert moe_gemm._chunk_flags(precision, 128, 128, 64, 4096)[2]
    ex = _experts(3, 128, 128, [precision, "bf16", precision], device, page_bytes=4096, seed=12)
    ids, w = _routing(10, 3, 2, device, seed=12)
    _check(torch.randn(10, 128, device=device).bfloat16(), ids, w, ex, config=BlockConfig(16, 32, 64))


def test_fp8_without_native_conversion(device, monkeypatch):
    """The dequantise-by-hand FP8 path taken on GPUs older than sm_89."""
    monkeypatch.setattr(moe_gemm, "fp8_native", lambda _device: False)
    ex = _experts(3, 64, 64, ["fp8"] * 3, device, seed=5)
    ids, w = _routing(4, 3, 2, device, seed=5)
    _check(torch.randn(4, 64, device=device).bfloat16(), ids, w, ex)


def test_default_configs_decode_step(device):
    """One decode token, block sizes from configs/default.json (the small-M rows)."""
    assert get_config("int4", 128, 128, 1).block_m == 16
    ex = _experts(4, 128, 128, ["bf16", "int8", "int4", "fp8"], device, page_bytes=1024, seed=6)
    ids, w = _routing(1, 4, 2, device, seed=6)
    _check(torch.randn(1, 128, device=device).bfloat16(), ids, w, ex, config=None)


def test_triton_and_reference_quantizers_fill_the_same_pool(device):
    """What the engine does on a GPU (quantise straight into scattered pages) leaves the same
    bytes as the reference path."""
    g = torch.Generator().manual_seed(11)
    mats = [[(torch.randn(n, k, generator=g) * 0.1).to(device) for _ in range(3)] for n, k in ((48, 64),) * 2]
    mats.append([(torch.randn(64, 48, generator=g) * 0.1).to(device) for _ in range(3)])
    precs = ["bf16", "int4", "fp8"]
    via_triton = PagedExperts.from_dense(*mats, precs, page_bytes=128, scatter_seed=3, quantizer="triton")
    via_torch = PagedExperts.from_dense(*mats, precs, page_bytes=128, scatter_seed=3, quantizer="reference")
    assert torch.equal(via_triton.pool.cpu(), via_torch.pool.cpu())


def test_paged_reference_matches_dense_reference():
    """The CPU path (dequantise through the table) equals the dense FFN on the same weights."""
    ex = _experts(4, 64, 64, ["int4", "bf16", "int8", "fp8"], "cpu", seed=7)
    ids, w = _routing(6, 4, 2, "cpu", seed=7)
    x = torch.randn(6, 64).bfloat16()
    dense = [[ex.dequantize_matrix(e, j, torch.bfloat16) for e in range(4)] for j in range(3)]
    torch.testing.assert_close(moe_ffn_paged_ref(x, ids, w, ex), moe_ffn_dense_ref(x, ids, w, *dense))


def test_precision_change_is_a_table_edit(device):
    """Re-quantise expert 1 to int4 into spare pages and flip its table row: the kernel reads
    the new format with no other change."""
    int4_pages = -(-PRECISIONS["int4"].matrix_bytes(64, 64) // 512)
    ex = _experts(3, 64, 64, ["bf16"] * 3, device, page_bytes=512, seed=8, spare_pages=3 * int4_pages + 2)
    ids, w = _routing(6, 3, 2, device, seed=8)
    x = torch.randn(6, 64, device=device).bfloat16()
    before = _check(x, ids, w, ex)
    used = set((ex.page_offsets // ex.page_bytes).tolist())
    spare = [p for p in range(ex.pool.numel() // ex.page_bytes) if p not in used]
    first = ex.page_offsets.numel()
    ex.page_offsets = torch.cat([ex.page_offsets, torch.tensor(spare, device=device) * ex.page_bytes])
    dense = [ex.dequantize_matrix(1, j, torch.float32).to(device) for j in range(3)]
    for j in range(3):
        ex.write_matrix(dense[j], "int4", first + j * int4_pages)
    ex.first_page[1] = torch.tensor([first + j * int4_pages for j in range(3)], dtype=torch.int32)
    ex.precisions = ("bf16", "int4", "bf16")
    ex.check()
    after = _check(x, ids, w, ex)
    assert not torch.equal(before, after)  # expert 1 now really computes in int4


def test_bad_inputs_say_what_is_wrong(device):
    ex = _experts(2, 64, 64, ["bf16"] * 2, device)
    ids, w = _routing(2, 2, 1, device)
    with pytest.raises(ValueError, match="do not match experts"):
        fused_moe(torch.randn(2, 32, device=device).bfloat16(), ids, w, ex)
    empty = fused_moe(torch.zeros(0, 64, device=device).bfloat16(), ids[:0], w[:0], ex)
    assert empty.shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 1024], ids=["decode", "mid", "prefill"])
def test_model_sized_shapes_with_default_configs(device, num_tokens):
    """Every format at once, 64 KiB pages, the block sizes of configs/default.json for each M
    bucket (BLOCK_M 16 .. 128): the aligned, vectorised per-row-chunk path the GPU takes."""
    if device != "cuda":
        pytest.skip("model-sized shapes take minutes in the interpreter")
    ex = _experts(7, 1024, 512, ALL, device, page_bytes=1 << 16, seed=9)
    ids, w = _routing(num_tokens, 7, 2, device, seed=9)
    _check(torch.randn(num_tokens, 1024, device=device).bfloat16(), ids, w, ex, config=None)


def test_block_config_prefers_a_tuned_entry(tmp_path, monkeypatch):
    from pwgpu.kernels import block_config

    (tmp_path / "default.json").write_text((block_config.CONFIG_DIR / "default.json").read_text())
    (tmp_path / "nvidia_h200.json").write_text('{"int4,14336,4096,16": [16, 128, 64, 4, 4, 8]}')
    monkeypatch.setattr(block_config, "CONFIG_DIR", tmp_path)
    block_config._load.cache_clear()
    try:
        tuned = block_config.get_config("int4", 14336, 4096, 9, "NVIDIA H200")  # 9 tokens -> bucket 16
        assert tuned == BlockConfig(16, 128, 64, 4, 4, 8)
        assert block_config.get_config("int8", 14336, 4096, 9, "NVIDIA H200") == get_config("int8", 1, 1, 16)
        assert block_config.get_config("int4", 14336, 4096, 2000, "NVIDIA H200").block_m == 128  # default 'max' row
    finally:
        block_config._load.cache_clear()
    with pytest.raises(ValueError, match="power of two"):
        BlockConfig(16, 48, 64)
