"""Served quality, end to end: what the engine served while precision moved, re-scored offline.

Recording (``pwgpu run`` with a prompt source, ``pwgpu.offline``): prompts are windows of real
text (``TextPrompts``), and ``TokenLog`` writes ``tokens.jsonl`` beside the results directory's
tables: per request its prompt and output ids, the times of its tokens, and every *chunk* of
positions the engine computed for it as ``[step, start, end, transitions]``, where
``transitions`` is how many precision changes the run had made before that step's forward
pass. All changes of a step (planned, forced by KV pressure, upgrades landing) happen before its
forward and none during it, so the map in force for a chunk is exactly ``initial_precisions.csv``
plus the first ``transitions`` rows of ``transitions.csv``. Times alone also give the map of the
step that *sampled* a token (every change of that step is logged before its end, the token's
time), but not of the earlier steps whose keys and values it attends to (prefill chunks,
recomputation after a preemption): hence the chunk log.

Re-scoring (``rescore``): for each request, the full-precision model's logits on the served
sequence (prompt + outputs), and the served model's, replayed chunk by chunk with each chunk
under the map that computed it (``MoeForward.extend``: the keys and values of earlier chunks
stay as their own maps made them, as in the engine's KV cache). The served KL of an output token
is KL(full || served) of the next-token distributions at the position that sampled it. The
replay runs in float32 with the kernels' reference quantiser, while a scenario's engine runs
bfloat16 activations: ``argmax_agree`` (served logits' argmax = the token the engine sampled
greedily) says how faithful the replay is.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pagedweight.errors import PagedWeightError


class TextPrompts:
    """Prompt ids cut from real text: request i takes ``prompt_tokens[i]`` consecutive tokens of
    file ``i % len(files)`` at an offset drawn from ``seed`` (the same for every policy)."""

    def __init__(self, model_dir: str | Path, files: list[str | Path], seed: int = 0):
        from pwgpu.evaluate import load_tokens

        if not files:
            raise PagedWeightError("a text prompt source needs at least one file")
        self.files = [str(f) for f in files]
        self.tokens = [load_tokens(model_dir, f) for f in files]
        self.seed = seed

    def __call__(self, trace) -> tuple[list[list[int]], list[dict]]:
        rng = np.random.default_rng(self.seed)
        prompts, sources = [], []
        for i, n in enumerate(trace.prompt_tokens):
            k = i % len(self.files)
            ids, n = self.tokens[k], int(n)
            if n > len(ids):
                raise PagedWeightError(
                    f"request {i} needs a {n}-token prompt; {self.files[k]} has only {len(ids)} tokens"
                )
            start = int(rng.integers(0, len(ids) - n + 1))
            prompts.append(ids[start : start + n].tolist())
            sources.append({"file": self.files[k], "domain": Path(self.files[k]).stem, "offset": start})
        return prompts, sources


class TokenLog:
    """Which positions each step computed for each request, and under how many transitions;
    with ``attach``, also the engine's own next-token logits of every token it sampled."""

    def __init__(self, policy: str, sources: list[dict]):
        self.policy = policy
        self.sources = sources
        self._state: dict[int, tuple[int, int]] = {}  # request id -> (computed tokens, preemptions)
        self._chunks: dict[int, list[list[int]]] = {}
        self._active: list = []
        self._seen = 0
        self.logits: dict[int, list[np.ndarray]] = {}  # request id -> [V] fp32 per sampled token

    def attach(self, engine) -> None:
        """Keep the logits the engine samples from (its ``on_logits`` hook)."""

        def keep(requests, logits):
            rows = logits.detach().float().cpu().numpy()
            for er, row in zip(requests, rows, strict=True):
                self.logits.setdefault(er.req.request_id, []).append(row)

        engine.on_logits = keep

    def observe(self, engine, requests: list) -> None:
        """After a step: the positions each request gained since the last call."""
        self._active.extend(requests[self._seen :])
        self._seen = len(requests)
        step = len(engine.core.steps) - 1
        changes = len(engine.core.transitions)
        swap = engine.core.scheduler.config.preemption_mode == "swap"
        still = []
        for er in self._active:
            r = er.req
            before, preempted = self._state.get(r.request_id, (0, 0))
            if r.num_preemptions != preempted and not swap:
                before = 0  # recomputed from the start: the earlier keys and values are gone
            now = r.num_computed_tokens
            if now > before:
                self._chunks.setdefault(r.request_id, []).append([step, before, now, changes])
            self._state[r.request_id] = (now, r.num_preemptions)
            if er.finish_reason is None:
                still.append(er)
        self._active = still

    def finish(self, engine, requests: list) -> dict:
        return {
            "policy": self.policy,
            "num_transitions": len(engine.core.transitions),
            "num_steps": len(engine.core.steps),
            "requests": [
                {
                    "request_id": er.req.request_id,
                    "source": self.sources[i] if i < len(self.sources) else {},
                    "prompt_ids": list(er.prompt_ids),
                    "output_ids": list(er.output_ids),
                    "token_times_s": list(er.req.token_times_s),
                    "chunks": self._chunks.get(er.req.request_id, []),
                }
                for i, er in enumerate(requests)
            ],
        }


