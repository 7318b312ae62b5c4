"""The default model: the project's trained tiny MoE when the checkout has it (``models/tiny-moe``),
else a tiny random Mixtral-format checkpoint with a byte-level tokenizer, created on first use
under the cache directory (``$PAGEDWEIGHT_CACHE`` or ``~/.cache/pagedweight``). The random one
makes ``pwgpu serve`` work with no download; its text is noise.

Sizes: 4 layers, H=128, 8 experts of F=256, top-2, 4 query / 2 KV heads of 32: each expert
matrix is 64 KiB at bf16 and 17 KiB at int4, so with 32 KiB pages a downgrade really frees pages.

Random checkpoints shaped like a built-in model (``random_model_dir``: ``pwgpu run --like``) serve
GPU benchmarks: Mixtral-format for GQA models, FP8 DeepSeek checkpoints for MLA ones.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from pagedweight.errors import ConfigError

NAME = "tiny-random-mixtral"
VOCAB_SIZE = 320  # 256 byte tokens, <s>, </s>, padding to a multiple of 64
BOS, EOS = 256, 257
CONFIG = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "sliding_window": None,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "torch_dtype": "bfloat16",
}


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDWEIGHT_CACHE") or Path.home() / ".cache" / "pagedweight")


# Where the project's trained tiny model lives once it is committed; preferred when present.
TRAINED_DIR = Path(__file__).resolve().parents[1] / "models" / "tiny-moe"


def default_model_dir() -> Path:
    """``$PWGPU_DEFAULT_MODEL``, else the trained tiny model if the checkout has it, else the
    random checkpoint in the cache (created atomically on first use)."""
    env = os.environ.get("PWGPU_DEFAULT_MODEL")
    if env:
        return Path(env)
    if (TRAINED_DIR / "config.json").is_file():
        return TRAINED_DIR
    d = cache_dir() / NAME
    if (d / "config.json").is_file():
        return d
    tmp = d.with_name(f".{NAME}.tmp{os.getpid()}")
    write_random_mixtral(tmp, seed=0)
    d.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, d)
    except OSError:  # another process won the race: use its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return d


def write_random_mixtral(path: str | Path, seed: int = 0, config: dict | None = None, tokenizer: bool = True) -> Path:
    from safetensors.torch import save_file

    cfg = config or CONFIG
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    h, f, e = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    d = cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    t = {
        "model.embed_tokens.weight": rand(cfg["vocab_size"], h, std=1.0),
        "model.norm.weight": torch.ones(h).bfloat16(),
    }
    t["lm_head.weight"] = rand(cfg["vocab_size"], h, std=h**-0.5)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = torch.ones(h).bfloat16()
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(h).bfloat16()
        for name, shape in (("q", (q_out, h)), ("k", (kv_out, h)), ("v", (kv_out, h)), ("o", (h, q_out))):
            t[f"{p}.self_attn.{name}_proj.weight"] = rand(*shape, std=h**-0.5)
        # Router logits of a few units so that experts are picked unevenly, as in trained models.
        t[f"{p}.block_sparse_moe.gate.weight"] = rand(e, h, std=0.3)
        for x in range(e):
            q = f"{p}.block_sparse_moe.experts.{x}"
            t[f"{q}.w1.weight"], t[f"{q}.w3.weight"] = rand(f, h, std=h**-0.5), rand(f, h, std=h**-0.5)
            t[f"{q}.w2.weight"] = rand(h, f, std=f**-0.5)
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if tokenizer:
        write_byte_tokenizer(path / "tokenizer.json")
    return path


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level BPE with no merges: one token per byte, so any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path))


def mixtral_config_like(spec, num_layers: int | None = None) -> dict:
    """A Mixtral ``config.json`` with the shape of a ``ModelSpec`` (e.g. mixtral-8x7b), optionally
    with fewer layers: random weights of a real model's shape for GPU runs."""
    if spec.num_shared_experts or spec.num_dense_layers or spec.attention != "gqa" or spec.qk_norm:
        raise ConfigError(f"{spec.name} is not Mixtral-shaped (shared experts, dense layers, MLA or q/k norms)")
    return dict(
        CONFIG,
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.expert_ffn_size,
        num_hidden_layers=num_layers or spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        num_local_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k,
        max_position_embeddings=spec.max_context_tokens,
        rms_norm_eps=spec.rms_norm_eps,
        rope_theta=spec.rope_theta,
        bos_token_id=1,
        eos_token_id=2,
    )


