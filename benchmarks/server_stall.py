"""Does a large request stall the server for everyone else? ``pwgpu serve`` (the trained tiny
model, a 4,096-token context) gets large requests one at a time while another client polls
``/health``; prints each request's status and time and the worst ``/health`` latency meanwhile.

    python benchmarks/server_stall.py [--model models/tiny-moe]

Also times the tokenizer's two entry points on a worker thread against a main thread that
wants to run: ``encode`` holds the GIL for the whole text, ``encode_batch`` (what the server
uses) releases it.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "gpu_engine"))


def worst_health_latency_s(url: str, send) -> tuple[object, float, float]:
    """(the request's outcome, its seconds, the worst /health latency while it ran)."""
    result: dict = {}

    def run():
        t0 = time.perf_counter()
        try:
            result["out"] = send()
        except httpx.HTTPError as e:
            result["out"] = f"{type(e).__name__}"
        result["s"] = time.perf_counter() - t0

    th = threading.Thread(target=run)
    th.start()
    worst = 0.0
    with httpx.Client() as c:
        while th.is_alive():
            t0 = time.perf_counter()
            c.get(f"{url}/health", timeout=120)
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.005)
    th.join()
    return result["out"], result["s"], worst


def gil_ticks(fn) -> tuple[int, float]:
    """How many 1 ms sleeps the main thread got through while ``fn`` ran on another thread."""
    th = threading.Thread(target=fn)
    ticks, t0 = 0, time.perf_counter()
    th.start()
    while th.is_alive():
        time.sleep(0.001)
        ticks += 1
    return ticks, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-moe"))
    args = ap.parse_args(argv)
    from server_process import API_KEY, serve

    from pwgpu.tokenizer import Tokenizer

    tok = Tokenizer(args.model)
    text = "hello world " * 30000  # 360 KB
    for name, fn in (("encode", lambda: tok._tok.encode(text)), ("encode_batch", lambda: tok.encode(text))):
        ticks, s = gil_ticks(fn)
        print(f"tokenizer {name:>12} of {len(text):,} chars: {s:.2f} s, main thread ran {ticks} 1-ms sleeps")
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"pwgpu-stall-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    h = {"Authorization": f"Bearer {API_KEY}"}
    with serve(tmp, "--model", args.model, "--max-model-len", "4096", "--mem-budget", "96MiB") as (url, _):

        def chunked(n_bytes: int):
            yield b'{"prompt": "'
            for _ in range(n_bytes // 65536):
                yield b"x" * 65536
            yield b'"}'

        cases = {
            "4 MiB body, chunked (no Content-Length)": lambda: httpx.post(
                f"{url}/v1/completions", content=chunked(4 << 20), headers=h, timeout=120
            ),
            "1 MiB text prompt": lambda: httpx.post(
                f"{url}/v1/completions",
                json={"prompt": "hello world " * 87000, "max_tokens": 1},
                headers=h,
                timeout=120,
            ),  # fmt: skip
            "300 KB text prompt (tokenized; over 4,095 tokens)": lambda: httpx.post(
                f"{url}/v1/completions",
                json={"prompt": "hello world " * 25000, "max_tokens": 1},
                headers=h,
                timeout=120,
            ),  # fmt: skip
        }
        for name, send in cases.items():
            out, s, worst = worst_health_latency_s(url, send)
            status = out.status_code if isinstance(out, httpx.Response) else out
            print(f"{name:>52}: HTTP {status} in {s:.2f} s; worst /health meanwhile {1000 * worst:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
