"""Memory of a long-running server against requests served: the engine in-process (no HTTP)
serving very many tiny requests (1-token prompt, 1 output token, a full batch per step), with
the server's per-request metrics bookkeeping, once with a history window and once keeping
everything, side by side.

    python benchmarks/server_memory.py [--requests 1000000] [--window 10000] [--every 100000]

Prints, at each checkpoint, requests served, the process's resident memory and the number of
request records, step rows and transitions held. What is measured is the bookkeeping a server
keeps per request (records, steps, transitions, metrics), not the HTTP layer: a million real
HTTP requests take hours on a 2-core machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from pagedweight.core.runtime import CoreConfig
from pagedweight.core.scheduler import SchedulerConfig
from pwgpu.default_model import write_random_mixtral
from pwgpu.engine import Engine, EngineConfig
from pwgpu.sampling import SamplingParams
from pwgpu.serve_metrics import RequestTiming, ServerMetrics


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run(model_dir: Path, requests: int, window: int | None, every: int, batch: int) -> list[tuple]:
    limits = SchedulerConfig(max_num_batched_tokens=batch, max_num_seqs=batch)
    core = CoreConfig(budget_bytes=24 << 20, scheduler=limits, history_window=window)
    engine = Engine(model_dir, EngineConfig(core, policy="static-fp16"))
    metrics = ServerMetrics("bench")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    done: list = []

    def on_event(er, new_ids, finished):
        if finished:
            done.append(er)

    rows, served, t0, next_report = [], 0, time.perf_counter(), every
    gc.collect()
    base = rss_mib()
    while served < requests:
        for i in range(min(batch, requests - served)):
            engine.add([1 + i % 200], params, on_event)
        engine.run()
        for er in done:  # what the server records per request
            r = er.req
            t = RequestTiming("length", r.arrival_s, r.finish_s, 1, 1, 1, r.first_scheduled_s, r.first_token_s,
                              r.first_token_s, r.finish_s)  # fmt: skip
            metrics.first_token(t)
            metrics.finish(t)
        served += len(done)
        done.clear()
        if served >= next_report or served == requests:
            next_report += every
            gc.collect()
            core = engine.core
            rows.append((served, rss_mib() - base, len(engine.records), len(core.steps), len(core.transitions),
                         time.perf_counter() - t0))  # fmt: skip
            print(f"  window {window or 'none':>6}: {served:>9,} requests  +{rows[-1][1]:7.1f} MiB RSS  "
                  f"records {rows[-1][2]:>9,}  steps {rows[-1][3]:>7,}  transitions {rows[-1][4]:>5,}  "
                  f"{rows[-1][5]:6.0f} s", flush=True)  # fmt: skip
    assert len(metrics.render(engine)) > 0
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--window", type=int, default=10_000, help="the history window (the server's default)")
    ap.add_argument("--every", type=int, default=100_000, help="report every this many requests")
    ap.add_argument("--batch", type=int, default=64, help="requests per step")
    ap.add_argument("--model", help="checkpoint directory (default: a tiny random one in /tmp)")
    ap.add_argument("--only", choices=("window", "all"), help=argparse.SUPPRESS)  # one run, in a child process
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model_dir = Path(args.model) if args.model else write_random_mixtral(Path("/tmp/pwgpu-bench-memory-model"))
    if args.only:
        rows = run(model_dir, args.requests, args.window if args.only == "window" else None, args.every, args.batch)
        print("ROWS " + json.dumps(rows))
        return 0
    print(f"{platform.machine()} Python {sys.version.split()[0]} torch {torch.__version__}")
    print(f"{args.requests:,} requests of 1 prompt + 1 output token, {args.batch} per step; RSS growth over the start")
    results = {}
    for only in ("window", "all"):  # each in a fresh process, so neither inherits the other's heap
        cmd = [sys.executable, __file__, "--only", only, "--model", str(model_dir)]
        cmd += [f"--{k}={getattr(args, k)}" for k in ("requests", "window", "every", "batch")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        print("\n".join(line for line in out.splitlines() if not line.startswith("ROWS ")), flush=True)
        results[only] = json.loads(next(line for line in out.splitlines() if line.startswith("ROWS "))[5:])
    bounded, unbounded = results["window"], results["all"]
    print("\nrequests    RSS growth (window)   RSS growth (keep all)   records held (window / all)")
    for b, u in zip(bounded, unbounded, strict=True):
        print(f"{b[0]:>9,}   {b[1]:>10.1f} MiB       {u[1]:>10.1f} MiB          {b[2]:>7,} / {u[2]:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
