"""What the rest of the project reasons about: models, GPUs and weight precisions.

Three frozen descriptions, loaded from YAML data files that each cite their source:

- ``Precision``: one storage format for an expert matrix, with its *exact* size including
  scales and zero points (the number the allocator and the page pool count).
- ``ModelSpec``: the shape of an MoE transformer, enough to size every tensor, the KV cache
  per token and the FLOPs of a step.
- ``GpuSpec``: the memory and speed figures of one accelerator (or "this CPU").

Shape legend used below: H = hidden size, F = expert FFN size, E = experts per MoE layer,
N = output rows of a matrix, K = input columns (the reduction dimension).
"""

from __future__ import annotations

import math
import os
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pagedweight.errors import ConfigError, SpecError, format_validation_error, read_yaml_mapping

# --------------------------------------------------------------------------------------------
# Precisions
# --------------------------------------------------------------------------------------------


class Precision(BaseModel):
    """A storage format for one weight matrix ``W[N, K]``.

    Metadata layout (the kernels in ``pwgpu/kernels/quant.py`` follow it):
    - ``group_size is None`` and ``scale_bits == 0``: no metadata (BF16/FP16).
    - ``group_size is None`` and ``scale_bits > 0``: one scale per output row (per-channel).
    - ``group_size = g``: one scale (and one zero point if asymmetric) per ``group_rows`` rows
      per ``g`` consecutive input columns, i.e. ``ceil(N / group_rows) * ceil(K / g)`` groups
      (``group_rows = 1``: per row; 128 x 128 blocks are DeepSeek-V3's FP8 format, whose
      edge blocks are ragged when N or K is not a multiple of 128).
    Zero points are stored as uint8: simpler kernels than packed 4-bit zeros for 0.03 bit/weight.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    weight_bits: int = Field(gt=0, le=16)
    group_size: int | None = None
    group_rows: int = Field(default=1, gt=0)
    scale_bits: int = 0
    zero_bits: int = 0
    kind: Literal["float", "int"] = "int"
    # Higher rank = more precise. Orders the precision ladder independently of bytes, because
    # FP8 and INT8 take the same bytes yet are different formats.
    rank: int

    def num_groups(self, n_out: int, k_in: int) -> int:
        if self.scale_bits == 0:
            return 0
        if self.group_size is None:
            return n_out
        return math.ceil(n_out / self.group_rows) * math.ceil(k_in / self.group_size)

    def matrix_bytes(self, n_out: int, k_in: int) -> int:
        """Exact bytes of ``W[n_out, k_in]`` in this format: packed data + scales + zeros."""
        data_bytes = math.ceil(n_out * k_in * self.weight_bits / 8)
        groups = self.num_groups(n_out, k_in)
        meta_bytes = math.ceil(groups * self.scale_bits / 8) + math.ceil(groups * self.zero_bits / 8)
        return data_bytes + meta_bytes

    def bits_per_weight(self, n_out: int, k_in: int) -> float:
        """Exact bits per weight including metadata, for a matrix of this shape."""
        return 8 * self.matrix_bytes(n_out, k_in) / (n_out * k_in)

    def __str__(self) -> str:
        return self.name


_PRECISION_LIST = (
    Precision(name="bf16", weight_bits=16, kind="float", rank=60),
    Precision(name="fp16", weight_bits=16, kind="float", rank=60),
    Precision(name="fp8", weight_bits=8, scale_bits=32, kind="float", rank=50),  # E4M3, fp32 scale per row
    Precision(name="int8", weight_bits=8, scale_bits=32, rank=40),  # symmetric, fp32 scale per row
    Precision(name="int4", weight_bits=4, group_size=128, scale_bits=16, zero_bits=8, rank=30),
    Precision(name="int3", weight_bits=3, group_size=128, scale_bits=16, zero_bits=8, rank=20),
    Precision(name="int2", weight_bits=2, group_size=64, scale_bits=16, zero_bits=8, rank=10),
    # Last, so that the codes of the others (and the column order of step tables) stay put.
    # E4M3 with one fp32 scale per 128 x 128 block: FP8 checkpoints as DeepSeek-V3 ships them
    # (``weight_scale_inv``). Finer scales than per-row FP8, hence the higher rank.
    Precision(name="fp8-b128", weight_bits=8, group_size=128, group_rows=128, scale_bits=32, kind="float", rank=55),
)
PRECISIONS: dict[str, Precision] = {p.name: p for p in _PRECISION_LIST}
# Compact codes for per-expert precision maps: ``precision_ids[layer, expert]`` (int8) indexes
# ``PRECISION_NAMES``. Runtimes and tables use these arrays instead of strings on hot paths.
PRECISION_NAMES: tuple[str, ...] = tuple(PRECISIONS)
PRECISION_ID: dict[str, int] = {name: i for i, name in enumerate(PRECISION_NAMES)}
# The ladder the controller walks by default: most to least precise, one format per rank.
DEFAULT_LADDER: tuple[str, ...] = ("bf16", "fp8", "int8", "int4")
# Formats a checkpoint ships its experts in, so the host master copy can hold them: the top of a
# ladder. ``fp8-b128`` experts go straight to INT4 and below (INT8 would be as large as the FP8
# block format and less precise).
MASTER_PRECISIONS: tuple[str, ...] = ("bf16", "fp16", "fp8-b128")
FP8_BLOCK_LADDER: tuple[str, ...] = ("fp8-b128", "int4")


def get_precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise SpecError(f"unknown precision {name!r}; allowed: {', '.join(PRECISIONS)}") from None


def ladder(names: tuple[str, ...] | list[str]) -> tuple[Precision, ...]:
    """Precisions sorted from most to least precise; duplicates and unknown names rejected."""
    precs = [get_precision(n) for n in names]
    if len(set(names)) != len(names):
        raise SpecError(f"precision ladder {list(names)} names a precision twice")
    return tuple(sorted(precs, key=lambda p: -p.rank))


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------

RouterNorm = Literal[
    "softmax_topk",  # Mixtral: top-k on logits, softmax over the k selected
    "softmax",  # softmax over all experts, top-k, no renormalisation (Qwen1.5-MoE, OLMoE, DS-MoE)
    "softmax_renorm",  # softmax, top-k, renormalise the k weights to sum to 1 (Qwen3-MoE)
    "sigmoid_renorm",  # sigmoid scores, top-k, renormalise (DeepSeek-V3)
]


class ModelSpec(BaseModel):
    """The shape of an MoE transformer. Counts are per model unless the name says otherwise."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    source: str  # where the numbers come from (config.json of a named checkpoint)
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    num_experts: int = Field(gt=0)  # routed experts per MoE layer
    top_k: int = Field(gt=0)
    expert_ffn_size: int = Field(gt=0)
    num_shared_experts: int = Field(default=0, ge=0)
    shared_expert_ffn_size: int = Field(default=0, ge=0)  # per shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid gate on the shared expert's output
    num_dense_layers: int = Field(default=0, ge=0)  # leading layers with a dense FFN instead of MoE
    dense_ffn_size: int = Field(default=0, ge=0)
    vocab_size: int = Field(gt=0)
    tie_embeddings: bool = False
    max_context_tokens: int = Field(gt=0)
    attention: Literal["gqa", "mla"] = "gqa"
    qk_norm: bool = False
    # MLA only (DeepSeek-V2/V3): the KV cache holds a compressed latent plus the RoPE key.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: queries projected directly
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    router_norm: RouterNorm = "softmax_topk"
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    dtype_bytes: int = 2  # full precision of the master copy and the KV cache (bf16/fp16)
    # Pinned parameters beyond this shape's own count: an expert-parallel rank's share of a
    # model (fewer experts per layer) still holds every router row.
    extra_pinned_params: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.top_k > self.num_experts:
            raise ConfigError(f"top_k(={self.top_k}) must be <= num_experts(={self.num_experts})")
        if self.num_dense_layers >= self.num_layers:
            raise ConfigError("num_dense_layers must be < num_layers: the model must have MoE layers")
        if self.num_dense_layers and not self.dense_ffn_size:
            raise ConfigError("dense_ffn_size is required when num_dense_layers > 0")
        if self.num_shared_experts and not self.shared_expert_ffn_size:
            raise ConfigError("shared_expert_ffn_size is required when num_shared_experts > 0")
        if self.attention == "gqa" and self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads(={self.num_heads}) must be a multiple of num_kv_heads")
        if self.attention == "mla" and not (self.kv_lora_rank and self.qk_rope_head_dim):
            raise ConfigError("attention 'mla' needs kv_lora_rank and qk_rope_head_dim")
        return self

    # ---- experts ------------------------------------------------------------------------
    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def num_experts_total(self) -> int:
        """Routed experts whose precision can change: MoE layers x experts per layer."""
        return self.num_moe_layers * self.num_experts

    @property
    def expert_matrices(self) -> tuple[tuple[str, int, int], ...]:
        """(name, N, K) of each routed-expert matrix, Mixtral names: w1 gate, w3 up, w2 down."""
        h, f = self.hidden_size, self.expert_ffn_size
        return (("w1", f, h), ("w3", f, h), ("w2", h, f))

    def expert_bytes(self, precision: Precision | str) -> int:
        """Bytes of one routed expert (all three matrices) at ``precision``."""
        p = get_precision(precision) if isinstance(precision, str) else precision
        return sum(p.matrix_bytes(n, k) for _, n, k in self.expert_matrices)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.expert_ffn_size

    # ---- pinned (always full precision) -------------------------------------------------
    def attention_params_per_layer(self) -> int:
        h = self.hidden_size
        if self.attention == "gqa":
            q_out = self.num_heads * self.head_dim
            kv_out = self.num_kv_heads * self.head_dim
            norms = 2 * self.head_dim if self.qk_norm else 0
            return h * q_out + 2 * h * kv_out + q_out * h + norms
        qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank:
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.num_heads * qk_head
        else:
            q = h * self.num_heads * qk_head
        kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        o = self.num_heads * self.v_head_dim * h
        return q + kv_a + kv_b + o

    def pinned_params(self) -> int:
        """Parameters that never change precision: embeddings, attention, norms, routers,
        shared experts and dense FFN layers."""
        h = self.hidden_size
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        per_layer = self.attention_params_per_layer() + 2 * h  # + two RMSNorms
        router = self.num_experts * h
        shared = self.num_shared_experts * 3 * h * self.shared_expert_ffn_size
        shared += h if self.shared_expert_gate else 0
        dense = 3 * h * self.dense_ffn_size
        return (
            embed
            + h  # final norm
            + self.num_layers * per_layer
            + self.num_moe_layers * (router + shared)
            + self.num_dense_layers * dense
            + self.extra_pinned_params
        )

    def pinned_bytes(self) -> int:
        return self.pinned_params() * self.dtype_bytes

    def total_params(self) -> int:
        return self.pinned_params() + self.num_experts_total * self.expert_params

    def weight_bytes(self, precision: Precision | str) -> int:
        """Pinned parts at full precision plus every routed expert at ``precision``."""
        return self.pinned_bytes() + self.num_experts_total * self.expert_bytes(precision)

    # ---- KV cache -----------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        if self.attention == "mla":
            per_layer = self.kv_lora_rank + self.qk_rope_head_dim
        else:
            per_layer = 2 * self.num_kv_heads * self.head_dim
        return self.num_layers * per_layer * self.dtype_bytes


