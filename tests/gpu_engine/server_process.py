"""A ``pwgpu serve`` subprocess on a free loopback port, for the server tests."""

import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

import proc

API_KEY = "test-key"
START_QUIET_S = 12  # a server up and healthy, checkpoint written, on a quiet 2-core machine


def free_port() -> int:
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
    """A ``pwgpu serve`` process (free loopback port) writing results to tmp/results; yields
    (url, process) once it answers /health. Its process group is stopped on the way out
    (tests/proc.py). Another process may take the free port before the server binds it: then it
    starts again on another."""
    env = dict(os.environ, PAGEDWEIGHT_CACHE=str(tmp / "cache"), PWGPU_API_KEY=API_KEY)
    log = tmp / "server.log"
    for _ in range(3):
        port = free_port()
        cmd = [sys.executable, "-m", "pwgpu.cli", "serve", "--port", str(port), "--out", str(tmp / "results"), *args]
        with open(log, "w") as out, proc.spawn(cmd, env=env, stdout=out, stderr=subprocess.STDOUT) as server:
            url = f"http://127.0.0.1:{port}"
            if _wait_healthy(url, server, log):
                yield url, server
                return
    raise RuntimeError(f"no free port after three tries: {log.read_text()}")


def metric(text: str, name: str, **labels) -> float:
    """The value of one series in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} {labels} not in the metrics")


def wait_for_metrics(url: str, ready, what: str, quiet_s: float = 9) -> str:
    """Poll /metrics until ``ready(text)``; a hang guard at ten times the quiet time, not a speed
    check (a loaded 2-core machine took over 30 s to free KV once)."""
    timeout_s = proc.hang_guard_s(quiet_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=60).text
        if ready(text):
            return text
        time.sleep(0.1)
    pytest.fail(f"{what} within {timeout_s} s:\n{text}")
