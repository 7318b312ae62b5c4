"""DeepSeek-V2/V3 against transformers: MLA with its latent in the paged KV pool, the routers,
YaRN, attention biases, the multi-token-prediction layers a real checkpoint carries, and the
engine with its paged experts (reference and Triton-interpreter MoE paths)."""

import copy
import json

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import build, make_checkpoint, run

from pagedweight.core.runtime import CoreConfig
from pagedweight.core.spec import PRECISION_ID, load_model
from pagedweight.policy.controller import DOWNGRADE, Change
from pwgpu.attention import build_batch
from pwgpu.engine import Engine, EngineConfig
from pwgpu.loader import CheckpointError, load_checkpoint, read_arch
from pwgpu.sampling import SamplingParams

# Variants the session checkpoints (V3 with query LoRA and grouped sigmoid routing, V2 without
# query LoRA and greedy softmax routing) leave out.
VARIANTS = {
    "v2-group-limited": ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                             routed_scaling_factor=1.5)),
    "v3-yarn": ("deepseek_v3", dict(max_position_embeddings=256, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32,
        beta_slow=1, mscale=1.0, mscale_all_dim=0.707))),
    "v3-bias-rotate-half": ("deepseek_v3", dict(attention_bias=True, rope_interleave=False, norm_topk_prob=False)),
    "v3-one-group": ("deepseek_v3", dict(n_group=1, topk_group=1, n_shared_experts=0, first_k_dense_replace=0)),
}  # fmt: skip


def _relative_error(path, hf, seed=1):
    model, kv, blocks = build(path, torch.float32)
    prompt = torch.randint(0, 96, (37,), generator=torch.Generator().manual_seed(seed)).tolist()
    ours = run(model, kv, blocks, prompt, 0)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_match_transformers_in_fp32(tmp_path, variant):
    family, overrides = VARIANTS[variant]
    hf = make_checkpoint(family, tmp_path, **overrides)
    assert _relative_error(tmp_path, hf) < 1e-5


def test_yarn_changes_the_numbers(tmp_path):
    """The YaRN variant differs from plain RoPE (so its parity above is not vacuous)."""
    family, overrides = VARIANTS["v3-yarn"]
    make_checkpoint(family, tmp_path / "yarn", **overrides)
    plain = make_checkpoint(family, tmp_path / "plain", max_position_embeddings=256)
    assert _relative_error(tmp_path / "yarn", plain) > 1e-3


def test_arch_and_the_kv_bytes_the_scheduler_counts(checkpoints):
    """MLA caches kv_lora_rank + qk_rope_head_dim values per layer per token: the spec the pool
    and scheduler use says so, and the engine's KV blocks are exactly that big."""
    path, _ = checkpoints["deepseek_v3"]
    a = read_arch(path)
    assert (a.attention, a.q_lora_rank, a.kv_lora_rank, a.head_dim, a.num_dense_layers) == ("mla", 48, 32, 8, 1)
    assert (a.router_scoring, a.num_groups, a.topk_groups, a.routed_scaling_factor) == ("sigmoid", 4, 2, 2.5)
    spec = a.model_spec("v3", 4)
    assert spec.kv_bytes_per_token() == 3 * (32 + 8) * 4
    eng = Engine(path, EngineConfig(CoreConfig(budget_bytes=8 << 20, page_bytes=1 << 14), policy="static-fp16"))
    assert eng.kv_cache.block_bytes == eng.core.kv.block_tokens * eng.spec.kv_bytes_per_token()
    # The built-in DeepSeek-V3 spec is the same formula at full size: 61 x (512 + 64) x 2 bytes.
    assert load_model("deepseek-v3").kv_bytes_per_token() == 61 * (512 + 64) * 2


