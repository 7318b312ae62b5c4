"""The shape of one engine step: what the latency model needs to time it.

The scheduler produces it; ``pwsim``'s latency model times it from tables; ``pwgpu`` records
it beside the measured time so that the two can be compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True, init=False)
class StepShape:
    """Sequences of ints (the scheduler's lists as they are: a step's latency model reads them
    in a Python loop, so making arrays of them, ~1 us each, would be spent for nothing; numpy
    arrays are accepted too)."""

    # One entry per request that runs a prefill chunk this step.
    prefill_tokens: Sequence[int]  # new prompt tokens computed in this chunk
    prefill_kv_lens: Sequence[int]  # context length after the chunk (tokens attended to)
    # One entry per request that decodes one token this step.
    decode_kv_lens: Sequence[int]  # context length including the new token
    # Their sums, which every consumer of a step needs: given by a producer that already has
    # them (the scheduler), else summed here once.
    num_prefill_tokens: int = -1
    decode_kv_tokens: int = -1  # sum of decode_kv_lens: KV entries the decodes read

    def __init__(
        self,
        prefill_tokens: Sequence[int],
        prefill_kv_lens: Sequence[int],
        decode_kv_lens: Sequence[int],
        num_prefill_tokens: int = -1,
        decode_kv_tokens: int = -1,
    ) -> None:
        # Written out (one call a step, not a generated __init__ and a __post_init__).
        self.prefill_tokens, self.prefill_kv_lens, self.decode_kv_lens = prefill_tokens, prefill_kv_lens, decode_kv_lens
        self.num_prefill_tokens = int(sum(prefill_tokens)) if num_prefill_tokens < 0 else num_prefill_tokens
        self.decode_kv_tokens = int(sum(decode_kv_lens)) if decode_kv_tokens < 0 else decode_kv_tokens

    @property
    def num_decodes(self) -> int:
        return len(self.decode_kv_lens)

    @property
    def num_tokens(self) -> int:
        """Tokens that go through the MoE layers this step."""
        return self.num_prefill_tokens + self.num_decodes

    @staticmethod
    def empty() -> StepShape:
        return StepShape([], [], [], 0, 0)
