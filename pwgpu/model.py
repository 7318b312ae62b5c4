"""One MoE transformer for the Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE families.

The families differ only in data (``MoeArch``): biases on q/k/v (Qwen2-MoE), q/k RMSNorm over
each head (Qwen3-MoE) or over the whole projection (OLMoE), QKV clipping (OLMoE), whether the
top-k routing weights are renormalised (Mixtral always; the others by ``norm_topk_prob``), a
shared expert with a sigmoid gate (Qwen2-MoE) and leading dense layers.

The forward pass takes a flat batch of new tokens from several requests (prefill chunks and
decodes mixed, as the scheduler builds them), writes their K/V into the paged KV cache and reads
the context back through block tables. Routed experts are computed by an ``ExpertRunner``: dense
tensors (parity tests) or the paged, mixed-precision store of ``pwgpu.weights``.

Shape legend: T = new tokens in the step, B = requests, H = hidden size, Hq / Hkv = query /
key-value heads, D = head dim, E = experts, k = top-k, V = vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F_

from pagedweight.core.spec import ModelSpec
from pwgpu.attention import AttentionBatch, PagedKvCache, paged_attention


@dataclass(frozen=True)
class MoeArch:
    """What differs between supported checkpoints, read from ``config.json`` by the loader."""

    family: str  # mixtral | qwen2_moe | qwen3_moe | olmoe
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_ffn_size: int
    router_renorm: bool  # renormalise the top-k softmax weights to sum to 1
    qkv_bias: bool = False
    qk_norm: str = "none"  # none | head (per head, Qwen3) | full (whole projection, OLMoE)
    clip_qkv: float | None = None
    shared_expert_ffn_size: int = 0
    shared_expert_gate: bool = False
    num_dense_layers: int = 0  # leading layers with a dense SwiGLU FFN
    dense_ffn_size: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"  # the checkpoint's dtype

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    def model_spec(self, name: str, dtype_bytes: int) -> ModelSpec:
        """The shape the page pool, scheduler and controller reason about."""
        return ModelSpec(
            name=name,
            source=f"config.json ({self.family})",
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            num_experts=self.num_experts,
            top_k=self.top_k,
            expert_ffn_size=self.expert_ffn_size,
            num_shared_experts=1 if self.shared_expert_ffn_size else 0,
            shared_expert_ffn_size=self.shared_expert_ffn_size,
            shared_expert_gate=self.shared_expert_gate,
            num_dense_layers=self.num_dense_layers,
            dense_ffn_size=self.dense_ffn_size,
            vocab_size=self.vocab_size,
            tie_embeddings=self.tie_embeddings,
            max_context_tokens=self.max_position_embeddings,
            qk_norm=self.qk_norm == "head",
            router_norm="softmax_topk" if self.router_renorm else "softmax",
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            dtype_bytes=dtype_bytes,
        )


@dataclass
class LayerWeights:
    """Pinned tensors of one decoder layer (always full precision)."""

    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    q: torch.Tensor  # [Hq*D, H]
    k: torch.Tensor  # [Hkv*D, H]
    v: torch.Tensor  # [Hkv*D, H]
    o: torch.Tensor  # [H, Hq*D]
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [D] (head) or [Hq*D] (full)
    k_norm: torch.Tensor | None = None
    router: torch.Tensor | None = None  # [E, H]; None for a dense layer
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # gate [F,H], up [F,H], down [H,F]
    shared_gate: torch.Tensor | None = None  # [1, H]
    dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # gate, up, down


@dataclass
class PinnedWeights:
    embed: torch.Tensor  # [V, H]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (the embedding when tied)
    layers: list[LayerWeights] = field(default_factory=list)

    def tensors(self) -> list[torch.Tensor]:
        """Every distinct tensor, largest first (the order they are packed into the arena)."""
        out = [self.embed, self.final_norm]
        if self.lm_head is not self.embed:
            out.append(self.lm_head)
        for lw in self.layers:
            for v in vars(lw).values():
                if isinstance(v, torch.Tensor):
                    out.append(v)
                elif isinstance(v, tuple):
                    out.extend(v)
        return sorted(out, key=lambda t: -t.numel() * t.element_size())


class ExpertRunner(Protocol):
    def moe_ffn(self, moe_layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """Routed-expert FFN of MoE layer ``moe_layer``: x [T, H] -> y [T, H]."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # In fp32 and rounded back before the weight, as the reference implementations do.
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F_.linear(F_.silu(F_.linear(x, gate)) * F_.linear(x, up), down)


def route(arch: MoeArch, x: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, k], topk_weights [T, k] fp32): softmax over all experts, top-k, optional
    renormalisation (for Mixtral this equals a softmax over the k selected logits)."""
    probs = torch.softmax(F_.linear(x, router).float(), dim=-1)
    weights, ids = torch.topk(probs, arch.top_k, dim=-1)
    if arch.router_renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


class Rope:
    """cos/sin tables in fp32 (rotate-half convention), grown on demand."""

    def __init__(self, head_dim: int, theta: float, device: torch.device):
        self.inv_freq = 1.0 / theta ** (
            torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        )
        self.cos = self.sin = torch.zeros(0, head_dim, device=device)

    def angles(
        self, positions: torch.Tensor, dtype: torch.dtype, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, 1, D] of each token's position, once per step for every layer.
        ``max_position``: the largest of ``positions`` when the caller knows it on the host
        (otherwise read from the device, a sync)."""
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else -1
        if max_position + 1 > self.cos.shape[0]:
            n = max(max_position + 1, 2 * self.cos.shape[0], 256)
            freqs = torch.outer(torch.arange(n, device=self.inv_freq.device).float(), self.inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)
            self.cos, self.sin = emb.cos(), emb.sin()
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by ``angles``."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by the angle of each token's position."""
        return self.rotate(x, *self.angles(positions, x.dtype))


