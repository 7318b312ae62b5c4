"""Replay a request trace against a running server at the trace's times and measure TTFT/ITL.

Sends each request as a streaming completion (random token ids of the trace's prompt length,
max_tokens = its output length, ignore_eos), measures from the stream as vLLM's
benchmark_serving does, and writes a results directory with report.html.
"""

from __future__ import annotations

import argparse
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="trace file (azure, mooncake, burstgpt or generic CSV/JSONL)")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply the arrival rate (default: 1)")
    p.add_argument("--out", default="reports/replay", help="results directory (default: reports/replay)")
    p.add_argument("--api-key", default=os.environ.get("PWGPU_API_KEY"))
    p.add_argument("--vocab-size", type=int, default=256, help="prompt token ids are drawn from [0, N)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout")
    p.add_argument("--no-report", action="store_true")


def run(args: argparse.Namespace) -> int:
    from pwgpu.replay import replay

    meta = replay(args.trace, args.url, args.out, args.rate_scale, args.api_key, args.vocab_size, args.seed,
                  args.timeout_s, report=not args.no_report)  # fmt: skip
    s = next(iter(meta["policies"].values()))
    print(f"pwgpu replay: {s['completed']}/{meta['trace']['num_requests']} completed, "
          f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} tok/s, "
          f"mean TTFT {s['mean_ttft_ms']:.1f} ms, mean ITL {s['mean_itl_ms']:.1f} ms; "
          f"results in {args.out}")  # fmt: skip
    return 0 if s["completed"] == meta["trace"]["num_requests"] else 1
