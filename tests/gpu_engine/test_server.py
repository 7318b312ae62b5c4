"""``pwgpu serve`` on loopback, driven by the official ``openai`` client and raw HTTP; then
``pwgpu replay`` of a short trace against it."""

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pandas as pd
import pytest
from server_process import API_KEY, metric, serve, wait_for_metrics

import proc

# Every test here starts a server process: the end-to-end tier (`pytest -m e2e`).
pytestmark = pytest.mark.e2e
MAX_PENDING = 4


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
        (httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=60), 401),
        (httpx.post(f"{url}/v1/completions", content=b"x" * (2 << 20), headers=h, timeout=60), 413),
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
    """A stream closed after its first chunk and a plain request whose client goes away while it
    runs are each aborted once, and their KV is freed."""
    url = server[0]

    def aborts(m: str) -> float:
        return metric(m, "vllm:request_success_total", finished_reason="abort")

    def idle(m: str) -> bool:
        return metric(m, "pwgpu:pool_pages", owner="kv") == 0 and metric(m, "vllm:num_requests_running") == 0

    before = aborts(wait_for_metrics(url, idle, "no request running"))
    body = {"prompt": [5] * 100, "max_tokens": 400, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=dict(body, stream=True), headers=_headers(),
                      timeout=60) as r:  # fmt: skip
        assert next(r.iter_lines()).startswith("data: ")
    wait_for_metrics(url, lambda m: idle(m) and aborts(m) == before + 1, "the stream aborted and its KV freed")
    # The plain request's client leaves once the server runs the request, not after a fixed
    # time: under load the server may not have read the request by then.
    # As long as the context allows (512), so that it cannot finish before the server next looks
    # for its client (``server.DISCONNECT_CHECK_S``).
    payload = json.dumps({"prompt": [5] * 8, "max_tokens": 500, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n")  # fmt: skip
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head.encode() + payload)
        wait_for_metrics(url, lambda m: metric(m, "vllm:num_requests_running") == 1, "the plain request running")
    metrics = wait_for_metrics(url, lambda m: idle(m) and aborts(m) >= before + 2, "the plain request aborted")
    time.sleep(0.5)  # an abort counted twice would show by now
    metrics = httpx.get(f"{url}/metrics", timeout=60).text
    assert aborts(metrics) == before + 2, metrics
    assert metric(metrics, "vllm:kv_cache_usage_perc") == 0
    for name in ("vllm:num_requests_waiting{", "vllm:time_to_first_token_seconds_bucket{", "pwgpu:weight_bytes{",
                 "pwgpu:precision_transitions_total{", "vllm:e2e_request_latency_seconds_count{"):  # fmt: skip
        assert name in metrics


def test_finish_reasons_tokens_and_latencies_are_counted(server, client):
    """A stop-string finish counts as "stop" (with its end-to-end latency), a max_tokens finish
    as "length"; token counters match the usage the client got; TTFT and queue time run from
    when the HTTP request arrived (its body trickling in for a second counts)."""
    url = server[0]
    model = client.models.list().data[0].id
    m0 = httpx.get(f"{url}/metrics", timeout=60).text
    full = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    text = full.choices[0].text
    stop = next(ch for ch in text[2:] if ch.isprintable() and ch != "\ufffd")
    cut = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.index(stop)]

    def slow_body():
        yield b'{"prompt": "Hello", "max_tokens": 2, '
        time.sleep(1.0)
        yield b'"ignore_eos": true}'

    slow = httpx.post(f"{url}/v1/completions", content=slow_body(), headers=_headers(), timeout=60)
    assert slow.status_code == 200, slow.text
    m1 = httpx.get(f"{url}/metrics", timeout=60).text

    def delta(name, **labels):
        return metric(m1, name, **labels) - metric(m0, name, **labels)

    assert delta("vllm:request_success_total", finished_reason="stop") == 1
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    assert delta("vllm:request_success_total", finished_reason="abort") == 0
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    usages = [full.usage, cut.usage, slow.json()["usage"]]
    assert delta("vllm:generation_tokens_total") == 8 + cut.usage.completion_tokens + 2
    assert delta("vllm:prompt_tokens_total") == sum(u.prompt_tokens if hasattr(u, "prompt_tokens")
                                                    else u["prompt_tokens"] for u in usages)  # fmt: skip
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    # The slow body alone adds a second to TTFT, queue time and end-to-end latency.
    for name in ("vllm:time_to_first_token_seconds_sum", "vllm:request_queue_time_seconds_sum",
                 "vllm:e2e_request_latency_seconds_sum"):  # fmt: skip
        assert delta(name) >= 1.0, name


INPUT_ERRORS = [
    # (method, path, body: dict or raw bytes, status, the field named in "param" or None)
    ("POST", "/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "prompt"),
    (
        "POST",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x\\udc00"}]}',
        400,
        "messages.0.content",
    ),
    ("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
    ("POST", "/v1/completions", b"{not json", 400, None),
    ("POST", "/v1/completions", b"[1, 2]", 400, None),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": "0.5"}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "x", "n": "2"}, 400, "n"),
    ("POST", "/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
    ("POST", "/v1/completions", {"prompt": [1, True]}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "foo": 1}, 400, "foo"),
    ("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("POST", "/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("POST", "/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("POST", "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("POST", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("POST", "/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("POST", "/v1/completions", {"prompt": "x", "model": "nope"}, 404, "model"),
    ("POST", "/v1/completions", {"prompt": [1] * 600}, 413, "prompt"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 600}, 400, "max_tokens"),
    # Far more text than 511 tokens can hold: refused before it is tokenized.
    ("POST", "/v1/completions", {"prompt": "hello world " * 70000}, 413, "prompt"),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0.role"),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages.0.content.0",
    ),  # fmt: skip
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]},
        400,
        "tools",
    ),
    ("GET", "/nope", None, 404, None),
    ("GET", "/v1/nope", None, 404, None),
    ("DELETE", "/v1/completions", None, 405, None),
    ("POST", "/health", None, 405, None),
]


@pytest.mark.parametrize("method, path, body, status, param", INPUT_ERRORS)
def test_input_errors_are_4xx_in_openai_shape(server, method, path, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    r = httpx.request(method, f"{server[0]}{path}", headers=_headers(), timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and err["type"]
    assert err["param"] == param, err


def test_body_limit_holds_without_content_length(server, client):
    """A 2 MiB body sent chunked (no Content-Length) is refused at the 1 MiB limit, and the
    server goes on serving."""

    def chunks():
        yield b'{"prompt": "'
        for _ in range(2048):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(f"{server[0]}/v1/completions", content=chunks(), headers=_headers(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert client.completions.create(model=client.models.list().data[0].id, prompt="ok", max_tokens=2).choices


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
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # load is gone: the controller upgrades back
            metrics = httpx.get(f"{url}/metrics", timeout=60).text
            if 'precision="int4"} 0' in metrics:
                break
            time.sleep(0.5)
        server.terminate()
        assert server.wait(timeout=proc.hang_guard_s(6)) == 0
    steps = pd.read_csv(tmp_path / "results" / "steps.csv")
    assert steps["num_downgrades"].sum() > 0 and steps["weight_pages_int4"].max() > 0
    assert steps["kv_pages"].max() > 40
    assert 'precision="int4"} 0' in metrics
