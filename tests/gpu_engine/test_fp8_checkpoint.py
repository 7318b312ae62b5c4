"""FP8 block-scaled checkpoints (DeepSeek-V3's format) as a precision, not a conversion: the
routed experts' host master is the checkpoint's E4M3 codes and scales, their ladder is
fp8-b128 -> int4, an upgrade restores the checkpoint's bytes, everything else is dequantised at
load; and every malformed FP8 checkpoint is refused in one line.

The tiny model has H = 128 and F = 160, so expert matrices span two 128 x 128 scale blocks on
one side (the second ragged), as DeepSeek's 7168 x 2048 matrices span 56 x 16."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import build, run, write_fp8_checkpoint

from pagedweight.core.runtime import CoreConfig
from pagedweight.core.spec import PRECISION_ID, PRECISION_NAMES
from pagedweight.policy.controller import DOWNGRADE, UPGRADE, Change, ControllerSettings
from pwgpu import fp8_checkpoint as fp8
from pwgpu.attention import build_batch
from pwgpu.engine import Engine, EngineConfig
from pwgpu.kernels.layout import matrix_layout
from pwgpu.loader import CheckpointError, expert_names, load_checkpoint
from pwgpu.sampling import SamplingParams

SHAPE = dict(hidden_size=128, moe_intermediate_size=160, intermediate_size=192)
PAGE_BYTES = 1 << 13


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8")
    return path, write_fp8_checkpoint("deepseek_v3", path, **SHAPE)


def _engine(path, budget_bytes=16 << 20, page_bytes=PAGE_BYTES, controller=None, **kw):
    core = CoreConfig(budget_bytes=budget_bytes, page_bytes=page_bytes, controller=controller or ControllerSettings())
    return Engine(path, EngineConfig(core, **({"policy": "static-fp16"} | kw)))


def _expert_bytes(eng, idx):
    """The bytes of expert ``idx``'s three matrices as its pages hold them, in matrix order."""
    pt, store = eng.core.page_table, eng.store
    prec_id = int(pt.precision_ids[idx])
    prec = PRECISION_NAMES[prec_id]
    out = []
    for j, pages in enumerate(pt.matrix_pages(prec_id, pt.pages[idx])):
        size = matrix_layout(prec, *store.masters.shape(j)).total_bytes
        out.append(torch.cat([store.arena[p * PAGE_BYTES : (p + 1) * PAGE_BYTES] for p in pages.tolist()])[:size])
    return out


def _checkpoint_blobs(path, layer, e):
    t = load_file(str(path / "model.safetensors"))
    arch = load_checkpoint(path).arch
    return [fp8.to_blob(t[n], t[fp8.scale_name(n)]) for n in expert_names(arch, layer, e)]


def test_the_host_master_is_the_checkpoint_and_its_ladder_tops_at_fp8(fp8_model):
    path, _ = fp8_model
    eng = _engine(path)
    assert eng.table.ladder == ("fp8-b128", "int4") and eng.store.masters.precision == "fp8-b128"
    assert (eng.core.page_table.precision_ids == PRECISION_ID["fp8-b128"]).all()
    # The pages of expert 5 of the first MoE layer (layer 1) hold the checkpoint's bytes as they are.
    for got, want in zip(_expert_bytes(eng, 5), _checkpoint_blobs(path, 1, 5), strict=True):
        assert torch.equal(got, want)
    assert any("dequantised" in n and "FP8 weight(s) outside the routed experts" in n for n in eng.load_notes)


