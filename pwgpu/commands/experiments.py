"""Regenerate the quality experiments of reports/quality/: quality at equal memory, the headline,
estimator rank correlation, and routing drift (see reports/quality/README.md for run times)."""

from __future__ import annotations

from pwgpu.experiments import add_arguments, run

__all__ = ["add_arguments", "run"]
