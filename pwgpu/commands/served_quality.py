"""Served quality end to end: a scenario on the engine with real-text prompts for every policy
at equal memory, re-scored against full precision per generated token, beside the simulator's
quality proxy for the same scenario (writes served_quality.{csv,json,md} and served_time.csv)."""

from __future__ import annotations

from pwgpu.served_quality import add_arguments, run

__all__ = ["add_arguments", "run"]
