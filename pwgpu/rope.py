"""Rotary position embeddings: plain RoPE and YaRN, in the two layouts checkpoints use.

Frequencies follow transformers' ``modeling_rope_utils`` exactly (``_compute_default_rope_parameters``
and ``_compute_yarn_parameters``), so the angles are the same bits. YaRN also returns the factor
transformers multiplies cos and sin by (``attention_factor``), and DeepSeek multiplies the softmax
scale by ``yarn_mscale(factor, mscale_all_dim) ** 2`` (see ``MoeArch.softmax_scale``).

Layouts: ``rotate`` is rotate-half (Llama, Mixtral, Qwen, OLMoE, DeepSeek-V3 with
``rope_interleave: false``); ``rotate_interleaved`` rotates pairs ``(x[2i], x[2i + 1])`` (DeepSeek-V2
and V3) and writes them de-interleaved, as transformers' DeepSeek-V3 does. Queries and keys get
the same permutation, so their dot products are those of the interleaved layout.

Shape legend: T = tokens, D = rotary dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Yarn:
    """``rope_scaling`` / ``rope_parameters`` of ``rope_type: yarn``."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(dim: int, theta: float, yarn: Yarn | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [D / 2] fp32, factor on cos and sin)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if yarn is None:
        return 1.0 / theta**exponents, 1.0
    factor = yarn.factor
    attention_factor = yarn.attention_factor
    if attention_factor is None:
        if yarn.mscale and yarn.mscale_all_dim:
            attention_factor = yarn_mscale(factor, yarn.mscale) / yarn_mscale(factor, yarn.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(yarn.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta**exponents
    extrapolation = 1 - ramp  # share of the unscaled frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class Rope:
    """cos/sin tables in fp32 (``cat(freqs, freqs)``, times YaRN's attention factor), grown on demand."""

    def __init__(self, dim: int, theta: float, device: torch.device, yarn: Yarn | None = None):
        inv_freq, self.attention_factor = rope_frequencies(dim, theta, yarn)
        self.inv_freq = inv_freq.to(device)
        self.cos = self.sin = torch.zeros(0, dim, device=device)

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
            self.cos, self.sin = emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by ``angles`` (rotate-half layout)."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @staticmethod
    def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] with rotary pairs ``(x[2i], x[2i + 1])`` -> rotated, pairs de-interleaved."""
        half = cos.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by the angle of each token's position (rotate-half)."""
        return self.rotate(x, *self.angles(positions, x.dtype))
