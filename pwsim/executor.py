"""Independent jobs (the policies of one run, the cells of a sweep) in worker processes, with
one progress display, and every worker stopped on Ctrl-C.

``run_jobs(jobs, workers, display)`` runs ``job.fn(*job.args, progress=...)`` for every job and
returns the results in job order; ``on_result`` sees each one as it finishes. With one worker
the jobs run in this process, one after another. With more, each of ``workers`` processes
(``spawn``: nothing of the parent's state leaks into a job) takes jobs until none are left.
A job reports its progress by calling ``progress(fraction)``.

Interrupts: workers ignore SIGINT (a terminal's Ctrl-C reaches the whole process group) and
die with their parent (Linux). On KeyboardInterrupt, or any error, the parent terminates
every worker (SIGTERM, then SIGKILL after ``STOP_GRACE_S``) before the exception leaves
``run_jobs``; what finished jobs wrote stays. A job's ``PagedWeightError`` is raised again in
the parent with the same message, so the CLI still prints one line.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from pagedweight.errors import PagedWeightError

STOP_GRACE_S = 2.0
# Progress messages from a worker at most this often (and at every 1% step at most once).
REPORT_INTERVAL_S = 0.2


# Where independent jobs of a sweep or a bench run: a local process pool, or Ray.
EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class Job:
    """``fn(*args, progress=callable)``: a module-level function (picklable), plain-data args.
    ``cost``: how long the job is expected to take, relative to the others; workers take the
    costliest first, so that a long job does not start last and run on alone while the other
    workers idle (results still come back in job order)."""

    name: str
    fn: Callable[..., Any]
    args: tuple = field(default_factory=tuple)
    cost: float = 1.0


class WorkerError(PagedWeightError):
    """A job failed in a worker with an error that is not the project's own (a bug): the
    message carries the worker's traceback."""


class Display:
    """No display at all; the base of the two real ones."""

    def start(self, jobs: Sequence[Job]) -> None: ...

    def update(self, index: int, fraction: float) -> None: ...

    def done(self, index: int, line: str) -> None: ...

    def add(self, jobs: Sequence[Job]) -> None:
        """More jobs joined the run (their indices follow the earlier ones)."""

    def close(self) -> None: ...


class LineDisplay(Display):
    """For logs and pipes: one line per finished job, nothing in between (to stderr, or to
    ``write``)."""

    def __init__(self, write: Callable[[str], None] | None = None):
        self.write = write

    def done(self, index: int, line: str) -> None:
        if self.write is not None:
            self.write(line)
        else:
            print(line, file=sys.stderr, flush=True)


class BarDisplay(Display):
    """For a terminal: one bar for all jobs (jobs done, and each running job's percentage),
    with a line above it as each job finishes. Erased when closed."""

    def start(self, jobs: Sequence[Job]) -> None:
        from tqdm import tqdm

        tqdm.monitor_interval = 0  # no monitor thread
        self.names = [j.name for j in jobs]
        self.running: dict[int, float] = {}
        columns, lines = _terminal_size()
        self.bar = tqdm(total=len(jobs), unit="job", leave=False, ncols=columns, nrows=lines, file=sys.stderr)
        self._last_s = 0.0

    def update(self, index: int, fraction: float) -> None:
        self.running[index] = fraction
        now = time.monotonic()
        if now - self._last_s >= 0.1:
            self._last_s = now
            self._postfix()

    def _postfix(self) -> None:
        text = "  ".join(f"{self.names[i]} {f:.0%}" for i, f in sorted(self.running.items()))
        self.bar.set_postfix_str(text, refresh=True)

    def done(self, index: int, line: str) -> None:
        self.running.pop(index, None)
        self.bar.write(line, file=sys.stderr)
        self.bar.update(1)
        self._postfix()

    def add(self, jobs: Sequence[Job]) -> None:
        self.names += [j.name for j in jobs]
        self.bar.total += len(jobs)
        self.bar.refresh()

    def close(self) -> None:
        if getattr(self, "bar", None) is not None:
            self.bar.close()
            self.bar = None


def _terminal_size() -> tuple[int, int]:
    """stderr's terminal size, 100 x 24 where it reports none: a pty without a size says 0 x 0,
    and tqdm would draw an empty bar, or none at all (it hides bars below the last row)."""
    try:
        columns, lines = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        columns = lines = 0
    return columns or 100, lines or 24


def auto_display(enabled: bool = True, write: Callable[[str], None] | None = None) -> Display:
    """Bars when stderr is a terminal, a line per job otherwise (to stderr, or ``write``);
    nothing when not ``enabled``."""
    if not enabled:
        return Display()
    return BarDisplay() if sys.stderr.isatty() else LineDisplay(write)


