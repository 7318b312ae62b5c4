"""``pwgpu serve`` on loopback, driven by the official ``openai`` client and raw HTTP; then
``pwgpu replay`` of a short trace against it."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pandas as pd
import pytest
from server_process import API_KEY, serve

MAX_PENDING = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from pwgpu.default_model import write_random_mixtral

    tmp = tmp_path_factory.mktemp("serve")
    # A fixed small model, not the default one: the checkout's default may be retrained meanwhile.
    model = write_random_mixtral(tmp / "model")
    args = ("--model", str(model), "--mem-budget", "24MiB", "--max-pending", str(MAX_PENDING), "--max-model-len", "512")
    with serve(tmp, *args) as (url, proc):
        yield url, tmp, proc


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _headers():
    return {"Authorization": f"Bearer {API_KEY}"}


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


def test_error_statuses_and_server_keeps_serving(server, client):
    url = server[0]
    h = _headers()
    cases = [
        (httpx.post(f"{url}/v1/completions", content=b"{not json", headers=h), 400),
        (httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": -3}, headers=h), 400),
        (httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, headers=h), 400),
        (httpx.post(f"{url}/v1/completions", json={"prompt": [1] * 600}, headers=h), 413),
        (httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 600}, headers=h), 400),
        (httpx.post(f"{url}/v1/completions", json={"prompt": "x"}), 401),
        (httpx.post(f"{url}/v1/completions", content=b"x" * (2 << 20), headers=h), 413),
    ]
    for resp, status in cases:
        assert resp.status_code == status, resp.text
        assert resp.json()["error"]["code"] == status
    # A burst past the queue limit: the excess gets 429 at once; the rest complete.
    body = {"prompt": [1, 2, 3], "max_tokens": 40, "ignore_eos": True}

    def post(_):
        return httpx.post(f"{url}/v1/completions", json=body, headers=h, timeout=120).status_code

    with ThreadPoolExecutor(12) as pool:
        codes = list(pool.map(post, range(12)))
    assert codes.count(429) >= 1 and codes.count(200) >= 1 and set(codes) <= {200, 429}
    r = client.completions.create(model=client.models.list().data[0].id, prompt="ok", max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_disconnect_frees_kv(server):
    url = server[0]
    body = {"prompt": [5] * 100, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=_headers(), timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    # The stream is closed after one chunk; a plain request's client gives up after 1.5 s.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{url}/v1/completions", json=dict(body, stream=False), headers=_headers(), timeout=1.5)
    # Both requests are aborted and their KV freed.
    deadline = time.monotonic() + 90  # generous: a loaded 2-core machine took over 30 s once
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{url}/metrics").text
        kv = [line for line in metrics.splitlines() if line.startswith("pwgpu:pool_pages{") and 'owner="kv"' in line]
        aborts = [line for line in metrics.splitlines() if 'finished_reason="abort"' in line]
        if kv and kv[0].endswith(" 0") and aborts and int(aborts[0].split()[-1]) >= 2:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"KV not freed after a disconnect: kv {kv}, aborts {aborts}\n{metrics}")
    for name in ("pwgpu:num_requests_running", "pwgpu:kv_cache_usage_perc", "pwgpu:time_to_first_token_seconds_bucket",
                 "pwgpu:weight_bytes{", "pwgpu:precision_transitions_total{"):  # fmt: skip
        assert name in metrics


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


def test_sigterm_writes_results(server):
    """Last in the module (tests run in file order): SIGTERM stops the server gracefully and
    it writes the run's results directory (``--out``) on the way out."""
    url, tmp, proc = server
    proc.terminate()
    assert proc.wait(timeout=60) == 0
    summary = json.loads((tmp / "results" / "summary.json").read_text())
    s = summary["policies"]["pagedweight"]
    assert summary["runtime"] == "pwgpu" and s["completed"] >= 5
    assert len(pd.read_csv(tmp / "results" / "steps.csv")) > 0


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
    with serve(tmp_path, "--model", str(model), "--mem-budget", "8.5MiB") as (url, proc):
        meta = replay(trace, url, tmp_path / "replay", api_key=API_KEY, report=False)
        assert meta["policies"]["pagedweight"]["completed"] == 12
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # load is gone: the controller upgrades back
            metrics = httpx.get(f"{url}/metrics").text
            if 'precision="int4"} 0' in metrics:
                break
            time.sleep(0.5)
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    steps = pd.read_csv(tmp_path / "results" / "steps.csv")
    assert steps["num_downgrades"].sum() > 0 and steps["weight_pages_int4"].max() > 0
    assert steps["kv_pages"].max() > 40
    assert 'precision="int4"} 0' in metrics
