"""Policies by name: how each one sets and changes expert precision.

| name           | what it does                                                                 |
|----------------|------------------------------------------------------------------------------|
| static-fp16    | every expert at full precision (vLLM-like); preempts when KV is full          |
| static-int8    | every expert at INT8, fixed                                                   |
| static-int4    | every expert at INT4, fixed                                                   |
| static-mixed   | one offline ``marginal`` plan at a fixed budget, never changed (MC-MoE-like)  |
| kv-swap        | full precision; KV of preempted requests swapped to host over PCIe (runtime)  |
| paper-greedy   | the paper's dynamic scheme: re-plan with ``paper-greedy`` on every KV change  |
| pagedweight    | per-precision losses, marginal knapsack, KV forecast, hysteresis, copy budget |
"""

from __future__ import annotations

POLICY_NAMES: tuple[str, ...] = (
    "static-fp16",
    "static-int8",
    "static-int4",
    "static-mixed",
    "kv-swap",
    "paper-greedy",
    "pagedweight",
)
