"""The engine on its own thread, for the server: the step loop runs there; HTTP handlers hand
requests in through the engine's thread-safe inbox and get tokens back on asyncio queues.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from pwgpu.engine import Engine, EngineRequest
from pwgpu.sampling import SamplingParams, TokenLogprobs


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
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        loop: asyncio.AbstractEventLoop,
        arrival_s: float | None = None,
    ) -> tuple[asyncio.Queue, Callable]:
        """Queue a request that reached the server at ``arrival_s`` (engine clock). Events
        ``(EngineRequest, new ids, their log-probabilities or None, finished)`` arrive on the queue."""
        q: asyncio.Queue = asyncio.Queue()

        def on_event(er: EngineRequest, new_ids: list[int], finished: bool) -> None:  # engine thread
            # Taken here, on the engine thread, while ``er.logprobs`` ends with these tokens.
            lps: list[TokenLogprobs] | None = er.logprobs[-len(new_ids) :] if new_ids and er.logprobs else None
            if finished:
                with self._lock:
                    self.num_pending -= 1
            loop.call_soon_threadsafe(q.put_nowait, (er, new_ids, lps, finished))

        with self._lock:
            self.num_pending += 1
        self.engine.submit(prompt_ids, params, on_event, arrival_s)
        self._wake.set()
        return q, on_event

    def cancel(self, on_event: Callable) -> None:
        self.engine.cancel(None, on_event)
        self._wake.set()
