"""Quality at equal bytes actually used: the best uniform mix against every allocator, both
ladders, several calibration seeds, paired bootstrap intervals and a noise floor (writes
equal_memory.{csv,json,md} and the seed tables; cached on disk, so a stopped run resumes)."""

from __future__ import annotations

from pwgpu.equal_memory import add_arguments, run

__all__ = ["add_arguments", "run"]
