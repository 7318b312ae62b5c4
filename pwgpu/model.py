"""One MoE transformer for the Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V2/V3 families.

The families differ only in data (``MoeArch``): biases on q/k/v (Qwen2-MoE; and o with
``attention_bias`` for Qwen3-MoE, OLMoE, DeepSeek), q/k RMSNorm over each head (Qwen3-MoE) or
over the whole projection (OLMoE), QKV clipping (OLMoE), multi-head latent attention with an
optional query LoRA (DeepSeek; ``pwgpu.mla``), the router (softmax or sigmoid scores, an
expert-choice bias, group-limited top-k, renormalisation, a scaling factor), shared experts with
or without a sigmoid gate, leading dense layers, the gated FFN's activation (SiLU or GELU), and
RoPE (plain or YaRN, rotate-half or interleaved pairs; ``pwgpu.rope``).

The forward pass takes a flat batch of new tokens from several requests (prefill chunks and
decodes mixed, as the scheduler builds them), writes their K/V (or MLA latents) into the paged KV
cache and reads the context back through block tables. Routed experts are computed by an
``ExpertRunner``: dense tensors (parity tests) or the paged, mixed-precision store of
``pwgpu.weights``.

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
from pwgpu.cpu_kernels import cpu_linear
from pwgpu.kernels.reference import ACTIVATIONS
from pwgpu.mla import LATENT_NORM_EPS, latent_attention
from pwgpu.rope import Rope, Yarn, yarn_mscale

__all__ = ["Rope", "rms_norm"]  # profile.py reuses them


@dataclass(frozen=True)
class MoeArch:
    """What differs between supported checkpoints, read from ``config.json`` by the loader."""

    family: str  # mixtral | qwen2_moe | qwen3_moe | olmoe | deepseek_v2 | deepseek_v3
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_ffn_size: int
    router_renorm: bool  # renormalise the top-k weights to sum to 1
    qkv_bias: bool = False  # gqa: q/k/v biases; mla: q_a and kv_a biases
    o_bias: bool = False
    qk_norm: str = "none"  # none | head (per head, Qwen3) | full (whole projection, OLMoE)
    clip_qkv: float | None = None
    num_shared_experts: int = 0
    shared_expert_ffn_size: int = 0  # per shared expert; they run as one FFN of the summed size
    shared_expert_gate: bool = False
    num_dense_layers: int = 0  # leading layers with a dense gated FFN
    dense_ffn_size: int = 0
    rope_theta: float = 10000.0
    rope_yarn: Yarn | None = None
    rope_interleave: bool = False  # rotate pairs (x[2i], x[2i + 1]) (DeepSeek)
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    hidden_act: str = "silu"  # of every gated FFN: silu, gelu (erf) or gelu_tanh (ACTIVATIONS)
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"  # the checkpoint's dtype
    # Multi-head latent attention (DeepSeek-V2/V3): head_dim is then qk_rope_head_dim.
    attention: str = "gqa"  # gqa | mla
    q_lora_rank: int = 0  # 0: queries projected directly
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # Routing beyond softmax-top-k (DeepSeek): scores, an expert-choice bias, groups, scaling.
    router_fp32: bool = False  # router logits from fp32 activations and weights (DeepSeek)
    router_scoring: str = "softmax"  # softmax | sigmoid
    router_bias: bool = False  # e_score_correction_bias: added to the scores to choose, not to weigh
    num_groups: int = 1  # top-k only within the best topk_groups of num_groups expert groups
    topk_groups: int = 1
    group_score: str = "max"  # a group's score: its best expert (V2) or its best two summed (V3)
    group_mask_value: float = 0.0  # what excluded experts score: 0 (V2, on softmax scores) or -inf (V3)
    routed_scaling_factor: float = 1.0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def rope_dim(self) -> int:
        return self.head_dim  # qk_rope_head_dim for MLA

    @property
    def softmax_scale(self) -> float:
        if self.attention == "mla":
            scale = (self.qk_nope_head_dim + self.head_dim) ** -0.5
            if self.rope_yarn is not None and self.rope_yarn.mscale_all_dim:
                scale *= yarn_mscale(self.rope_yarn.factor, self.rope_yarn.mscale_all_dim) ** 2
            return scale
        return self.head_dim**-0.5

    @property
    def kv_cache_geometry(self) -> tuple[int, int, int]:
        """(parts, heads, dims) cached per token and layer: (2, Hkv, D) for K and V, or MLA's
        one latent of kv_lora_rank + qk_rope_head_dim."""
        if self.attention == "mla":
            return 1, 1, self.kv_lora_rank + self.head_dim
        return 2, self.num_kv_heads, self.head_dim

    def model_spec(self, name: str, dtype_bytes: int) -> ModelSpec:
        """The shape the page pool, scheduler and controller reason about."""
        mla = self.attention == "mla"
        if self.router_scoring == "sigmoid":
            router_norm = "sigmoid_renorm"
        else:
            router_norm = "softmax_topk" if self.router_renorm else "softmax"
        return ModelSpec(
            name=name,
            source=f"config.json ({self.family})",
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_heads if mla else self.num_kv_heads,
            head_dim=self.v_head_dim if mla else self.head_dim,
            num_experts=self.num_experts,
            top_k=self.top_k,
            expert_ffn_size=self.expert_ffn_size,
            num_shared_experts=self.num_shared_experts,
            shared_expert_ffn_size=self.shared_expert_ffn_size,
            shared_expert_gate=self.shared_expert_gate,
            num_dense_layers=self.num_dense_layers,
            dense_ffn_size=self.dense_ffn_size,
            vocab_size=self.vocab_size,
            tie_embeddings=self.tie_embeddings,
            max_context_tokens=self.max_position_embeddings,
            attention="mla" if mla else "gqa",
            qk_norm=self.qk_norm == "head",
            kv_lora_rank=self.kv_lora_rank,
            q_lora_rank=self.q_lora_rank,
            qk_rope_head_dim=self.head_dim if mla else 0,
            qk_nope_head_dim=self.qk_nope_head_dim,
            v_head_dim=self.v_head_dim,
            router_norm=router_norm,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            dtype_bytes=dtype_bytes,
        )


@dataclass
class LayerWeights:
    """Pinned tensors of one decoder layer (always full precision). Attention is either GQA
    (q, k, v, o) or MLA (q or q_a/q_a_norm/q_b, kv_a, kv_a_norm, kv_b, o)."""

    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    o: torch.Tensor  # [H, Hq*Dv]
    q: torch.Tensor | None = None  # gqa [Hq*D, H]; mla without q LoRA [Hq*(Dn+Dr), H]
    k: torch.Tensor | None = None  # [Hkv*D, H]
    v: torch.Tensor | None = None  # [Hkv*D, H]
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [D] (head) or [Hq*D] (full)
    k_norm: torch.Tensor | None = None
    q_a: torch.Tensor | None = None  # mla: [q_lora_rank, H]
    q_a_bias: torch.Tensor | None = None
    q_a_norm: torch.Tensor | None = None  # [q_lora_rank]
    q_b: torch.Tensor | None = None  # [Hq*(Dn+Dr), q_lora_rank]
    kv_a: torch.Tensor | None = None  # [R+Dr, H]
    kv_a_bias: torch.Tensor | None = None
    kv_a_norm: torch.Tensor | None = None  # [R]
    kv_b: torch.Tensor | None = None  # [Hq*(Dn+Dv), R]
    router: torch.Tensor | None = None  # [E, H]; None for a dense layer
    router_bias: torch.Tensor | None = None  # [E] fp32 (e_score_correction_bias)
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


def swiglu(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, activation: str = "silu"
) -> torch.Tensor:
    """``down(act(gate x) * up x)``: SwiGLU, or GeGLU with a GELU ``activation``."""
    return F_.linear(ACTIVATIONS[activation](F_.linear(x, gate)) * F_.linear(x, up), down)


def route(
    arch: MoeArch, x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor | None = None, linear=F_.linear
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, k], topk_weights [T, k] fp32).

    Softmax routers (Mixtral, Qwen, OLMoE): softmax over all experts, top-k, optional
    renormalisation (for Mixtral this equals a softmax over the k selected logits).
    DeepSeek, in fp32 as transformers computes it: softmax (V2) or sigmoid (V3) scores; experts
    are chosen by the scores plus ``bias`` (V3's e_score_correction_bias), only inside the best
    ``topk_groups`` of ``num_groups`` groups (a group's score: its best expert, V2, or its two best
    summed, V3); the weights are the chosen experts' scores without the bias, renormalised if
    asked (V3), times ``routed_scaling_factor``."""
    if not arch.router_fp32:
        probs = torch.softmax(linear(x, router).float(), dim=-1)
        weights, ids = torch.topk(probs, arch.top_k, dim=-1)
        if arch.router_renorm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights
    logits = F_.linear(x.float(), router.float())
    scores = logits.sigmoid() if arch.router_scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if bias is None else scores + bias
    if arch.num_groups > 1:
        t, e = choice.shape
        grouped = choice.view(t, arch.num_groups, e // arch.num_groups)
        if arch.group_score == "top2_sum":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        kept = torch.topk(group_scores, arch.topk_groups, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~mask.repeat_interleave(e // arch.num_groups, dim=1), arch.group_mask_value)
    ids = torch.topk(choice, arch.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if arch.router_renorm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * arch.routed_scaling_factor


class MoeTransformer:
    def __init__(self, arch: MoeArch, pinned: PinnedWeights, experts: ExpertRunner, device: torch.device):
        self.arch, self.w, self.experts, self.device = arch, pinned, experts, device
        self.rope = Rope(arch.rope_dim, arch.rope_theta, device, arch.rope_yarn)
        self.rotate = Rope.rotate_interleaved if arch.rope_interleave else Rope.rotate
        self.dtype = pinned.embed.dtype
        self.linear = cpu_linear(device, self.dtype)  # the projections (see cpu_kernels.padded_rows)

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
        attention = self._mla if a.attention == "mla" else self._attention
        for i, lw in enumerate(self.w.layers):
            h = h + attention(i, lw, rms_norm(h, lw.input_norm, a.rms_norm_eps), angles, batch, kv)
            h = h + self._ffn(i, lw, rms_norm(h, lw.post_norm, a.rms_norm_eps), routing_counts)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> fp32 logits [N, V]."""
        return self.linear(rms_norm(hidden, self.w.final_norm, self.arch.rms_norm_eps), self.w.lm_head).float()

    def _attention(self, layer, lw: LayerWeights, x, angles, batch: AttentionBatch, kv: PagedKvCache):
        a = self.arch
        t = x.shape[0]
        linear = self.linear
        q, k, v = linear(x, lw.q, lw.q_bias), linear(x, lw.k, lw.k_bias), linear(x, lw.v, lw.v_bias)
        if a.qk_norm == "full":
            q, k = rms_norm(q, lw.q_norm, a.rms_norm_eps), rms_norm(k, lw.k_norm, a.rms_norm_eps)
        if a.clip_qkv is not None:
            q, k, v = (z.clamp(-a.clip_qkv, a.clip_qkv) for z in (q, k, v))
        q = q.view(t, a.num_heads, a.head_dim)
        k = k.view(t, a.num_kv_heads, a.head_dim)
        v = v.view(t, a.num_kv_heads, a.head_dim)
        if a.qk_norm == "head":
            q, k = rms_norm(q, lw.q_norm, a.rms_norm_eps), rms_norm(k, lw.k_norm, a.rms_norm_eps)
        q, k = self.rotate(q, *angles), self.rotate(k, *angles)
        kv.write(layer, batch.slot_blocks, batch.slot_offsets, k, v)
        out = paged_attention(q, kv, layer, batch, a.softmax_scale)  # [T, Hq, D]
        return linear(out.reshape(t, -1), lw.o, lw.o_bias)

    def _mla(self, layer, lw: LayerWeights, x, angles, batch: AttentionBatch, kv: PagedKvCache):
        """Multi-head latent attention: cache the latent, attend in the absorbed form (``pwgpu.mla``)."""
        a = self.arch
        t, heads, rank = x.shape[0], a.num_heads, a.kv_lora_rank
        dn, dr, dv = a.qk_nope_head_dim, a.head_dim, a.v_head_dim
        if lw.q_a is not None:
            q = F_.linear(rms_norm(F_.linear(x, lw.q_a, lw.q_a_bias), lw.q_a_norm, LATENT_NORM_EPS), lw.q_b)
        else:
            q = F_.linear(x, lw.q)
        q_nope, q_pe = q.view(t, heads, dn + dr).split([dn, dr], dim=-1)
        c, k_pe = F_.linear(x, lw.kv_a, lw.kv_a_bias).split([rank, dr], dim=-1)
        q_pe, k_pe = self.rotate(q_pe, *angles), self.rotate(k_pe[:, None, :], *angles)
        latent = torch.cat([rms_norm(c, lw.kv_a_norm, LATENT_NORM_EPS), k_pe[:, 0]], dim=-1)  # [T, R + Dr]
        kv.write(layer, batch.slot_blocks, batch.slot_offsets, latent[:, None, :])
        w_kv_b = lw.kv_b.view(heads, dn + dv, rank)
        q_latent = torch.einsum("thd,hdr->thr", q_nope, w_kv_b[:, :dn])  # W_uk absorbed into the query
        out = latent_attention(torch.cat([q_latent, q_pe], dim=-1), kv, layer, batch, a.softmax_scale, rank)
        out = torch.einsum("thr,hvr->thv", out, w_kv_b[:, dn:])  # W_uv after the softmax: [T, Hq, Dv]
        return F_.linear(out.reshape(t, heads * dv), lw.o, lw.o_bias)

    def _ffn(self, layer: int, lw: LayerWeights, x: torch.Tensor, routing_counts: torch.Tensor | None = None):
        if lw.router is None:
            return swiglu(x, *lw.dense, self.arch.hidden_act)
        ids, weights = route(self.arch, x, lw.router, lw.router_bias, self.linear)
        moe_layer = layer - self.arch.num_dense_layers
        if routing_counts is not None:
            # One scatter-add on the device per layer; read by the host once per step. (On CUDA
            # torch.bincount reads the largest id back to size its output: a sync per layer.)
            ids_flat = ids.reshape(-1)
            routing_counts[moe_layer].index_add_(0, ids_flat, torch.ones_like(ids_flat))
        y = self.experts.moe_ffn(moe_layer, x, ids, weights.to(x.dtype))
        if lw.shared is not None:
            shared = swiglu(x, *lw.shared, self.arch.hidden_act)
            if lw.shared_gate is not None:
                shared = torch.sigmoid(F_.linear(x, lw.shared_gate)) * shared
            y = y + shared
        return y


class DenseExperts:
    """Routed experts as plain tensors in the model's dtype: the oracle for parity tests and the
    path of a model served without a page pool."""

    def __init__(self, w1: list[torch.Tensor], w3: list[torch.Tensor], w2: list[torch.Tensor], activation="silu"):
        self.w1, self.w3, self.w2 = w1, w3, w2  # per MoE layer: [E, F, H], [E, F, H], [E, H, F]
        self.activation = activation

    def moe_ffn(self, moe_layer, x, topk_ids, topk_w):
        from pwgpu.kernels.reference import moe_ffn_dense_ref

        w1, w3, w2 = (list(w[moe_layer]) for w in (self.w1, self.w3, self.w2))
        return moe_ffn_dense_ref(x, topk_ids, topk_w, w1, w3, w2, self.activation)
