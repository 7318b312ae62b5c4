"""Processes that tests start, and how they end.

Every process a test starts goes through ``run`` or ``spawn``: it leads a session (a process
group) of its own, and when the test is done with it, times out or fails, the whole group is
killed, so that a grandchild (the ``pwgpu run`` that ``pwsim validate`` starts, a server's
workers) cannot outlive its test.

A ``timeout`` here is a hang guard, never a speed check: each call states ``quiet_s``, how long the
command takes on a quiet 2-core machine, and is stopped only after ``HANG_FACTOR`` times that.
The ``quiet_s`` figures are times measured on the 2-core development VM at its quietest (load
average about 3), rounded up, and never below 3 s (a cold Python start with numpy and pandas).

Every process started by the test run carries ``SESSION_ENV`` in its environment (tests/conftest.py
sets it before any test); at the end of the run conftest looks for processes that still carry it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence

import pytest

HANG_FACTOR = 10
SESSION_ENV = "PAGEDWEIGHT_TEST_SESSION"
TERM_GRACE_S = 10.0  # between SIGTERM and SIGKILL of a group


def hang_guard_s(quiet_s: float) -> float:
    """The wall-clock limit for something that takes ``quiet_s`` seconds on a quiet machine."""
    return HANG_FACTOR * quiet_s


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to every process of the group; False when none is left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def stop(proc: subprocess.Popen, grace_s: float = TERM_GRACE_S) -> None:
    """End ``proc`` and everything in its process group: SIGTERM, then SIGKILL after ``grace_s``.
    The leader is reaped; members that outlive it (orphans) are killed too."""
    if proc.poll() is None and _signal_group(proc.pid, signal.SIGTERM):
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    _signal_group(proc.pid, signal.SIGKILL)  # the leader, if it ignored SIGTERM, and any orphan
    proc.wait()


@contextlib.contextmanager
def spawn(cmd: Sequence[str], **popen_kw) -> Iterator[subprocess.Popen]:
    """``subprocess.Popen(cmd)`` in a session of its own; its whole group is stopped when the
    block ends, whether by return, failure or a hang-guard timeout."""
    proc = subprocess.Popen(list(map(str, cmd)), start_new_session=True, **popen_kw)
    try:
        yield proc
    finally:
        stop(proc)


def run(cmd: Sequence[str], *, quiet_s: float, check: bool = False, **popen_kw) -> subprocess.CompletedProcess:
    """Like ``subprocess.run(cmd, capture_output=True, text=True)`` in a session of its own. Past
    ``hang_guard_s(quiet_s)`` the group is killed and the test fails, saying so, with the output's
    tail; the group is killed as well if anything else interrupts the wait (pytest-timeout, ^C)."""
    popen_kw.setdefault("stdout", subprocess.PIPE)
    popen_kw.setdefault("stderr", subprocess.PIPE)
    popen_kw.setdefault("text", True)
    limit_s = hang_guard_s(quiet_s)
    start = time.monotonic()
    with spawn(cmd, **popen_kw) as proc:
        try:
            out, err = proc.communicate(timeout=limit_s)
            hung = False
        except subprocess.TimeoutExpired:
            stop(proc)
            out, err = proc.communicate()
            hung = True
    if hung:
        pytest.fail(
            f"hang guard: {' '.join(map(str, cmd))} still running after {time.monotonic() - start:.0f} s "
            f"({HANG_FACTOR}x its quiet {quiet_s:g} s); its process group was killed\n"
            f"stdout tail: {(out or '')[-2000:]}\nstderr tail: {(err or '')[-2000:]}"
        )
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def _environ(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:  # gone meanwhile, or not ours to read
        return b""


def _stat(pid: str) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def survivors(session_token: str) -> dict[int, str]:
    """pid -> command line (and the test that started it) of every live process this test run
    started: those whose environment carries ``SESSION_ENV=session_token`` (exec'd descendants,
    orphans included) and the test process's own children (forks keep its original environment)."""
    if not os.path.isdir("/proc"):
        return {}
    me = os.getpid()
    marker = f"{SESSION_ENV}={session_token}".encode()
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == me:
            continue
        stat = _stat(pid)
        if stat is None or stat[0] == "Z":  # a zombie is already dead; its parent reaps it
            continue
        env = _environ(pid).split(b"\0")
        if stat[1] == me or marker in env:
            test = next((v[20:].decode(errors="replace") for v in env if v.startswith(b"PYTEST_CURRENT_TEST=")), "?")
            found[int(pid)] = f"{_cmdline(pid)}  (started during {test})"
    return found
