"""Quality of a per-expert precision plan: KL against full precision and perplexity, per domain.

``MoeForward`` is a compact fp32 forward pass of a Mixtral-layout checkpoint (read straight from
its safetensors, so it does not depend on how a given ``transformers`` version lays the experts
out in memory) whose routed experts can each be swapped for their quantise-dequantise image at
any precision. The quantiser is the kernels' pure-PyTorch reference (``pwgpu.kernels.reference``),
so the error measured here is the error the engine's pages hold, bit for bit. It also exposes the
per-expert inputs and outputs the importance estimators need (``Tap``).

Shape legend: B = rows, T = tokens per row, H = hidden size, F = expert FFN size, E = experts,
k = top-k, V = vocabulary, L = MoE layers.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F_

from pagedweight.errors import PagedWeightError
from pwgpu.kernels.reference import dequantize_ref, quantize_ref

MASTER = "bf16"  # the checkpoint's own precision: the "full precision" every KL is measured against


class QualityError(PagedWeightError):
    """Bad input to the quality tools (model directory, plan, data)."""


@dataclass
class Tap:
    """What one forward pass recorded. ``route[l] = (ids [N, k], weights [N, k])`` for the N = B*T
    tokens; with ``keep_experts``, ``expert_io[(l, e)] = (token_index [n], slot [n], x [n, H], y [n, H])``
    where y is the expert's output before the gate weight multiplies it (gradients kept)."""

    keep_experts: bool = False

    def __post_init__(self):
        self.route: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.expert_io: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return (F_.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def quantized(w: torch.Tensor, precision: str) -> torch.Tensor:
    """``w`` as the engine would hold it at ``precision``: quantise, then dequantise to fp32."""
    if precision == MASTER:
        return w
    n, k = w.shape
    return dequantize_ref(quantize_ref(w.to(torch.bfloat16), precision), precision, n, k, dtype=torch.float32)


class MoeForward:
    """fp32 forward pass of a Mixtral-layout checkpoint with per-expert precision."""

    def __init__(self, model_dir: str | Path):
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        cfg_path = model_dir / "config.json"
        if not cfg_path.is_file():
            raise QualityError(f"{model_dir}: no config.json (expected a Mixtral checkpoint directory)")
        cfg = json.loads(cfg_path.read_text())
        if cfg.get("model_type") != "mixtral":
            raise QualityError(f"{cfg_path}: model_type {cfg.get('model_type')!r}; the quality tools read mixtral")
        from pwgpu.loader import read_arch

        arch = read_arch(model_dir)  # refuses, by name, every config key no loader implements
        if arch.rope_yarn is not None or arch.hidden_act != "silu":
            raise QualityError(f"{cfg_path}: the quality tools compute plain RoPE and SiLU experts only")
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise QualityError(f"{model_dir}: no *.safetensors file")
        t = {}
        for f in files:
            t.update({k: v.float() for k, v in load_file(str(f)).items()})
        self.config = cfg
        self.num_layers = cfg["num_hidden_layers"]
        self.num_experts = cfg["num_local_experts"]
        self.top_k = cfg["num_experts_per_tok"]
        self.hidden = cfg["hidden_size"]
        self.ffn = cfg["intermediate_size"]
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or self.hidden // self.heads
        self.eps = cfg.get("rms_norm_eps", 1e-5)
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        self.embed = t["model.embed_tokens.weight"]
        self.norm = t["model.norm.weight"]
        self.lm_head = t.get("lm_head.weight", self.embed)
        self.layers = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}"
            layer = {
                name: t[f"{p}.{name}"]
                for name in (
                    "input_layernorm.weight",
                    "post_attention_layernorm.weight",
                    "self_attn.q_proj.weight",
                    "self_attn.k_proj.weight",
                    "self_attn.v_proj.weight",
                    "self_attn.o_proj.weight",
                    "block_sparse_moe.gate.weight",
                )
            }
            self.layers.append(layer)
        # master[l][e] = (w1 gate [F, H], w3 up [F, H], w2 down [H, F]); active = what the forward uses
        self.master = [
            [
                tuple(t[f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"] for w in ("w1", "w3", "w2"))
                for e in range(self.num_experts)
            ]
            for i in range(self.num_layers)
        ]
        self.active = [list(row) for row in self.master]
        self.precision = np.full((self.num_layers, self.num_experts), MASTER, dtype=object)
        self._cache: dict[tuple[int, int, str], tuple[torch.Tensor, ...]] = {}

    # ---- precision -------------------------------------------------------------------------
    def expert_weights(self, layer: int, expert: int, precision: str) -> tuple[torch.Tensor, ...]:
        key = (layer, expert, precision)
        if key not in self._cache:
            self._cache[key] = tuple(quantized(w, precision) for w in self.master[layer][expert])
        return self._cache[key]

    def set_precision(self, layer: int, expert: int, precision: str) -> None:
        self.active[layer][expert] = self.expert_weights(layer, expert, precision)
        self.precision[layer, expert] = precision

    def set_plan(self, precisions: np.ndarray) -> None:
        """``precisions[l, e]``: a precision name per routed expert."""
        if precisions.shape != (self.num_layers, self.num_experts):
            raise QualityError(
                f"plan is {precisions.shape[0]} x {precisions.shape[1]} experts; the model has "
                f"{self.num_layers} x {self.num_experts}"
            )
        for layer in range(self.num_layers):
            for e in range(self.num_experts):
                self.set_precision(layer, e, str(precisions[layer, e]))

    def reset(self) -> None:
        self.active = [list(row) for row in self.master]
        self.precision[:] = MASTER

    # ---- forward ---------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _attention(self, lw: dict, x: torch.Tensor, cos, sin) -> torch.Tensor:
        b, t, _ = x.shape
        d = self.head_dim
        q = (x @ lw["self_attn.q_proj.weight"].T).view(b, t, self.heads, d).transpose(1, 2)
        k = (x @ lw["self_attn.k_proj.weight"].T).view(b, t, self.kv_heads, d).transpose(1, 2)
        v = (x @ lw["self_attn.v_proj.weight"].T).view(b, t, self.kv_heads, d).transpose(1, 2)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F_.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.transpose(1, 2).reshape(b, t, self.heads * d) @ lw["self_attn.o_proj.weight"].T

    def _moe(self, layer: int, x: torch.Tensor, tap: Tap | None) -> torch.Tensor:
        xf = x.reshape(-1, self.hidden)  # [N, H]
        logits = xf @ self.layers[layer]["block_sparse_moe.gate.weight"].T  # [N, E]
        # Mixtral: softmax over all experts, top-k, renormalise (= softmax over the k logits).
        probs = torch.softmax(logits, dim=-1)
        top_w, top_ids = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        top_w = top_w / top_w.sum(-1, keepdim=True)
        if tap is not None:
            tap.route[layer] = (top_ids.detach(), top_w.detach())
        out = torch.zeros_like(xf)
        for e in range(self.num_experts):
            tok, slot = torch.nonzero(top_ids == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            xe = xf[tok]
            y = swiglu(xe, *self.active[layer][e])  # [n, H]
            if tap is not None and tap.keep_experts:
                if y.requires_grad:
                    y.retain_grad()
                tap.expert_io[(layer, e)] = (tok, slot, xe.detach(), y)
            out = out.index_add(0, tok, y * top_w[tok, slot, None])
        return out.view_as(x)

    def rope(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[None, None], emb.sin()[None, None]

    def _layer(self, i: int, h: torch.Tensor, rope, tap: Tap | None) -> torch.Tensor:
        lw = self.layers[i]
        h = h + self._attention(lw, self._rms(h, lw["input_layernorm.weight"]), *rope)
        return h + self._moe(i, self._rms(h, lw["post_attention_layernorm.weight"]), tap)

    def run_from(self, layer: int, h: torch.Tensor, rope, tap: Tap | None = None) -> torch.Tensor:
        """Layers ``layer..`` on their input h [B, T, H], then the head: logits [B, T, V]."""
        for i in range(layer, self.num_layers):
            h = self._layer(i, h, rope, tap)
        return self._rms(h, self.norm) @ self.lm_head.T

    def layer_inputs(self, ids: torch.Tensor) -> tuple[list[torch.Tensor], tuple]:
        """The input of every layer for ids [B, T] (no gradients), and the RoPE tables: lets a
        change to layer l be measured without recomputing the layers before it."""
        rope = self.rope(ids.shape[1])
        h, inputs = self.embed[ids], []
        with torch.no_grad():
            for i in range(self.num_layers):
                inputs.append(h)
                h = self._layer(i, h, rope, None)
        return inputs, rope

    def logits(self, ids: torch.Tensor, tap: Tap | None = None, grad: bool = False) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, V]. With ``grad``, autograd records the expert outputs so
        that a backward pass fills ``y.grad`` of the tapped experts."""
        h = self.embed[ids]
        if grad:
            h = h.clone().requires_grad_(True)
        return self.run_from(0, h, self.rope(ids.shape[1]), tap)

    def log_probs(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(self.logits(ids), dim=-1)


# ------------------------------------------------------------------------------------------
# Data and plans
# ------------------------------------------------------------------------------------------


def load_tokens(model_dir: str | Path, path: str | Path, max_tokens: int | None = None) -> np.ndarray:
    """A text file -> token ids with the checkpoint's tokenizer (``tokenizer.json``)."""
    from tokenizers import Tokenizer

    tok_path = Path(model_dir) / "tokenizer.json"
    if not tok_path.is_file():
        raise QualityError(f"{model_dir}: no tokenizer.json")
    path = Path(path)
    if not path.is_file():
        raise QualityError(f"data file {path} does not exist")
    ids = Tokenizer.from_file(str(tok_path)).encode(path.read_text(), add_special_tokens=False).ids
    ids = np.array(ids[:max_tokens] if max_tokens else ids, dtype=np.int64)
    if len(ids) < 2:
        raise QualityError(f"{path}: fewer than 2 tokens")
    return ids


def windows(ids: np.ndarray, window: int) -> list[torch.Tensor]:
    """Non-overlapping rows of ``window`` tokens (the last one shorter), each [1, t]."""
    return [torch.as_tensor(ids[s : s + window])[None] for s in range(0, len(ids), window) if len(ids) - s >= 2]


def read_plan(path: str | Path, num_layers: int, num_experts: int) -> np.ndarray:
    """``pwsim allocate --out`` CSV (``layer,expert,precision,...``; ``#`` lines skipped) -> [L, E] names."""
    path = Path(path)
    if not path.is_file():
        raise QualityError(f"plan {path} does not exist")
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    rows = list(csv.DictReader(lines))
    if not rows or not {"layer", "expert", "precision"} <= set(rows[0]):
        raise QualityError(f"{path}: expected columns layer,expert,precision (as `pwsim allocate --out` writes)")
    plan = np.full((num_layers, num_experts), None, dtype=object)
    for line, r in enumerate(rows, 2):
        try:
            layer, e = int(r["layer"]), int(r["expert"])
        except (TypeError, ValueError):
            raise QualityError(f"{path}: row {line}: layer and expert must be integers (got {r})") from None
        if not (0 <= layer < num_layers and 0 <= e < num_experts):
            raise QualityError(f"{path}: layer {layer} expert {e} is outside the model's {num_layers} x {num_experts}")
        plan[layer, e] = r["precision"]
    missing = np.argwhere(plan == None)  # noqa: E711 (elementwise comparison on an object array)
    if len(missing):
        raise QualityError(
            f"{path}: {len(missing)} experts have no precision, first layer {missing[0][0]} expert {missing[0][1]}"
        )
    return plan


def uniform_plan(model: MoeForward, precision: str) -> np.ndarray:
    return np.full((model.num_layers, model.num_experts), precision, dtype=object)


# ------------------------------------------------------------------------------------------
# Evaluation
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DomainResult:
    domain: str
    tokens: int
    kl_nats_per_token: float  # mean over tokens of KL(full precision || plan)
    ppl_full: float
    ppl_plan: float


class ReferenceCache:
    """Full-precision log-probs of each evaluation window, computed once and reused by every plan."""

    def __init__(self, model: MoeForward, data: dict[str, np.ndarray], window: int):
        self.window = window
        self.data = data
        saved = [row[:] for row in model.active], model.precision.copy()
        model.reset()
        self.rows = {d: windows(ids, window) for d, ids in data.items()}
        self.ref = {d: [model.log_probs(r) for r in rows] for d, rows in self.rows.items()}
        model.active, model.precision = saved


def evaluate_plan(model: MoeForward, ref: ReferenceCache, plan: np.ndarray | None) -> list[DomainResult]:
    """KL(full || plan) and perplexities per domain; ``plan=None`` evaluates the model as it is set."""
    if plan is not None:
        model.set_plan(plan)
    results = []
    for domain, rows in ref.rows.items():
        kl_sum, nll_full, nll_plan, n = 0.0, 0.0, 0.0, 0
        for row, lp_ref in zip(rows, ref.ref[domain], strict=True):
            lp = model.log_probs(row)
            kl_sum += float((lp_ref.exp() * (lp_ref - lp)).sum(-1)[0, :-1].sum())
            target = row[0, 1:]
            nll_full -= float(lp_ref[0, :-1].gather(-1, target[:, None]).sum())
            nll_plan -= float(lp[0, :-1].gather(-1, target[:, None]).sum())
            n += row.shape[1] - 1
        results.append(DomainResult(domain, n, kl_sum / n, math.exp(nll_full / n), math.exp(nll_plan / n)))
    return results


def write_results(path: str | Path, results: list[DomainResult], extra: dict | None = None) -> None:
    extra = extra or {}
    cols = [*extra, "domain", "tokens", "kl_nats_per_token", "ppl_full", "ppl_plan"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in results:
            w.writerow(
                [
                    *extra.values(),
                    r.domain,
                    r.tokens,
                    f"{r.kl_nats_per_token:.6g}",
                    f"{r.ppl_full:.4f}",
                    f"{r.ppl_plan:.4f}",
                ]
            )
