"""Turn a validated ``workload:`` config into the ``RequestTrace`` a run replays.

``build_workload`` is the one entry point; the steps it applies are separate functions so tests
and tools can use them alone. Every step that changes the requests says so in ``trace.notes``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pagedweight.config.workload import (
    FileLengths,
    FixedLengths,
    LengthsConfig,
    LognormalLengths,
    LognormalTokens,
    SyntheticWorkload,
    TraceWorkload,
)
from pagedweight.errors import ConfigError, TraceError
from pagedweight.workload.arrivals import generate_arrivals
from pagedweight.workload.traces import (
    RequestTrace,
    load_azure,
    load_burstgpt,
    load_generic,
    load_lengths,
    load_mooncake,
)


def build_workload(
    cfg: TraceWorkload | SyntheticWorkload, base_dir: str | Path, max_context_tokens: int, rng: np.random.Generator
) -> RequestTrace:
    """Load or generate the requests, then window, scale and fit them to the model's context.

    ``base_dir`` is the scenario file's directory (relative paths resolve against it); ``rng``
    is the run's generator (used by synthetic arrivals and lengths and by random spreading)."""
    if max_context_tokens < 2:
        raise ConfigError(f"max_context_tokens(={max_context_tokens}) must be >= 2")
    if isinstance(cfg, SyntheticWorkload):
        arrival_s = generate_arrivals(cfg.arrival, rng, num_requests=cfg.num_requests, duration_s=cfg.duration_s)
        if len(arrival_s) == 0:
            raise TraceError("synthetic workload produced no requests (duration_s too short for the rate?)")
        prompt, output = sample_lengths(cfg.lengths, len(arrival_s), rng, base_dir)
        trace = RequestTrace(arrival_s, prompt, output, source=f"synthetic:{cfg.arrival.kind}")
    else:
        trace = load_trace(cfg, base_dir, rng)
        if cfg.spread_bucket_s is not None:
            trace = spread_buckets(trace, cfg.spread_bucket_s, cfg.spread, rng)
        trace = window(trace, cfg.start_s, cfg.duration_s)
        if cfg.max_requests is not None and cfg.max_requests < len(trace):
            trace = take(trace, cfg.max_requests)
        if cfg.copies > 1:
            trace = overlay_copies(trace, cfg.copies)
        if cfg.rate_scale != 1.0:
            trace = scale_rate(trace, cfg.rate_scale)
    return truncate_to_context(trace, max_context_tokens)


def load_trace(cfg: TraceWorkload, base_dir: str | Path, rng: np.random.Generator) -> RequestTrace:
    """The file named by a ``kind: trace`` config, as-is (sharegpt gets arrivals from its process)."""
    path = cfg.resolved_path(base_dir)
    unit = cfg.effective_time_unit()
    if cfg.format == "azure":
        return load_azure(path, sort=cfg.sort)
    if cfg.format == "mooncake":
        return load_mooncake(path, unit, sort=cfg.sort)
    if cfg.format == "burstgpt":
        return load_burstgpt(path, model=cfg.burstgpt_model, drop_failed=cfg.drop_failed, time_unit=unit, sort=cfg.sort)
    if cfg.format == "generic":
        c = cfg.columns
        return load_generic(path, c.arrival, c.prompt_tokens, c.output_tokens, unit, sort=cfg.sort)
    prompt, output = load_lengths(path)
    # Arrivals for every row, or up to the end of the window, whichever comes first.
    horizon_s = None if cfg.duration_s is None else cfg.start_s + cfg.duration_s
    arrival_s = generate_arrivals(cfg.arrival, rng, num_requests=len(prompt), duration_s=horizon_s)
    n = len(arrival_s)
    note = f"{n} of {len(prompt)} rows, in file order, with {cfg.arrival.kind} arrivals"
    return RequestTrace(arrival_s, prompt[:n], output[:n], source=f"sharegpt:{path}", notes=[note])