# --------------------------------------------------------------------------------------------
# GPUs
# --------------------------------------------------------------------------------------------


class GpuSpec(BaseModel):
    """Memory and speed of one accelerator. Peak figures are dense (no sparsity)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    source: str
    hbm_bytes: int = Field(gt=0)
    hbm_bandwidth_bytes_per_s: float = Field(gt=0)
    h2d_bandwidth_bytes_per_s: float = Field(gt=0)  # pinned host -> device copies
    peak_bf16_flops: float = Field(gt=0)
    peak_fp8_flops: float = Field(ge=0)  # 0: no native FP8 (weights dequantised to bf16)
    peak_int8_ops: float = Field(ge=0)
    # GPU-to-GPU link for expert parallelism's all-to-all: sustained bytes/s per direction per
    # GPU and a fixed cost per collective. A spec that gives none talks over its host link.
    interconnect: Literal["nvlink", "pcie", "shared-memory"] = "pcie"
    interconnect_bandwidth_bytes_per_s: float | None = Field(default=None, gt=0)
    interconnect_latency_s: float = Field(default=3.0e-5, ge=0)

    @property
    def peer_bandwidth_bytes_per_s(self) -> float:
        return self.interconnect_bandwidth_bytes_per_s or self.h2d_bandwidth_bytes_per_s


# --------------------------------------------------------------------------------------------
# Loading the built-in data files
# --------------------------------------------------------------------------------------------


def _data_dir(kind: str) -> Path:
    return Path(str(resources.files("pagedweight") / "data" / kind))


def list_models() -> list[str]:
    return sorted(p.stem for p in _data_dir("models").glob("*.yaml"))


def list_gpus() -> list[str]:
    return sorted(p.stem for p in _data_dir("gpus").glob("*.yaml"))


def _load_yaml_model(path: Path, cls: type[BaseModel]) -> BaseModel:
    raw = read_yaml_mapping(path, SpecError, list(cls.model_fields))
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        raise SpecError(format_validation_error(e, str(path), cls)) from None


def _resolve(name_or_path: str, kind: str, known: list[str]) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise SpecError(f"{kind} spec file {name_or_path} does not exist")
        return p
    if name_or_path not in known:
        raise SpecError(f"unknown {kind} {name_or_path!r}; built-in: {', '.join(known)} (or a path to a .yaml file)")
    return _data_dir(kind + "s") / f"{name_or_path}.yaml"


@cache
def load_model(name_or_path: str) -> ModelSpec:
    """A built-in model by name (see ``list_models()``) or a YAML file of ``ModelSpec`` fields."""
    return _load_yaml_model(_resolve(name_or_path, "model", list_models()), ModelSpec)  # type: ignore[return-value]


@cache
def load_gpu(name_or_path: str) -> GpuSpec:
    """A built-in GPU by name (see ``list_gpus()``) or a YAML file of ``GpuSpec`` fields.

    ``cpu`` is the CPU engine's device: its memory is this machine's RAM, read at load time.
    """
    spec: GpuSpec = _load_yaml_model(_resolve(name_or_path, "gpu", list_gpus()), GpuSpec)  # type: ignore[assignment]
    if name_or_path == "cpu":
        ram_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        spec = spec.model_copy(update={"hbm_bytes": ram_bytes})
    return spec