def write_token_logs(path: Path, logs: list[dict], engine_logits: dict[str, dict] | None = None) -> None:
    """``tokens.jsonl``; with ``engine_logits`` ({policy: {request id: [V] per token}}) also
    ``served_logits.npz`` beside it (fp32; ~16 KB per token of a 4,096-token vocabulary)."""
    import os

    from pagedweight.results.writer import atomic_write_text

    if engine_logits:
        arrays = {
            f"{policy}/{rid}": np.stack(rows) for policy, per in engine_logits.items() for rid, rows in per.items()
        }
        tmp = Path(path).with_name(f".served_logits.tmp{os.getpid()}.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, Path(path).with_name("served_logits.npz"))
    lines = []
    for log in logs:
        head = {k: v for k, v in log.items() if k != "requests"}
        lines.append(json.dumps({"kind": "policy", **head}))
        lines += [json.dumps({"kind": "request", "policy": log["policy"], **r}) for r in log["requests"]]
    atomic_write_text(Path(path), "\n".join(lines) + "\n")


def read_token_logs(path: Path) -> dict[str, dict]:
    """``tokens.jsonl`` -> {policy: {"num_transitions", "num_steps", "requests": [...]}}."""
    path = Path(path)
    if not path.is_file():
        raise PagedWeightError(f"{path} does not exist: run `pwgpu run` with --prompt-text to record served tokens")
    out: dict[str, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise PagedWeightError(f"{path}: line {n}: not JSON ({e})") from None
        if rec.get("kind") == "policy":
            out[rec["policy"]] = {**rec, "requests": []}
        elif rec.get("kind") == "request" and rec.get("policy") in out:
            out[rec["policy"]]["requests"].append(rec)
        else:
            raise PagedWeightError(f"{path}: line {n}: expected kind 'policy' or 'request' after its policy")
    return out


class PrecisionMaps:
    """The map in force after the first n transitions of one policy, for any n (in order)."""

    def __init__(self, initial: np.ndarray, transitions: list[tuple[int, str, str]], num_experts: int):
        self.initial = initial  # (L, E) names
        self.transitions = transitions  # (expert, kind, to_precision), in the run's order
        self.num_experts = num_experts
        self._cache: dict[int, np.ndarray] = {0: initial.copy()}

    def at(self, n: int) -> np.ndarray:
        if n not in self._cache:
            base = max(k for k in self._cache if k <= n)
            grid = self._cache[base].copy()
            for expert, kind, to in self.transitions[base:n]:
                if kind in ("downgrade", "upgrade"):
                    grid[expert // self.num_experts, expert % self.num_experts] = to
            self._cache[n] = grid
        return self._cache[n]


def load_maps(results_dir: Path, policy: str, num_layers: int, num_experts: int) -> PrecisionMaps:
    import pandas as pd

    init = pd.read_csv(results_dir / "initial_precisions.csv")
    init = init[init["policy"] == policy].sort_values("expert")
    if len(init) != num_layers * num_experts:
        raise PagedWeightError(
            f"{results_dir / 'initial_precisions.csv'}: {len(init)} experts for {policy}; the model has "
            f"{num_layers} x {num_experts}"
        )
    initial = init["precision"].to_numpy(dtype=object).reshape(num_layers, num_experts)
    path = results_dir / "transitions.csv"
    rows: list[tuple[int, str, str]] = []
    if path.is_file() and path.stat().st_size > 0:
        t = pd.read_csv(path)
        t = t[t["policy"] == policy]
        rows = list(zip(t["expert"].astype(int), t["kind"], t["to_precision"], strict=True))
    return PrecisionMaps(initial, rows, num_experts)


def rescore(results_dir: str | Path, model_dir: str | Path, cache=None, progress=None) -> list[dict]:
    """One row per generated token of every policy in ``tokens.jsonl`` (see the module doc)."""
    import pandas as pd
    import torch

    from pwgpu.evaluate import MoeForward, kl_per_position, truncate_past

    results_dir = Path(results_dir)
    logs = read_token_logs(results_dir / "tokens.jsonl")
    steps = pd.read_csv(results_dir / "steps.csv")
    tpath = results_dir / "transitions.csv"
    trans = pd.read_csv(tpath) if tpath.is_file() and tpath.stat().st_size else None
    torch.set_num_threads(1)  # one token at a time: more threads only wait on each other
    model = MoeForward(model_dir)
    model_key = cache.model_key(model_dir) if cache is not None else None
    logits_path = results_dir / "served_logits.npz"
    engine_logits = np.load(logits_path) if logits_path.is_file() else None
    rows = []
    for policy, log in logs.items():
        maps = load_maps(results_dir, policy, model.num_layers, model.num_experts)
        if len(maps.transitions) != log["num_transitions"]:
            raise PagedWeightError(
                f"{results_dir}: transitions.csv has {len(maps.transitions)} rows for {policy}, "
                f"tokens.jsonl counted {log['num_transitions']}"
            )
        st = steps[steps["policy"] == policy].set_index("step")
        times = trans[trans["policy"] == policy]["time_s"].to_numpy() if trans is not None else np.zeros(0)
        for rec in log["requests"]:
            prompt, outputs = rec["prompt_ids"], rec["output_ids"]
            if len(outputs) == 0:
                continue
            seq = torch.tensor(prompt + outputs[:-1])[None]
            ref = _reference(model, seq, cache, model_key)
            name = f"{policy}/{rec['request_id']}"
            served_engine = (
                torch.from_numpy(engine_logits[name]) if engine_logits is not None and name in engine_logits else None
            )
            past, produced = None, 0
            for step, start, end, changes in rec["chunks"]:
                past = truncate_past(past, start)
                model.set_plan(maps.at(changes))
                logits, past = model.extend(seq[:, start:end], past)
                j = end - len(prompt)  # output j is sampled from position end - 1
                if j < 0 or j >= len(outputs):
                    continue
                served = logits[0, -1]
                token_time = rec["token_times_s"][j] if j < len(rec["token_times_s"]) else float("nan")
                by_time = int(np.searchsorted(times, token_time, side="left"))  # changes logged before the token
                row = st.loc[step]
                rows.append(
                    {
                        "policy": policy,
                        "request_id": rec["request_id"],
                        "domain": rec.get("source", {}).get("domain", ""),
                        "token": j,
                        "step": int(step),
                        "time_s": token_time,
                        "step_start_s": float(row["start_s"]),
                        "step_duration_s": float(row["duration_s"]),
                        "transitions": changes,
                        "map_by_time_agrees": by_time == changes,
                        "kl": float(kl_per_position(ref[end - 1], served)),
                        "argmax_agree": int(served.argmax()) == outputs[j],
                        "kl_engine": float(kl_per_position(ref[end - 1], served_engine[j]))
                        if served_engine is not None
                        else float("nan"),
                        "quality_proxy": float(row["quality_proxy"]),
                    }
                )
                produced = max(produced, j + 1)
            if produced != len(outputs):
                raise PagedWeightError(
                    f"{results_dir}: {policy} request {rec['request_id']}: the chunk log yields {produced} of "
                    f"{len(outputs)} output tokens"
                )
        if progress:
            progress(f"re-scored {policy}: {sum(r['policy'] == policy for r in rows)} tokens")
    model.reset()
    return rows


def _reference(model, seq, cache, model_key):
    """Full-precision logits [T, V] of a sequence (disk-cached by the checkpoint and the ids)."""
    import torch

    key = cache.key("served-reference", model_key, seq.numpy()) if cache is not None else None
    if key is not None:
        hit = cache.load(key)
        if hit is not None:
            return torch.from_numpy(hit["logits"])
    model.reset()
    with torch.no_grad():
        logits = model.logits(seq)[0]
    if key is not None:
        cache.save(key, logits=logits.numpy())
    return logits
