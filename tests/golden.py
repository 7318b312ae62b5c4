"""The simulator's golden run: a fixed scenario under KV pressure, every policy that acts on it,
and the figures of its summary that must not change unnoticed.

tests/test_sim_engine.py compares a fresh run with the committed file and never writes it. After
a change that is meant to move the figures, write the file again with

    PYTHONPATH=. python3 tests/golden.py

then read its diff, and commit it with the change that explains it.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
GOLDEN = FIXTURES / "golden" / "good_summary.json"
# The tiny model in a budget that forces KV pressure: every policy has something to do.
PRESSURE = (
    "memory.budget=40 MiB",
    "memory.page_bytes=16 KiB",
    "memory.kv_block_tokens=8",
    "workload.num_requests=150",
    "workload.arrival.rate_qps=400",
    "workload.lengths.prompt_tokens=600",
)
OVERRIDES = (
    *PRESSURE,
    "workload.lengths.output_tokens=60",
    "policies=[static-fp16, static-int4, paper-greedy, pagedweight]",
)
GOLDEN_KEYS = (
    "completed",
    "total_output_tokens",
    "num_preemptions",
    "num_steps",
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "mean_quality_proxy",
    "num_downgrades",
    "num_upgrades",
)


def golden_scenario():
    from pagedweight.config.scenario import load_scenario

    return load_scenario(FIXTURES / "scenarios" / "good.yaml", list(OVERRIDES))


def golden_view(summary: dict) -> dict:
    """The compared figures of each policy, floats rounded to 6 decimals."""
    return {p: {k: round(v[k], 6) if isinstance(v[k], float) else v[k] for k in GOLDEN_KEYS}
            for p, v in summary["policies"].items()}  # fmt: skip


def read_golden() -> dict:
    """The committed figures; a missing file is one clear error saying how to write it."""
    if not GOLDEN.is_file():
        raise FileNotFoundError(
            f"{GOLDEN} is missing: write it with `PYTHONPATH=. python3 tests/golden.py`, review it, commit it"
        )
    return json.loads(GOLDEN.read_text())


def main() -> int:
    from pwsim.run import run_scenario

    with tempfile.TemporaryDirectory() as tmp:
        view = golden_view(run_scenario(golden_scenario(), Path(tmp), report=False))
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(view, indent=2, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}: review `git diff {GOLDEN}` before committing it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
