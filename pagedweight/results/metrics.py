"""Result records and the run summary, with vLLM ``benchmark_serving`` field names.

Both runtimes write the same three tables, so one report reads either:
- requests: one row per request (``request_rows``),
- steps: one row per engine step (``StepRecorder``),
- summary: one dict per policy (``summarize``).

Definitions (as vLLM's benchmark): TTFT = first token - arrival; E2EL = finish - arrival;
TPOT = (E2EL - TTFT) / (output_len - 1), only for requests with more than one output token;
ITL = gaps between consecutive tokens of a request, pooled over requests. Throughputs divide
by ``duration_s`` = last finish - first arrival. Goodput counts completed requests meeting
every SLO that is set.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from pagedweight.core.pool import (
    OWNER_FREE,
    OWNER_KV,
    OWNER_PINNED,
    OWNER_TRANSITION,
    PagePool,
    weight_owner,
)
from pagedweight.core.scheduler import FINISHED, REJECTED, Request
from pagedweight.core.spec import PRECISION_NAMES

_FIRST_WEIGHT_OWNER = weight_owner(0)  # weight owners are the last codes, one per precision id
PERCENTILES = (("median", 50.0), ("p90", 90.0), ("p99", 99.0))

REQUEST_COLUMNS = (
    "request_id",
    "state",
    "arrival_s",
    "prompt_tokens",
    "max_output_tokens",
    "output_tokens",
    "first_scheduled_s",
    "first_token_s",
    "finish_s",
    "ttft_ms",
    "tpot_ms",
    "e2el_ms",
    "num_preemptions",
    "preempted_at_s",
    "reject_reason",
)


@dataclass(frozen=True)
class Slo:
    """Service-level objectives for goodput; ``None`` means not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None


def _ms(a: float | None, b: float | None) -> float:
    return (a - b) * 1e3 if a is not None and b is not None else float("nan")


def request_rows(requests: list[Request]) -> list[dict]:
    rows = []
    for r in requests:
        ttft = _ms(r.first_token_s, r.arrival_s)
        e2el = _ms(r.finish_s, r.arrival_s) if r.state is FINISHED else float("nan")
        n = r.num_output_tokens
        tpot = (e2el - ttft) / (n - 1) if r.state is FINISHED and n > 1 else float("nan")
        rows.append(
            {
                "request_id": r.request_id,
                "state": r.state.value,
                "arrival_s": r.arrival_s,
                "prompt_tokens": r.prompt_tokens,
                "max_output_tokens": r.max_output_tokens,
                "output_tokens": n,
                "first_scheduled_s": r.first_scheduled_s,
                "first_token_s": r.first_token_s,
                "finish_s": r.finish_s,
                "ttft_ms": ttft,
                "tpot_ms": tpot,
                "e2el_ms": e2el,
                "num_preemptions": r.num_preemptions,
                "preempted_at_s": ";".join(f"{t:.6f}" for t in r.preempted_at_s),
                "reject_reason": r.reject_reason or "",
            }
        )
    return rows


def _stats(name: str, values: np.ndarray, out: dict) -> None:
    values = values[~np.isnan(values)]
    if len(values) == 0:
        out[f"mean_{name}_ms"] = out[f"std_{name}_ms"] = float("nan")
        for label, _ in PERCENTILES:
            out[f"{label}_{name}_ms"] = float("nan")
        return
    out[f"mean_{name}_ms"] = float(values.mean())
    out[f"std_{name}_ms"] = float(values.std())
    for label, q in PERCENTILES:
        out[f"{label}_{name}_ms"] = float(np.percentile(values, q))


