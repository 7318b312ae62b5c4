"""Token sampling: greedy, temperature, top-k, top-p (nucleus) and min-p, with an optional
per-request seed; presence, frequency and repetition penalties; a minimum output length; and
the log-probabilities of the sampled token and of the most likely ones.

The rules are those of vLLM's sampler, so that a client gets the same distribution from either:
- ``min_tokens``: until that many tokens are out, the stop tokens (EOS unless ``ignore_eos``,
  and ``stop_token_ids``) cannot be drawn.
- ``repetition_penalty`` r: every token seen in the prompt or the output so far has its logit
  divided by r when positive, multiplied by r when negative.
- ``frequency_penalty`` f and ``presence_penalty`` p: a token drawn c times in the output so
  far (the prompt does not count) loses ``f * c + p * (c > 0)`` from its logit.
- Then temperature, min-p (tokens below ``min_p`` times the top probability go), top-k and
  top-p, and a draw.
- Log-probabilities are those of the model: ``log_softmax`` of its raw logits, before
  penalties and temperature.

Shape legend: B = requests sampled this step, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedweight.errors import ConfigError

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: all tokens
    min_p: float = 0.0
    seed: int | None = None  # same seed, same prompt, same model -> same tokens
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: none; k: the sampled token's and the k most likely

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens(={self.max_tokens}) must be >= 1")
        if self.temperature < 0:
            raise ConfigError(f"temperature(={self.temperature}) must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p(={self.top_p}) must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"top_k(={self.top_k}) must be >= 0 (0: all tokens)")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p(={self.min_p}) must be in [0, 1]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(f"min_tokens(={self.min_tokens}) must be in [0, max_tokens(={self.max_tokens})]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ConfigError(f"{name}(={getattr(self, name)}) must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 2:
            raise ConfigError(f"repetition_penalty(={self.repetition_penalty}) must be in (0, 2]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ConfigError(f"logprobs(={self.logprobs}) must be in [0, {MAX_LOGPROBS}]")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability and the ``k`` most likely tokens' (best first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class RequestSampler:
    """What sampling one request needs beyond its parameters: its random stream, how many tokens
    it has drawn, and (only when a penalty asks for them) the prompt's tokens and the output's
    token counts, kept up to date token by token instead of recounted every step."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int, device: torch.device,
                 eos_token_ids: tuple[int, ...] = ()):  # fmt: skip
        self.params = params
        self.generator = None if params.seed is None else torch.Generator(device=device).manual_seed(params.seed)
        self.num_output = 0
        self.output_counts: torch.Tensor | None = None  # [V] fp32
        self.seen: torch.Tensor | None = None  # [V] bool: in the prompt or the output
        if params.has_penalties:
            self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            ids = [t for t in prompt_ids if 0 <= t < vocab_size]  # the engine rejects the others
            if ids:
                self.seen[torch.tensor(ids, dtype=torch.long, device=device)] = True
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.banned_until_min = sorted(t for t in stops if 0 <= t < vocab_size)

    def observe(self, token_id: int) -> None:
        self.num_output += 1
        if self.output_counts is not None:
            self.output_counts[token_id] += 1
            self.seen[token_id] = True

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """The row's logits [V] after min_tokens and the penalties (a new tensor when changed)."""
        p = self.params
        if self.banned_until_min and self.num_output < p.min_tokens:
            logits = logits.clone()
            logits[self.banned_until_min] = float("-inf")
        if self.output_counts is not None:
            r = p.repetition_penalty
            if r != 1:
                scaled = torch.where(logits > 0, logits / r, logits * r)
                logits = torch.where(self.seen, scaled, logits)
            logits = logits - p.frequency_penalty * self.output_counts
            logits = logits - p.presence_penalty * (self.output_counts > 0).float()
        return logits

    @property
    def changes_logits(self) -> bool:
        banning = bool(self.banned_until_min) and self.num_output < self.params.min_tokens
        return banning or self.output_counts is not None


def _draw(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    probs = torch.softmax(logits / p.temperature, dim=-1)
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
    if p.top_k > 0 or p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        if p.top_k > 0:
            sorted_p[p.top_k :] = 0
        if p.top_p < 1.0:
            # The smallest prefix whose mass (among what top-k left) reaches top_p; the first
            # token always stays.
            sorted_p = sorted_p / sorted_p.sum()
            sorted_p = torch.where(torch.cumsum(sorted_p, 0) - sorted_p < p.top_p, sorted_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, samplers: list[RequestSampler]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits [B, V] -> one token id per request, and its log-probabilities where asked for.
    Call each sampler's ``observe`` with its token afterwards."""
    logits = logits.float()
    adjusted = logits
    changed = [i for i, s in enumerate(samplers) if s.changes_logits]
    if changed:  # the common case (no penalty, no min_tokens) skips this and every row view
        adjusted = logits.clone()
        for i in changed:
            adjusted[i] = samplers[i].adjust(logits[i])
    greedy = adjusted.argmax(dim=-1).tolist()
    tokens = [
        greedy[i] if s.params.temperature == 0 else _draw(adjusted[i], s.params, s.generator)
        for i, s in enumerate(samplers)
    ]
    out: list[TokenLogprobs | None] = [None] * len(samplers)
    want = [i for i, s in enumerate(samplers) if s.params.logprobs is not None]
    if want:
        lsm = torch.log_softmax(logits[want], dim=-1)
        k = max(samplers[i].params.logprobs for i in want)
        top_v, top_i = lsm.topk(k, dim=-1) if k else (lsm[:, :0], lsm[:, :0].long())
        chosen = lsm[torch.arange(len(want)), torch.tensor([tokens[i] for i in want])].tolist()
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, i in enumerate(want):
            n = samplers[i].params.logprobs
            out[i] = TokenLogprobs(tokens[i], chosen[j], tuple(zip(top_i[j][:n], top_v[j][:n], strict=True)))
    return tokens, out