def run_jobs(
    jobs: Sequence[Job],
    workers: int,
    display: Display | None = None,
    on_result: Callable[[int, Any], str | None] | None = None,
    then: Callable[[int, Any], Sequence[Job]] | None = None,
) -> list[Any]:
    """Run every job; results in job order. ``on_result(index, result)`` is called in the
    parent as each job finishes and may return the line the display shows for it. ``then(index,
    result)``, called next, may return more jobs: they join the same workers (no worker idles
    waiting for a whole batch to end), ahead of the jobs not started yet (costliest first), and
    their results follow in the list."""
    jobs = list(jobs)
    display = display or Display()
    display.start(jobs)
    results: list[Any] = [None] * len(jobs)

    def finished(index: int, result: Any, wall_s: float) -> list[int]:
        results[index] = result
        line = on_result(index, result) if on_result else None
        display.done(index, line or f"{jobs[index].name}: done ({wall_s:.1f} s)")
        more = list(then(index, result)) if then else []
        if not more:
            return []
        first = len(jobs)
        jobs.extend(more)
        results.extend([None] * len(more))
        display.add(more)
        return list(range(first, len(jobs)))

    try:
        if workers <= 1 or (len(jobs) <= 1 and then is None):
            todo = deque(range(len(jobs)))
            while todo:
                i = todo.popleft()
                job = jobs[i]
                t0 = time.perf_counter()
                result = job.fn(*job.args, progress=_Throttle(lambda f, i=i: display.update(i, f)))
                todo.extendleft(sorted(finished(i, result, time.perf_counter() - t0), key=lambda j: jobs[j].cost))
        elif jobs:
            # Without ``then`` no job joins later: no more workers than jobs.
            _run_in_workers(jobs, workers if then else min(workers, len(jobs)), display, finished)
    finally:
        display.close()
    return results


class _Throttle:
    """``progress(fraction)`` that passes on at most one call per ``REPORT_INTERVAL_S`` (and the
    last one), so a job may call it as often as it likes."""

    def __init__(self, send: Callable[[float], None]):
        self.send, self._last_s, self._last = send, 0.0, -1.0

    def __call__(self, fraction: float) -> None:
        now = time.monotonic()
        if fraction >= 1.0 or (now - self._last_s >= REPORT_INTERVAL_S and fraction - self._last >= 0.01):
            self._last_s, self._last = now, fraction
            self.send(fraction)


def dispatch_order(jobs: Sequence[Job]) -> list[int]:
    """The order workers take jobs in: costliest first (the longest runs start early, so the
    workers finish together), equal costs in job order."""
    return sorted(range(len(jobs)), key=lambda i: -jobs[i].cost)


def _run_in_workers(jobs: list[Job], num_workers: int, display: Display, finished) -> None:
    """``finished(index, result, wall_s)`` returns the indices of jobs it added to ``jobs``."""
    ctx = mp.get_context("spawn")
    procs: list[mp.process.BaseProcess] = []
    conns: list[Connection] = []
    try:
        for _ in range(num_workers):
            parent_end, child_end = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(child_end,), daemon=True, name="pwsim-worker")
            # Block SIGINT while the worker is created: it inherits the mask and ignores SIGINT
            # before unblocking it, so a Ctrl-C can never raise inside a worker; here the
            # signal waits until the mask is restored, then stops the run as usual.
            old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                p.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        todo = deque(dispatch_order(jobs))
        busy: dict[int, tuple[int, float]] = {}  # worker -> (job index, start time)
        idle: list[int] = []  # workers waiting for a job that a finishing one may yet add

        def assign(w: int) -> None:
            if todo:
                i = todo.popleft()
                job = jobs[i]
                conns[w].send((i, job.fn, job.args))
                busy[w] = (i, time.perf_counter())
            else:
                idle.append(w)

        for w in range(num_workers):
            assign(w)
        while busy:
            waiting = {conns[w]: w for w in busy} | {procs[w].sentinel: w for w in busy}
            for ready in wait(list(waiting), timeout=1.0):
                w = waiting[ready]
                if w not in busy:
                    continue  # its message was read through the other handle already
                i = busy[w][0]
                try:
                    msg = conns[w].recv() if conns[w].poll() else None
                except EOFError:
                    msg = None
                if msg is None:
                    if procs[w].is_alive():
                        continue
                    raise PagedWeightError(f"{jobs[i].name}: its worker process died (exit code {procs[w].exitcode})")
                if msg[0] == "progress":
                    display.update(i, msg[2])
                elif msg[0] == "done":
                    start_s = busy.pop(w)[1]
                    added = finished(i, msg[2], time.perf_counter() - start_s)
                    if added:
                        # Ahead of the jobs not started yet: they continue work under way (a
                        # search's next probe, with later rounds waiting on it).
                        todo.extendleft(sorted(added, key=lambda j: jobs[j].cost))
                        while idle and todo:
                            assign(idle.pop())
                    assign(w)
                else:  # "failed": the job's own exception
                    raise msg[2]
        for w in idle:
            conns[w].send(None)
    finally:
        _stop(procs, conns)


def _stop(procs, conns) -> None:
    """Terminate every worker still running (finished ones were told to leave) and make sure
    none is left."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    for c in conns:
        c.close()


def _worker_main(conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _die_with_parent()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        index, fn, args = msg
        try:
            result = fn(*args, progress=_Throttle(lambda f, i=index: conn.send(("progress", i, f))))
        except Exception as e:  # noqa: BLE001 - handed to the parent, which raises it
            conn.send(("failed", index, _portable(e)))
        else:
            conn.send(("done", index, result))
        # A finished simulation is garbage in cycles (engine, processes, generators) that has
        # aged into the oldest generation, which the collector rarely looks at: without this, a
        # worker grew by a cluster replica's memory (~160 MB) with every job it ran.
        result = msg = None
        gc.collect()


def _portable(e: Exception) -> Exception:
    """``e`` if it survives pickling as itself, else a ``WorkerError`` with the traceback."""
    import pickle

    if isinstance(e, PagedWeightError):
        try:
            back = pickle.loads(pickle.dumps(e))
            if type(back) is type(e) and str(back) == str(e):
                return e
        except Exception:  # noqa: BLE001
            pass
        return PagedWeightError(str(e))
    return WorkerError(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the parent dies, even by SIGKILL, so no worker outlives a run."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
