"""Multi-head latent attention (DeepSeek-V2/V3) over the paged KV cache.

The cache holds, per token and layer, what MLA compresses K and V into: the normalised latent
``c = RMSNorm(W_kv_a x)[:R]`` and the shared rotated key ``k_pe`` (``R + Dr`` values, the
``kv_bytes_per_token`` the scheduler and ``ModelSpec`` count). Attention runs in the absorbed
form, as MLA serving engines do: ``W_kv_b`` splits per head into ``W_uk [Dn, R]`` and
``W_uv [Dv, R]``, so ``q_nope . (W_uk c) = (W_uk^T q_nope) . c`` and the value path applies
``W_uv`` after the softmax. Every head then attends to the same cached vector, multi-query
attention with keys ``[c, k_pe]`` (``R + Dr``) and values ``c`` (``R``); nothing is expanded per
head per token. transformers expands instead; the two agree to fp32 rounding (the parity tests).

Decodes of a step go through one batched call; each prefill chunk uses SDPA with its causal
mask offset by the tokens already cached, as in ``pwgpu.attention``.

Shape legend: T = new tokens, B = requests, H = heads, R = kv_lora_rank, Dr = qk_rope_head_dim,
Dn = qk_nope_head_dim, Dv = v_head_dim, C = context tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F_

from pwgpu.attention import AttentionBatch, PagedKvCache

# transformers and DeepSeek build q_a_layernorm and kv_a_layernorm with their default eps,
# whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


def latent_decode(
    q: torch.Tensor, kv: PagedKvCache, layer: int, block_tables: torch.Tensor, context_lens: torch.Tensor,
    scale: float, rank: int,
) -> torch.Tensor:  # fmt: skip
    """One query per request: q [B, H, R + Dr] -> [B, H, R], attending to ``context_lens`` tokens."""
    latent = kv.gather_part(layer, block_tables, 0)[:, :, 0].float()  # [B, C, R + Dr]
    scores = torch.einsum("bhd,bcd->bhc", q.float(), latent) * scale
    valid = torch.arange(latent.shape[1], device=q.device)[None, :] < context_lens[:, None]  # [B, C]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    out = torch.einsum("bhc,bcr->bhr", torch.softmax(scores, dim=-1), latent[..., :rank])
    return out.to(q.dtype)


def latent_attention(
    q: torch.Tensor, kv: PagedKvCache, layer: int, batch: AttentionBatch, scale: float, rank: int
) -> torch.Tensor:
    """q [T, H, R + Dr] of the new tokens (their latents already written) -> [T, H, R]."""
    if batch.all_decode:
        return latent_decode(q, kv, layer, batch.block_tables, batch.context_lens, scale, rank)
    t, h, _ = q.shape
    out = q.new_empty(t, h, rank)
    starts = batch.query_starts
    if batch.decode_seqs:
        sel, rows = batch.decode_idx, batch.decode_rows
        out[rows] = latent_decode(q[rows], kv, layer, batch.block_tables[sel], batch.context_lens[sel], scale, rank)
    for i in range(len(starts) - 1):
        s, e, ctx = starts[i], starts[i + 1], batch.context_lens_host[i]
        if e - s == 1:
            continue  # done in the batched decode call above
        n_blocks = -(-ctx // kv.block_tokens)
        latent = kv.gather_part(layer, batch.block_tables[i : i + 1, :n_blocks], 0)[0, :ctx, 0].to(q.dtype)
        n = e - s
        # Query j sits at position ctx - n + j and sees keys [0, ctx - n + j].
        mask = torch.arange(ctx, device=q.device)[None, :] <= (ctx - n + torch.arange(n, device=q.device))[:, None]
        keys = latent.expand(h, ctx, latent.shape[-1])  # one cached vector for every head: a view
        o = F_.scaled_dot_product_attention(q[s:e].transpose(0, 1), keys, keys[..., :rank], mask, scale=scale)
        out[s:e] = o.transpose(0, 1)
    return out
