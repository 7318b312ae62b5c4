"""The server's Prometheus metrics (text format 0.0.4), under vLLM's names so that vLLM
dashboards and load generators that read a server's metrics find them, plus this project's
own under ``pwgpu:``. Every series carries ``model_name``.

Request metrics are observed once per request, when the server hands its last chunk to the
client (or the client goes away): counters and histograms are updated in place, so a scrape
costs the same after a million requests as after one. Times are seconds on the engine's
clock; a request's clock starts when its HTTP request reaches the server.

Only the event-loop thread observes; the engine thread is read (gauges) but never written.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from pagedweight.core.spec import PRECISION_NAMES

# vLLM's buckets for the same histograms.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                     240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")


def _labels(pairs: dict) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in pairs.items()) + "}"


class Histogram:
    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]):
        self.name, self.doc, self.buckets = name, doc, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total, self.num = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.num += 1

    def render(self, base: dict) -> list[str]:
        out = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        running = 0
        for b, c in zip(self.buckets, self.counts, strict=False):
            running += c
            out.append(f"{self.name}_bucket{_labels({**base, 'le': float(b)})} {running}")
        out.append(f"{self.name}_bucket{_labels({**base, 'le': '+Inf'})} {self.num}")
        return out + [f"{self.name}_sum{_labels(base)} {self.total}", f"{self.name}_count{_labels(base)} {self.num}"]


@dataclass
class RequestTiming:
    """One finished request as the metrics see it (engine-clock seconds; None: never happened)."""

    finish_reason: str  # stop, length or abort
    arrival_s: float  # the HTTP request reached the server
    end_s: float  # the last chunk was handed over, or the client went away
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    scheduled_s: float | None = None  # first scheduled by the engine
    first_token_s: float | None = None  # first token handed to the client
    engine_first_token_s: float | None = None  # the step that produced the first token ended
    engine_last_token_s: float | None = None


class ServerMetrics:
    def __init__(self, model_name: str):
        self.base = {"model_name": model_name}
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.refused: dict[int, int] = {}  # HTTP status -> requests answered with it
        self.prompt_tokens = 0
        self.generation_tokens = 0
        h = Histogram
        self.ttft = h("vllm:time_to_first_token_seconds", "Time to first token (from HTTP arrival).", TTFT_BUCKETS_S)
        # vLLM renamed time_per_output_token to inter_token_latency; both are served, same values.
        self.tpot = h("vllm:time_per_output_token_seconds", "Time between output tokens.", ITL_BUCKETS_S)
        self.itl = h("vllm:inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS_S)
        self.request_tpot = h("vllm:request_time_per_output_token_seconds",
                              "Per request: decode time per token after the first.", ITL_BUCKETS_S)  # fmt: skip
        self.e2e = h("vllm:e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_BUCKETS_S)
        self.queue = h("vllm:request_queue_time_seconds", "From HTTP arrival to first scheduled.", REQUEST_BUCKETS_S)
        self.prefill = h("vllm:request_prefill_time_seconds", "From first scheduled to first token.", REQUEST_BUCKETS_S)
        self.decode = h("vllm:request_decode_time_seconds", "From first to last token.", REQUEST_BUCKETS_S)
        self.inference = h("vllm:request_inference_time_seconds", "From first scheduled to last token.",
                           REQUEST_BUCKETS_S)  # fmt: skip
        self.prompt_hist = h("vllm:request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.generation_hist = h("vllm:request_generation_tokens", "Output tokens per request.", TOKEN_BUCKETS)
        self.max_tokens_hist = h("vllm:request_params_max_tokens", "max_tokens per request.", TOKEN_BUCKETS)
        self.n_hist = h("vllm:request_params_n", "n per request.", N_BUCKETS)
        self.histograms = (self.ttft, self.tpot, self.itl, self.request_tpot, self.e2e, self.queue, self.prefill,
                           self.decode, self.inference, self.prompt_hist, self.generation_hist, self.max_tokens_hist,
                           self.n_hist)  # fmt: skip

    # ---- observations (event-loop thread) ----------------------------------------------------
    def first_token(self, t: RequestTiming) -> None:
        self.ttft.observe(t.first_token_s - t.arrival_s)
        self.prompt_tokens += t.prompt_tokens
        self.generation_tokens += 1

    def token_gap(self, gap_s: float, num_tokens: int = 1) -> None:
        """``num_tokens`` more tokens (after the first) handed over ``gap_s`` after the previous ones."""
        self.generation_tokens += num_tokens
        for _ in range(num_tokens):
            self.tpot.observe(gap_s / num_tokens)
            self.itl.observe(gap_s / num_tokens)

    def finish(self, t: RequestTiming) -> None:
        self.finished[t.finish_reason] = self.finished.get(t.finish_reason, 0) + 1
        self.e2e.observe(t.end_s - t.arrival_s)
        self.prompt_hist.observe(t.prompt_tokens)
        self.generation_hist.observe(t.output_tokens)
        self.max_tokens_hist.observe(t.max_tokens)
        if t.scheduled_s is not None:
            self.queue.observe(max(t.scheduled_s - t.arrival_s, 0.0))
            if t.engine_first_token_s is not None:
                self.prefill.observe(t.engine_first_token_s - t.scheduled_s)
                last = t.engine_last_token_s or t.engine_first_token_s
                self.decode.observe(last - t.engine_first_token_s)
                self.inference.observe(last - t.scheduled_s)
                if t.output_tokens > 1:
                    self.request_tpot.observe((last - t.engine_first_token_s) / (t.output_tokens - 1))

    def refuse(self, status: int) -> None:
        self.refused[status] = self.refused.get(status, 0) + 1

    # ---- the scrape ----------------------------------------------------------------------------
    def render(self, engine) -> str:
        """The metrics text; ``engine`` is read for the gauges (numbers it keeps up to date)."""
        core = engine.core
        sched, kv, pool = core.scheduler, core.kv, core.pool
        lines: list[str] = []

        def series(name: str, doc: str, kind: str, values: list[tuple[dict, float]]) -> None:
            lines.extend([f"# HELP {name} {doc}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{_labels({**self.base, **labels})} {value}" for labels, value in values)

        used, free = kv.num_used_blocks, kv.num_free_blocks
        series("vllm:num_requests_running", "Requests in the running batch.", "gauge", [({}, len(sched.running))])
        series("vllm:num_requests_waiting", "Requests waiting to be scheduled.", "gauge", [({}, len(sched.waiting))])
        series("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", "gauge",
               [({}, used / max(used + free, 1))])  # fmt: skip
        series("vllm:num_preemptions_total", "Preemptions so far.", "counter", [({}, sched.num_preemptions)])
        series("vllm:prompt_tokens_total", "Prompt tokens of requests that got a first token.", "counter",
               [({}, self.prompt_tokens)])  # fmt: skip
        series("vllm:generation_tokens_total", "Output tokens handed to clients.", "counter",
               [({}, self.generation_tokens)])  # fmt: skip
        series("vllm:request_success_total", "Finished requests by reason.", "counter",
               [({"finished_reason": r}, n) for r, n in self.finished.items()])  # fmt: skip
        for h in self.histograms:
            lines.extend(h.render(self.base))
        usage, page = pool.usage(), pool.page_bytes
        series("pwgpu:weight_bytes", "Routed-expert bytes by precision.", "gauge",
               [({"precision": p}, usage.get(f"weight:{p}", 0) * page) for p in PRECISION_NAMES])  # fmt: skip
        owners = ("free", "kv", "kv_cached", "pinned", "transition")  # kv_cached: evictable cached prefixes
        series("pwgpu:pool_pages", "Pages of the unified pool by owner.", "gauge",
               [({"owner": o}, usage.get(o, 0)) for o in owners])  # fmt: skip
        series("pwgpu:pool_page_bytes", "Bytes per pool page.", "gauge", [({}, pool.page_bytes)])
        series("pwgpu:precision_transitions_total", "Expert precision changes.", "counter",
               [({"kind": k.value}, n) for k, n in core.num_transitions.items()])  # fmt: skip
        series("pwgpu:requests_refused_total", "Requests answered with an error, by HTTP status.", "counter",
               [({"code": c}, n) for c, n in sorted(self.refused.items())])  # fmt: skip
        series("pwgpu:quality_proxy", "Importance-weighted loss estimate of the current precisions.", "gauge",
               [({}, core.quality_proxy)])  # fmt: skip
        return "\n".join(lines) + "\n"
