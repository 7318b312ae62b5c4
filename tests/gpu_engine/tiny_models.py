"""Tiny random checkpoints of every family, saved by ``transformers``, and our model built from
one with dense experts and a standalone paged KV cache: what the engine tests compare."""

import json

import torch

from pwgpu.attention import PagedKvCache, build_batch
from pwgpu.loader import dense_expert_weights, load_checkpoint, pinned_weights
from pwgpu.model import DenseExperts, MoeTransformer

BLOCK_TOKENS = 16

# Small but not degenerate: GQA (4 query heads over 2 KV heads), K multiples of 8 for the packed
# formats, more experts than top-k. Shared by every family.
COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


# DeepSeek: MLA (every head has its own key: num_key_value_heads = heads), a leading dense layer,
# shared experts. V3: query LoRA, 16 experts in 4 groups of which the best 2 are searched, sigmoid
# scores with a correction bias, scaling 2.5. V2: direct queries (as V2-Lite), softmax top-k, two
# shared experts.
_MLA = dict(COMMON, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
            kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1,
            num_experts_per_tok=4, n_routed_experts=16)  # fmt: skip
CONFIGS = {
    "mixtral": ("MixtralConfig", dict(COMMON, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                         num_experts=6, num_experts_per_tok=2, intermediate_size=80,
                                         norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(COMMON, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                                         head_dim=16, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", dict(COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=2, pad_token_id=0,
                                  eos_token_id=1)),
    "deepseek_v3": ("DeepseekV3Config", dict(_MLA, q_lora_rank=48, n_group=4, topk_group=2)),
    "deepseek_v2": ("DeepseekV2Config", dict(_MLA, q_lora_rank=None, n_shared_experts=2)),
}  # fmt: skip


def _family_config(family: str, **overrides):
    import transformers as tf

    cls, kwargs = CONFIGS[family]
    return getattr(tf, cls)(**(kwargs | overrides))


DEEPSEEK = ("deepseek_v2", "deepseek_v3")
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", *DEEPSEEK)


def make_checkpoint(family: str, path, seed: int = 0, dtype=torch.float32, **overrides):
    """A random ``family`` model saved by transformers to ``path``; returns the HF model (fp32, eval).
    ``overrides``: config keys to change."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = _family_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    # Random init of the norms is all ones, of biases zero, and the routers small: perturb them
    # so that the test sees norms, biases and routing actually matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("gate.weight"):
                p.mul_(20.0)
            # bf16-representable values: the engine stores experts at bf16, so an fp32 run of
            # the engine and of transformers start from the same numbers.
            p.copy_(p.to(torch.bfloat16).float())
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's expert-choice bias, kept fp32
                b.copy_(0.05 * torch.randn_like(b))
    model.to(dtype).save_pretrained(path)
    return model


def build(model_dir, dtype, max_tokens=128):
    """Our model with dense experts and a standalone paged KV cache of ``max_tokens`` tokens."""
    ckpt = load_checkpoint(model_dir)
    a = ckpt.arch
    dev = torch.device("cpu")
    experts = DenseExperts(*dense_expert_weights(ckpt, dtype), a.hidden_act)
    model = MoeTransformer(a, pinned_weights(ckpt, dtype, dev), experts, dev)
    num_blocks = -(-max_tokens // BLOCK_TOKENS)
    elem = torch.tensor([], dtype=dtype).element_size()
    parts, heads, dims = a.kv_cache_geometry
    block_bytes = a.num_layers * parts * BLOCK_TOKENS * heads * dims * elem
    arena = torch.zeros(num_blocks * block_bytes, dtype=torch.uint8)
    kv = PagedKvCache(arena, block_bytes, BLOCK_TOKENS, 1, a.num_layers, heads, dims, dtype, parts)
    # Blocks in reverse order: the cache must follow the block table, not the arena order.
    return model, kv, list(range(num_blocks))[::-1]


def run(model, kv, blocks, ids, computed):
    batch, pos = build_batch([(blocks, computed, len(ids))], BLOCK_TOKENS, torch.device("cpu"))
    return model.logits(model.forward(torch.tensor(ids), pos, batch, kv))


def greedy(model, kv, blocks, prompt, steps):
    """Greedy tokens with EOS masked, as ``generate(min_new_tokens=steps)`` does."""
    out = []
    logits = run(model, kv, blocks, prompt, 0)
    n = len(prompt)
    eos = list(model.arch.eos_token_ids)
    for _ in range(steps):
        logits[-1, eos] = float("-inf")
        tok = int(logits[-1].argmax())
        out.append(tok)
        logits = run(model, kv, blocks, [tok], n)
        n += 1
    return out


def bf16_like_transformers_loads_it(hf):
    """``hf`` in bf16 except what ``from_pretrained(dtype=bfloat16)`` keeps in fp32
    (``_keep_in_fp32_modules_strict``: DeepSeek's router weight and expert-choice bias)."""
    hf.to(torch.bfloat16)
    keep = getattr(hf, "_keep_in_fp32_modules_strict", None) or []
    for name, module in hf.named_modules():
        for p_name, p in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if any(k in f"{name}.{p_name}" for k in keep):
                p.data = p.data.float()
    return hf


def write_fp8_checkpoint(family: str, path, seed: int = 0, **overrides):
    """A random ``family`` model as an FP8 block-scaled checkpoint, like DeepSeek-V3 ships: every
    linear layer's weight (attention, dense and shared FFNs, routed experts) as E4M3 codes with a
    ``weight_scale_inv`` per 128 x 128 block; embeddings, norms, routers and lm_head as they were.
    Returns the HF model holding exactly the dequantised weights (the reference)."""
    from safetensors.torch import load_file, save_file

    from pwgpu import fp8_checkpoint as fp8

    hf = make_checkpoint(family, path, seed=seed, **overrides)
    tensors = load_file(str(path / "model.safetensors"))
    params = dict(hf.named_parameters())
    skip = ("embed_tokens", "norm", ".gate.weight", "lm_head")
    for name in [n for n, t in tensors.items() if t.dim() == 2 and not any(s in n for s in skip)]:
        codes, scales = fp8.quantize(tensors[name])
        tensors[name], tensors[fp8.scale_name(name)] = codes, scales
        dequantised = fp8.dequantize(codes, scales, torch.float32)
        _set_hf_weight(hf, params, name, dequantised)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return hf


def _set_hf_weight(hf, params, name, value):
    """Put a checkpoint tensor's value into the HF model; transformers 5 stacks routed experts as
    ``experts.gate_up_proj [E, 2F, H]`` and ``experts.down_proj [E, H, F]``."""
    with torch.no_grad():
        if name in params:
            params[name].copy_(value)
            return
        *path, e, proj, _ = name.split(".")  # ...mlp.experts.<e>.<proj>.weight
        prefix, e = ".".join(path), int(e)
        if proj == "down_proj":
            params[f"{prefix}.down_proj"][e].copy_(value)
        else:
            f = value.shape[0]
            rows = slice(0, f) if proj == "gate_proj" else slice(f, 2 * f)
            params[f"{prefix}.gate_up_proj"][e, rows].copy_(value)
