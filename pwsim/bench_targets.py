"""The scoreboard's targets for one policy, cell by cell (``pwsim bench``): is it best or within
``GOODPUT_TOLERANCE`` of the best other policy on goodput (and on the largest sustainable load),
and best or within ``QUALITY_TOLERANCE`` of the best time-averaged quality proxy among the
policies that reach its goodput?

*Reach* means a goodput at least ``1 - GOODPUT_TOLERANCE`` of the policy's own: goodputs that
close are the same result (a few requests, or the span of the last answers), so a policy
whose goodput is 0.1% lower still counts as reaching it. The policy itself is among them. When
the best quality proxy among them is exactly 0 (no expert ever below the top), the target is a
proxy of exactly 0: 10% of nothing is nothing.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from pagedweight.results.writer import markdown_table

GOODPUT_TOLERANCE = 0.02  # best, or within 2% of the best other policy
QUALITY_TOLERANCE = 0.10  # best, or within 10% of the best quality among those reaching the goodput


def _best_other(values: pd.Series, policy: str) -> tuple[str | None, float]:
    """The best of the other policies' ``values`` (per policy) and its value; (None, NaN) if
    none has one."""
    others = values.drop(policy).dropna()
    if others.empty:
        return None, np.nan
    name = str(others.idxmax())
    return name, float(others[name])


def _margin(value: float, best_other: float) -> float:
    return (value - best_other) / best_other if best_other > 0 and np.isfinite(best_other) else np.nan


def margins(values: pd.Series) -> pd.Series:
    """Each policy's margin over the best *other* policy, as a fraction (+0.05: 5% better)."""
    return pd.Series({p: _margin(v, _best_other(values, p)[1]) for p, v in values.items()})


def cell_verdicts(table: pd.DataFrame, policy: str = "pagedweight") -> pd.DataFrame:
    """One row per (cell, load) where ``policy`` ran: its goodput against the best other policy,
    its quality proxy against the best of the policies that reach its goodput, and whether each
    target is met. ``table``: the scoreboard (``bench.csv``: cell, load, policy,
    request_goodput, mean_quality_proxy)."""
    rows = []
    for (cell, load), g in table.groupby(["cell", "load"], sort=False):
        g = g.set_index("policy")
        if policy not in g.index:
            continue
        goodput = float(g.at[policy, "request_goodput"])
        other, other_goodput = _best_other(g["request_goodput"], policy)
        margin = _margin(goodput, other_goodput)
        goodput_met = bool(other is None or goodput >= (1 - GOODPUT_TOLERANCE) * other_goodput)
        reaching = g[g["request_goodput"] >= (1 - GOODPUT_TOLERANCE) * goodput]["mean_quality_proxy"].dropna()
        quality = float(g.at[policy, "mean_quality_proxy"])
        best_quality_policy = str(reaching.idxmin()) if len(reaching) else policy
        best_quality = float(reaching.min()) if len(reaching) else quality
        quality_met = bool(quality <= (1 + QUALITY_TOLERANCE) * best_quality)
        rows.append(
            {
                "cell": cell,
                "load": load,
                "goodput": goodput,
                "best_other": other,
                "best_other_goodput": other_goodput,
                "goodput_margin": margin,
                "goodput_met": goodput_met,
                "quality_proxy": quality,
                "best_quality_reaching": best_quality_policy,
                "best_quality_proxy": best_quality,
                "quality_met": quality_met,
            }
        )
    return pd.DataFrame(rows)


def sustainable_verdicts(sustainable: pd.DataFrame, policy: str = "pagedweight") -> pd.DataFrame:
    """One row per cell: ``policy``'s largest sustainable load against the best other policy's
    (``sustainable.csv``: cell, policy, max_load)."""
    rows = []
    for cell, g in sustainable.groupby("cell", sort=False):
        g = g.set_index("policy")
        if policy not in g.index:
            continue
        load = float(g.at[policy, "max_load"])
        other, other_load = _best_other(g["max_load"], policy)
        met = bool(other is None or load >= (1 - GOODPUT_TOLERANCE) * other_load)
        rows.append(
            {"cell": cell, "max_load": load, "best_other": other, "best_other_max_load": other_load, "met": met}
        )
    return pd.DataFrame(rows)


def targets_markdown(table: pd.DataFrame, sustainable: pd.DataFrame, policy: str = "pagedweight") -> list[str]:
    """The bench.md section: a count of the cells that meet each target, then the rows."""
    cells = cell_verdicts(table, policy)
    if cells.empty:
        return []
    n = len(cells)
    both = int((cells["goodput_met"] & cells["quality_met"]).sum())
    lines = [
        f"## Targets: {policy}",
        "",
        f"Best or within {GOODPUT_TOLERANCE:.0%} of the best other policy on goodput; best or within "
        f"{QUALITY_TOLERANCE:.0%} of the best quality proxy among the policies whose goodput is within "
        f"{GOODPUT_TOLERANCE:.0%} of its own (pwsim/bench_targets.py).",
        "",
        f"- goodput met in {int(cells['goodput_met'].sum())} of {n} (cell, load) pairs; quality met in "
        f"{int(cells['quality_met'].sum())} of {n}; both in {both} of {n}",
    ]
    held = sustainable_verdicts(sustainable, policy) if len(sustainable) else pd.DataFrame()
    if len(held):
        lines.append(f"- largest sustainable load met in {int(held['met'].sum())} of {len(held)} cells")
    lines += ["", markdown_table(_yes_no(cells)), ""]
    if len(held):
        lines += [markdown_table(_yes_no(held)), ""]
    return lines


def _yes_no(df: pd.DataFrame) -> pd.DataFrame:
    out = df.copy()
    for col in out.columns:
        if out[col].dtype == bool:
            out[col] = out[col].map({True: "yes", False: "**no**"})
    return out