def random_model_dir(spec, num_layers: int | None = None) -> Path:
    """A cached random checkpoint shaped like ``spec``, created on first use: Mixtral format
    (``mixtral_config_like``), or for an MLA spec (DeepSeek-V2/V3) an FP8 block-scaled DeepSeek
    checkpoint (``deepseek_config_like``, ``write_random_deepseek_fp8``). Without a tokenizer:
    prompts are token ids."""
    mla = spec.attention == "mla"
    cfg = deepseek_config_like(spec, num_layers) if mla else mixtral_config_like(spec, num_layers)
    d = cache_dir() / f"random-{spec.name}-{cfg['num_hidden_layers']}l{'-fp8' if mla else ''}"
    if not (d / "config.json").is_file():
        tmp = d.with_name(f".{d.name}.tmp{os.getpid()}")
        if mla:
            write_random_deepseek_fp8(tmp, cfg, seed=0)
        else:
            write_random_mixtral(tmp, seed=0, config=cfg, tokenizer=False)
        os.replace(tmp, d)
    return d


def deepseek_config_like(spec, num_layers: int | None = None) -> dict:
    """A DeepSeek ``config.json`` with the shape of an MLA ``ModelSpec`` (e.g. deepseek-v3),
    optionally cut to ``num_layers`` of which at most half are the leading dense ones (so a cut
    keeps MoE layers), FP8 block-scaled as DeepSeek-V3 ships. The router is V3's (sigmoid,
    8 groups of which 4 are searched, scaling 2.5) for a ``sigmoid_renorm`` spec, else V2's greedy
    softmax. The real model's YaRN RoPE is left out: random weights have no long context to keep."""
    if spec.attention != "mla":
        raise ConfigError(f"{spec.name} has no multi-head latent attention: not DeepSeek-shaped")
    layers = num_layers or spec.num_layers
    v3 = spec.router_norm == "sigmoid_renorm"
    groups = 8 if v3 and spec.num_experts % 8 == 0 and spec.num_experts >= 16 else 1
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.dense_ffn_size or spec.expert_ffn_size,
        "moe_intermediate_size": spec.expert_ffn_size,
        "num_hidden_layers": layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_heads,
        "n_shared_experts": spec.num_shared_experts,
        "n_routed_experts": spec.num_experts,
        "num_experts_per_tok": spec.top_k,
        "first_k_dense_replace": min(spec.num_dense_layers, layers // 2),
        "kv_lora_rank": spec.kv_lora_rank,
        "q_lora_rank": spec.q_lora_rank or None,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "v_head_dim": spec.v_head_dim,
        "routed_scaling_factor": 2.5 if v3 else 1.0,
        "norm_topk_prob": v3,
        "max_position_embeddings": spec.max_context_tokens,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie_embeddings,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        },
    }  # fmt: skip
    if v3:
        cfg |= {"n_group": groups, "topk_group": min(4, groups), "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    return cfg


# Random E4M3 codes: magnitudes below 4 (codes under 0x48) with a random sign, never NaN (0x7F).
_FP8_CODES = 0x48


def _random_fp8(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 codes [n, k], block scales): weights of RMS about ``k ** -0.5``."""
    from pwgpu.fp8_checkpoint import scale_shape

    x = torch.randint(0, 2 * _FP8_CODES, (n, k), generator=g, dtype=torch.uint8)
    codes = torch.where(x >= _FP8_CODES, (x - _FP8_CODES) | 0x80, x)
    rms = 1.13  # root mean square of these codes' values (the largest is 3.75)
    return codes.view(torch.float8_e4m3fn), torch.full(scale_shape((n, k)), 1.0 / (rms * k**0.5))


def write_random_deepseek_fp8(path: str | Path, cfg: dict, seed: int = 0) -> Path:
    """A random DeepSeek checkpoint as ``cfg`` describes it, every linear layer FP8 with block
    scales, one safetensors shard per layer (the full model does not fit in memory at once).

    Built for speed at DeepSeek-V3 size (a 256-expert layer is 11 GB): the codes are drawn as
    bytes, not quantised from floats, and each MoE layer draws one code matrix per projection
    that its experts hold rotated by different row offsets, so experts differ without drawing
    11 GB of random numbers per layer. Timing, not text, is what such a model is for."""
    from safetensors.torch import save_file

    from pwgpu.fp8_checkpoint import scale_name

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    h, heads, rank, rope = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, v_dim, q_rank = cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["q_lora_rank"]
    experts, f = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    weight_map: dict[str, str] = {}

    def fp8(t: dict, name: str, n: int, k: int) -> None:
        t[name], t[scale_name(name)] = _random_fp8(n, k, g)

    def shard(t: dict, i: int) -> None:
        name = f"model-{i:05d}.safetensors"
        save_file(t, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(t, name))

    def rand(*shape, std):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    top = {
        "model.embed_tokens.weight": rand(cfg["vocab_size"], h, std=1.0),
        "model.norm.weight": torch.ones(h).bfloat16(),
    }
    if not cfg["tie_word_embeddings"]:
        top["lm_head.weight"] = rand(cfg["vocab_size"], h, std=h**-0.5)
    shard(top, 0)
    for i in range(cfg["num_hidden_layers"]):
        p, a, t = f"model.layers.{i}", f"model.layers.{i}.self_attn", {}
        t[f"{p}.input_layernorm.weight"], t[f"{p}.post_attention_layernorm.weight"] = (
            torch.ones(h).bfloat16(),
            torch.ones(h).bfloat16(),
        )
        if q_rank:
            fp8(t, f"{a}.q_a_proj.weight", q_rank, h)
            t[f"{a}.q_a_layernorm.weight"] = torch.ones(q_rank).bfloat16()
            fp8(t, f"{a}.q_b_proj.weight", heads * (nope + rope), q_rank)
        else:
            fp8(t, f"{a}.q_proj.weight", heads * (nope + rope), h)
        fp8(t, f"{a}.kv_a_proj_with_mqa.weight", rank + rope, h)
        t[f"{a}.kv_a_layernorm.weight"] = torch.ones(rank).bfloat16()
        fp8(t, f"{a}.kv_b_proj.weight", heads * (nope + v_dim), rank)
        fp8(t, f"{a}.o_proj.weight", h, heads * v_dim)
        if i < cfg["first_k_dense_replace"]:
            for m, (n, k) in (("gate", (cfg["intermediate_size"], h)), ("up", (cfg["intermediate_size"], h)),
                              ("down", (h, cfg["intermediate_size"]))):  # fmt: skip
                fp8(t, f"{p}.mlp.{m}_proj.weight", n, k)
            shard(t, i + 1)
            continue
        # Router logits of a few units so that experts are picked unevenly, as in trained models.
        t[f"{p}.mlp.gate.weight"] = rand(experts, h, std=3.0 * h**-0.5)
        if cfg["model_type"] == "deepseek_v3":
            t[f"{p}.mlp.gate.e_score_correction_bias"] = torch.zeros(experts)
        fs = f * cfg["n_shared_experts"]
        if fs:
            for m, (n, k) in (("gate", (fs, h)), ("up", (fs, h)), ("down", (h, fs))):
                fp8(t, f"{p}.mlp.shared_experts.{m}_proj.weight", n, k)
        for m, (n, k) in (("gate", (f, h)), ("up", (f, h)), ("down", (h, f))):
            codes, scales = _random_fp8(n, k, g)
            for e in range(experts):
                name = f"{p}.mlp.experts.{e}.{m}_proj.weight"
                t[name], t[scale_name(name)] = (
                    torch.roll(codes.view(torch.uint8), e, 0).view(torch.float8_e4m3fn),
                    scales.clone(),
                )
        shard(t, i + 1)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path
