"""Trace loading speed: each real trace through its loader (parsing, validation, the
RequestTrace), side by side with a bare ``pandas.read_csv`` / ``read_json`` of the same file.

    python benchmarks/trace_load.py [--shared ../shared/traces]

Prints the best of five wall times and the loader's cost as a multiple of the bare read.
Target: the Azure conversation trace (19,366 rows) loads in under 0.5 s.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import pandas as pd

from pagedweight.workload.traces import load_azure, load_lengths, load_mooncake

ROOT = Path(__file__).resolve().parent.parent
TRACES = [
    ("azure_conv_2023.csv", load_azure, pd.read_csv),
    ("mooncake_synthetic.jsonl", load_mooncake, lambda p: pd.read_json(p, lines=True)),
    ("sharegpt_lengths_llama2tok.csv", load_lengths, pd.read_csv),
]


def best_s(fn, path: Path, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(path)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shared", type=Path, default=ROOT.parent / "shared" / "traces")
    args = p.parse_args()
    print(f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'trace':32s} {'loader s':>9s} {'bare read s':>12s} {'ratio':>6s}")
    for name, loader, bare in TRACES:
        path = args.shared / name
        if not path.is_file():
            print(f"{name:32s} missing under {args.shared}")
            continue
        ours, base = best_s(loader, path), best_s(bare, path)
        print(f"{name:32s} {ours:9.3f} {base:12.3f} {ours / base:6.2f}")


if __name__ == "__main__":
    main()