class MoeTransformer:
    def __init__(self, arch: MoeArch, pinned: PinnedWeights, experts: ExpertRunner, device: torch.device):
        self.arch, self.w, self.experts, self.device = arch, pinned, experts, device
        self.rope = Rope(arch.head_dim, arch.rope_theta, device)
        self.dtype = pinned.embed.dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv: PagedKvCache,
        routing_counts: torch.Tensor | None = None,
    ):
        """input_ids, positions [T] -> final hidden states [T, H] (before the final norm).
        ``routing_counts`` [MoE layers, E] int64 on the device, if given, gains the tokens the
        router sent to each expert (what the controller's drift tracker observes)."""
        a = self.arch
        h = F_.embedding(input_ids, self.w.embed)
        # RoPE angles once per step for all layers; the largest position is known on the host.
        angles = self.rope.angles(positions, h.dtype, max(batch.context_lens_host, default=0) - 1)
        for i, lw in enumerate(self.w.layers):
            h = h + self._attention(i, lw, rms_norm(h, lw.input_norm, a.rms_norm_eps), angles, batch, kv)
            h = h + self._ffn(i, lw, rms_norm(h, lw.post_norm, a.rms_norm_eps), routing_counts)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> fp32 logits [N, V]."""
        return F_.linear(rms_norm(hidden, self.w.final_norm, self.arch.rms_norm_eps), self.w.lm_head).float()

    def _attention(self, layer, lw: LayerWeights, x, angles, batch: AttentionBatch, kv: PagedKvCache):
        a = self.arch
        t = x.shape[0]
        q, k, v = F_.linear(x, lw.q, lw.q_bias), F_.linear(x, lw.k, lw.k_bias), F_.linear(x, lw.v, lw.v_bias)
        if a.qk_norm == "full":
            q, k = rms_norm(q, lw.q_norm, a.rms_norm_eps), rms_norm(k, lw.k_norm, a.rms_norm_eps)
        if a.clip_qkv is not None:
            q, k, v = (z.clamp(-a.clip_qkv, a.clip_qkv) for z in (q, k, v))
        q = q.view(t, a.num_heads, a.head_dim)
        k = k.view(t, a.num_kv_heads, a.head_dim)
        v = v.view(t, a.num_kv_heads, a.head_dim)
        if a.qk_norm == "head":
            q, k = rms_norm(q, lw.q_norm, a.rms_norm_eps), rms_norm(k, lw.k_norm, a.rms_norm_eps)
        q, k = Rope.rotate(q, *angles), Rope.rotate(k, *angles)
        kv.write(layer, batch.slot_blocks, batch.slot_offsets, k, v)
        out = paged_attention(q, kv, layer, batch, a.head_dim**-0.5)  # [T, Hq, D]
        return F_.linear(out.reshape(t, -1), lw.o)

    def _ffn(self, layer: int, lw: LayerWeights, x: torch.Tensor, routing_counts: torch.Tensor | None = None):
        if lw.router is None:
            return swiglu(x, *lw.dense)
        ids, weights = route(self.arch, x, lw.router)
        moe_layer = layer - self.arch.num_dense_layers
        if routing_counts is not None:
            # One scatter-add on the device per layer; read by the host once per step. (On CUDA
            # torch.bincount reads the largest id back to size its output: a sync per layer.)
            ids_flat = ids.reshape(-1)
            routing_counts[moe_layer].index_add_(0, ids_flat, torch.ones_like(ids_flat))
        y = self.experts.moe_ffn(moe_layer, x, ids, weights.to(x.dtype))
        if lw.shared is not None:
            shared = swiglu(x, *lw.shared)
            if lw.shared_gate is not None:
                shared = torch.sigmoid(F_.linear(x, lw.shared_gate)) * shared
            y = y + shared
        return y


class DenseExperts:
    """Routed experts as plain tensors in the model's dtype: the oracle for parity tests and the
    path of a model served without a page pool."""

    def __init__(self, w1: list[torch.Tensor], w3: list[torch.Tensor], w2: list[torch.Tensor]):
        self.w1, self.w3, self.w2 = w1, w3, w2  # per MoE layer: [E, F, H], [E, F, H], [E, H, F]

    def moe_ffn(self, moe_layer, x, topk_ids, topk_w):
        from pwgpu.kernels.reference import moe_ffn_dense_ref

        return moe_ffn_dense_ref(
            x, topk_ids, topk_w, list(self.w1[moe_layer]), list(self.w3[moe_layer]), list(self.w2[moe_layer])
        )
