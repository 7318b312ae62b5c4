"""Hugging Face checkpoint directories -> ``MoeArch`` + tensors, safetensors only.

Accepts the config keys of transformers 4.x and 5.x (``rope_theta`` or ``rope_parameters``,
``num_local_experts`` or ``num_experts``, ``torch_dtype`` or ``dtype``), one ``*.safetensors``
file or several with ``model.safetensors.index.json``. Every missing or mis-shaped tensor is
named in one error, so a wrong checkpoint is diagnosed in one run. Pickle files are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedweight.errors import PagedWeightError
from pwgpu.model import LayerWeights, MoeArch, PinnedWeights

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# A scenario run (``pwgpu run --scenario``) computes in bf16 on any device: the spec's 2-byte KV
# and pinned weights, as the simulator counts them. ``pwgpu profile --scenario`` times the same.
SCENARIO_DTYPE = "bfloat16"


def default_dtype_name(device: torch.device) -> str:
    """The engine's activation and KV dtype unless told otherwise: bf16 on a GPU; fp32 on a CPU,
    where bf16 matmuls are emulated and slower."""
    return "bfloat16" if device.type == "cuda" else "float32"


class CheckpointError(PagedWeightError):
    """A checkpoint directory that cannot be served, with every reason listed."""


def _get(cfg: dict, *keys, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def read_arch(model_dir: str | Path) -> MoeArch:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json (expected a Hugging Face checkpoint directory)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise CheckpointError(f"{path}: model_type {family!r} is not supported; supported: {', '.join(FAMILIES)}")
    rope = cfg.get("rope_parameters") or {}
    if (rope.get("rope_type") or "default") != "default" or cfg.get("rope_scaling"):
        raise CheckpointError(f"{path}: only plain RoPE is supported (got {rope or cfg.get('rope_scaling')})")
    ffn_key = "intermediate_size" if family in ("mixtral", "olmoe") else "moe_intermediate_size"
    required = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "num_experts_per_tok", ffn_key)
    missing = [k for k in required if k not in cfg]
    if missing:
        raise CheckpointError(f"{path}: missing keys {missing}; a {family} config needs {', '.join(required)}")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    num_layers = cfg["num_hidden_layers"]
    dense_layers = 0
    if family in ("qwen2_moe", "qwen3_moe"):
        mlp_only = sorted(cfg.get("mlp_only_layers") or [])
        if mlp_only != list(range(len(mlp_only))) or _get(cfg, "decoder_sparse_step", default=1) != 1:
            raise CheckpointError(f"{path}: only leading dense layers are supported (mlp_only_layers={mlp_only})")
        dense_layers = len(mlp_only)
    if family != "mixtral" and (cfg.get("sliding_window") and cfg.get("use_sliding_window")):
        raise CheckpointError(f"{path}: sliding-window attention is not supported")
    if family == "mixtral" and cfg.get("sliding_window"):
        raise CheckpointError(
            f"{path}: sliding-window attention (sliding_window={cfg['sliding_window']}) is not supported"
        )
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    shared = (cfg.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
    return MoeArch(
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=_get(cfg, "num_key_value_heads", default=heads),
        head_dim=_get(cfg, "head_dim", default=hidden // heads),
        num_experts=_get(cfg, "num_local_experts", "num_experts"),
        top_k=cfg["num_experts_per_tok"],
        expert_ffn_size=cfg[ffn_key],
        router_renorm=True if family == "mixtral" else bool(cfg.get("norm_topk_prob", False)),
        qkv_bias=family == "qwen2_moe" and cfg.get("qkv_bias", True),
        qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(family, "none"),
        clip_qkv=cfg.get("clip_qkv"),
        shared_expert_ffn_size=shared,
        shared_expert_gate=bool(shared),
        num_dense_layers=dense_layers,
        dense_ffn_size=cfg.get("intermediate_size", 0) if dense_layers else 0,
        rope_theta=float(_get(rope, "rope_theta", default=cfg.get("rope_theta", 10000.0))),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        dtype=_get(cfg, "dtype", "torch_dtype", default="bfloat16"),
    )


def expert_names(arch: MoeArch, layer: int, e: int) -> tuple[str, str, str]:
    """Checkpoint names of routed expert ``e``'s gate (w1), up (w3) and down (w2) matrices."""
    if arch.family == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
        return f"{p}.w1.weight", f"{p}.w3.weight", f"{p}.w2.weight"
    p = f"model.layers.{layer}.mlp.experts.{e}"
    return f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight"


