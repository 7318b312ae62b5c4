"""The analytic latency model: a roofline per operator from the ``GpuSpec``.

Each operator of a step takes ``max(bytes / (bw * hbm_eff), flops / (peak * flops_eff))`` and
operators run one after another (the time of a step is their sum plus fixed overheads).

- **Routed experts**, per expert: weight bytes at the expert's precision against ``2 * 3 * H * F``
  flops per token. The roofline is applied *per expert*, then summed over a layer: a grouped MoE
  kernel streams each expert's weights once and runs that expert's tokens as its own GEMM, so a
  hot expert can be compute-bound while cold ones are still bandwidth-bound. Only active
  experts (tokens > 0) count. One kernel launch per precision class present in a layer, since a
  fused MoE kernel holds one weight dtype.
- **Compute peak by precision**: FP8 weights (per row or in 128 x 128 blocks) run FP8 MMAs
  (activations quantised per token) when
  the GPU has them; every other format dequantises into bf16 tiles, so it runs at the bf16 peak
  (weight-only quantisation saves bytes, not flops).
- **Attention**: prefill flops ``2 * q * kv_eff * heads * (d_qk + d_v)`` with
  ``kv_eff = kv_len - (q - 1) / 2`` for the causal chunk, against the chunk's KV bytes; decode
  reads every sequence's KV (``kv_len * kv_bytes_per_token / num_layers`` per layer). MLA decodes
  in the absorbed form (``d_qk = kv_lora_rank + rope``, ``d_v = kv_lora_rank``).
- **Pinned parts** (attention projections, norms, router, shared experts, dense FFN layers): bytes
  of their bf16 weights against ``2 * params`` flops per token. ``lm_head`` runs for the last token
  of every sequence in the step (vLLM computes logits for every scheduled request).
"""

from __future__ import annotations

import operator

import numpy as np

from pagedweight.config.latency import AnalyticLatencyConfig
from pagedweight.core.spec import PRECISION_NAMES, PRECISIONS, GpuSpec, ModelSpec
from pagedweight.core.step import StepShape
from pwsim.roofline_kernels import expert_times, expert_times_into


def roofline_s(num_bytes, flops, bw_bytes_per_s: float, flops_per_s: float):
    return np.maximum(num_bytes / bw_bytes_per_s, flops / flops_per_s)


class _PrecisionGrid:
    """What ``moe_s`` needs that depends only on the experts' precisions (L, E)."""

    __slots__ = (
        "key", "shape", "dtype", "read_s", "s_per_token", "layer_class", "num_keys", "ones",
        "fill", "times", "times_row", "num_calls",
    )  # fmt: skip

    def __init__(self, model: AnalyticLatencyModel, precision_ids: np.ndarray, key: bytes):
        self.key, self.shape, self.dtype = key, precision_ids.shape, precision_ids.dtype
        # One row of the experts flattened: ``roofline_kernels.expert_times``' rank.
        self.read_s = model.expert_read_s.take(precision_ids).reshape(1, -1)
        self.s_per_token = model.expert_s_per_token.take(precision_ids).reshape(1, -1)
        self.layer_class = (model._layer_base + precision_ids).reshape(1, -1)  # (layer, precision) key
        self.num_keys = model.model.num_moe_layers * model._num_precisions
        self.ones = np.ones(precision_ids.size)
        # The per-expert pass and its outputs, used by one ``moe_s`` after another (each reads
        # them before the next call).
        self.fill = expert_times_into()
        self.times, self.num_calls = np.empty((1, precision_ids.size)), np.empty(1, dtype=np.int64)
        self.times_row = self.times[0]


