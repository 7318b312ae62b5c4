"""A load test with an independent, OpenAI-compatible load generator (NVIDIA AIPerf) against
``pwgpu serve`` on loopback, for a bounded time: no 5xx, every request answered, KV back to
zero afterwards, and the server's TTFT (from HTTP arrival) within 10% of what AIPerf measured
at the client. Prints the figures (recorded in benchmarks/RESULTS.md).

AIPerf pins its own versions of pandas and others, so it lives in its own virtual environment
(the ``load`` extra names it):

    python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip install 'aiperf>=0.13'
    PWGPU_AIPERF=.venv-aiperf/bin/aiperf python3 -m pytest -m slow tests/gpu_engine/test_load_aiperf.py -s

It needs nothing from a model hub: prompts come from AIPerf's bundled corpus and are counted
with the served model's own ``tokenizer.json`` (``--tokenizer <model dir>``); token counts in
the results are the server's (``--use-server-token-count``, which asks for usage in the stream).
"""

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
from server_process import API_KEY, metric, serve, wait_for_metrics

import proc

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "tiny-moe"  # a trained model: its first chunks hold text (see below)
DURATION_S = 30
CONCURRENCY = 8


def aiperf_command() -> str | None:
    exe = os.environ.get("PWGPU_AIPERF") or shutil.which("aiperf")
    if exe is None and (ROOT / ".venv-aiperf" / "bin" / "aiperf").is_file():
        exe = str(ROOT / ".venv-aiperf" / "bin" / "aiperf")
    return exe


@pytest.mark.slow
def test_aiperf_load_on_loopback(tmp_path):
    exe = aiperf_command()
    if exe is None:
        pytest.skip("aiperf is not installed (set PWGPU_AIPERF; see this file's docstring)")
    if not (MODEL / "tokenizer.json").is_file():
        pytest.skip(f"{MODEL} is absent")
    args = ("--model", str(MODEL), "--mem-budget", "64MiB", "--max-model-len", "512", "--max-pending", "64")
    with serve(tmp_path, *args) as (url, _proc):
        name = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0]["id"]
        before = httpx.get(f"{url}/metrics", timeout=60).text
        out = tmp_path / "aiperf"
        cmd = [exe, "profile", "--model", name, "--url", url, "--api-key", API_KEY, "--endpoint-type", "completions",
               "--streaming", "--tokenizer", str(MODEL), "--concurrency", str(CONCURRENCY),
               "--benchmark-duration", str(DURATION_S), "--benchmark-grace-period", "30",
               "--prompt-input-tokens-mean", "64", "--prompt-input-tokens-stddev", "16",
               "--prompt-output-tokens-mean", "24", "--prompt-output-tokens-stddev", "8",
               "--extra-inputs", "ignore_eos:true", "--use-server-token-count", "--random-seed", "1",
               "--ui-type", "none", "--output-artifact-dir", str(out)]  # fmt: skip
        # Not offline mode: AIPerf 0.13 then looks the local tokenizer up in the hub cache.
        env = dict(os.environ, HF_HUB_DISABLE_TELEMETRY="1")
        env.pop("HF_HUB_OFFLINE", None)
        env.pop("TRANSFORMERS_OFFLINE", None)
        run = proc.run(cmd, env=env, quiet_s=2 * DURATION_S)  # a hang guard at 10x, in its own process group
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        after = wait_for_metrics(
            url,
            lambda m: metric(m, "pwgpu:pool_pages", owner="kv") == 0 and metric(m, "vllm:num_requests_running") == 0,
            "KV back to zero after the load",
        )
    client = json.loads((out / "profile_export_aiperf.json").read_text())
    records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines() if line]
    errors = [r["error"] for r in records if r.get("error")]
    assert not errors, errors[:5]
    num = int(client["request_count"]["avg"])
    assert num >= CONCURRENCY, client["request_count"]
    refused = [line for line in after.splitlines() if line.startswith("pwgpu:requests_refused_total{")]
    assert not any('code="5' in line for line in refused), refused

    def delta(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:request_success_total", finished_reason="length") == num
    assert delta("vllm:request_success_total", finished_reason="abort") == 0
    assert delta("vllm:generation_tokens_total") == client["total_osl"]["avg"]
    server_ttft_ms = (
        1000 * delta("vllm:time_to_first_token_seconds_sum") / delta("vllm:time_to_first_token_seconds_count")
    )
    client_ttft_ms = client["time_to_first_token"]["avg"]
    print(f"\nAIPerf {DURATION_S} s at concurrency {CONCURRENCY}: {num} requests, 0 errors, "
          f"{client['request_throughput']['avg']:.2f} req/s, {client['output_token_throughput']['avg']:.1f} tok/s; "
          f"TTFT client {client_ttft_ms:.1f} ms vs server {server_ttft_ms:.1f} ms "
          f"({100 * (server_ttft_ms / client_ttft_ms - 1):+.1f}%); p50 ITL "
          f"{client['inter_token_latency']['p50']:.1f} ms; KV back to 0")  # fmt: skip
    assert abs(server_ttft_ms - client_ttft_ms) <= 0.10 * client_ttft_ms
