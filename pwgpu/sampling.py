"""Token sampling: greedy, temperature and nucleus (top-p), with an optional per-request seed.

Shape legend: B = requests sampled this step, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedweight.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # same seed, same prompt, same model -> same tokens
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens(={self.max_tokens}) must be >= 1")
        if self.temperature < 0:
            raise ConfigError(f"temperature(={self.temperature}) must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p(={self.top_p}) must be in (0, 1]")


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, V] fp32 -> one token id per request."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, p in enumerate(params):
        if p.temperature == 0:
            out.append(greedy[i])
            continue
        probs = torch.softmax(logits[i] / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        out.append(int(torch.multinomial(probs, 1, generator=generators[i])))
    return out
