"""Measure an importance table on a real checkpoint: routing statistics, the paper's gradient
score, per-precision Fisher estimates of the loss of quantising each expert, and the oracle.

Definitions (per routed expert i of MoE layer l; N calibration tokens in all; ``y_i(x)`` is the
expert's output vector for token x before the gate weight ``a_i(x)`` multiplies it):

- ``routing_freq = n_i / N``, ``routing_weight_mass = sum_x a_i(x) / N`` (as in
  ``pagedweight/policy/importance.py``).
- ``g(x) = dL/dy_i(x)`` where L is the summed next-token loss of x's calibration window: the
  loss y_i(x) really changes (its own position and the later ones it reaches through attention).
  A per-token-loss gradient would need one backward pass per token.
- ``importance = (1/N) sum_{x routed to i} Var_h g(x)_h``: the paper's ``E_x[Var(dL/dE_i(x))]``,
  the variance over the H components, averaged over all N tokens (zero where i is not routed).
- ``dy_p(x) = FFN_i^p(x) - FFN_i(x)``: the expert's real output error with its three matrices
  quantised to p by the kernels' reference quantiser.
- ``fisher_token(p) = (1/N) * 1/2 sum_x (g(x) . dy_p(x))**2``: the second-order (empirical Fisher)
  estimate of the mean loss increase per token, one term per token. This is ``dloss_<p>`` by default.
- ``fisher_seq(p) = (1/N) * 1/2 sum_windows (sum_x g(x) . dy_p(x))**2``: the same with the
  first-order change summed over a window before squaring (the Fisher of the window's loss).
- ``output_error(p) = (1/N) sum_x ||a_i(x) dy_p(x)||**2``: a gradient-free proxy (what the layer
  output loses), the kind of score MC-MoE-style methods use.
- ``oracle(p)``: mean KL(full precision || model with only expert i at p) per token, measured.

Disjoint subsets (``fold_tokens``): cut each file into windows and give window i to fold
``i % folds``; tables calibrated on different folds are independent repetitions ("seeds"), and
the oracle is measured on a fold no table was calibrated on.

Calibration draws windows from every data file in turn (equal tokens per domain), then keeps
drawing while some expert has fewer than ``min_expert_tokens`` routed tokens (up to twice the
budget). Experts still below it get a fallback ``dloss`` (the layer's median loss per routed
token, at a frequency floor of ``min_expert_tokens / N``) and are listed in the table's source line.

Shape legend: L = MoE layers, E = experts, P = precisions of the ladder (most precise first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedweight.core.spec import get_precision, ladder
from pagedweight.policy.importance import ImportanceTable
from pwgpu.evaluate import MASTER, MoeForward, QualityError, ScoredReference, swiglu, windows

TABLE_LADDER = ("bf16", "fp8", "int8", "int4", "int3", "int2")
DLOSS_SOURCES = ("fisher-token", "fisher-seq", "output-error", "oracle")


@dataclass
class Estimates:
    """Sums over the calibration tokens; divide by ``tokens`` for per-token means."""

    ladder: tuple[str, ...]
    num_layers: int
    num_experts: int
    tokens: int = 0
    tokens_per_domain: dict[str, int] = field(default_factory=dict)
    counts: np.ndarray = None  # (L, E) routed tokens
    weight_sum: np.ndarray = None  # (L, E) sum of gate weights
    grad_var_sum: np.ndarray = None  # (L, E) sum over routed tokens of Var_h g
    fisher_token: np.ndarray = None  # (L, E, P)
    fisher_seq: np.ndarray = None  # (L, E, P)
    output_error: np.ndarray = None  # (L, E, P)
    oracle: np.ndarray | None = None  # (L, E, P) mean KL per token; NaN where not measured
    oracle_tokens: int = 0

    def __post_init__(self):
        le, lep = (self.num_layers, self.num_experts), (self.num_layers, self.num_experts, len(self.ladder))
        for name, shape in (("counts", le), ("weight_sum", le), ("grad_var_sum", le)):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(shape))
        for name in ("fisher_token", "fisher_seq", "output_error"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(lep))

    def per_token(self, name: str) -> np.ndarray:
        """A sum turned into a mean over all calibration tokens."""
        return getattr(self, name) / max(self.tokens, 1)


def fold_tokens(ids: np.ndarray, window: int, folds: int, chosen) -> np.ndarray:
    """The whole windows ``i`` of ``window`` tokens with ``i % folds`` in ``chosen``, concatenated
    in order (so re-cutting the result into windows of ``window`` gives exactly those windows)."""
    chosen = set(chosen)
    bad = [f for f in chosen if not 0 <= f < folds]
    if bad:
        raise QualityError(f"fold {bad[0]} is outside 0..{folds - 1}")
    n = len(ids) // window
    keep = [ids[i * window : (i + 1) * window] for i in range(n) if i % folds in chosen]
    if not keep:
        raise QualityError(f"no whole window of {window} tokens falls in folds {sorted(chosen)} of {folds}")
    return np.concatenate(keep)


def _ladder(names) -> tuple[str, ...]:
    names = tuple(p.name for p in ladder(list(names)))
    if names[0] != MASTER:
        raise QualityError(f"the ladder must start at the checkpoint's precision {MASTER}, got {names[0]}")
    return names


def _accumulate(model: MoeForward, est: Estimates, ids: torch.Tensor) -> None:
    """One calibration batch ids [B, T]: forward, backward of the summed loss, then every estimator."""
    from pwgpu.evaluate import Tap

    tap = Tap(keep_experts=True)
    logits = model.logits(ids, tap, grad=True)
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
    )
    loss.backward()
    b, t = ids.shape
    est.tokens += b * t
    with torch.no_grad():
        for (layer, e), (tok, slot, x, y) in tap.expert_io.items():
            g = y.grad if y.grad is not None else torch.zeros_like(y)
            a = tap.route[layer][1][tok, slot]
            est.counts[layer, e] += len(tok)
            est.weight_sum[layer, e] += float(a.sum())
            est.grad_var_sum[layer, e] += float(g.var(dim=-1, unbiased=False).sum())
            row = tok // t
            for j, p in enumerate(est.ladder):
                if p == MASTER:
                    continue
                dy = swiglu(x, *model.expert_weights(layer, e, p)) - y.detach()
                s = (g * dy).sum(-1)  # first-order loss change per token
                est.fisher_token[layer, e, j] += 0.5 * float((s**2).sum())
                per_row = torch.zeros(b, dtype=s.dtype).index_add_(0, row, s)
                est.fisher_seq[layer, e, j] += 0.5 * float((per_row**2).sum())
                est.output_error[layer, e, j] += float(((a[:, None] * dy) ** 2).sum())


def calibrate(
    model: MoeForward,
    data: dict[str, np.ndarray],
    tokens_per_domain: int,
    window: int = 256,
    ladder_names=TABLE_LADDER,
    min_expert_tokens: int = 16,
    progress=None,
) -> Estimates:
    """Run the gradient estimators over ``data`` (domain -> token ids), balanced as the module says."""
    est = Estimates(_ladder(ladder_names), model.num_layers, model.num_experts)
    model.reset()
    per_domain = {}
    for d, ids in data.items():
        rows = [r for r in windows(ids, window) if r.shape[1] == window]
        if not rows:
            raise QualityError(f"{d}: fewer than one window ({window} tokens) of calibration data")
        per_domain[d] = rows
    budget_rows = max(1, tokens_per_domain // window)
    cursor = dict.fromkeys(per_domain, 0)
    used = dict.fromkeys(per_domain, 0)

    def draw() -> bool:
        """One row from every domain that still has rows; False when all are used up."""
        batch = []
        for d, rows in per_domain.items():
            if cursor[d] < len(rows):
                batch.append(rows[cursor[d]])
                cursor[d] += 1
                used[d] += window
        if not batch:
            return False
        _accumulate(model, est, torch.cat(batch))
        return True

    for i in range(budget_rows):
        if not draw():
            break
        if progress and (i + 1) % 8 == 0:
            progress(f"calibration: {est.tokens:,} tokens")
    extra = 0
    while (est.counts < min_expert_tokens).any() and extra < budget_rows and draw():
        extra += 1  # rare experts: more data rather than an estimate from a handful of tokens
    est.tokens_per_domain = used
    return est


def oracle_kl(
    model: MoeForward,
    est: Estimates,
    data: dict[str, np.ndarray],
    tokens_per_domain: int,
    window: int = 512,
    experts: list[tuple[int, int]] | None = None,
    progress=None,
) -> None:
    """Fill ``est.oracle[l, e, p]``: mean KL(full || only expert (l, e) at p) per token, measured on
    the first ``tokens_per_domain`` tokens of each domain. Each forward restarts at layer l from
    cached full-precision hidden states (the layers before l do not see the change)."""
    model.reset()
    rows = [r for ids in data.values() for r in windows(ids[:tokens_per_domain], window)]
    if est.oracle is None:
        est.oracle = np.full((est.num_layers, est.num_experts, len(est.ladder)), np.nan)
        est.oracle[:, :, 0] = 0.0
    experts = (
        experts if experts is not None else [(l, e) for l in range(est.num_layers) for e in range(est.num_experts)]
    )
    with torch.no_grad():
        cached = [model.layer_inputs(r) for r in rows]  # per row: (inputs of each layer, rope)
        ref = [ScoredReference(model.run_from(0, h[0], rope)) for h, rope in cached]
        est.oracle_tokens = sum(int(r.shape[1]) for r in rows)
        for n, (layer, e) in enumerate(experts):
            for j, p in enumerate(est.ladder):
                if p == MASTER:
                    continue
                model.set_precision(layer, e, p)
                kl = 0.0
                for (h, rope), scored in zip(cached, ref, strict=True):
                    kl += float(scored.kl(model.run_from(layer, h[layer], rope))[0].sum())
                est.oracle[layer, e, j] = kl / est.oracle_tokens
            model.set_precision(layer, e, MASTER)
            if progress and (n + 1) % 8 == 0:
                progress(f"oracle: {n + 1}/{len(experts)} experts")


def expert_bytes(model: MoeForward, precision: str) -> int:
    p = get_precision(precision)
    h, f = model.hidden, model.ffn
    return p.matrix_bytes(f, h) * 2 + p.matrix_bytes(h, f)


def build_table(
    model: MoeForward,
    est: Estimates,
    dloss_source: str = "fisher-token",
    min_expert_tokens: int = 16,
    model_name: str = "tiny-moe",
    source: str = "",
) -> tuple[ImportanceTable, list[tuple[int, int, int]]]:
    """The importance table and the experts that got the fallback ``(layer, expert, tokens)``."""
    if dloss_source not in DLOSS_SOURCES:
        raise QualityError(f"dloss source {dloss_source!r}; allowed: {', '.join(DLOSS_SOURCES)}")
    if est.tokens == 0:
        raise QualityError("no calibration tokens")
    n = est.tokens
    freq = est.counts / n
    if dloss_source == "oracle":
        if est.oracle is None or np.isnan(est.oracle).any():
            raise QualityError("dloss from the oracle needs the oracle measured for every expert (--oracle, no subset)")
        dloss = np.clip(est.oracle, 0.0, None)  # KL is >= 0; tiny negative values are float noise
    else:
        dloss = est.per_token(
            {"fisher-token": "fisher_token", "fisher-seq": "fisher_seq", "output-error": "output_error"}[dloss_source]
        ).copy()
    fallback = []
    floor = min_expert_tokens / n
    for layer in range(est.num_layers):
        ok = est.counts[layer] >= min_expert_tokens
        if ok.all():
            continue
        if ok.any():
            density = np.median(dloss[layer, ok] / freq[layer, ok, None], axis=0)  # loss per unit frequency
        else:
            density = np.median(dloss[:, :, :] / np.maximum(freq[:, :, None], floor), axis=(0, 1))
        for e in np.flatnonzero(~ok):
            dloss[layer, e] = density * max(freq[layer, e], floor)
            fallback.append((layer, int(e), int(est.counts[layer, e])))
    note = f"fallback dloss for {len(fallback)} expert(s) with < {min_expert_tokens} tokens"
    if fallback:
        note += ": " + " ".join(f"{layer}:{e}({c})" for layer, e, c in fallback)
    bytes_per = np.array([expert_bytes(model, p) for p in est.ladder], dtype=np.int64)
    rows = est.num_layers * est.num_experts
    table = ImportanceTable(
        model=model_name,
        ladder=est.ladder,
        num_layers=est.num_layers,
        num_experts=est.num_experts,
        routing_freq=freq.reshape(rows),
        routing_weight_mass=(est.weight_sum / n).reshape(rows),
        importance=(est.grad_var_sum / n).reshape(rows),
        dloss=dloss.reshape(rows, -1),
        bytes=np.broadcast_to(bytes_per, (rows, len(est.ladder))).copy(),
        source=f"{source}; calibration {n} tokens ({', '.join(f'{d} {t}' for d, t in est.tokens_per_domain.items())})"
        f"; dloss={dloss_source}; {note}",
        synthetic=False,
    )
    return table, fallback


DETAIL_FIELDS = ("fisher_token", "fisher_seq", "output_error", "oracle")


def write_details(
    path, est: Estimates, oracle_text: str = "", run_time_s: float | None = None, load: tuple | None = None
) -> None:
    """Every estimator per expert (one wide CSV), for comparing them against the oracle. The
    header line says what text the oracle saw and, with ``run_time_s``, what the run took (and
    ``load``: the 1-minute load average at its start and end, and the CPUs)."""
    cols = ["layer", "expert", "tokens", "routing_freq", "routing_weight_mass", "importance"]
    lossy = [p for p in est.ladder if p != MASTER]
    cols += [f"{f}_{p}" for f in DETAIL_FIELDS for p in lossy]
    lines = [",".join(cols)]
    per = {f: est.per_token(f) for f in DETAIL_FIELDS[:3]}
    per["oracle"] = est.oracle if est.oracle is not None else np.full_like(per["fisher_token"], np.nan)
    for layer in range(est.num_layers):
        for e in range(est.num_experts):
            cells = [
                layer,
                e,
                int(est.counts[layer, e]),
                est.counts[layer, e] / est.tokens,
                est.weight_sum[layer, e] / est.tokens,
                est.grad_var_sum[layer, e] / est.tokens,
            ]
            for f in DETAIL_FIELDS:
                cells += [per[f][layer, e, est.ladder.index(p)] for p in lossy]
            lines.append(
                ",".join(
                    x if isinstance(x, str) else repr(x) if isinstance(x, float) else str(x) for x in map(_plain, cells)
                )
            )
    with open(path, "w") as f:
        where = f"; oracle_text: {oracle_text}" if oracle_text else ""
        took = f"; run_time_s: {run_time_s:.1f}" if run_time_s is not None else ""
        if load is not None:
            took += f"; load_start: {load[0]:.2f}; load_end: {load[1]:.2f}; cpus: {load[2]}"
        f.write(f"# calibration_tokens: {est.tokens}; oracle_tokens: {est.oracle_tokens}{where}{took}\n")
        f.write("\n".join(lines) + "\n")


def _plain(x):
    return float(x) if isinstance(x, np.floating) else int(x) if isinstance(x, np.integer) else x