def sample_lengths(
    cfg: LengthsConfig, n: int, rng: np.random.Generator, base_dir: str | Path = "."
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` (prompt_tokens, output_tokens) pairs from a ``lengths:`` config."""
    if isinstance(cfg, FixedLengths):
        return np.full(n, cfg.prompt_tokens, dtype=np.int64), np.full(n, cfg.output_tokens, dtype=np.int64)
    if isinstance(cfg, LognormalLengths):
        return _lognormal(cfg.prompt, n, rng), _lognormal(cfg.output, n, rng)
    if isinstance(cfg, FileLengths):
        prompt, output = load_lengths(cfg.resolved_path(base_dir))
        rows = rng.integers(0, len(prompt), size=n) if cfg.order == "random" else np.arange(n) % len(prompt)
        return prompt[rows], output[rows]
    raise TypeError(f"unknown lengths config {type(cfg).__name__}")


def _lognormal(dist: LognormalTokens, n: int, rng: np.random.Generator) -> np.ndarray:
    mu, sigma = dist.mu_sigma()
    tokens = np.rint(rng.lognormal(mu, sigma, size=n))
    return np.clip(tokens, dist.min, dist.max if dist.max is not None else None).astype(np.int64)


def spread_buckets(trace: RequestTrace, bucket_s: float, mode: str, rng: np.random.Generator) -> RequestTrace:
    """Spread requests that share a timestamp over [t, t + bucket_s), never past the next timestamp.

    Mooncake's conversation trace stamps ~10 requests at once every ~3 s; replaying them as one
    batch is an artefact of the logging. File order is kept within a bucket (multi-turn order)."""
    if bucket_s <= 0:
        raise ConfigError(f"bucket_s(={bucket_s}) must be > 0")
    t = trace.arrival_s
    if len(t) < 2:
        return trace
    starts, group, sizes = np.unique(t, return_inverse=True, return_counts=True)
    if len(starts) == len(t):
        return trace
    next_start = np.append(starts[1:], np.inf)
    width = np.minimum(bucket_s, next_start - starts)
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # t is sorted, so groups are contiguous
    rank = np.arange(len(t)) - first[group]
    if mode == "even":
        frac = rank / sizes[group]
    elif mode == "random":
        u = rng.uniform(size=len(t))
        frac = u[np.lexsort((u, group))]  # sorted within each group, so file order is kept
    else:
        raise ConfigError(f"mode(={mode!r}) must be 'even' or 'random'")
    spread_s = starts[group] + width[group] * frac
    shared = int(np.sum(sizes[sizes > 1]))
    note = f"spread {shared} requests sharing {int(np.sum(sizes > 1))} timestamps over {bucket_s:g} s ({mode})"
    return trace.with_changes(note, arrival_s=spread_s)


def window(trace: RequestTrace, start_s: float = 0.0, duration_s: float | None = None) -> RequestTrace:
    """Requests arriving in [start_s, start_s + duration_s), with times shifted so start_s is 0."""
    if start_s == 0 and duration_s is None:
        return trace
    t = trace.arrival_s
    end_s = np.inf if duration_s is None else start_s + duration_s
    keep = (t >= start_s) & (t < end_s)
    if not keep.any():
        raise TraceError(
            f"{trace.source}: no requests in the window [{start_s:g}, {end_s:g}) s; "
            f"the trace spans [0, {trace.span_s():.1f}] s"
        )
    note = f"window [{start_s:g}, {end_s:g}) s: {int(keep.sum())} of {len(t)} requests"
    return trace.select(keep, note, arrival_s=t[keep] - start_s)


def take(trace: RequestTrace, max_requests: int) -> RequestTrace:
    """The first ``max_requests`` requests."""
    n = max(0, int(max_requests))
    note = f"first {n} of {len(trace)} requests"
    return trace.select(slice(0, n), note)


def scale_rate(trace: RequestTrace, rate_scale: float) -> RequestTrace:
    """Multiply the load: every inter-arrival time is divided by ``rate_scale``."""
    if rate_scale <= 0:
        raise ConfigError(f"rate_scale(={rate_scale}) must be > 0")
    return trace.with_changes(f"rate x{rate_scale:g}", arrival_s=trace.arrival_s / rate_scale)


def overlay_copies(trace: RequestTrace, copies: int) -> RequestTrace:
    """``copies`` times the requests over the same span: copy j's arrivals move later by
    ``j * span / copies`` and those past the end wrap to the start (times modulo the span), so
    every copy keeps the trace's lengths and gaps and the copies' bursts fall apart."""
    if copies <= 1 or len(trace) == 0:
        return trace
    t0 = float(trace.arrival_s[0])
    rel = trace.arrival_s - t0
    span = float(rel[-1]) or 1.0
    # The span is closed at its last arrival; one mean gap more keeps that arrival and the
    # first from landing on each other when they wrap.
    period = span + span / max(len(trace) - 1, 1)
    times = np.concatenate([(rel + j * period / copies) % period for j in range(copies)])
    order = np.argsort(times, kind="stable")
    note = f"{copies} copies overlaid, each shifted by 1/{copies} of the {period:.0f} s span"
    return trace.with_changes(
        note,
        arrival_s=t0 + times[order],
        prompt_tokens=np.tile(trace.prompt_tokens, copies)[order],
        output_tokens=np.tile(trace.output_tokens, copies)[order],
    )


def truncate_to_context(trace: RequestTrace, max_context_tokens: int) -> RequestTrace:
    """Make prompt + output <= max_context_tokens: shorten the prompt first (to 1 at least),
    then the output (which keeps >= 1 token)."""
    p, o = trace.prompt_tokens, trace.output_tokens
    over = p + o > max_context_tokens
    if not over.any():
        return trace
    new_o = np.minimum(o, max_context_tokens - 1)
    new_p = np.minimum(p, max_context_tokens - new_o)
    note = (
        f"truncated {int(over.sum())} requests to the {max_context_tokens}-token context "
        f"({int(np.sum(new_p < p))} prompts, {int(np.sum(new_o < o))} outputs shortened)"
    )
    return trace.with_changes(note, prompt_tokens=new_p, output_tokens=new_o)
