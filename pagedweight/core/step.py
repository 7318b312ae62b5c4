"""The shape of one engine step: what the latency model needs to time it.

The scheduler produces it; ``pwsim``'s latency model times it from tables; ``pwgpu`` records
it beside the measured time so that the two can be compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class StepShape:
    # One entry per request that runs a prefill chunk this step.
    prefill_tokens: np.ndarray  # int64: new prompt tokens computed in this chunk
    prefill_kv_lens: np.ndarray  # int64: context length after the chunk (tokens attended to)
    # One entry per request that decodes one token this step.
    decode_kv_lens: np.ndarray  # int64: context length including the new token
    # Their sums, which every consumer of a step needs: given by a producer that already has
    # them (the scheduler), else summed here once (a numpy sum costs ~2 us, a step ~60).
    num_prefill_tokens: int = -1
    decode_kv_tokens: int = -1  # sum of decode_kv_lens: KV entries the decodes read

    def __post_init__(self) -> None:
        if self.num_prefill_tokens < 0:
            self.num_prefill_tokens = int(self.prefill_tokens.sum())
        if self.decode_kv_tokens < 0:
            self.decode_kv_tokens = int(self.decode_kv_lens.sum())

    @property
    def num_decodes(self) -> int:
        return len(self.decode_kv_lens)

    @property
    def num_tokens(self) -> int:
        """Tokens that go through the MoE layers this step."""
        return self.num_prefill_tokens + self.num_decodes

    @staticmethod
    def empty() -> StepShape:
        z = np.zeros(0, dtype=np.int64)
        return StepShape(z, z, z, 0)