def expected_tensors(arch: MoeArch) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with its shape."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.expert_ffn_size
    q_out, kv_out = arch.num_heads * d, arch.num_kv_heads * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    if not arch.tie_embeddings:
        out["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}"
        out |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,)}
        a = f"{p}.self_attn"
        out |= {f"{a}.q_proj.weight": (q_out, h), f"{a}.k_proj.weight": (kv_out, h)}
        out |= {f"{a}.v_proj.weight": (kv_out, h), f"{a}.o_proj.weight": (h, q_out)}
        if arch.qkv_bias:
            out |= {f"{a}.q_proj.bias": (q_out,), f"{a}.k_proj.bias": (kv_out,), f"{a}.v_proj.bias": (kv_out,)}
        if arch.qk_norm != "none":
            full = arch.qk_norm == "full"
            out |= {f"{a}.q_norm.weight": (q_out if full else d,), f"{a}.k_norm.weight": (kv_out if full else d,)}
        if i < arch.num_dense_layers:
            fd = arch.dense_ffn_size
            out |= {f"{p}.mlp.gate_proj.weight": (fd, h), f"{p}.mlp.up_proj.weight": (fd, h)}
            out[f"{p}.mlp.down_proj.weight"] = (h, fd)
            continue
        moe = f"{p}.block_sparse_moe" if arch.family == "mixtral" else f"{p}.mlp"
        out[f"{moe}.gate.weight"] = (arch.num_experts, h)
        for e in range(arch.num_experts):
            w1, w3, w2 = expert_names(arch, i, e)
            out |= {w1: (f, h), w3: (f, h), w2: (h, f)}
        if arch.shared_expert_ffn_size:
            fs, s = arch.shared_expert_ffn_size, f"{p}.mlp.shared_expert"
            out |= {f"{s}.gate_proj.weight": (fs, h), f"{s}.up_proj.weight": (fs, h), f"{s}.down_proj.weight": (h, fs)}
            out[f"{p}.mlp.shared_expert_gate.weight"] = (1, h)
    return out


@dataclass
class Checkpoint:
    arch: MoeArch
    tensors: dict[str, torch.Tensor]  # checkpoint name -> tensor (host, checkpoint dtype)
    path: Path


def load_checkpoint(model_dir: str | Path) -> Checkpoint:
    from safetensors import safe_open

    model_dir = Path(model_dir)
    arch = read_arch(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        hint = (
            f" (found {', '.join(pickles)}: pickle checkpoints are not loaded; convert to safetensors)"
            if pickles
            else ""
        )
        raise CheckpointError(f"{model_dir}: no *.safetensors files{hint}")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing_files = [n for n in names if not (model_dir / n).is_file()]
        if missing_files:
            raise CheckpointError(f"{index}: shards missing: {', '.join(missing_files)}")
        files = [model_dir / n for n in names]
    want = expected_tensors(arch)
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if name in want:
                    tensors[name] = f.get_tensor(name)
    problems = [f"missing {n} {list(s)}" for n, s in want.items() if n not in tensors]
    problems += [
        f"{n} has shape {list(t.shape)}, expected {list(want[n])}"
        for n, t in tensors.items()
        if tuple(t.shape) != want[n]
    ]
    if problems:
        shown = "; ".join(problems[:20]) + (f"; and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise CheckpointError(f"{model_dir} ({arch.family}): {len(problems)} tensor problem(s): {shown}")
    return Checkpoint(arch, tensors, model_dir)


def pinned_weights(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device) -> PinnedWeights:
    """Everything but the routed experts, converted to ``dtype`` on ``device``."""
    a, t = ckpt.arch, ckpt.tensors

    def get(name: str) -> torch.Tensor:
        return t[name].to(device=device, dtype=dtype)

    def opt(name: str) -> torch.Tensor | None:
        return get(name) if name in t else None

    embed = get("model.embed_tokens.weight")
    out = PinnedWeights(embed, get("model.norm.weight"), embed if a.tie_embeddings else get("lm_head.weight"))
    for i in range(a.num_layers):
        p, at = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        lw = LayerWeights(
            input_norm=get(f"{p}.input_layernorm.weight"),
            post_norm=get(f"{p}.post_attention_layernorm.weight"),
            q=get(f"{at}.q_proj.weight"),
            k=get(f"{at}.k_proj.weight"),
            v=get(f"{at}.v_proj.weight"),
            o=get(f"{at}.o_proj.weight"),
            q_bias=opt(f"{at}.q_proj.bias"),
            k_bias=opt(f"{at}.k_proj.bias"),
            v_bias=opt(f"{at}.v_proj.bias"),
            q_norm=opt(f"{at}.q_norm.weight"),
            k_norm=opt(f"{at}.k_norm.weight"),
        )
        if i < a.num_dense_layers:
            lw.dense = tuple(get(f"{p}.mlp.{m}_proj.weight") for m in ("gate", "up", "down"))
        else:
            moe = f"{p}.block_sparse_moe" if a.family == "mixtral" else f"{p}.mlp"
            lw.router = get(f"{moe}.gate.weight")
            if a.shared_expert_ffn_size:
                lw.shared = tuple(get(f"{p}.mlp.shared_expert.{m}_proj.weight") for m in ("gate", "up", "down"))
                lw.shared_gate = get(f"{p}.mlp.shared_expert_gate.weight")
        out.layers.append(lw)
    return out


def expert_masters(ckpt: Checkpoint, dtype: torch.dtype) -> tuple[list, list, list]:
    """Routed experts stacked per MoE layer on the host: w1, w3 [E, F, H] and w2 [E, H, F]."""
    a = ckpt.arch
    w1, w3, w2 = [], [], []
    for i in range(a.num_dense_layers, a.num_layers):
        names = [expert_names(a, i, e) for e in range(a.num_experts)]
        for j, dst in enumerate((w1, w3, w2)):
            dst.append(torch.stack([ckpt.tensors[n[j]] for n in names]).to(dtype))
    return w1, w3, w2
