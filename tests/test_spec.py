"""Specs: published parameter counts, exact precision sizes, and clear errors."""

import pytest

from pagedweight.core.spec import (
    PRECISION_ID,
    PRECISION_NAMES,
    PRECISIONS,
    get_precision,
    ladder,
    list_gpus,
    list_models,
    load_gpu,
    load_model,
)
from pagedweight.errors import SpecError

# Parameter counts published with each checkpoint (billions).
PUBLISHED_PARAMS_B = {
    "mixtral-8x7b": 46.7,
    "mixtral-8x22b": 140.6,
    "deepseek-moe-16b": 16.4,
    "deepseek-v2-lite": 15.7,
    "qwen1.5-moe-a2.7b": 14.3,
    "qwen3-30b-a3b": 30.5,
    "olmoe-1b-7b": 6.9,
    "deepseek-v3": 671.0,
}


def test_every_builtin_model_is_there_with_a_source():
    assert set(PUBLISHED_PARAMS_B) | {"tiny-moe"} == set(list_models())
    for name in list_models():
        assert load_model(name).source


@pytest.mark.parametrize("name, billions", sorted(PUBLISHED_PARAMS_B.items()))
def test_parameter_counts_match_published(name, billions):
    assert load_model(name).total_params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_mixtral_numbers_from_the_anchors():
    m = load_model("mixtral-8x7b")
    assert m.kv_bytes_per_token() == 128 * 1024  # 128 KiB per token
    assert m.expert_bytes("bf16") == pytest.approx(352e6, rel=0.01)  # 352 MB per expert
    assert m.expert_bytes("int4") == pytest.approx(92e6, rel=0.01)  # ~91 MB with g128 scales + zeros
    assert m.num_experts_total == 256


def test_deepseek_v3_scale():
    m = load_model("deepseek-v3")
    assert m.num_moe_layers == 58 and m.num_experts_total == 14848
    assert m.kv_bytes_per_token() == 61 * (512 + 64) * 2  # MLA latent + RoPE key


@pytest.mark.parametrize(
    "name, bits",
    [
        ("bf16", 16.0),
        ("fp8", 8 + 32 / 4096),  # fp32 scale per row of K = 4096
        ("int8", 8 + 32 / 4096),
        ("int4", 4 + (16 + 8) / 128),  # fp16 scale + uint8 zero per 128
        ("int3", 3 + (16 + 8) / 128),
        ("int2", 2 + (16 + 8) / 64),
    ],
)
def test_exact_bits_per_weight(name, bits):
    assert get_precision(name).bits_per_weight(14336, 4096) == pytest.approx(bits)


def test_fp8_block_format_counts_one_fp32_scale_per_128x128_block():
    p = get_precision("fp8-b128")
    # DeepSeek-V3's expert w1 [2048, 7168]: 16 x 56 blocks; ragged edges round up.
    assert p.matrix_bytes(2048, 7168) == 2048 * 7168 + 16 * 56 * 4
    assert p.matrix_bytes(200, 130) == 200 * 130 + 2 * 2 * 4
    m = load_model("deepseek-v3")
    assert m.expert_bytes("fp8-b128") == 3 * 2048 * 7168 + 3 * 16 * 56 * 4
    assert [q.name for q in ladder(["int4", "fp8-b128", "fp8", "bf16"])] == ["bf16", "fp8-b128", "fp8", "int4"]


def test_ragged_groups_round_up():
    # K = 200 is two groups of 128 per row; 3 rows of 4-bit data are 300 bytes.
    assert get_precision("int4").matrix_bytes(3, 200) == 300 + 3 * 2 * 2 + 3 * 2


def test_ladder_orders_and_rejects():
    assert [p.name for p in ladder(["int4", "bf16", "int8"])] == ["bf16", "int8", "int4"]
    with pytest.raises(SpecError, match="twice"):
        ladder(["int4", "int4"])
    with pytest.raises(SpecError, match="unknown precision 'int5'; allowed: bf16"):
        get_precision("int5")
    assert PRECISION_NAMES[PRECISION_ID["int4"]] == "int4" and len(PRECISION_NAMES) == len(PRECISIONS)


def test_gpus_and_cpu():
    assert {"h200", "h100-sxm", "a100-80gb", "l40s", "cpu"} == set(list_gpus())
    assert load_gpu("h200").hbm_bytes == 143771 * 2**20
    assert load_gpu("cpu").hbm_bytes > 2**30  # read from this machine
    assert load_gpu("a100-80gb").peak_fp8_flops == 0


def test_unknown_and_malformed_specs(tmp_path):
    with pytest.raises(SpecError, match="unknown model 'gpt-5'; built-in: deepseek-moe-16b"):
        load_model("gpt-5")
    bad = tmp_path / "m.yaml"
    bad.write_text("name: m\nsource: x\nnum_layers: 2\nhidden_size: 8\nnum_heads: 2\nnum_kv_heads: 2\n")
    with pytest.raises(SpecError, match=r"m.yaml: head_dim: required key is missing"):
        load_model(str(bad))
    bad.write_text(
        "name: m\nsource: x\nnum_layers: 2\nhidden_size: 8\nnum_heads: 2\nnum_kv_heads: 2\nhead_dim: 4\n"
        "num_experts: 2\ntop_k: 3\nexpert_ffn_size: 8\nvocab_size: 10\nmax_context_tokens: 64\n"
    )
    with pytest.raises(SpecError, match=r"top_k\(=3\) must be <= num_experts\(=2\)"):
        load_model(str(bad))
