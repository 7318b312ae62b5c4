"""Replay a request trace against an OpenAI-compatible server and measure it as vLLM's
``benchmark_serving`` does: each request is sent at its trace time (open loop) as a streaming
completion of ``prompt_tokens`` token ids with ``max_tokens = output_tokens`` and
``ignore_eos``; TTFT is the first streamed chunk after sending, ITL the gaps between chunks
(one chunk per token), E2EL the last chunk.

Writes a results directory ``pagedweight.results.report`` reads (``requests.csv``, ``summary.json``,
``report.html``): the same request table and summary names as the runtimes, measured at the
client.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedweight.core.scheduler import FINISHED, REJECTED, Request
from pagedweight.errors import ConfigError
from pagedweight.results.metrics import Slo, request_table, summarize
from pagedweight.results.writer import atomic_write_csv, atomic_write_text
from pagedweight.workload.build import scale_rate, truncate_to_context
from pagedweight.workload.traces import (
    RequestTrace,
    detect_format,
    load_azure,
    load_burstgpt,
    load_generic,
    load_mooncake,
)


def load_trace(path: str | Path, arrival: str = "arrival_s", prompt: str = "prompt_tokens",
               output: str = "output_tokens", time_unit: str = "s") -> RequestTrace:  # fmt: skip
    """A trace in any format ``pagedweight.workload.traces`` reads; generic files name their columns."""
    fmt = detect_format(path)
    if fmt == "azure":
        return load_azure(path)
    if fmt == "mooncake":
        return load_mooncake(path)
    if fmt == "burstgpt":
        return load_burstgpt(path)
    if fmt == "sharegpt":
        raise ConfigError(f"{path}: a lengths file has no arrival times; replay needs a timed trace")
    return load_generic(path, arrival, prompt, output, time_unit)


@dataclass
class Outcome:
    send_s: float
    token_times_s: list[float]
    error: str | None = None


async def _one(client, url: str, headers: dict, model: str, ids: list[int], max_tokens: int, t0: float) -> Outcome:
    out = Outcome(time.perf_counter() - t0, [])
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                out.error = f"HTTP {r.status_code}: {text[:300]}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    out.token_times_s.append(time.perf_counter() - t0)
    except Exception as e:  # a dropped connection is a failed request, not a failed replay
        out.error = f"{type(e).__name__}: {e}"
    return out


async def replay_async(
    trace: RequestTrace, url: str, api_key: str | None, vocab_size: int, seed: int, timeout_s: float
) -> tuple[list[Request], dict]:
    import httpx

    url = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = np.random.default_rng(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        info = (await client.get(f"{url}/v1/models", headers=headers)).raise_for_status().json()["data"][0]
        if info.get("max_model_len"):
            trace = truncate_to_context(trace, int(info["max_model_len"]))
        prompts = [rng.integers(0, vocab_size, int(n)).tolist() for n in trace.prompt_tokens]
        t0 = time.perf_counter()
        tasks = []
        for i in range(len(trace)):
            delay = float(trace.arrival_s[i]) - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(
                _one(client, url, headers, info["id"], prompts[i], int(trace.output_tokens[i]), t0)
            ))  # fmt: skip
        outcomes = await asyncio.gather(*tasks)
    requests = []
    for i, o in enumerate(outcomes):
        r = Request(i, o.send_s, int(trace.prompt_tokens[i]), int(trace.output_tokens[i]))
        r.token_times_s.extend(o.token_times_s)
        r.num_output_tokens = len(o.token_times_s)
        r.first_token_s = o.token_times_s[0] if o.token_times_s else None
        r.finish_s = o.token_times_s[-1] if o.token_times_s else o.send_s
        r.state = FINISHED if o.error is None and o.token_times_s else REJECTED
        r.reject_reason = o.error or ("" if o.token_times_s else "no tokens streamed")
        requests.append(r)
    return requests, {"model": info, "trace": trace}


def replay(trace_path: str | Path, url: str, out_dir: str | Path, rate_scale: float = 1.0, api_key: str | None = None,
           vocab_size: int = 256, seed: int = 0, timeout_s: float = 600.0, report: bool = True) -> dict:  # fmt: skip
    trace = load_trace(trace_path)
    if rate_scale != 1.0:
        trace = scale_rate(trace, rate_scale)
    wall0 = time.perf_counter()
    requests, info = asyncio.run(replay_async(trace, url, api_key, vocab_size, seed, timeout_s))
    trace, server = info["trace"], info["model"].get("pwgpu", {})
    summary = summarize(requests, Slo())
    summary["wall_s"] = time.perf_counter() - wall0
    policy = server.get("policy", "server")
    meta = {
        "runtime": "pwgpu",
        "measured_by": "client (pwgpu replay)",
        "url": url,
        "scenario": f"replay of {Path(trace_path).name}",
        "model": info["model"]["id"],
        "gpu": server.get("device", "unknown"),
        "budget_bytes": server.get("budget_bytes", 0),
        "page_bytes": server.get("page_bytes", 0),
        "latency_model": "measured at the client over HTTP",
        "importance": server.get("importance", "unknown"),
        "trace": {"source": trace.source, "num_requests": len(trace), "notes": list(trace.notes)},
        "seed": seed,
        "policies": {policy: summary},
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    df = request_table(requests)
    df.insert(0, "policy", policy)
    atomic_write_csv(df, out / "requests.csv")
    atomic_write_text(out / "summary.json", json.dumps(meta, indent=2) + "\n")
    if report:
        from pagedweight.results.report import write_report

        write_report([out], out / "report.html")
    return meta
