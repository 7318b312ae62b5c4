"""The engine on its own thread, for the server: the step loop runs there; HTTP handlers hand
requests in through the engine's thread-safe inbox and get tokens back on asyncio queues.

Also the server metrics in Prometheus text format, named after vLLM's (``pwgpu:`` prefix).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from pagedweight.core.spec import PRECISION_NAMES
from pagedweight.policy.controller import ChangeKind
from pwgpu.engine import Engine, EngineRequest
from pwgpu.sampling import SamplingParams

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


class Histogram:
    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]):
        self.name, self.doc, self.buckets = name, doc, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total, self.num = 0.0, 0

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += 1
        self.total += value
        self.num += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        running = 0
        for b, c in zip(self.buckets, self.counts, strict=False):
            running += c
            out.append(f'{self.name}_bucket{{le="{b}"}} {running}')
        out += [f'{self.name}_bucket{{le="+Inf"}} {self.num}', f"{self.name}_sum {self.total}"]
        return out + [f"{self.name}_count {self.num}"]


class EngineThread:
    def __init__(self, engine: Engine, idle_tick_s: float = 0.05):
        self.engine = engine
        self.idle_tick_s = idle_tick_s
        self.error: str | None = None
        self.num_pending = 0  # submitted and not finished: what the queue limit counts
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pwgpu-engine", daemon=True)
        self.ttft = Histogram("pwgpu:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS_S)
        self.itl = Histogram("pwgpu:inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS_S)
        self.e2e = Histogram("pwgpu:e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS_S)
        self.num_finished = {"stop": 0, "length": 0, "abort": 0, "rejected": 0}

    def start(self) -> EngineThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def _loop(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                if eng.has_work() and eng.step():
                    continue
                # Idle, or waiting for memory: let upgrades land and precision come back.
                eng.idle_tick()
                self._wake.wait(self.idle_tick_s)
                self._wake.clear()
        except Exception as e:  # the server answers 503 from now on and tells waiting clients why
            self.error = f"{type(e).__name__}: {e}"
            for er in eng.unfinished():
                if er.on_event is not None:
                    er.finish_reason = "error"
                    er.on_event(er, [], True)
            raise

    # ---- called from the event loop -------------------------------------------------------
    def submit(
        self, prompt_ids: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop
    ) -> tuple[asyncio.Queue, Callable]:
        """Queue a request; events ``(EngineRequest, new ids, finished)`` arrive on the queue."""
        q: asyncio.Queue = asyncio.Queue()
        last_s = [None]

        def on_event(er: EngineRequest, new_ids: list[int], finished: bool) -> None:  # engine thread
            now = time.perf_counter()
            with self._lock:
                if new_ids:
                    if last_s[0] is None:
                        self.ttft.observe(self.engine.now() - er.req.arrival_s)
                    else:
                        self.itl.observe(now - last_s[0])
                    last_s[0] = now
                if finished:
                    self.num_pending -= 1
                    reason = er.finish_reason or "length"
                    self.num_finished[reason] = self.num_finished.get(reason, 0) + 1
                    if reason in ("stop", "length"):
                        self.e2e.observe(self.engine.now() - er.req.arrival_s)
            loop.call_soon_threadsafe(q.put_nowait, (er, new_ids, finished))

        with self._lock:
            self.num_pending += 1
        self.engine.submit(prompt_ids, params, on_event)
        self._wake.set()
        return q, on_event

    def cancel(self, on_event: Callable) -> None:
        self.engine.cancel(None, on_event)
        self._wake.set()

    # ---- metrics ----------------------------------------------------------------------------
    def metrics_text(self, model_name: str) -> str:
        eng = self.engine
        core = eng.core
        sched, kv, pool = core.scheduler, core.kv, core.pool
        used, free = kv.num_used_blocks, kv.num_free_blocks
        usage = pool.usage()
        lines = []

        def gauge(name: str, doc: str, value, kind: str = "gauge", labels: dict | None = None) -> None:
            if not any(line.startswith(f"# TYPE {name} ") for line in lines):
                lines.extend([f"# HELP {name} {doc}", f"# TYPE {name} {kind}"])
            lab = ",".join([f'model_name="{model_name}"'] + [f'{k}="{v}"' for k, v in (labels or {}).items()])
            lines.append(f"{name}{{{lab}}} {value}")

        gauge("pwgpu:num_requests_running", "Requests in the running batch.", len(sched.running))
        gauge("pwgpu:num_requests_waiting", "Requests waiting to be scheduled.", len(sched.waiting))
        gauge("pwgpu:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", used / max(used + free, 1))
        gauge("pwgpu:num_preemptions_total", "Preemptions so far.", sched.num_preemptions, "counter")
        for reason, n in sorted(self.num_finished.items()):
            gauge(
                "pwgpu:request_success_total", "Finished requests by reason.", n, "counter", {"finished_reason": reason}
            )
        for name in PRECISION_NAMES:
            pages = usage.get(f"weight:{name}", 0)
            gauge(
                "pwgpu:weight_bytes",
                "Routed-expert bytes by precision.",
                pages * pool.page_bytes,
                labels={"precision": name},
            )
        for owner in ("free", "kv", "pinned", "transition"):
            gauge(
                "pwgpu:pool_pages", "Pages of the unified pool by owner.", usage.get(owner, 0), labels={"owner": owner}
            )
        kinds = dict.fromkeys(ChangeKind, 0)
        for t in core.transitions:
            kinds[t.kind] += 1
        for kind, n in kinds.items():
            gauge("pwgpu:precision_transitions_total", "Expert precision changes.", n, "counter", {"kind": kind.value})
        with self._lock:
            for h in (self.ttft, self.itl, self.e2e):
                lines.extend(h.render())
        return "\n".join(lines) + "\n"
