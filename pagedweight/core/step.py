"""The shape of one engine step: what the latency model needs to time it.

The scheduler produces it; ``pwsim``'s latency model times it from tables; ``pwgpu`` records
it beside the measured time so that the two can be compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
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

    def __post_init__(self) -> None:
        if self.num_prefill_tokens < 0:
            self.num_prefill_tokens = int(sum(self.prefill_tokens))
        if self.decode_kv_tokens < 0:
            self.decode_kv_tokens = int(sum(self.decode_kv_lens))

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
