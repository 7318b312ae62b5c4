"""What every test run shares: no timing checks in disguise, and no process left behind.

- Hypothesis never fails a test for being slow (no per-example deadline, no too_slow health
  check): a busy machine is not a bug.
- The simulator's page pool checks every call's pages (``PAGEDWEIGHT_POOL_CHECKS=1``), which
  its runs leave off for speed.
- Torch, BLAS and OpenMP run one thread per process (unless ``OMP_NUM_THREADS`` is set): on a
  shared machine two OpenMP threads that wait for each other at every op made the engine's
  runs 2-5x slower than one thread did. Subprocesses inherit the setting.
- Tests read nothing of the user's setup: the model cache is a fresh folder per run and
  ``$PWGPU_DEFAULT_MODEL`` is ignored (the default model is the checkout's).
- Every process a test starts carries ``proc.SESSION_ENV`` in its environment; when the run ends,
  any such process still alive (and any child of the test process itself) is reported, killed,
  and the run fails. Tests start processes through tests/proc.py, which kills each one's whole
  process group when the test is done with it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time

import proc

# Before anything imports torch or numpy's BLAS (conftest is imported before the test modules).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The simulator's page pool checks every call's pages here (off by default in runs: pwsim.engine).
os.environ["PAGEDWEIGHT_POOL_CHECKS"] = "1"

try:  # the dev extra has it; a GPU machine running only -m gpu may not
    from hypothesis import HealthCheck, settings
except ImportError:
    pass
else:
    settings.register_profile("pagedweight", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("pagedweight")

_TOKEN = f"{os.getpid()}-{time.time_ns()}"
_CACHE = tempfile.mkdtemp(prefix="pagedweight-test-cache-")


def pytest_configure(config):
    os.environ[proc.SESSION_ENV] = _TOKEN
    os.environ["PAGEDWEIGHT_CACHE"] = _CACHE
    os.environ.pop("PWGPU_DEFAULT_MODEL", None)


def _stop_resource_tracker() -> None:
    """multiprocessing's resource tracker, which the first spawned worker (pwsim's executor, run
    in the test process) starts for this process and which lives as long as it does, by design:
    stopped here like any helper of the test process, so only real leftovers are reported."""
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop is not None:
        stop()


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_CACHE, ignore_errors=True)
    _stop_resource_tracker()
    left = proc.survivors(_TOKEN)
    if not left:
        return
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    lines = [f"  pid {pid}: {cmd[:300]}" for pid, cmd in sorted(left.items())]
    message = "\n".join([f"{len(left)} process(es) started by tests outlived the run (now killed):", *lines])
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("!", "processes left behind", red=True, bold=True)
        reporter.write_line(message)
    else:
        print(message)
    session.exitstatus = 1
