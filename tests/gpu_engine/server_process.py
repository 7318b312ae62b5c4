"""A ``pwgpu serve`` subprocess on a free loopback port, for the server tests."""

import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(tmp, *args):
    """A ``pwgpu serve`` process (free loopback port) writing results to tmp/results; yields
    (url, process) once it answers /health, and stops it on the way out."""
    port = free_port()
    env = dict(os.environ, PAGEDWEIGHT_CACHE=str(tmp / "cache"), PWGPU_API_KEY=API_KEY)
    cmd = [sys.executable, "-m", "pwgpu.cli", "serve", "--port", str(port), "--out", str(tmp / "results"), *args]
    with open(tmp / "server.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited: {(tmp / 'server.log').read_text()}")
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.3)
            else:
                raise RuntimeError("server did not become healthy within 120 s")
            yield url, proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def metric(text: str, name: str, **labels) -> float:
    """The value of one series in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} {labels} not in the metrics")


def wait_for_metrics(url: str, ready, what: str, timeout_s: float = 90) -> str:
    """Poll /metrics until ``ready(text)``; a hang guard, not a speed check (a loaded 2-core
    machine took over 30 s to free KV once)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics").text
        if ready(text):
            return text
        time.sleep(0.1)
    pytest.fail(f"{what} within {timeout_s} s:\n{text}")
