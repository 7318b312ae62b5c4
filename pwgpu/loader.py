"""Hugging Face checkpoint directories -> ``MoeArch`` + tensors, safetensors only.

Strict: every key of ``config.json`` is implemented, ignored because it cannot change a forward
pass (listed in one line), or refused by name (``pwgpu.config_schema``, read into ``MoeArch`` by
``pwgpu.arch_config``); every tensor of the checkpoint is used, or skipped for a stated reason
(the multi-token-prediction layers of DeepSeek-V3), or the load fails naming it. Missing or
mis-shaped tensors are all named in one error, so a wrong checkpoint is diagnosed in one run.
One ``*.safetensors`` file or several with ``model.safetensors.index.json``; pickle files are
refused. FP8 block-scaled checkpoints: see ``pwgpu.fp8_checkpoint``.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pwgpu import fp8_checkpoint as fp8
from pwgpu.arch_config import CheckpointError, config_value, read_arch, read_config, read_config_json
from pwgpu.model import LayerWeights, MoeArch, PinnedWeights

__all__ = ["CheckpointError", "read_arch", "read_config"]  # re-exported: where callers look for them

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# A scenario run (``pwgpu run --scenario``) computes in bf16 on any device: the spec's 2-byte KV
# and pinned weights, as the simulator counts them. ``pwgpu profile --scenario`` times the same.
SCENARIO_DTYPE = "bfloat16"


def default_dtype_name(device: torch.device) -> str:
    """The engine's activation and KV dtype unless told otherwise: bf16 on a GPU; fp32 on a CPU,
    where bf16 matmuls are emulated and slower."""
    return "bfloat16" if device.type == "cuda" else "float32"


# ---- tensors ----------------------------------------------------------------------------------


def expert_names(arch: MoeArch, layer: int, e: int) -> tuple[str, str, str]:
    """Checkpoint names of routed expert ``e``'s gate (w1), up (w3) and down (w2) matrices."""
    if arch.family == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
        return f"{p}.w1.weight", f"{p}.w3.weight", f"{p}.w2.weight"
    p = f"model.layers.{layer}.mlp.experts.{e}"
    return f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight"


