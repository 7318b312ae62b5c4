"""Our MoE transformer against ``transformers`` on tiny random checkpoints of each family."""

import copy
import json
import re

import pytest
import torch
from tiny_models import FAMILIES, bf16_like_transformers_loads_it, build, greedy, run

from pwgpu.loader import CheckpointError, load_checkpoint


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logits_match_transformers(checkpoints, family):
    path, hf = checkpoints[family]
    model, kv, blocks = build(path, torch.float32)
    prompt = torch.randint(0, 96, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = run(model, kv, blocks, prompt, 0)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < 1e-5, f"{family}: max relative logit error {rel:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_equals_one_pass(checkpoints, family):
    """A prompt computed in chunks (13 + 11 + 1 tokens) through the paged cache gives the same
    last logits as one pass: the cache holds exactly what attention needs."""
    path, _ = checkpoints[family]
    model, kv, blocks = build(path, torch.float32)
    prompt = list(range(3, 28))
    whole = run(model, kv, blocks, prompt, 0)[-1]
    run(model, kv, blocks, prompt[:13], 0)
    run(model, kv, blocks, prompt[13:24], 13)
    last = run(model, kv, blocks, prompt[24:], 24)[-1]
    torch.testing.assert_close(last, whole, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers(checkpoints, family):
    path, hf = checkpoints[family]
    model, kv, blocks = build(path, torch.float32)
    prompt = [5, 17, 42, 9, 33, 71, 2, 60]
    ours = greedy(model, kv, blocks, prompt, 32)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert ours == ref[0, len(prompt) :].tolist()


# bf16 rounds every activation (8 mantissa bits): after a few layers logits differ by a few
# bf16 ulps of their magnitude. Stated tolerance: 3% of the largest logit, and the top token of
# at least 90% of positions agrees.
BF16_REL = 3e-2


@pytest.mark.parametrize("family", ("mixtral", "qwen2_moe", "olmoe", "deepseek_v3"))
def test_bf16_logits_within_tolerance(checkpoints, family):
    path, hf = checkpoints[family]
    model, kv, blocks = build(path, torch.bfloat16)
    prompt = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = run(model, kv, blocks, prompt, 0)
    # A copy: the session's model is shared, and a round trip through bf16 would round its fp32
    # buffers (the rotary frequencies) for every later test.
    with torch.no_grad():
        ref = bf16_like_transformers_loads_it(copy.deepcopy(hf))(torch.tensor([prompt])).logits[0].float()
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < BF16_REL, f"{family}: bf16 max relative logit error {rel:.2e}"
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_missing_and_misshaped_tensors_are_named(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    src, _ = checkpoints["mixtral"]
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    msg = str(e.value)
    assert "missing model.layers.1.block_sparse_moe.experts.3.w2.weight [64, 64]" in msg
    assert "model.layers.0.self_attn.k_proj.weight has shape [8, 64], expected [32, 64]" in msg


def test_config_keys_of_transformers_4_and_pickle_refused(checkpoints, tmp_path):
    from pwgpu.loader import read_arch

    src, _ = checkpoints["olmoe"]
    cfg = json.loads((src / "config.json").read_text())
    new = read_arch(src)
    cfg.pop("rope_parameters")
    cfg["rope_theta"] = new.rope_theta
    cfg["torch_dtype"] = cfg.pop("dtype")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert read_arch(tmp_path) == new
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickle checkpoints are not loaded"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "text, words",
    [("{nope", "not valid JSON"), ("[1, 2]", "expected a JSON object"),
     ('{"model_type": "mixtral", "hidden_size": 8}', "missing keys ['num_attention_heads'")],
)  # fmt: skip
def test_malformed_config_is_a_checkpoint_error(tmp_path, text, words):
    from pwgpu.loader import read_arch

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=re.escape(words)):
        read_arch(tmp_path)
