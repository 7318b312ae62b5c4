"""reports/claims.md: the paper's four headline numbers restated, each with our figure, its
interval, where it was measured and whether it holds. Rendered from committed outputs (seconds);
--run regenerates every input first (simulator scoreboard, equal-memory, served-quality)."""

from __future__ import annotations

from pwgpu.claims import add_arguments, run

__all__ = ["add_arguments", "run"]