@pytest.mark.parametrize("family", ("deepseek_v2", "deepseek_v3"))
def test_engine_greedy_matches_transformers(checkpoints, family):
    """Two requests batched together through paged experts and the paged latent cache give
    transformers' greedy tokens (EOS is ignored on both sides)."""
    path, hf = checkpoints[family]
    eng = Engine(path, EngineConfig(CoreConfig(budget_bytes=8 << 20, page_bytes=1 << 14), policy="static-fp16"))
    prompts = [[5, 17, 42, 9, 33, 71, 2, 60], [7, 3, 88, 19, 64, 21, 50, 11, 45, 8, 30, 1, 2]]
    ers = [eng.add(p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)) for p in prompts]
    eng.run()
    gen = copy.deepcopy(hf.generation_config)
    gen.eos_token_id = None  # generate keeps going past EOS, as ignore_eos does
    for p, er in zip(prompts, ers, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), generation_config=gen, max_new_tokens=16, do_sample=False)
        assert er.output_ids == ref[0, len(p) :].tolist()


def test_the_engine_reports_the_grouped_routers_choices_per_moe_layer(checkpoints, monkeypatch):
    """What the controller's drift tracker sees of a DeepSeek-V3 step is what its grouped top-k
    router chose: one row per MoE layer (the leading dense layer has none), each row the
    router's expert ids of that layer counted, top_k per token, all inside topk_groups groups."""
    import numpy as np

    import pwgpu.model

    path, _ = checkpoints["deepseek_v3"]
    eng = Engine(path, EngineConfig(CoreConfig(budget_bytes=8 << 20, page_bytes=1 << 14), policy="static-fp16"))
    a = eng.arch
    num_moe = a.num_layers - a.num_dense_layers
    assert a.num_dense_layers >= 1 and a.num_groups > 1 and num_moe >= 1
    chosen, steps = [], []
    route = pwgpu.model.route

    def spy(*args, **kw):
        ids, weights = route(*args, **kw)
        chosen.append(ids.clone())
        return ids, weights

    def on_step(step):
        steps.append((step.routing, step.shape.num_tokens, chosen.copy()))
        chosen.clear()

    monkeypatch.setattr(pwgpu.model, "route", spy)
    eng.core.on_step = on_step
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for p in ([5, 17, 42, 9, 33, 71, 2, 60], [7, 3, 88, 19, 64]):
        eng.add(p, params)
    eng.run()
    assert len(steps) >= 3
    group_size = a.num_experts // a.num_groups
    for counts, num_tokens, ids in steps:
        assert counts.shape == (num_moe, a.num_experts) and len(ids) == num_moe
        want = np.stack([np.bincount(i.reshape(-1).numpy(), minlength=a.num_experts) for i in ids])
        np.testing.assert_array_equal(counts, want)
        assert (counts.sum(axis=1) == num_tokens * a.top_k).all()
        for i in ids:
            assert max(len(set(row)) for row in (i // group_size).tolist()) <= a.topk_groups


def test_triton_moe_through_the_arena_matches_reference(checkpoints):
    """256-expert-style routing in miniature: the fused Triton MoE kernel (interpreter on CPU)
    reads the engine's arena for experts at mixed precisions and gives the reference path's logits."""
    path, _ = checkpoints["deepseek_v3"]
    core = CoreConfig(budget_bytes=8 << 20, page_bytes=1 << 12)
    engines = [
        Engine(path, EngineConfig(core, "static-fp16", dtype="bfloat16", moe_kernel=k)) for k in ("reference", "triton")
    ]
    mix = [PRECISION_ID[p] for p in ("int4", "fp8")]  # every 3rd expert stays bf16
    prompt = [3, 14, 15, 92, 65, 35]
    logits = []
    for eng in engines:
        n = eng.core.page_table.num_experts
        eng.core.apply([Change(DOWNGRADE, i, mix[i % 3]) for i in range(n) if i % 3 < 2])
        eng.store.refresh()
        blocks = eng.core.kv.allocate(1)
        batch, pos = build_batch([(blocks, 0, len(prompt))], eng.core.kv.block_tokens, eng.device)
        logits.append(eng.model.logits(eng.model.forward(torch.tensor(prompt), pos, batch, eng.kv_cache)[-1:]))
    torch.testing.assert_close(logits[1], logits[0], rtol=2e-2, atol=2e-2)


def test_mtp_layers_are_skipped_and_listed_other_extras_refused(checkpoints, tmp_path):
    """DeepSeek-V3 checkpoints carry the multi-token-prediction module as layer
    ``num_hidden_layers``: skipped with a note. Any other tensor the model does not read fails
    the load, named."""
    src, _ = checkpoints["deepseek_v3"]
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # num_hidden_layers = 3
    tensors["model.layers.3.mlp.experts.0.up_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    ckpt = load_checkpoint(tmp_path)
    assert "skipped 2 tensor(s) of the multi-token-prediction module" in " ".join(ckpt.notes)
    tensors["model.layers.4.self_attn.extra.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) the deepseek_v3 model does not use: model\.layers\.4"):
        load_checkpoint(tmp_path)


# A DeepSeek-V3-shaped spec small enough for a CPU: the GPU check builds deepseek-v3 itself.
TINY_V3 = """name: tiny-v3
source: test
num_layers: 4
hidden_size: 256
num_heads: 4
num_kv_heads: 4
head_dim: 32
num_experts: 16
top_k: 4
expert_ffn_size: 128
num_shared_experts: 1
shared_expert_ffn_size: 128
num_dense_layers: 3
dense_ffn_size: 384
vocab_size: 512
max_context_tokens: 4096
attention: mla
kv_lora_rank: 64
q_lora_rank: 96
qk_rope_head_dim: 16
qk_nope_head_dim: 32
v_head_dim: 32
router_norm: sigmoid_renorm
rms_norm_eps: 1.0e-6
"""


def test_deepseek_v3_config_like_is_a_loadable_fp8_v3_cut():
    from pwgpu.config_schema import check_keys
    from pwgpu.default_model import deepseek_config_like

    cfg = deepseek_config_like(load_model("deepseek-v3"), 4)
    assert (cfg["model_type"], cfg["n_routed_experts"], cfg["first_k_dense_replace"]) == ("deepseek_v3", 256, 2)
    assert (cfg["n_group"], cfg["topk_group"], cfg["q_lora_rank"], cfg["kv_lora_rank"]) == (8, 4, 1536, 512)
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert check_keys(cfg, "deepseek_v3") == ([], ["architectures"])


def test_the_gpu_checks_deepseek_run_works_on_a_small_shape(tmp_path, monkeypatch):
    """What benchmarks/gpu_check.sh runs (``pwgpu run --like deepseek-v3 --layers 4``), on a
    DeepSeek-V3-shaped spec a CPU can serve: the random FP8 checkpoint is written (sharded), its
    experts load at fp8-b128, and requests complete."""
    from pwgpu.cli import main

    monkeypatch.setenv("PAGEDWEIGHT_CACHE", str(tmp_path / "cache"))
    spec = tmp_path / "tiny-v3.yaml"
    spec.write_text(TINY_V3)
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,40,4\n0.02,70,3\n0.04,25,5\n")
    out = tmp_path / "run"
    args = ["run", "--like", str(spec), "--layers", "4", "--trace", str(trace), "--max-requests", "2"]
    assert main([*args, "--mem-budget", "24MiB", "--policies", "static-fp16", "--out", str(out)]) == 0
    model_dir = tmp_path / "cache" / "random-tiny-v3-4l-fp8"
    assert len(list(model_dir.glob("model-*.safetensors"))) == 5  # embeddings, then one shard per layer
    a = read_arch(model_dir)
    assert (a.num_dense_layers, a.num_experts, a.attention) == (2, 16, "mla")  # at most half the cut is dense
    summary = json.loads((out / "summary.json").read_text())
    assert summary["policies"]["static-fp16"]["completed"] == 2
    assert any("FP8 weight(s) outside the routed experts" in n for n in summary["checkpoint_notes"])
    steps = pd.read_csv(out / "steps.csv")
    assert (steps["weight_pages_fp8-b128"] > 0).all()
