"""Strict loading: every config key is implemented, listed as ignored, or refused by name, in one
line, before any number is computed; every checkpoint tensor is used or the load fails naming it.
Keys that were silently wrong before and are now implemented are checked against transformers."""

import json
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import build, make_checkpoint, run

from pwgpu.config_schema import SCHEMAS
from pwgpu.loader import CheckpointError, load_checkpoint, read_arch

import proc


def _with_config(src, dst, **changes):
    """``src``'s checkpoint in ``dst`` with config keys changed."""
    cfg = json.loads((src / "config.json").read_text()) | changes
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    return dst


def _refused(path) -> str:
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    msg = str(e.value)
    assert "\n" not in msg, "a refusal is one line"
    return msg


# (family, config changes, words the one-line refusal must contain)
REFUSALS = [
    ("mixtral", {"attention_bias": True}, "attention_bias=true (unknown to the mixtral loader"),
    ("qwen2_moe", {"attention_bias": True}, "attention_bias=true (unknown to the qwen2_moe loader"),
    ("deepseek_v2", {"mlp_bias": True}, "mlp_bias=true (implemented: false)"),
    ("mixtral", {"hidden_act": "quick_gelu"},
     "hidden_act=\"quick_gelu\" (implemented: 'silu', 'swish', 'gelu', 'gelu_pytorch_tanh', 'gelu_new')"),
    ("qwen3_moe", {"hidden_act": "gelu_fast"}, "hidden_act=\"gelu_fast\""),
    ("olmoe", {"hidden_act": "relu"}, "hidden_act=\"relu\""),
    ("deepseek_v3", {"hidden_act": "gelu_accurate"}, "hidden_act=\"gelu_accurate\""),
    ("mixtral", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type 'linear' is not implemented"),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "'dynamic'"),
    ("olmoe", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4, "low_freq_factor": 1}},
     "keys ['low_freq_factor'] are not implemented for rope_type 'yarn'"),
    ("mixtral", {"sliding_window": 16}, "sliding_window=16 (sliding-window attention is not implemented"),
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window=true"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window=true"),
    ("qwen2_moe", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types="),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers=[1] (only leading dense layers"),
    ("olmoe", {"quantization_config": {"quant_method": "awq", "bits": 4}}, "quant_method 'awq' is not implemented"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "gptq"}}, "quant_method 'gptq' is not implemented"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [1, 128]}},
     "weight_block_size [1, 128] is not implemented"),
    ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob=true (implemented: false)"),
    ("deepseek_v2", {"topk_method": "noaux_tc"},
     "topk_method=\"noaux_tc\" (implemented: 'greedy', 'group_limited_greedy')"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func=\"softmax\" (implemented: 'sigmoid')"),
    ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq=2 (implemented: 1)"),
    ("qwen3_moe", {"my_new_feature": 3},
     "my_new_feature=3 (unknown to the qwen3_moe loader; it may change the numbers)"),
]  # fmt: skip


@pytest.mark.parametrize("family, changes, words", REFUSALS, ids=[f"{f}-{next(iter(c))}" for f, c, _ in REFUSALS])
def test_each_refusal_is_one_line_naming_the_key(checkpoints, tmp_path, family, changes, words):
    src, _ = checkpoints[family]
    msg = _refused(_with_config(src, tmp_path, **changes))
    assert words in msg, msg
    assert "refusing to compute wrong numbers" in msg


def test_all_refusals_of_one_config_come_together(checkpoints, tmp_path):
    src, _ = checkpoints["olmoe"]
    msg = _refused(_with_config(src, tmp_path, hidden_act="relu", foo=1, rope_scaling={"type": "linear", "factor": 2}))
    assert "hidden_act" in msg and "foo=1" in msg and "rope_scaling" in msg


def test_harmless_keys_are_listed_as_ignored_in_one_line(checkpoints, tmp_path):
    src, _ = checkpoints["mixtral"]
    path = _with_config(src, tmp_path, router_aux_loss_coef=0.5, attention_dropout=0.1, some_future_key=None)
    ckpt = load_checkpoint(path)
    (line,) = [n for n in ckpt.notes if n.startswith("ignored config keys")]
    assert "router_aux_loss_coef" in line and "attention_dropout" in line and "some_future_key" in line


def test_a_refusal_reaches_the_cli_as_one_line_and_exit_2(checkpoints, tmp_path):
    src, _ = checkpoints["qwen3_moe"]
    path = _with_config(src, tmp_path / "m", hidden_act="quick_gelu")
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,4,2\n")
    args = ["run", "--model", str(path), "--trace", str(trace), "--mem-budget", "8MiB", "--out", str(tmp_path / "o")]
    done = proc.run([sys.executable, "-m", "pwgpu.cli", *args], quiet_s=8)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and 'hidden_act="quick_gelu"' in lines[0] and "Traceback" not in done.stderr


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_extra_and_missing_tensors_are_named(checkpoints, tmp_path, family):
    """Bias tensors the config does not announce fail the load (they used to be skipped)."""
    src, _ = checkpoints[family]
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    msg = _refused(tmp_path)
    assert f"1 tensor(s) the {family} model does not use: model.layers.0.self_attn.o_proj.bias" in msg


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_attention_bias_is_implemented_and_matches_transformers(tmp_path, family):
    """Was: biases skipped, 0% argmax agreement. Now: q/k/v/o biases loaded and applied."""
    hf = make_checkpoint(family, tmp_path, attention_bias=True)
    assert read_arch(tmp_path).o_bias
    model, kv, blocks = build(tmp_path, torch.float32)
    prompt = torch.randint(0, 96, (29,), generator=torch.Generator().manual_seed(4)).tolist()
    ours = run(model, kv, blocks, prompt, 0)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-5


def test_every_family_schema_covers_what_transformers_saves(checkpoints):
    """A config saved by transformers loads with no refusal: every key it writes is in the
    family's schema or ignored."""
    for path, _ in checkpoints.values():
        cfg = json.loads((path / "config.json").read_text())
        assert cfg["model_type"] in SCHEMAS
        load_checkpoint(path)  # no refusal


@pytest.mark.parametrize(
    "family, act", [("mixtral", "gelu"), ("olmoe", "gelu_pytorch_tanh"), ("deepseek_v3", "gelu_new")]
)
def test_gelu_is_implemented_and_matches_transformers(tmp_path, family, act):
    """Was: ignored (4.5% logit error). Now: GeGLU in routed experts, shared experts and dense
    layers alike, against transformers in fp32."""
    hf = make_checkpoint(family, tmp_path, hidden_act=act)
    model, kv, blocks = build(tmp_path, torch.float32)
    prompt = torch.randint(0, 96, (31,), generator=torch.Generator().manual_seed(8)).tolist()
    ours = run(model, kv, blocks, prompt, 0)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-5


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_yarn_is_implemented_for_gqa_families_too(tmp_path, family):
    """YaRN (Qwen3's documented long-context setting): frequencies and the cos/sin factor as
    transformers computes them."""
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)
    hf = make_checkpoint(family, tmp_path, max_position_embeddings=128, rope_parameters=rope, head_dim=16)
    assert read_arch(tmp_path).rope_yarn.factor == 4.0
    model, kv, blocks = build(tmp_path, torch.float32)
    prompt = torch.randint(0, 96, (45,), generator=torch.Generator().manual_seed(6)).tolist()
    ours = run(model, kv, blocks, prompt, 0)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-5