def summarize(requests: list[Request], slo: Slo = Slo(), steps: dict[str, np.ndarray] | None = None) -> dict:
    """The run's summary. ``steps`` (``StepRecorder.columns()``) adds KV usage figures."""
    done = [r for r in requests if r.state is FINISHED]
    rows = request_rows(done)
    ttft = np.array([r["ttft_ms"] for r in rows], dtype=float)
    tpot = np.array([r["tpot_ms"] for r in rows], dtype=float)
    e2el = np.array([r["e2el_ms"] for r in rows], dtype=float)
    itl = np.concatenate([np.diff(np.asarray(r.token_times_s)) * 1e3 for r in done]) if done else np.zeros(0)
    start_s = min((r.arrival_s for r in requests), default=0.0)
    end_s = max((r.finish_s for r in done), default=start_s)
    duration_s = max(end_s - start_s, 1e-9)
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    good = np.ones(len(done), dtype=bool)
    for limit, values in ((slo.ttft_ms, ttft), (slo.tpot_ms, tpot), (slo.e2el_ms, e2el)):
        if limit is not None:
            good &= np.nan_to_num(values, nan=0.0) <= limit
    out = {
        "num_requests": len(requests),
        "completed": len(done),
        "rejected": sum(r.state is REJECTED for r in requests),
        "unfinished": len(requests) - len(done) - sum(r.state is REJECTED for r in requests),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "request_goodput": int(good.sum()) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "num_preemptions": sum(r.num_preemptions for r in requests),
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        _stats(name, values, out)
    if steps is not None and len(steps["kv_usage"]):
        out["mean_kv_cache_usage_perc"] = float(steps["kv_usage"].mean() * 100)
        out["max_kv_cache_usage_perc"] = float(steps["kv_usage"].max() * 100)
    return out


class StepRecorder:
    """One row per engine step, stored column-wise (a list per column) because it is appended
    to on the hot path of a run: ~150,000 rows for an hour of simulated traffic."""

    BASE_COLUMNS = (
        "step",
        "start_s",
        "duration_s",
        "num_running",
        "num_waiting",
        "num_prefill_tokens",
        "num_decodes",
        "num_preempted",
        "kv_blocks_used",
        "kv_usage",
        "kv_pages",
        "pinned_pages",
        "transition_pages",
        "free_pages",
        "num_downgrades",
        "num_upgrades",
        "bytes_downgraded",
        "bytes_upgraded",
        "bytes_swapped",
        "quality_proxy",
    )
    WEIGHT_COLUMNS = tuple(f"weight_pages_{p}" for p in PRECISION_NAMES)
    COLUMNS = BASE_COLUMNS + WEIGHT_COLUMNS

    def __init__(self, max_rows: int | None = None) -> None:
        """``max_rows``: keep only the newest rows (a long-running server); None keeps all."""
        self._rows: list[tuple] | deque[tuple] = deque(maxlen=max_rows) if max_rows else []
        self.num_recorded = 0  # every step, beyond the window too

    def record(
        self,
        *,
        start_s: float,
        duration_s: float,
        num_running: int,
        num_waiting: int,
        num_prefill_tokens: int,
        num_decodes: int,
        num_preempted: int,
        kv_blocks_used: int,
        kv_blocks_free: int,
        pool: PagePool,
        num_downgrades: int = 0,
        num_upgrades: int = 0,
        bytes_downgraded: int = 0,
        bytes_upgraded: int = 0,
        bytes_swapped: int = 0,
        quality_proxy: float = 0.0,
    ) -> None:
        # One list of the pool's counts per step (indexing the array per owner cost 2 us a step).
        counts = pool.owner_counts.tolist()
        capacity = kv_blocks_used + kv_blocks_free
        self.num_recorded += 1
        self._rows.append(
            (
                self.num_recorded - 1,
                start_s,
                duration_s,
                num_running,
                num_waiting,
                num_prefill_tokens,
                num_decodes,
                num_preempted,
                kv_blocks_used,
                kv_blocks_used / capacity if capacity else 0.0,
                counts[OWNER_KV],
                counts[OWNER_PINNED],
                counts[OWNER_TRANSITION],
                counts[OWNER_FREE],
                num_downgrades,
                num_upgrades,
                bytes_downgraded,
                bytes_upgraded,
                bytes_swapped,
                quality_proxy,
                *counts[_FIRST_WEIGHT_OWNER:],
            )
        )

    def __len__(self) -> int:
        return len(self._rows)

    def columns(self) -> dict[str, np.ndarray]:
        if not self._rows:
            return {c: np.zeros(0) for c in self.COLUMNS}
        cols = list(zip(*self._rows, strict=True))
        return {name: np.asarray(col) for name, col in zip(self.COLUMNS, cols, strict=True)}