class AnalyticLatencyModel:
    name = "analytic"

    def __init__(self, cfg: AnalyticLatencyConfig, model: ModelSpec, gpu: GpuSpec):
        self.cfg, self.model, self.gpu = cfg, model, gpu
        m = model
        self.bw_bytes_per_s = gpu.hbm_bandwidth_bytes_per_s * cfg.hbm_efficiency
        self.bf16_flops_per_s = gpu.peak_bf16_flops * cfg.flops_efficiency
        self.h = m.hidden_size
        # Per precision id: the expert's weight-read time and its time per token at the compute roof.
        self.expert_flops_per_token = 2.0 * m.expert_params
        self.expert_read_s = np.zeros(len(PRECISION_NAMES))
        self.expert_s_per_token = np.zeros(len(PRECISION_NAMES))
        self.expert_peak_flops_per_s = np.zeros(len(PRECISION_NAMES))
        for pid, pname in enumerate(PRECISION_NAMES):
            eff = cfg.precision_hbm_efficiency.get(pname, cfg.hbm_efficiency)
            self.expert_read_s[pid] = m.expert_bytes(pname) / (gpu.hbm_bandwidth_bytes_per_s * eff)
            self.expert_peak_flops_per_s[pid] = self._peak_flops_per_s(pname)
            self.expert_s_per_token[pid] = self.expert_flops_per_token / self.expert_peak_flops_per_s[pid]
        # Tokens per expert above which an expert is compute-bound, per precision.
        self.expert_ridge_tokens = self.expert_read_s / self.expert_s_per_token
        self._num_precisions = len(PRECISION_NAMES)
        self._layer_base = (np.arange(m.num_moe_layers) * self._num_precisions)[:, None]
        self._grid: _PrecisionGrid | None = None
        self._ranks_stack: tuple | None = None  # moe_s_ranks: the ranks' grids, stacked

        # Pinned parts, per layer and once per step.
        db = m.dtype_bytes
        attn_params = m.attention_params_per_layer() + 2 * self.h  # projections + two RMSNorms
        router_params = m.num_experts * self.h
        shared_params = m.num_shared_experts * 3 * self.h * m.shared_expert_ffn_size
        shared_params += self.h if m.shared_expert_gate else 0
        moe_layer_params = attn_params + router_params + shared_params
        dense_layer_params = attn_params + 3 * self.h * m.dense_ffn_size
        self.moe_layer_pinned = (moe_layer_params * db, 2.0 * moe_layer_params)  # (bytes, flops per token)
        self.dense_layer_pinned = (dense_layer_params * db, 2.0 * dense_layer_params)
        head_params = m.vocab_size * self.h
        self.lm_head = (head_params * db + self.h * db, 2.0 * head_params)
        # Attention per layer: KV bytes per token and head dims for prefill / decode flops.
        self.kv_bytes_per_token_layer = m.kv_bytes_per_token() / m.num_layers
        if m.attention == "mla":
            self.prefill_head_dims = m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim
            self.decode_head_dims = 2 * m.kv_lora_rank + m.qk_rope_head_dim
        else:
            self.prefill_head_dims = self.decode_head_dims = 2 * m.head_dim

    def _peak_flops_per_s(self, precision: str) -> float:
        p = PRECISIONS[precision]
        if p.kind == "float" and p.weight_bits == 8 and self.gpu.peak_fp8_flops > 0:  # fp8, fp8-b128
            return self.gpu.peak_fp8_flops * self.cfg.flops_efficiency
        return self.bf16_flops_per_s

    # ---- the parts of a step -------------------------------------------------------------
    def moe_s(self, tokens_per_expert: np.ndarray, precision_ids: np.ndarray) -> float:
        """All routed-expert FFNs of all MoE layers, (L, E) inputs."""
        # Each numpy call on a small array costs ~1 us on one core, so the count of calls matters
        # more than their size. Precisions change rarely: what depends only on them (each
        # expert's weight-read time and time per token) is kept until the precision grid
        # changes; the per-expert pass is one compiled loop (pwsim.roofline_kernels).
        grid = self._grid_for(precision_ids)
        grid.fill(
            tokens_per_expert.reshape(1, -1), grid.s_per_token, grid.read_s, grid.layer_class, grid.num_keys,
            grid.times, grid.num_calls,
        )  # fmt: skip
        # One launch per (layer, precision class) with active experts.
        # ndarray.dot: np.dot's product (BLAS's sum, the same float) with less dispatch.
        return float(grid.times_row.dot(grid.ones)) + grid.num_calls.item(0) * self.cfg.kernel_launch_s

    def moe_s_ranks(self, models: list[AnalyticLatencyModel], tokens: np.ndarray, precision_ids: list) -> list[float]:
        """``moe_s`` of every rank of an expert-parallel replica at once: ``models[r]``,
        ``tokens[r]`` (R, L, E) and ``precision_ids[r]`` are rank r's; the same floats as R
        calls (each rank's sum over the same values in the same order), in one pass and a dot
        per rank (DeepSeek-V3 on 8 GPUs: R calls were 20% of a static policy's step)."""
        grids = [m._grid_for(p) for m, p in zip(models, precision_ids, strict=True)]
        stack = self._ranks_stack
        if stack is None or len(stack[0]) != len(grids) or any(map(operator.is_not, stack[0], grids)):
            num_keys = grids[0].num_keys  # (layer, precision) pairs of one rank
            offsets = (np.arange(len(grids)) * num_keys)[:, None]
            stack = self._ranks_stack = (
                grids,
                np.concatenate([g.s_per_token for g in grids]),
                np.concatenate([g.read_s for g in grids]),
                np.concatenate([g.layer_class for g in grids]) + offsets,  # keys distinct per rank
                len(grids) * num_keys,
            )
        _, s_per_token, read_s, keys, num_keys = stack
        times, calls = expert_times(tokens.reshape(len(grids), -1), s_per_token, read_s, keys, num_keys)
        launch_s = self.cfg.kernel_launch_s
        calls = calls.tolist()
        return [float(np.dot(times[r], g.ones)) + calls[r] * launch_s for r, g in enumerate(grids)]

    def _grid_for(self, precision_ids: np.ndarray) -> _PrecisionGrid:
        key = precision_ids.tobytes()  # 256 bytes for Mixtral: cheaper than any array compare
        grid = self._grid
        if grid is None or grid.key != key or grid.shape != precision_ids.shape or grid.dtype != precision_ids.dtype:
            grid = self._grid = _PrecisionGrid(self, precision_ids, key)
        return grid

    def moe_class_s(self, precision_id: int, tokens_per_active_expert, num_active_experts):
        """Expert FFNs of one precision class: ``e`` experts with ``m`` tokens each (vectorised)."""
        per_expert = np.maximum(
            self.expert_read_s[precision_id], tokens_per_active_expert * self.expert_s_per_token[precision_id]
        )
        return num_active_experts * per_expert + self.cfg.kernel_launch_s

    def attn_prefill_s(self, chunk_tokens, kv_lens):
        """Per layer, per chunk (vectorised over chunks)."""
        q = np.asarray(chunk_tokens, dtype=np.float64)
        kv_eff = np.asarray(kv_lens, dtype=np.float64) - (q - 1) / 2
        flops = 2.0 * q * kv_eff * self.model.num_heads * self.prefill_head_dims
        return roofline_s(kv_lens * self.kv_bytes_per_token_layer, flops, self.bw_bytes_per_s, self.bf16_flops_per_s)

    def attn_decode_s(self, num_seqs, total_kv_tokens):
        """Per layer, for ``num_seqs`` sequences reading ``total_kv_tokens`` KV entries in all."""
        flops = 2.0 * total_kv_tokens * self.model.num_heads * self.decode_head_dims
        return roofline_s(
            total_kv_tokens * self.kv_bytes_per_token_layer, flops, self.bw_bytes_per_s, self.bf16_flops_per_s
        )

    def dense_s(self, num_tokens):
        """Pinned weights of one MoE layer (attention projections, norms, router, shared experts)."""
        nbytes, flops_per_token = self.moe_layer_pinned
        return roofline_s(nbytes, flops_per_token * num_tokens, self.bw_bytes_per_s, self.bf16_flops_per_s)

    def dense_layer_s(self, num_tokens):
        """One leading dense layer's pinned weights, its dense FFN included."""
        nbytes, flops_per_token = self.dense_layer_pinned
        return roofline_s(nbytes, flops_per_token * num_tokens, self.bw_bytes_per_s, self.bf16_flops_per_s)

    def lm_head_s(self, num_seqs):
        nbytes, flops_per_token = self.lm_head
        return roofline_s(nbytes, flops_per_token * num_seqs, self.bw_bytes_per_s, self.bf16_flops_per_s)

    # ---- the LatencyModel interface ------------------------------------------------------
    def step_time_s(
        self, shape: StepShape, tokens_per_expert: np.ndarray, precision_ids: np.ndarray, moe_s: float | None = None
    ) -> float:
        """``moe_s``: the routed experts' time when the caller has it (``moe_s_ranks``)."""
        # Scalar parts in plain Python floats: a numpy call on a scalar costs ~1 us, a float op 50 ns.
        m = self.model
        bw, peak = self.bw_bytes_per_s, self.bf16_flops_per_s
        num_decodes = len(shape.decode_kv_lens)
        num_chunks = len(shape.prefill_tokens)
        num_prefill = shape.num_prefill_tokens
        num_tokens = num_prefill + num_decodes
        if num_tokens == 0:
            return 0.0
        attn_s = 0.0
        if num_chunks:
            heads_flops = 2.0 * m.num_heads * self.prefill_head_dims
            for q, kv in zip(shape.prefill_tokens, shape.prefill_kv_lens, strict=True):
                flops = heads_flops * q * (kv - (q - 1) / 2)
                attn_s += max(kv * self.kv_bytes_per_token_layer / bw, flops / peak)
        if num_decodes:
            kv_total = float(shape.decode_kv_tokens)
            flops = 2.0 * kv_total * m.num_heads * self.decode_head_dims
            attn_s += max(kv_total * self.kv_bytes_per_token_layer / bw, flops / peak)
        nbytes, flops_per_token = self.moe_layer_pinned
        moe_layer_pinned_s = max(nbytes / bw, flops_per_token * num_tokens / peak)
        dense_layers_s = 0.0
        if m.num_dense_layers:
            nbytes, flops_per_token = self.dense_layer_pinned
            dense_layers_s = m.num_dense_layers * max(nbytes / bw, flops_per_token * num_tokens / peak)
        nbytes, flops_per_token = self.lm_head
        head_s = max(nbytes / bw, flops_per_token * (num_chunks + num_decodes) / peak)
        return (
            m.num_layers * (attn_s + self.cfg.layer_overhead_s)
            + m.num_moe_layers * moe_layer_pinned_s
            + dense_layers_s
            + head_s
            + (self.moe_s(tokens_per_expert, precision_ids) if moe_s is None else moe_s)
            + self.cfg.step_overhead_s
        )

    def quantize_time_s(self, n: int, k: int, precision_id: int) -> float:
        """Downgrade one ``[n, k]`` matrix on the device: read bf16 once, write the packed format."""
        prec = PRECISIONS[PRECISION_NAMES[precision_id]]
        nbytes = n * k * self.model.dtype_bytes + prec.matrix_bytes(n, k)
        return self.cfg.kernel_launch_s + nbytes / self.bw_bytes_per_s

    def h2d_time_s(self, num_bytes: int) -> float:
        """``GpuSpec.h2d_bandwidth_bytes_per_s`` is already a sustained pinned-copy figure."""
        if num_bytes <= 0:
            return 0.0
        return self.cfg.kernel_launch_s + num_bytes / self.gpu.h2d_bandwidth_bytes_per_s

    def describe(self) -> str:
        return f"{self.cfg.describe()} on {self.gpu.name}"
