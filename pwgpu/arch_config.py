"""``config.json`` -> ``MoeArch``: what each family's keys mean, with transformers' defaults for
the optional ones, after ``pwgpu.config_schema`` has refused what is not implemented.

Accepts the config keys of transformers 4.x and 5.x (``rope_theta`` / ``rope_scaling`` or
``rope_parameters``, ``num_local_experts`` or ``num_experts``, ``torch_dtype`` or ``dtype``).
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedweight.errors import PagedWeightError
from pwgpu.config_schema import FAMILIES, check_keys
from pwgpu.model import MoeArch
from pwgpu.rope import Yarn

DEEPSEEK = ("deepseek_v2", "deepseek_v3")

# transformers' defaults for the optional keys that change the numbers (a config saved by
# transformers states them; hand-written ones may not).
DEFAULTS: dict[str, dict] = {
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 131072},
    "qwen2_moe": {"rms_norm_eps": 1e-6, "norm_topk_prob": False, "qkv_bias": True, "max_position_embeddings": 32768},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "norm_topk_prob": False, "attention_bias": False},
    "olmoe": {"rms_norm_eps": 1e-5, "norm_topk_prob": False, "attention_bias": False},
    "deepseek_v2": {
        "rms_norm_eps": 1e-6, "first_k_dense_replace": 0, "n_shared_experts": 2, "routed_scaling_factor": 1.0,
        "topk_method": "greedy", "attention_bias": False, "max_position_embeddings": 2048,
    },
    "deepseek_v3": {
        "rms_norm_eps": 1e-6, "first_k_dense_replace": 3, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
        "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "rope_interleave": True, "attention_bias": False,
    },
}  # fmt: skip
# transformers' activation names -> ours (pwgpu.kernels.reference.ACTIVATIONS).
HIDDEN_ACTS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


class CheckpointError(PagedWeightError):
    """A checkpoint directory that cannot be served, with every reason listed."""


def config_value(cfg: dict, *keys, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def read_config_json(model_dir: str | Path) -> tuple[dict, Path]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json (expected a Hugging Face checkpoint directory)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return cfg, path


def _required(family: str, cfg: dict) -> tuple[str, ...]:
    base = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "num_experts_per_tok")
    if family in ("mixtral", "olmoe"):
        return (*base, "intermediate_size")
    if family in DEEPSEEK:
        dense = ("intermediate_size",) if (DEFAULTS[family] | cfg).get("first_k_dense_replace") else ()
        return (*base, "moe_intermediate_size", "n_routed_experts", *MLA_KEYS, *dense)
    return (*base, "moe_intermediate_size")


def read_config(model_dir: str | Path) -> tuple[MoeArch, list[str]]:
    """(architecture, config keys ignored because they cannot change a forward pass)."""
    raw, path = read_config_json(model_dir)
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise CheckpointError(f"{path}: model_type {family!r} is not supported; supported: {', '.join(FAMILIES)}")
    required = _required(family, raw)
    missing = [k for k in required if k not in raw]
    if missing:
        raise CheckpointError(f"{path}: missing keys {missing}; a {family} config needs {', '.join(required)}")
    refused, ignored = check_keys(raw, family)
    if refused:
        raise CheckpointError(
            f"{path}: not implemented for {family}, refusing to compute wrong numbers: " + "; ".join(refused)
        )
    cfg = DEFAULTS[family] | {k: v for k, v in raw.items() if v is not None}
    return (_deepseek_arch if family in DEEPSEEK else _gqa_arch)(cfg, family, path), ignored


def read_arch(model_dir: str | Path) -> MoeArch:
    return read_config(model_dir)[0]


def _common(cfg: dict, family: str) -> dict:
    theta, yarn = _rope(cfg)
    eos = cfg.get("eos_token_id")
    return dict(
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        top_k=cfg["num_experts_per_tok"],
        rope_theta=theta,
        rope_yarn=yarn,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=HIDDEN_ACTS[cfg.get("hidden_act", "silu")],
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        dtype=config_value(cfg, "dtype", "torch_dtype", default="bfloat16"),
    )


def _rope(cfg: dict) -> tuple[float, Yarn | None]:
    """(theta, YaRN or None) from ``rope_scaling`` (4.x) or ``rope_parameters`` (5.x), as transformers
    reads them (the schema has refused every other RoPE type)."""
    rp = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = float(config_value(rp, "rope_theta", default=cfg.get("rope_theta", 10000.0)))
    if rp.get("rope_type", rp.get("type", "default")) != "yarn":
        return theta, None
    original = rp.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
    return theta, Yarn(
        factor=float(rp.get("factor") or cfg["max_position_embeddings"] / original),
        original_max_position_embeddings=original,
        beta_fast=float(rp.get("beta_fast") or 32),
        beta_slow=float(rp.get("beta_slow") or 1),
        mscale=rp.get("mscale"),
        mscale_all_dim=rp.get("mscale_all_dim"),
        attention_factor=rp.get("attention_factor"),
        truncate=bool(rp.get("truncate", True)),
    )


def _gqa_arch(cfg: dict, family: str, path: Path) -> MoeArch:
    ffn_key = "intermediate_size" if family in ("mixtral", "olmoe") else "moe_intermediate_size"
    heads = cfg["num_attention_heads"]
    dense_layers = len(cfg.get("mlp_only_layers") or []) if family in ("qwen2_moe", "qwen3_moe") else 0
    shared = (cfg.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
    attention_bias = family in ("qwen3_moe", "olmoe") and bool(cfg.get("attention_bias"))
    return MoeArch(
        **_common(cfg, family),
        num_kv_heads=config_value(cfg, "num_key_value_heads", default=heads),
        head_dim=config_value(cfg, "head_dim", default=cfg["hidden_size"] // heads),
        num_experts=config_value(cfg, "num_local_experts", "num_experts"),
        expert_ffn_size=cfg[ffn_key],
        router_renorm=True if family == "mixtral" else bool(cfg.get("norm_topk_prob", False)),
        qkv_bias=(family == "qwen2_moe" and bool(cfg.get("qkv_bias", True))) or attention_bias,
        o_bias=attention_bias,
        qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(family, "none"),
        clip_qkv=cfg.get("clip_qkv"),
        num_shared_experts=1 if shared else 0,
        shared_expert_ffn_size=shared,
        shared_expert_gate=bool(shared),
        num_dense_layers=dense_layers,
        dense_ffn_size=cfg.get("intermediate_size", 0) if dense_layers else 0,
    )


def _deepseek_arch(cfg: dict, family: str, path: Path) -> MoeArch:
    experts, v3 = cfg["n_routed_experts"], family == "deepseek_v3"
    grouped = v3 or cfg.get("topk_method") == "group_limited_greedy"
    groups, topk_groups = (cfg.get("n_group") or 1, cfg.get("topk_group") or 1) if grouped else (1, 1)
    problems = []
    if experts % groups:
        problems.append(f"n_routed_experts={experts} is not a multiple of n_group={groups}")
    if v3 and experts // groups < 2:
        problems.append(f"n_group={groups} leaves fewer than 2 experts per group")
    if topk_groups > groups:
        problems.append(f"topk_group={topk_groups} exceeds n_group={groups}")
    if cfg["num_experts_per_tok"] > experts:
        problems.append(f"num_experts_per_tok={cfg['num_experts_per_tok']} exceeds n_routed_experts={experts}")
    if cfg["first_k_dense_replace"] >= cfg["num_hidden_layers"]:
        problems.append("first_k_dense_replace must leave at least one MoE layer")
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))
    shared = cfg.get("n_shared_experts") or 0
    return MoeArch(
        **_common(cfg, family),
        num_kv_heads=cfg["num_attention_heads"],
        head_dim=cfg["qk_rope_head_dim"],
        num_experts=experts,
        expert_ffn_size=cfg["moe_intermediate_size"],
        router_renorm=v3 and bool(cfg.get("norm_topk_prob")),
        qkv_bias=bool(cfg.get("attention_bias")),
        o_bias=bool(cfg.get("attention_bias")),
        num_shared_experts=shared,
        shared_expert_ffn_size=cfg["moe_intermediate_size"] if shared else 0,
        num_dense_layers=cfg["first_k_dense_replace"],
        dense_ffn_size=cfg.get("intermediate_size", 0) if cfg["first_k_dense_replace"] else 0,
        rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
        attention="mla",
        q_lora_rank=cfg.get("q_lora_rank") or 0,
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        router_fp32=True,
        router_scoring="sigmoid" if v3 else "softmax",
        router_bias=v3,
        num_groups=groups,
        topk_groups=topk_groups,
        group_score="top2_sum" if v3 else "max",
        group_mask_value=float("-inf") if v3 else 0.0,
        routed_scaling_factor=float(cfg["routed_scaling_factor"]),
    )
