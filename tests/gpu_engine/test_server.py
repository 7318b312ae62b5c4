"""``pwgpu serve`` on loopback, driven by the official ``openai`` client and raw HTTP; then
``pwgpu replay`` of a short trace against it.

Each server is a process of its own (tests/proc.py stops its group). Waits on a server are hang
guards at ten times their quiet time; what a test checks never depends on how fast it answers."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pandas as pd
import pytest

import proc

API_KEY = "test-key"
MAX_PENDING = 4
HTTP_TIMEOUT_S = 60  # every client call's hang guard (httpx's default, 5 s, is a speed check on a busy machine)
START_QUIET_S = 12  # a server up and healthy, checkpoint written, on a quiet 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, server: subprocess.Popen, log) -> bool:
    """True once /health answers; False if the server exited because its port was taken meanwhile."""
    deadline = time.monotonic() + proc.hang_guard_s(START_QUIET_S)
    while time.monotonic() < deadline:
        if server.poll() is not None:
            text = log.read_text()
            if "address already in use" in text.lower():
                return False
            raise RuntimeError(f"server exited: {text}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            time.sleep(0.3)
    raise RuntimeError(f"hang guard: server not healthy after {proc.hang_guard_s(START_QUIET_S):.0f} s")


@contextlib.contextmanager
def serve(tmp, *args):
    """A ``pwgpu serve`` process (default model, free loopback port) writing results to tmp/results;
    yields (url, process). Another process may take the free port before the server binds it:
    then it starts again on another."""
    env = dict(os.environ, PAGEDWEIGHT_CACHE=str(tmp / "cache"), PWGPU_API_KEY=API_KEY)
    log = tmp / "server.log"
    for _ in range(3):
        port = _free_port()
        cmd = [sys.executable, "-m", "pwgpu.cli", "serve", "--port", str(port), "--out", str(tmp / "results"), *args]
        with open(log, "w") as out, proc.spawn(cmd, env=env, stdout=out, stderr=subprocess.STDOUT) as server:
            url = f"http://127.0.0.1:{port}"
            if _wait_healthy(url, server, log):
                yield url, server
                return
    raise RuntimeError(f"no free port after three tries: {log.read_text()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from pwgpu.default_model import write_random_mixtral

    tmp = tmp_path_factory.mktemp("serve")
    # A fixed small model, not the default one: the checkout's default may be retrained meanwhile.
    model = write_random_mixtral(tmp / "model")
    args = ("--model", str(model), "--mem-budget", "24MiB", "--max-pending", str(MAX_PENDING), "--max-model-len", "512")
    with serve(tmp, *args) as (url, server_proc):
        yield url, tmp, server_proc


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _headers():
    return {"Authorization": f"Bearer {API_KEY}"}


def _post(url: str, **kw) -> httpx.Response:
    return httpx.post(url, timeout=HTTP_TIMEOUT_S, **kw)


@pytest.mark.e2e
def test_models_and_completions(client):
    model = client.models.list().data[0].id
    r = client.completions.create(
        model=model, prompt="Hello", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    again = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert again.choices[0].text == r.choices[0].text  # greedy is deterministic
    chunks = list(client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))  # fmt: skip
    assert len(chunks) == 8 and chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


@pytest.mark.e2e
def test_chat_plain_and_streaming(client):
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=6, seed=3, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 6
    stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, seed=3, stream=True,
                                            extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content


@pytest.mark.e2e
def test_error_statuses_and_server_keeps_serving(server, client):
    url = server[0]
    h = _headers()
    cases = [
        (_post(f"{url}/v1/completions", content=b"{not json", headers=h), 400),
        (_post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": -3}, headers=h), 400),
        (_post(f"{url}/v1/chat/completions", json={"messages": []}, headers=h), 400),
        (_post(f"{url}/v1/completions", json={"prompt": [1] * 600}, headers=h), 413),
        (_post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 600}, headers=h), 400),
        (_post(f"{url}/v1/completions", json={"prompt": "x"}), 401),
        (_post(f"{url}/v1/completions", content=b"x" * (2 << 20), headers=h), 413),
    ]
    for resp, status in cases:
        assert resp.status_code == status, resp.text
        assert resp.json()["error"]["code"] == status
    # A burst past the queue limit: the excess gets 429 at once; the rest complete. Each request
    # is long (hundreds of steps), so that the first MAX_PENDING are still unfinished when the
    # others arrive, however slow the client's threads start.
    body = {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True}

    def post(_):
        return httpx.post(f"{url}/v1/completions", json=body, headers=h, timeout=120).status_code

    with ThreadPoolExecutor(12) as pool:
        codes = list(pool.map(post, range(12)))
    assert codes.count(429) >= 1 and codes.count(200) >= 1 and set(codes) <= {200, 429}
    r = client.completions.create(model=client.models.list().data[0].id, prompt="ok", max_tokens=2)
    assert r.usage.completion_tokens >= 1


def _metric(metrics: str, prefix: str) -> float:
    (line,) = [ln for ln in metrics.splitlines() if ln.startswith(prefix)]
    return float(line.split()[-1])


def _wait_for(url: str, done, what: str, quiet_s: float = 6) -> str:
    """Poll /metrics until ``done(metrics)``; a hang guard, not a deadline on the server's speed."""
    deadline = time.monotonic() + proc.hang_guard_s(quiet_s)
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{url}/metrics", timeout=HTTP_TIMEOUT_S).text
        if done(metrics):
            return metrics
        time.sleep(0.2)
    pytest.fail(f"hang guard: {what} not seen after {proc.hang_guard_s(quiet_s):.0f} s\n{metrics}")


