"""Summary statistics of a trace, with the definitions of ``../shared/traces/PROVENANCE.md``.

- rate: 1 / mean IAT = (rows - 1) / span, span = last arrival - first arrival.
- IAT CV: std/mean of the gaps between consecutive (sorted) arrivals (population std).
- per-W count CV / max: std/mean and max of the number of arrivals in each W-second window,
  windows [kW, (k+1)W) from the first arrival up to the one holding the last.
- lengths: numpy percentiles with linear interpolation.
- prefix reuse (traces with Mooncake ``hash_ids``): the share of block ids seen earlier in the
  trace (PROVENANCE.md's figure), and the prefix cache hit rate: prompt tokens in each
  request's longest run of leading blocks cached before it arrived, over all prompt tokens, with
  an unbounded cache (every block ever seen stays) or an LRU cache of ``capacity_blocks`` blocks.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from pagedweight.workload.traces import RequestTrace

COUNT_WINDOWS_S = (1.0, 3.0, 60.0)


def arrival_stats(arrival_s: np.ndarray, windows_s: tuple[float, ...] = COUNT_WINDOWS_S) -> dict:
    t = np.sort(np.asarray(arrival_s, dtype=np.float64))
    t = t - t[0]
    span_s = float(t[-1]) if len(t) else 0.0
    out: dict = {"rows": len(t), "span_s": span_s}
    # 1 / mean IAT, i.e. (rows - 1) / span: the figure PROVENANCE.md reports.
    out["rate_qps"] = (len(t) - 1) / span_s if span_s > 0 else float("nan")
    gaps = np.diff(t)
    if len(gaps) and gaps.mean() > 0:
        out["iat_cv"] = float(gaps.std() / gaps.mean())
        out["iat_under_1ms_share"] = float(np.mean(gaps < 1e-3))
        out["max_gap_s"] = float(gaps.max())
    for w in windows_s:
        counts = np.bincount((t // w).astype(np.int64), minlength=int(span_s // w) + 1)
        out[f"count_{w:g}s_cv"] = float(counts.std() / counts.mean())
        out[f"count_{w:g}s_max"] = int(counts.max())
    return out


def length_stats(tokens: np.ndarray) -> dict:
    x = np.asarray(tokens, dtype=np.float64)
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {
        "mean": float(x.mean()),
        "median": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": int(x.max()),
        "min": int(x.min()),
    }


def prefix_stats(trace: RequestTrace, capacity_blocks: int | None = None, block_tokens: int = 512) -> dict:
    """Prefix reuse of a trace with ``hash_ids`` (blocks of ``block_tokens`` prompt tokens). A
    request's hit is its longest run of leading blocks whose chain (this block and every one
    before it) is cached; its hit tokens are capped at its prompt less one token, as a serving
    engine computes at least the last one. ``capacity_blocks``: an LRU cache of that many
    blocks; None: unbounded."""
    if trace.hash_ids is None:
        return {}
    seen_ids: set[int] = set()
    chains: dict[tuple[int, int], int] = {}  # (chain of the blocks before, block id) -> chain
    cache: OrderedDict[int, None] = OrderedDict()
    reused = total_ids = hit_tokens = 0
    for ids, prompt in zip(trace.hash_ids, trace.prompt_tokens.tolist(), strict=True):
        ids = ids.tolist()
        total_ids += len(ids)
        reused += sum(i in seen_ids for i in ids)
        seen_ids.update(ids)
        chain, hit, missed = -1, 0, False
        for block_id in ids:
            chain = chains.setdefault((chain, block_id), len(chains))  # equal only if every id so far is
            if not missed and chain in cache:
                hit += 1
                cache.move_to_end(chain)
            else:
                missed = True
                cache[chain] = None
        if capacity_blocks is not None:
            while len(cache) > capacity_blocks:
                cache.popitem(last=False)
        hit_tokens += min(hit * block_tokens, max(prompt - 1, 0))
    prompt_total = int(trace.prompt_tokens.sum())
    return {
        "block_ids_seen_before_share": reused / total_ids if total_ids else 0.0,
        "prefix_hit_rate": hit_tokens / prompt_total if prompt_total else 0.0,
        "prefix_cache_blocks": "unbounded" if capacity_blocks is None else capacity_blocks,
    }


def trace_stats(trace: RequestTrace) -> dict:
    out = {
        **arrival_stats(trace.arrival_s),
        "prompt_tokens": length_stats(trace.prompt_tokens),
        "output_tokens": length_stats(trace.output_tokens),
    }
    if trace.hash_ids is not None:
        out["prefix"] = prefix_stats(trace)
    return out


def format_stats(stats: dict) -> str:
    """Plain text, one figure per line, in the order PROVENANCE.md lists them."""
    lines = [f"rows                      {stats['rows']:,}"]
    if "span_s" in stats:
        lines += [
            f"span                      {stats['span_s']:,.1f} s ({stats['span_s'] / 60:.1f} min)",
            f"mean arrival rate         {stats['rate_qps']:.3f} req/s",
        ]
        if "iat_cv" in stats:
            lines += [
                f"IAT CV                    {stats['iat_cv']:.2f}",
                f"share of IATs < 1 ms      {100 * stats['iat_under_1ms_share']:.1f} %",
                f"largest gap               {stats['max_gap_s']:.1f} s",
            ]
        for w in COUNT_WINDOWS_S:
            key = f"count_{w:g}s"
            if f"{key}_cv" in stats:
                label = f"per-{w:g} s count CV / max"
                lines.append(f"{label:26s}{stats[key + '_cv']:.3f} / {stats[key + '_max']}")
    for name in ("prompt_tokens", "output_tokens"):
        s = stats[name]
        label = name.replace("_", " ")
        lines.append(
            f"{label:26s}mean {s['mean']:,.1f}  median {s['median']:,.1f}  p90 {s['p90']:,.1f}  "
            f"p99 {s['p99']:,.1f}  max {s['max']:,}  min {s['min']:,}"
        )
    if stats.get("prefix"):
        p = stats["prefix"]
        lines += [
            f"block ids seen before     {100 * p['block_ids_seen_before_share']:.1f} %",
            f"prefix cache hit rate     {100 * p['prefix_hit_rate']:.1f} % of prompt tokens "
            f"({p['prefix_cache_blocks']} cache of 512-token blocks)",
        ]
    return "\n".join(lines)