def _moe_prefix(arch: MoeArch, layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe" if arch.family == "mixtral" else f"model.layers.{layer}.mlp"


def _shared_prefix(arch: MoeArch, layer: int) -> str:
    return f"model.layers.{layer}.mlp.shared_expert" + ("s" if arch.attention == "mla" else "")


def _attention_tensors(arch: MoeArch, a: str) -> dict[str, tuple[int, ...]]:
    h, heads = arch.hidden_size, arch.num_heads
    out: dict[str, tuple[int, ...]] = {}
    if arch.attention == "mla":
        q_out = heads * (arch.qk_nope_head_dim + arch.head_dim)
        rank, latent = arch.q_lora_rank, arch.kv_lora_rank + arch.head_dim
        if rank:
            out |= {f"{a}.q_a_proj.weight": (rank, h), f"{a}.q_a_layernorm.weight": (rank,)}
            out[f"{a}.q_b_proj.weight"] = (q_out, rank)
            if arch.qkv_bias:
                out[f"{a}.q_a_proj.bias"] = (rank,)
        else:
            out[f"{a}.q_proj.weight"] = (q_out, h)
        out |= {f"{a}.kv_a_proj_with_mqa.weight": (latent, h), f"{a}.kv_a_layernorm.weight": (arch.kv_lora_rank,)}
        out[f"{a}.kv_b_proj.weight"] = (heads * (arch.qk_nope_head_dim + arch.v_head_dim), arch.kv_lora_rank)
        out[f"{a}.o_proj.weight"] = (h, heads * arch.v_head_dim)
        if arch.qkv_bias:
            out[f"{a}.kv_a_proj_with_mqa.bias"] = (latent,)
    else:
        d = arch.head_dim
        q_out, kv_out = heads * d, arch.num_kv_heads * d
        out |= {f"{a}.q_proj.weight": (q_out, h), f"{a}.k_proj.weight": (kv_out, h)}
        out |= {f"{a}.v_proj.weight": (kv_out, h), f"{a}.o_proj.weight": (h, q_out)}
        if arch.qkv_bias:
            out |= {f"{a}.q_proj.bias": (q_out,), f"{a}.k_proj.bias": (kv_out,), f"{a}.v_proj.bias": (kv_out,)}
        if arch.qk_norm != "none":
            full = arch.qk_norm == "full"
            out |= {f"{a}.q_norm.weight": (q_out if full else d,), f"{a}.k_norm.weight": (kv_out if full else d,)}
    if arch.o_bias:
        out[f"{a}.o_proj.bias"] = (h,)
    return out


def expected_tensors(arch: MoeArch) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with its shape."""
    h, f = arch.hidden_size, arch.expert_ffn_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    if not arch.tie_embeddings:
        out["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}"
        out |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,)}
        out |= _attention_tensors(arch, f"{p}.self_attn")
        if i < arch.num_dense_layers:
            fd = arch.dense_ffn_size
            out |= {f"{p}.mlp.gate_proj.weight": (fd, h), f"{p}.mlp.up_proj.weight": (fd, h)}
            out[f"{p}.mlp.down_proj.weight"] = (h, fd)
            continue
        moe = _moe_prefix(arch, i)
        out[f"{moe}.gate.weight"] = (arch.num_experts, h)
        if arch.router_bias:
            out[f"{moe}.gate.e_score_correction_bias"] = (arch.num_experts,)
        for e in range(arch.num_experts):
            w1, w3, w2 = expert_names(arch, i, e)
            out |= {w1: (f, h), w3: (f, h), w2: (h, f)}
        if arch.shared_expert_ffn_size:
            fs, s = arch.num_shared_experts * arch.shared_expert_ffn_size, _shared_prefix(arch, i)
            out |= {f"{s}.gate_proj.weight": (fs, h), f"{s}.up_proj.weight": (fs, h), f"{s}.down_proj.weight": (h, fs)}
            if arch.shared_expert_gate:
                out[f"{p}.mlp.shared_expert_gate.weight"] = (1, h)
    return out


def _linear_weights(want: dict[str, tuple[int, ...]]) -> set[str]:
    """The tensors an FP8 checkpoint may quantise: linear layers' weights (not embeddings, norms,
    routers or the shared expert's one-row gate)."""
    skip = ("embed_tokens", "norm", ".gate.weight", "shared_expert_gate")
    return {n for n, s in want.items() if len(s) == 2 and n.endswith(".weight") and not any(x in n for x in skip)}


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _skipped(name: str, arch: MoeArch, num_mtp_layers: int) -> str | None:
    """Why a tensor the model does not read is fine to leave out, or None."""
    m = _LAYER.match(name)
    if m and arch.num_layers <= int(m.group(1)) < arch.num_layers + num_mtp_layers:
        return "the multi-token-prediction module (speculative decoding, not run)"
    if name.endswith("rotary_emb.inv_freq"):
        return "RoPE frequencies (computed from the config)"
    return None


@dataclass
class Checkpoint:
    arch: MoeArch
    tensors: dict[str, torch.Tensor]  # checkpoint name -> tensor (host, checkpoint dtype; FP8 stays FP8)
    path: Path
    scales: dict[str, torch.Tensor] = field(default_factory=dict)  # weight name -> fp32 block scales
    notes: list[str] = field(default_factory=list)  # what loading ignored or converted, one line each

    def is_fp8(self, name: str) -> bool:
        return name in self.scales

    def dense(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``name`` in ``dtype`` on the host, FP8 dequantised."""
        t = self.tensors[name]
        return fp8.dequantize(t, self.scales[name], dtype) if name in self.scales else t.to(dtype)


def _files(model_dir: Path) -> list[Path]:
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
    return files


def _shown(items: list[str], limit: int = 20) -> str:
    return "; ".join(items[:limit]) + (f"; and {len(items) - limit} more" if len(items) > limit else "")


def load_checkpoint(model_dir: str | Path) -> Checkpoint:
    from safetensors import safe_open

    model_dir = Path(model_dir)
    arch, ignored_keys = read_config(model_dir)
    raw, _ = read_config_json(model_dir)
    num_mtp_layers = 0
    if arch.family == "deepseek_v3":
        num_mtp_layers = config_value(raw, "num_nextn_predict_layers", "num_mtp_layers", default=0)
    want = expected_tensors(arch)
    tensors: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    unused: list[str] = []
    skipped: dict[str, int] = {}
    for path in _files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if name in want:
                    tensors[name] = f.get_tensor(name)
                elif name.endswith(fp8.SCALE_SUFFIX) and name.removesuffix(fp8.SCALE_SUFFIX) in want:
                    scales[name] = f.get_tensor(name)
                elif (why := _skipped(name, arch, num_mtp_layers)) is not None:
                    skipped[why] = skipped.get(why, 0) + 1
                elif 0 in f.get_slice(name).get_shape():  # e.g. transformers' DeepSeek with no shared expert
                    skipped["empty tensors"] = skipped.get("empty tensors", 0) + 1
                else:
                    unused.append(name)
    problems = [f"missing {n} {list(s)}" for n, s in want.items() if n not in tensors]
    problems += [
        f"{n} has shape {list(t.shape)}, expected {list(want[n])}"
        for n, t in tensors.items()
        if tuple(t.shape) != want[n]
    ]
    if unused:
        shown = ", ".join(sorted(unused)[:10]) + (", ..." if len(unused) > 10 else "")
        problems.append(f"{len(unused)} tensor(s) the {arch.family} model does not use: {shown}")
    if not problems:
        problems = fp8.check(tensors, scales, raw.get("quantization_config") is not None, _linear_weights(want))
    if problems:
        raise CheckpointError(f"{model_dir} ({arch.family}): {len(problems)} tensor problem(s): {_shown(problems)}")
    ckpt = Checkpoint(
        arch, tensors, model_dir, {n.removesuffix(fp8.SCALE_SUFFIX): s.float() for n, s in scales.items()}
    )
    if ignored_keys:
        ckpt.notes.append(f"ignored config keys (they do not change a forward pass): {', '.join(ignored_keys)}")
    for why, count in skipped.items():
        ckpt.notes.append(f"skipped {count} tensor(s) of {why}")
    pinned_fp8 = sorted(n for n in ckpt.scales if n not in _routed_names(arch))
    if pinned_fp8:
        ckpt.notes.append(
            f"dequantised {len(pinned_fp8)} FP8 weight(s) outside the routed experts (attention, dense, shared) "
            "to the compute dtype"
        )
    for note in ckpt.notes:
        log.info("%s: %s", model_dir, note)
    return ckpt


def _routed_names(arch: MoeArch) -> set[str]:
    return {
        n for i in range(arch.num_dense_layers, arch.num_layers) for e in range(arch.num_experts)
        for n in expert_names(arch, i, e)
    }  # fmt: skip


def pinned_weights(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device) -> PinnedWeights:
    """Everything but the routed experts, converted to ``dtype`` on ``device`` (FP8 dequantised);
    DeepSeek's expert-choice bias stays fp32."""
    a, t = ckpt.arch, ckpt.tensors

    def get(name: str) -> torch.Tensor:
        return ckpt.dense(name, dtype).to(device)

    def opt(name: str) -> torch.Tensor | None:
        return get(name) if name in t else None

    embed = get("model.embed_tokens.weight")
    out = PinnedWeights(embed, get("model.norm.weight"), embed if a.tie_embeddings else get("lm_head.weight"))
    for i in range(a.num_layers):
        p, at = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        lw = LayerWeights(
            input_norm=get(f"{p}.input_layernorm.weight"),
            post_norm=get(f"{p}.post_attention_layernorm.weight"),
            o=get(f"{at}.o_proj.weight"),
            o_bias=opt(f"{at}.o_proj.bias"),
        )
        if a.attention == "mla":
            lw.q, lw.q_a, lw.q_a_bias = (
                opt(f"{at}.q_proj.weight"),
                opt(f"{at}.q_a_proj.weight"),
                opt(f"{at}.q_a_proj.bias"),
            )
            lw.q_a_norm, lw.q_b = opt(f"{at}.q_a_layernorm.weight"), opt(f"{at}.q_b_proj.weight")
            lw.kv_a, lw.kv_a_bias = get(f"{at}.kv_a_proj_with_mqa.weight"), opt(f"{at}.kv_a_proj_with_mqa.bias")
            lw.kv_a_norm, lw.kv_b = get(f"{at}.kv_a_layernorm.weight"), get(f"{at}.kv_b_proj.weight")
        else:
            lw.q, lw.k, lw.v = get(f"{at}.q_proj.weight"), get(f"{at}.k_proj.weight"), get(f"{at}.v_proj.weight")
            lw.q_bias, lw.k_bias, lw.v_bias = (opt(f"{at}.{m}_proj.bias") for m in "qkv")
            lw.q_norm, lw.k_norm = opt(f"{at}.q_norm.weight"), opt(f"{at}.k_norm.weight")
        if i < a.num_dense_layers:
            lw.dense = tuple(get(f"{p}.mlp.{m}_proj.weight") for m in ("gate", "up", "down"))
        else:
            moe = _moe_prefix(a, i)
            lw.router = get(f"{moe}.gate.weight")
            if a.router_bias:
                lw.router_bias = t[f"{moe}.gate.e_score_correction_bias"].float().to(device)
            if a.shared_expert_ffn_size:
                s = _shared_prefix(a, i)
                lw.shared = tuple(get(f"{s}.{m}_proj.weight") for m in ("gate", "up", "down"))
                lw.shared_gate = opt(f"{p}.mlp.shared_expert_gate.weight")
        out.layers.append(lw)
    return out


def dense_expert_weights(ckpt: Checkpoint, dtype: torch.dtype) -> tuple[list, list, list]:
    """Routed experts stacked per MoE layer on the host in ``dtype`` (FP8 dequantised): w1, w3
    [E, F, H] and w2 [E, H, F]. The parity tests' oracle; the engine keeps ``expert_masters``."""
    a = ckpt.arch
    w1, w3, w2 = [], [], []
    for i in range(a.num_dense_layers, a.num_layers):
        names = [expert_names(a, i, e) for e in range(a.num_experts)]
        for j, dst in enumerate((w1, w3, w2)):
            dst.append(torch.stack([ckpt.dense(n[j], dtype) for n in names]))
    return w1, w3, w2


def expert_masters(ckpt: Checkpoint, compute_dtype: torch.dtype):
    """The host master copy of the routed experts (``pwgpu.weights.ExpertMasters``): the FP8
    checkpoint's own bytes when its experts are FP8 (``fp8-b128``), else 16-bit (fp16 for fp16
    models, else bf16). Takes the routed experts out of ``ckpt``: they are most of a large
    model's bytes, and a second host copy of them would double its host memory."""
    a = ckpt.arch
    routed = [expert_names(a, i, e) for i in range(a.num_dense_layers, a.num_layers) for e in range(a.num_experts)]
    quantized = [ckpt.is_fp8(n) for names in routed for n in names]
    if any(quantized) and not all(quantized):
        raise CheckpointError(f"{ckpt.path}: some routed experts are FP8 and some are not; one format is served")
    try:
        return _masters(ckpt, compute_dtype, all(quantized))
    finally:
        for names in routed:
            for n in names:
                ckpt.tensors.pop(n, None)
                ckpt.scales.pop(n, None)


def _masters(ckpt: Checkpoint, compute_dtype: torch.dtype, quantized: bool):
    from pwgpu.weights import ExpertMasters

    a = ckpt.arch
    if not quantized:
        precision = "fp16" if compute_dtype == torch.float16 else "bf16"
        return ExpertMasters(
            precision, dense_expert_weights(ckpt, DTYPES["float16" if precision == "fp16" else "bfloat16"])
        )
    mats: tuple[list, list, list] = ([], [], [])
    for i in range(a.num_dense_layers, a.num_layers):
        names = [expert_names(a, i, e) for e in range(a.num_experts)]
        for j, dst in enumerate(mats):
            dst.append(torch.stack([fp8.to_blob(ckpt.tensors.pop(n[j]), ckpt.scales.pop(n[j])) for n in names]))
    return ExpertMasters(fp8.PRECISION, mats, ffn_size=a.expert_ffn_size, hidden_size=a.hidden_size)
