"""The default model: the project's trained tiny MoE when the checkout has it (``models/tiny-moe``),
else a tiny random Mixtral-format checkpoint with a byte-level tokenizer, created on first use
under the cache directory (``$PAGEDWEIGHT_CACHE`` or ``~/.cache/pagedweight``). The random one
makes ``pwgpu serve`` work with no download; its text is noise.

Sizes: 4 layers, H=128, 8 experts of F=256, top-2, 4 query / 2 KV heads of 32: each expert
matrix is 64 KiB at bf16 and 17 KiB at int4, so with 32 KiB pages a downgrade really frees pages.
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
    """A cached random checkpoint shaped like ``spec`` (see ``mixtral_config_like``); created on
    first use. Without a tokenizer: prompts are token ids."""
    cfg = mixtral_config_like(spec, num_layers)
    d = cache_dir() / f"random-{spec.name}-{cfg['num_hidden_layers']}l"
    if not (d / "config.json").is_file():
        tmp = d.with_name(f".{d.name}.tmp{os.getpid()}")
        write_random_mixtral(tmp, seed=0, config=cfg, tokenizer=False)
        os.replace(tmp, d)
    return d