ABORTS = 'pwgpu:request_success_total{model_name="model",finished_reason="abort"}'
LENGTHS = 'pwgpu:request_success_total{model_name="model",finished_reason="length"}'
KV_PAGES = 'pwgpu:pool_pages{model_name="model",owner="kv"}'


@pytest.mark.e2e
def test_disconnect_frees_kv(tmp_path):
    """Both kinds of disconnect abort the request and free its KV, and nothing races the abort:
    the server runs one sequence at a time and the requests are far too long to finish first.
    The streaming request holds the only slot, so the plain one waits in the queue until its
    client gives up; the stream is closed after that."""
    from pwgpu.default_model import write_random_mixtral

    model = write_random_mixtral(tmp_path / "model")
    with serve(tmp_path, "--model", str(model), "--mem-budget", "24MiB", "--max-num-seqs", "1") as (url, _):
        body = {"prompt": [5] * 100, "max_tokens": 3900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=_headers(), timeout=60) as r:
            assert next(r.iter_lines()).startswith("data: ")  # running: it holds the only slot
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"{url}/v1/completions", json=dict(body, stream=False), headers=_headers(), timeout=1.5)
            metrics = _wait_for(url, lambda m: _metric(m, ABORTS) == 1, "the queued request's abort")
            assert _metric(metrics, "pwgpu:num_requests_running{") == 1 and _metric(metrics, LENGTHS) == 0
        # The stream is closed mid-generation.
        metrics = _wait_for(url, lambda m: _metric(m, ABORTS) == 2 and _metric(m, KV_PAGES) == 0, "KV freed")
    assert _metric(metrics, LENGTHS) == 0  # neither request ended any other way
    assert _metric(metrics, "pwgpu:num_requests_running{") == _metric(metrics, "pwgpu:num_requests_waiting{") == 0
    assert _metric(metrics, "pwgpu:kv_cache_usage_perc{") == 0
    for name in ("pwgpu:num_requests_running", "pwgpu:kv_cache_usage_perc", "pwgpu:time_to_first_token_seconds_bucket",
                 "pwgpu:weight_bytes{", "pwgpu:precision_transitions_total{"):  # fmt: skip
        assert name in metrics


@pytest.mark.e2e
def test_replay_short_trace(server, tmp_path):
    from pwgpu.cli import main

    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,20,5\n0.1,35,8\n0.2,12,3\n0.25,50,6\n")
    out = tmp_path / "replay"
    rc = main(["replay", "--trace", str(trace), "--url", server[0], "--out", str(out), "--api-key", API_KEY,
               "--rate-scale", "2"])  # fmt: skip
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    s = summary["policies"]["pagedweight"]
    assert summary["runtime"] == "pwgpu" and s["completed"] == 4 and s["total_output_tokens"] == 22
    assert s["mean_ttft_ms"] > 0 and s["mean_itl_ms"] > 0
    rows = pd.read_csv(out / "requests.csv")
    assert rows["output_tokens"].tolist() == [5, 8, 3, 6]
    assert "PagedWeight report" in (out / "report.html").read_text()


@pytest.mark.e2e
def test_sigterm_writes_results(tmp_path):
    """SIGTERM stops the server gracefully and it writes the run's results directory (``--out``)
    on the way out, with every request it served."""
    from pwgpu.default_model import write_random_mixtral

    model = write_random_mixtral(tmp_path / "model")
    with serve(tmp_path, "--model", str(model), "--mem-budget", "24MiB") as (url, server):
        for i in range(5):
            body = {"prompt": [1, 2, 3 + i], "max_tokens": 4, "ignore_eos": True}
            assert httpx.post(f"{url}/v1/completions", json=body, headers=_headers(), timeout=120).status_code == 200
        server.terminate()
        assert server.wait(timeout=proc.hang_guard_s(6)) == 0
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    s = summary["policies"]["pagedweight"]
    assert summary["runtime"] == "pwgpu" and s["completed"] == 5 and s["total_output_tokens"] == 20
    assert len(pd.read_csv(tmp_path / "results" / "steps.csv")) > 0


@pytest.mark.slow
def test_pressure_through_http(tmp_path):
    """A budget with room for bf16 experts plus ~40 KV pages, and a burst of 12 long requests
    replayed over HTTP: experts are downgraded while KV grows, every request completes, and the
    experts are back at bf16 once the burst is over (about 30 s on two cores)."""
    from pwgpu.default_model import write_random_mixtral
    from pwgpu.replay import replay

    model = write_random_mixtral(tmp_path / "model")  # the budget below is sized for this model
    rng = np.random.default_rng(0)
    rows = [f"{t:.3f},{rng.integers(150, 250)},{rng.integers(60, 120)}" for t in np.sort(rng.uniform(0, 2, 12))]
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n" + "\n".join(rows) + "\n")
    with serve(tmp_path, "--model", str(model), "--mem-budget", "8.5MiB") as (url, server):
        meta = replay(trace, url, tmp_path / "replay", api_key=API_KEY, report=False)
        assert meta["policies"]["pagedweight"]["completed"] == 12
        # Load is gone: the controller upgrades back (a few seconds when quiet; the wait is a hang guard).
        metrics = _wait_for(url, lambda m: 'precision="int4"} 0' in m, "the upgrade back to bf16", quiet_s=10)
        server.terminate()
        assert server.wait(timeout=proc.hang_guard_s(6)) == 0
    steps = pd.read_csv(tmp_path / "results" / "steps.csv")
    assert steps["num_downgrades"].sum() > 0 and steps["weight_pages_int4"].max() > 0
    assert steps["kv_pages"].max() > 40
    assert 'precision="int4"} 0' in metrics