def test_logits_match_transformers_on_the_dequantised_weights(fp8_model):
    """fp32: the FP8 experts read through the page table, the rest dequantised at load, against
    transformers holding the dequantised weights."""
    path, hf = fp8_model
    prompt = torch.randint(0, 96, (33,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].float()
    model, kv, blocks = build(path, torch.float32)  # dense oracle
    assert (run(model, kv, blocks, prompt, 0)[-1] - ref).abs().max() / ref.abs().max() < 1e-5
    eng = _engine(path, dtype="float32")
    ours = _last_logits(eng, prompt)
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-5


def test_downgrade_goes_to_int4_and_upgrade_restores_the_fp8_bytes(fp8_model):
    path, _ = fp8_model
    eng = _engine(path, dtype="float32")
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    before = _last_logits(eng, prompt)
    n = eng.core.page_table.num_experts
    eng.core.apply([Change(DOWNGRADE, i, PRECISION_ID["int4"]) for i in range(n)])
    assert (eng.core.page_table.precision_ids == PRECISION_ID["int4"]).all()
    int4 = _last_logits(eng, prompt)
    assert not torch.allclose(int4, before, rtol=1e-3, atol=1e-3)
    eng.core.apply([Change(UPGRADE, i, PRECISION_ID["fp8-b128"]) for i in range(n)])
    eng.store.poll()
    assert (eng.core.page_table.precision_ids == PRECISION_ID["fp8-b128"]).all()
    for got, want in zip(_expert_bytes(eng, n - 1), _checkpoint_blobs(path, 2, 15), strict=True):
        assert torch.equal(got, want)
    torch.testing.assert_close(_last_logits(eng, prompt), before, rtol=0, atol=0)


def test_memory_pressure_moves_fp8_experts_to_int4_and_back(fp8_model):
    """The controller, with a ladder whose top is FP8: KV demand beyond what fits beside FP8
    experts downgrades some to INT4, nothing is preempted, and they return to FP8 afterwards."""
    path, _ = fp8_model
    usage = _engine(path).core.pool.usage()
    # 40 pages beside FP8 experts: they start at FP8; 6 requests x (64 + 48) tokens need 42 KV
    # pages of 16 tokens.
    budget = (usage["pinned"] + usage["weight:fp8-b128"] + 40) * PAGE_BYTES
    # A narrow hysteresis band (the default keeps 10% of the pool free, a quarter of this room).
    ctl = ControllerSettings(horizon_steps=4, min_dwell_s=0.0, plan_interval_s=0.0, copy_budget_bytes_per_s=1e12,
                             low_watermark=0.01, high_watermark=0.03)  # fmt: skip
    eng = _engine(path, budget_bytes=budget, policy="pagedweight", controller=ctl)
    fp8_id = PRECISION_ID["fp8-b128"]
    assert (eng.core.page_table.precision_ids == fp8_id).all()
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ers = [eng.add([(7 * i + j) % 96 for j in range(64)], params) for i in range(6)]
    eng.run()
    assert all(len(er.output_ids) == 48 for er in ers) and sum(er.req.num_preemptions for er in ers) == 0
    kinds = {(t.from_precision, t.to_precision, t.kind) for t in eng.core.transitions}
    assert ("fp8-b128", "int4", DOWNGRADE) in kinds
    for _ in range(200):
        eng.idle_tick()
        if (eng.core.page_table.precision_ids == fp8_id).all():
            break
    assert (eng.core.page_table.precision_ids == fp8_id).all()
    assert ("int4", "fp8-b128", UPGRADE) in {(t.from_precision, t.to_precision, t.kind) for t in eng.core.transitions}


def test_triton_moe_reads_fp8_block_experts_from_the_arena(fp8_model):
    """The fused kernel (interpreter on CPU) on FP8 block experts, some downgraded to INT4,
    against the reference path."""
    path, _ = fp8_model
    engines = [_engine(path, dtype="bfloat16", moe_kernel=k, page_bytes=1 << 12) for k in ("reference", "triton")]
    logits = []
    for eng in engines:
        eng.core.apply([Change(DOWNGRADE, i, PRECISION_ID["int4"]) for i in range(0, 32, 3)])
        logits.append(_last_logits(eng, [3, 14, 15, 92, 65, 35]))
    torch.testing.assert_close(logits[1], logits[0], rtol=2e-2, atol=2e-2)


# ---- refusals -----------------------------------------------------------------------------------


def _copy(src, dst, tensors=None, config=None):
    dst.mkdir()
    save_file(
        tensors if tensors is not None else load_file(str(src / "model.safetensors")), str(dst / "model.safetensors")
    )
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
    return dst


def _refused(path) -> str:
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_missing_scales_are_refused(fp8_model, tmp_path):
    src, _ = fp8_model
    t = load_file(str(src / "model.safetensors"))
    del t["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"]
    del t["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"]
    msg = _refused(_copy(src, tmp_path / "m", tensors=t))
    assert "2 tensor problem(s)" in msg
    assert "model.layers.1.mlp.experts.3.down_proj.weight is FP8 but its scales " in msg
    assert "model.layers.0.self_attn.kv_b_proj.weight_scale_inv are missing" in msg


def test_misshaped_scales_and_scales_of_unquantised_weights_are_refused(fp8_model, tmp_path):
    src, _ = fp8_model
    t = load_file(str(src / "model.safetensors"))
    t["model.layers.1.mlp.experts.0.up_proj.weight_scale_inv"] = torch.ones(1, 1)  # F = 160: 2 x 1 blocks
    t["lm_head.weight_scale_inv"] = torch.ones(1, 1)  # lm_head is not FP8
    msg = _refused(_copy(src, tmp_path / "m", tensors=t))
    assert "up_proj.weight_scale_inv is torch.float32 [1, 1], expected float32 [2, 1]" in msg
    assert "lm_head.weight_scale_inv scales lm_head.weight, which is torch.float32, not FP8" in msg


def test_fp8_tensors_without_a_quantization_config_are_refused(fp8_model, tmp_path):
    src, _ = fp8_model
    msg = _refused(
        _copy(src, tmp_path / "m", config=lambda c: {k: v for k, v in c.items() if k != "quantization_config"})
    )
    assert "is torch.float8_e4m3fn but config.json has no quantization_config" in msg


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes", "compressed-tensors", "mxfp4"])
def test_unknown_quantization_methods_are_refused_by_name(fp8_model, tmp_path, method):
    src, _ = fp8_model
    msg = _refused(_copy(src, tmp_path / "m", config=lambda c: c | {"quantization_config": {"quant_method": method}}))
    assert f"quant_method {method!r} is not implemented; implemented: 'fp8'" in msg


def _last_logits(eng, prompt):
    eng.store.refresh()
    blocks = eng.core.kv.allocate(-(-len(prompt) // eng.core.kv.block_tokens))
    batch, pos = build_batch([(blocks, 0, len(prompt))], eng.core.kv.block_tokens, eng.device)
    hidden = eng.model.forward(torch.tensor(prompt), pos, batch, eng.kv_cache)
    eng.core.kv.free(blocks)
    return eng.model.logits(hidden[-1:])[0]
