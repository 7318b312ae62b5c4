"""Measure the latency table ``pwsim`` reads (schema: ``pagedweight.config.kernel_table``).

Every op is timed on the device the engine would run it on: on a GPU the Triton MoE kernel and
quantiser, on a CPU the PyTorch references (the CPU engine's path). Each op's keys are measured
on a full rectilinear grid, because the simulator builds dense grids and refuses holes.

The approximations made are listed in ``NOTES`` and copied into the meta file.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F_

from pagedweight.config.kernel_table import KEY_COLUMNS, OP_GROUPS, decode_step_counts, decode_step_routing
from pagedweight.core.spec import PRECISION_NAMES, ModelSpec
from pagedweight.errors import ConfigError
from pwgpu.attention import PagedKvCache, build_batch, paged_attention
from pwgpu.cpu_kernels import cpu_linear, dense_dtype, moe_ffn_grouped
from pwgpu.host_allocator import keep_host_temporaries
from pwgpu.kernels.paging import PagedExperts
from pwgpu.loader import DTYPES, default_dtype_name
from pwgpu.mla import latent_attention
from pwgpu.model import LayerWeights, MoeArch, MoeTransformer, PinnedWeights, Rope, rms_norm

MiB = 1 << 20
NOTES = (
    "activations and KV in meta 'dtype': the engine's default on the device, or bf16 for a scenario run",
    "every timed sample starts with the caches flushed (meta 'flush_bytes' touched just before: written on "
    "a GPU, read on a CPU, where written lines would leave their write-back to the timed op); on a CPU "
    "dequantize and h2d_copy are timed warm: in a step they find their data in the caches",
    "on a CPU the rows of an op group (of one precision, for moe_ffn) are timed in rounds, one sample "
    "of every row per round, so that the machine's drift spreads over all of them",
    "moe_ffn: e experts of one precision, each routed exactly m tokens (top-1 routing: the top-k sum, "
    "one elementwise pass, is not timed); on a CPU, precisions whose dense copies share a dtype share "
    "one timing (the same matmuls)",
    "attn_prefill: the engine's paged attention for one chunk of m new tokens whose context after the "
    "chunk is max(kv_len, m) tokens, K/V written into scattered KV blocks first; attn_decode: the "
    "engine's batched paged decode for batch requests of kv_len tokens each (MLA specs: the latent "
    "written into the blocks and the engine's absorbed latent attention, pwgpu/mla.py)",
    "dense: one layer's non-expert work as the engine runs it: two RMSNorms, the q/k/v/o projections, "
    "RoPE, the router softmax, top-k and renormalisation, the count of its choices, shared experts, both "
    "residual adds (MLA: the attention parameters as one matrix)",
    "lm_head: final RMSNorm, LM head and greedy sampling for m sequences",
    "decode_step (CPU only; Mixtral-shaped models: GQA, no dense or shared-expert FFNs, no q/k norms): a "
    "whole decode step of batch requests of kv_len tokens each, the engine's own forward pass and LM head"
    " over random weights (experts as the dense copies of the rows' precision, the first profiled; every "
    "token routed to experts i*k .. i*k+k-1 mod E, spread evenly), timed warm: each sample right after an"
    " untimed run of the same step, as consecutive decode steps of one batch find what the last one left "
    "in the caches; pwsim scales its pure decode steps by this over the sum of the other rows at the same"
    " shape",
    "quantize: one master [n, k] matrix into a standalone packed blob",
    "dequantize (CPU only): one [n, k] matrix read from its pages into the dense copy the CPU engine "
    "keeps per expert; it runs again on an expert's first use after each precision change (GPU kernels "
    "dequantise inside the MoE call: no rows)",
    "meta 'upgrades': synchronous on a CPU (no copy stream: an upgrade is written inside the step that "
    "starts it), asynchronous on a GPU (a side stream overlaps the copy with compute)",
    "all_to_all (only with --ep N; pwgpu/profile_a2a.py): one all_to_all_single of N ranks (gloo on a CPU, "
    "NCCL on N GPUs) with equal splits, not the engine's uneven ones; batch = N, bytes = what each rank sends "
    "to the other ranks; the slowest rank's time after a barrier; measured once, under the first model",
)


@dataclass(frozen=True)
class Grid:
    """Axis values per op; each op is measured on the full cross product of its axes."""

    name: str
    moe_m: tuple[int, ...]
    attn_prefill_m: tuple[int, ...]
    attn_prefill_kv: tuple[int, ...]
    attn_decode_batch: tuple[int, ...]
    attn_decode_kv: tuple[int, ...]
    dense_m: tuple[int, ...]
    h2d_bytes: tuple[int, ...]
    samples: int
    warmup: int

    def moe_e(self, model: ModelSpec) -> tuple[int, ...]:
        if self.name == "small":
            return tuple(sorted({1, model.top_k, model.num_experts}))
        powers = {2**i for i in range(12) if 2**i <= model.num_experts}
        return tuple(sorted(powers | {model.top_k, model.num_experts}))

    @classmethod
    def fitted(cls, name: str, max_batched_tokens: int, max_num_seqs: int, max_context_tokens: int,
               copy_bytes: tuple[int, int]) -> Grid:  # fmt: skip
        """A grid that covers every step a scheduler with these limits can form, so that a
        simulation of it never leaves the measured range: powers of two from 1 and the limit
        itself; copies in powers of four over ``copy_bytes`` = (smallest, largest)."""

        def up_to(lo: int, hi: int, base: int = 2) -> tuple[int, ...]:
            vals, v = [], lo
            while v < hi:  # hi itself ends the axis (a limit below lo makes it (hi,))
                vals.append(v)
                v *= base
            return (*vals, hi)

        return cls(
            name=name,
            moe_m=up_to(1, max_batched_tokens),
            attn_prefill_m=up_to(1, max_batched_tokens),
            attn_prefill_kv=up_to(1, max_context_tokens),
            attn_decode_batch=up_to(1, max_num_seqs),
            attn_decode_kv=up_to(1, max_context_tokens),
            dense_m=up_to(1, max(max_batched_tokens, max_num_seqs)),
            h2d_bytes=up_to(copy_bytes[0], copy_bytes[1], 4),
            samples=7,
            warmup=2,
        )


GRIDS = {
    "small": Grid(
        name="small",
        moe_m=(1, 8, 64),
        attn_prefill_m=(16, 128),
        attn_prefill_kv=(128, 512),
        attn_decode_batch=(1, 8),
        attn_decode_kv=(128, 1024),
        dense_m=(1, 16, 128),
        h2d_bytes=(1 * MiB, 16 * MiB),
        samples=3,
        warmup=1,
    ),
    "full": Grid(
        name="full",
        moe_m=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
        attn_prefill_m=(16, 64, 256, 1024, 4096),
        attn_prefill_kv=(256, 1024, 4096, 16384),
        # batch x kv_len stays <= 2M tokens: 8 GB of KV per layer for Mixtral.
        attn_decode_batch=(1, 4, 16, 64, 256),
        attn_decode_kv=(256, 1024, 4096, 8192),
        dense_m=(1, 4, 16, 64, 256, 1024, 4096),
        h2d_bytes=(64 * 1024, 1 * MiB, 16 * MiB, 128 * MiB, 1024 * MiB),
        samples=10,  # compile time, not timing noise, bounds a full run; p20-p80 shows the spread
        warmup=2,
    ),
}


# Touched before each timed repetition, outside the timing, so every op starts with cold caches
# as it does inside a step, where the other ops of the layer (and the other layers) have just
# run: larger than an H200's 50 MB L2, and twice the 32 MB L3 of the 2-core CPU VM. A GPU writes
# the buffer. A CPU reads it (``_read_all``): written, it left 64 MB of dirty lines whose
# write-back the timed op then paid (a batch-16 decode attention layer 2.7 ms flushed by writes
# against 1.7 ms inside engine steps). Measured in place by benchmarks/step_breakdown.py on the
# CPU VM (benchmarks/RESULTS.md, 2026-12-02), warm samples, which find the previous repetition's
# data still in L2 and L3, timed a step's ops short: the dense work 1.46x, the LM head 2.7x, the
# experts and attention 1.2x; read-flushed, 0.7-1.25x in three runs, as far apart as the
# machine's own drift from run to run. Two ops on a CPU stay warm
# (``WARM_ON_CPU``): the dequantisation into an expert's dense copy, which reads the packed pages
# a downgrade has just written (in place 0.7-1.3x its warm rows in nine runs; flushed rows are
# 1.6x the warm ones), and the host copy. A downgrade's write reads the host's master copy, cold
# in a step: flushed (in place it took 1.5-2.6x its warm rows in four runs, 1.25x the flushed).
FLUSH_BYTES = {"cuda": 256 << 20, "cpu": 64 << 20}
WARM_ON_CPU = frozenset({"dequantize", "h2d_copy"})
# Ops timed right after an untimed run of themselves (and no flush): a steady state of repeats.
PRIMED = frozenset({"decode_step"})
# Whole decode steps are timed in one group of rounds over every batch size and context while
# their KV caches together stay within this many bytes (then a new group starts): pwsim reads
# these rows for how a step grows with its batch, and batch sizes timed in separate groups carried
# the machine's drift between the groups. Drained per batch size, the batch-16 over batch-8 step
# at 340 tokens of context (scenarios/cpu_validate.yaml) read 0.83-1.80 across the 90 profiles of
# ten validations on the 2-core VM; one group cut its spread from profile to profile by about a
# third (sd 0.18 -> 0.11 over 20 profiles; benchmarks/RESULTS.md, 2026-12-03).
DECODE_STEP_GROUP_BYTES = 1 << 30
_flush_buffers: dict[torch.device, torch.Tensor] = {}


def _read_all(buf: torch.Tensor) -> None:
    """Read every byte of ``buf`` (a reduction): its lines fill the caches clean."""
    buf.view(torch.int64 if buf.numel() % 8 == 0 else torch.uint8).max()


def _flush(device: torch.device, num_bytes: int | None) -> None:
    n = FLUSH_BYTES.get(device.type, 64 << 20) if num_bytes is None else num_bytes
    if n == 0:
        return
    buf = _flush_buffers.get(device)
    if buf is None or buf.numel() != n:
        buf = _flush_buffers[device] = torch.ones(n, dtype=torch.uint8, device=device)
    if device.type == "cpu":
        _read_all(buf)
    else:
        buf.fill_(1)


def time_us(
    fn: Callable[[], object], device: torch.device, samples: int, warmup: int, flush_bytes: int | None = None
) -> tuple[float, float, float]:
    """(p50, p20, p80) of ``fn``'s latency in microseconds, caches flushed before each sample
    (``flush_bytes``, default ``FLUSH_BYTES`` of the device; 0 keeps them warm); CUDA events on
    a GPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(samples):
            if flush_bytes != 0:
                _flush(device, flush_bytes)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
    else:
        for _ in range(samples):
            if flush_bytes != 0:
                _flush(device, flush_bytes)
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    p20, p50, p80 = np.percentile(times, [20, 50, 80])
    return float(p50), float(p20), float(p80)


class Profiler:
    def __init__(
        self, model: ModelSpec, grid: Grid, device: torch.device, precisions: tuple[str, ...], dtype: torch.dtype
    ):
        self.model, self.grid, self.device, self.precisions = model, grid, device, precisions
        self.dtype = dtype  # activations and KV, as the engine to be simulated computes them
        self.master_dtype = torch.bfloat16  # the host masters experts are quantised from
        self.rows: list[dict] = []
        self.gen = torch.Generator(device=device).manual_seed(0)
        # A CPU's speed drifts by tens of percent over seconds (a shared VM's neighbours, its
        # clock): timed one after another, two rows of a table differed by the drift between
        # them (the same matmuls by up to 2x; a row moved +-30-70% from one profile to the
        # next beyond the machine's overall speed). On a CPU the rows of an op group are
        # therefore timed in rounds, one sample of every row per round (``drain``): each
        # row's median spans the whole group. A GPU times each row at once (its clock holds).
        self._pending: list[tuple[dict, Callable[[], object]]] | None = [] if device.type == "cpu" else None
        self._moe_aliases: list[tuple[str, str]] = []  # (precision, the one whose moe_ffn rows it shares)

    def _randn(self, *shape: int, scale: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.device, dtype=dtype or self.dtype) * scale

    def _record(self, op: str, fn: Callable[[], object], precision: str = "-", **keys: int) -> None:
        row = dict(model=self.model.name, op=op, precision=precision, **keys)
        if self._pending is not None:
            self._pending.append((row, fn))
            return
        p50, p20, p80 = time_us(fn, self.device, self.grid.samples, self.grid.warmup)
        samples = self.grid.samples
        self.rows.append(dict(row, latency_us_p50=p50, latency_us_p20=p20, latency_us_p80=p80, samples=samples))

    def drain(self) -> None:
        """Time the rows recorded since the last drain in rounds (CPU; see ``__init__``)."""
        pending = self._pending or []
        if self._pending is not None:
            self._pending = []
        for _ in range(self.grid.warmup if pending else 0):
            for _, fn in pending:
                fn()
        times = [[] for _ in pending]
        for _ in range(self.grid.samples):
            for (row, fn), mine in zip(pending, times, strict=True):
                if row["op"] in PRIMED:
                    fn()
                else:
                    _flush(self.device, 0 if row["op"] in WARM_ON_CPU else None)
                t0 = time.perf_counter()
                fn()
                mine.append((time.perf_counter() - t0) * 1e6)
        for (row, _), mine in zip(pending, times, strict=True):
            p20, p50, p80 = (float(x) for x in np.percentile(mine, [20, 50, 80]))
            self.rows.append(dict(row, latency_us_p50=p50, latency_us_p20=p20, latency_us_p80=p80, samples=len(mine)))
        for prec, same in self._moe_aliases:
            rows = [r for r in self.rows if r["op"] == "moe_ffn" and r["precision"] == same]
            self.rows.extend(dict(r, precision=prec) for r in rows)
        self._moe_aliases = []

    # ---- ops ------------------------------------------------------------------------------
    def moe_ffn(self) -> None:
        h, f = self.model.hidden_size, self.model.expert_ffn_size
        es = self.grid.moe_e(self.model)
        num = max(es)
        md = self.master_dtype
        w1 = [self._randn(f, h, scale=h**-0.5, dtype=md) for _ in range(num)]
        w3 = [self._randn(f, h, scale=h**-0.5, dtype=md) for _ in range(num)]
        w2 = [self._randn(h, f, scale=f**-0.5, dtype=md) for _ in range(num)]
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            from pwgpu.kernels.moe_gemm import fused_moe as run_moe
        else:
            from pwgpu.cpu_kernels import dense_expert, moe_ffn_grouped
        timed: dict[torch.dtype, str] = {}  # CPU: dense copy dtype -> the precision timed with it
        for prec in self.precisions:
            if not on_gpu:
                # The CPU path multiplies by dense copies (``cpu_kernels.dense_dtype``): precisions
                # whose copies share a dtype run the very same matmuls, so they share one timing
                # too, rather than differ by the machine's drift between two timings of it.
                same = timed.setdefault(dense_dtype(prec, self.dtype), prec)
                if same != prec:
                    self._moe_aliases.append((prec, same))  # its rows copied when timed (``drain``)
                    continue
            experts = PagedExperts.from_dense(
                w1, w3, w2, [prec] * num, quantizer="triton" if on_gpu else "reference", scatter_seed=0
            )
            if not on_gpu:
                # The CPU engine dequantises an expert once per precision change and then runs
                # dense matmuls (pwgpu/weights.py): time that, not a dequantisation per call.
                dense = list(zip(*(dense_expert(experts, i, self.dtype) for i in range(num)), strict=True))
            for e in es:
                # The first e experts as a layer of their own: the kernel sizes blocks by m.
                sub = PagedExperts(experts.pool, experts.page_offsets, experts.first_page[:e], (prec,) * e, h, f,
                                   experts.page_bytes)  # fmt: skip
                for m in self.grid.moe_m:
                    x = self._randn(m * e, h)
                    ids = torch.arange(e, device=self.device).repeat_interleave(m)[:, None]
                    weights = torch.ones(m * e, 1, device=self.device)
                    if on_gpu:
                        fn = lambda x=x, ids=ids, w=weights, s=sub: run_moe(x, ids, w, s)  # noqa: E731
                    else:
                        fn = lambda x=x, ids=ids, w=weights, c=[m] * e, d=dense: moe_ffn_grouped(x, ids, w, *d, c)  # noqa: E731
                    self._record("moe_ffn", fn, precision=prec, m=m, e=e, n=f, k=h)
            self.drain()  # this precision's dense copies go with ``experts``
            del experts
        if on_gpu:
            torch.cuda.empty_cache()

    def attention(self) -> None:
        """The engine's KV write and paged attention: GQA (``pwgpu.attention``) or, for MLA specs,
        the latent write and absorbed attention (``pwgpu.mla``)."""
        spec, block_tokens = self.model, 16
        if spec.attention == "mla":
            rank = spec.kv_lora_rank
            parts, kv_heads, d = 1, 1, rank + spec.qk_rope_head_dim
            scale = (spec.qk_nope_head_dim + spec.qk_rope_head_dim) ** -0.5

            def attend(q, kv, batch):
                return latent_attention(q, kv, 0, batch, scale, rank)
        else:
            parts, kv_heads, d = 2, spec.num_kv_heads, spec.head_dim

            def attend(q, kv, batch):
                return paged_attention(q, kv, 0, batch, d**-0.5)

        def paged(seqs_tokens: list[tuple[int, int]]):
            """(tokens cached, new tokens) per request -> the engine's KV write + paged attention
            over blocks scattered through an arena of exactly the blocks needed."""
            counts = [-(-(c + n) // block_tokens) for c, n in seqs_tokens]
            kv = _kv_cache(sum(counts), 1, kv_heads, d, block_tokens, self.dtype, self.device, parts)
            perm = torch.randperm(sum(counts), generator=torch.Generator().manual_seed(0)).tolist()
            seqs, at = [], 0
            for (c, n), cnt in zip(seqs_tokens, counts, strict=True):
                seqs.append((perm[at : at + cnt], c, n))
                at += cnt
            batch, _ = build_batch(seqs, block_tokens, self.device)
            t = sum(n for _, n in seqs_tokens)
            q = self._randn(t, spec.num_heads, d)
            new = [self._randn(t, kv_heads, d) for _ in range(parts)]  # K and V, or MLA's latent
            kv.write(0, batch.slot_blocks, batch.slot_offsets, *new)  # fill once, then time write + read

            def fn():
                kv.write(0, batch.slot_blocks, batch.slot_offsets, *new)
                return attend(q, kv, batch)

            return fn

        for m in self.grid.attn_prefill_m:
            for kv_len in self.grid.attn_prefill_kv:
                ctx = max(kv_len, m)
                self._record("attn_prefill", paged([(ctx - m, m)]), m=m, kv_len=kv_len)
        for b in self.grid.attn_decode_batch:
            for kv_len in self.grid.attn_decode_kv:
                self._record("attn_decode", paged([(kv_len - 1, 1)] * b), batch=b, kv_len=kv_len)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def dense_and_head(self) -> None:
        spec, h = self.model, self.model.hidden_size
        eps = spec.rms_norm_eps
        if spec.attention == "mla":
            w_q = self._randn(spec.attention_params_per_layer() // h, h, scale=h**-0.5)
            w_k = w_v = w_o = None
        else:
            hq, hkv, d = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.head_dim
            w_q, w_o = self._randn(hq, h, scale=h**-0.5), self._randn(h, hq, scale=hq**-0.5)
            w_k, w_v = self._randn(hkv, h, scale=h**-0.5), self._randn(hkv, h, scale=h**-0.5)
            rope = Rope(d, 10000.0, self.device)
        router = self._randn(spec.num_experts, h, scale=h**-0.5)
        shared = spec.num_shared_experts * spec.shared_expert_ffn_size
        w_up = self._randn(2 * shared, h, scale=h**-0.5) if shared else None
        w_down = self._randn(h, shared, scale=shared**-0.5) if shared else None
        norm_w = torch.ones(h, device=self.device, dtype=self.dtype)
        head = self._randn(spec.vocab_size, h, scale=h**-0.5)
        counts = torch.zeros(spec.num_experts, dtype=torch.int64, device=self.device)
        linear = cpu_linear(self.device, self.dtype)  # the engine's projections (model.py)

        def dense(x, angles):
            # One layer of the engine's forward (pwgpu/model.py) without attention and experts.
            y = rms_norm(x, norm_w, eps)
            q = linear(y, w_q)
            if w_k is not None:
                t = x.shape[0]
                linear(y, w_v)  # V goes to the cache; the attention op times that write
                # The RoPE angles are computed once per step for all layers, as the engine does.
                q = Rope.rotate(q.view(t, spec.num_heads, spec.head_dim), *angles)
                Rope.rotate(linear(y, w_k).view(t, spec.num_kv_heads, spec.head_dim), *angles)
                q = linear(q.reshape(t, -1), w_o)  # attention itself is the attn_* ops
            x = x + q
            z = rms_norm(x, norm_w, eps)
            probs = torch.softmax(linear(z, router).float(), dim=-1)
            weights, ids = torch.topk(probs, spec.top_k, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)  # renormalised, as for Mixtral
            # The router's choices counted on the device, its weights cast for the experts.
            ids_flat = ids.reshape(-1)
            counts.index_add_(0, ids_flat, torch.ones_like(ids_flat))
            weights.to(x.dtype)
            if w_up is not None:
                gate, up = F_.linear(z, w_up).chunk(2, dim=-1)  # shared experts: model.swiglu, unpadded
                x = x + F_.linear(F_.silu(gate) * up, w_down)
            return x + z  # the experts' output (the moe_ffn op) added to the residual

        def lm_head(hidden):
            logits = linear(rms_norm(hidden, norm_w, eps), head).float()
            return logits.argmax(dim=-1).tolist()  # greedy sampling, as in the validation runs

        for m in self.grid.dense_m:
            x = self._randn(m, h)
            angles = rope.angles(torch.arange(m, device=self.device), self.dtype, m - 1) if w_k is not None else None
            self._record("dense", lambda x=x, a=angles: dense(x, a), m=m)
            self._record("lm_head", lambda x=x: lm_head(x), m=m)

    def decode_step(self) -> None:
        """Whole decode steps on a CPU (see ``NOTES``): the engine's own forward pass
        (``MoeTransformer``) and LM head over random weights of the model's shape, timed warm,
        where the table's other rows time each op with cold caches. A small model's weights and
        a small batch's KV fit in a CPU's last-level cache and are found there by the next step;
        a larger batch's are not. This over the op rows' sum at the same shape is how far the
        cold rows overstate a decode step of that shape (``pwsim.table_latency``)."""
        spec = self.model
        plain = spec.attention == "gqa" and not (spec.num_dense_layers or spec.num_shared_experts or spec.qk_norm)
        if self.device.type != "cpu" or not plain:  # the engine's forward of Mixtral-shaped layers only
            return
        h, f, d, n_exp = spec.hidden_size, spec.expert_ffn_size, spec.head_dim, spec.num_experts
        copy = dense_dtype(self.precisions[0], self.dtype)

        def w(*shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
            return self._randn(*shape, scale=shape[-1] ** -0.5, dtype=dtype)

        def ones() -> torch.Tensor:
            return torch.ones(h, device=self.device, dtype=self.dtype)

        arch = MoeArch(
            family="mixtral", vocab_size=spec.vocab_size, hidden_size=h, num_layers=spec.num_layers,
            num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=d, num_experts=n_exp,
            top_k=spec.top_k, expert_ffn_size=f, router_renorm=True, rope_theta=spec.rope_theta,
            rms_norm_eps=spec.rms_norm_eps, max_position_embeddings=spec.max_context_tokens,
        )  # fmt: skip
        hq, hkv = spec.num_heads * d, spec.num_kv_heads * d
        layers = [
            LayerWeights(input_norm=ones(), post_norm=ones(), o=w(h, hq), q=w(hq, h), k=w(hkv, h), v=w(hkv, h),
                         router=w(n_exp, h))
            for _ in range(spec.num_layers)
        ]  # fmt: skip
        pinned = PinnedWeights(embed=w(spec.vocab_size, h), final_norm=ones(), lm_head=w(spec.vocab_size, h),
                               layers=layers)  # fmt: skip
        experts = EvenlyRoutedExperts(
            [[w(2 * f, h, dtype=copy) for _ in range(n_exp)] for _ in layers],
            [[w(h, f, dtype=copy) for _ in range(n_exp)] for _ in layers],
            spec.top_k,
        )
        model, block_tokens = MoeTransformer(arch, pinned, experts, self.device), 16
        held_bytes = 0  # KV arenas of the steps recorded since the last drain
        for b in self.grid.attn_decode_batch:
            input_ids = torch.randint(0, spec.vocab_size, (b,), generator=self.gen, device=self.device)
            for kv_len in self.grid.attn_decode_kv:
                per_seq = -(-kv_len // block_tokens)
                kv = _kv_cache(
                    b * per_seq, spec.num_layers, spec.num_kv_heads, d, block_tokens, self.dtype, self.device
                )
                if held_bytes and held_bytes + kv.arena.numel() > DECODE_STEP_GROUP_BYTES:
                    self.drain()  # the earlier steps' KV caches go
                    held_bytes = 0
                held_bytes += kv.arena.numel()  # a uint8 arena: its bytes
                perm = torch.randperm(b * per_seq, generator=torch.Generator().manual_seed(0)).tolist()
                seqs = [(perm[i * per_seq : (i + 1) * per_seq], kv_len - 1, 1) for i in range(b)]
                batch, positions = build_batch(seqs, block_tokens, self.device)

                def step(ids=input_ids, positions=positions, batch=batch, kv=kv):
                    hidden = model.forward(ids, positions, batch, kv)
                    return model.logits(hidden).argmax(dim=-1).tolist()  # greedy, as the validation runs

                step()  # every block written once before timing
                self._record("decode_step", step, precision=self.precisions[0], batch=b, kv_len=kv_len)

    def quantize(self) -> None:
        h, f = self.model.hidden_size, self.model.expert_ffn_size
        if self.device.type == "cuda":
            from pwgpu.kernels.quant import quantize as run_quant
        else:
            from pwgpu.kernels.reference import quantize_ref as run_quant
        for prec in self.precisions:
            for n in sorted({h, f}):
                for k in sorted({h, f}):  # the full n x k cross product: pwsim's grids have no holes
                    w = self._randn(n, k, scale=0.02, dtype=self.master_dtype)
                    self._record("quantize", lambda w=w, p=prec: run_quant(w, p), precision=prec, n=n, k=k)

    def dequantize(self) -> None:
        """The CPU engine's dequantisation of one expert matrix from its pages into the dense
        copy its MoE path multiplies by (``pwgpu.weights.WeightStore.moe_ffn``; 16-bit experts
        stay 16-bit, the rest take the activations' dtype: ``pwgpu.cpu_kernels.dense_dtype``). A GPU's
        MoE kernel reads the packed pages itself: nothing to time there."""
        if self.device.type == "cuda":
            return
        h, f = self.model.hidden_size, self.model.expert_ffn_size
        for prec in self.precisions:
            for n in sorted({h, f}):
                for k in sorted({h, f}):  # the full cross product, as for quantize
                    # One expert whose first matrix is [n, k] (w1, w3 [n, k]; w2 [k, n]).
                    w = self._randn(n, k, scale=0.02, dtype=self.master_dtype)
                    experts = PagedExperts.from_dense([w], [w], [w.T.contiguous()], [prec], scatter_seed=0)
                    dtype = dense_dtype(prec, self.dtype)
                    fn = lambda x=experts, d=dtype: x.dequantize_matrix(0, 0, d)  # noqa: E731
                    self._record("dequantize", fn, precision=prec, n=n, k=k)

    def h2d_copy(self) -> None:
        for num_bytes in self.grid.h2d_bytes:
            src = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            dst = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
            self._record("h2d_copy", lambda s=src, d=dst: d.copy_(s, non_blocking=True), bytes=num_bytes)
            self.drain()  # one buffer pair at a time (up to 1 GiB each)


def _kv_cache(num_blocks: int, num_layers: int, kv_heads: int, head_dim: int, block_tokens: int,
              dtype: torch.dtype, device: torch.device, num_parts: int = 2) -> PagedKvCache:  # fmt: skip
    """A KV cache of ``num_blocks`` blocks, one per page, as the engine lays them out."""
    elem = torch.tensor([], dtype=dtype).element_size()
    block_bytes = num_layers * num_parts * block_tokens * kv_heads * head_dim * elem
    arena = torch.zeros(num_blocks * block_bytes, dtype=torch.uint8, device=device)
    return PagedKvCache(arena, block_bytes, block_tokens, 1, num_layers, kv_heads, head_dim, dtype, num_parts)


class EvenlyRoutedExperts:
    """The CPU engine's expert path (``moe_ffn_grouped`` on dense copies, as
    ``WeightStore.moe_ffn`` runs it) with the tokens sent to ``decode_step_routing``'s experts
    whatever the router chose, so that the profiler's decode step has a routing ``pwsim`` can time again
    from the op rows (``TableLatencyModel._decode_scale``). ``w13[layer][e]`` is w1 over w3."""

    def __init__(self, w13: list[list[torch.Tensor]], w2: list[list[torch.Tensor]], top_k: int):
        self.w13, self.w2, self.top_k = w13, w2, top_k
        self._routes: dict[int, tuple[torch.Tensor, list[int]]] = {}

    def moe_ffn(self, moe_layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        num_exp, t = len(self.w13[moe_layer]), x.shape[0]
        if t not in self._routes:
            ids = torch.from_numpy(decode_step_routing(t, self.top_k, num_exp)).to(x.device)
            self._routes[t] = (ids, decode_step_counts(t, self.top_k, num_exp).tolist())
        ids, counts = self._routes[t]
        return moe_ffn_grouped(x, ids, topk_w, self.w13[moe_layer], self.w2[moe_layer], counts)


def profile(
    models: list[ModelSpec],
    grid_name: str | Grid = "small",
    device: str | torch.device | None = None,
    precisions: tuple[str, ...] = PRECISION_NAMES,
    ops: tuple[str, ...] = OP_GROUPS,
    on_progress: Callable[[pd.DataFrame, dict], None] | None = None,
    dtype: str | None = None,
) -> tuple[pd.DataFrame, dict]:
    """Measure every op for every model; returns the long table and its meta dict.
    ``dtype``: activations and KV (default: the engine's default on the device; a table for a
    scenario run is measured in ``SCENARIO_DTYPE``).

    ``on_progress(table_so_far, meta)`` runs after each op group, so a run cut short by a time
    limit still leaves what it measured (meta ``complete: false``).
    """
    if isinstance(grid_name, str) and grid_name not in GRIDS:
        raise ConfigError(f"grid {grid_name!r} unknown; allowed: {', '.join(GRIDS)}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    grid = GRIDS[grid_name] if isinstance(grid_name, str) else grid_name
    dtype = dtype or default_dtype_name(dev)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} unknown; allowed: {', '.join(DTYPES)}")
    rows: list[dict] = []
    keep_host_temporaries()  # as the engine does (host_allocator.py): time the engine's ops
    with torch.inference_mode():
        for model in models:
            prof = Profiler(model, grid, dev, precisions, DTYPES[dtype])
            steps = {"moe_ffn": prof.moe_ffn, "attention": prof.attention, "dense": prof.dense_and_head,
                     "quantize": prof.quantize, "dequantize": prof.dequantize,
                     "h2d_copy": prof.h2d_copy, "decode_step": prof.decode_step}  # fmt: skip
            for op in ops:
                steps[op]()
                prof.drain()
                if on_progress is not None and (rows or prof.rows):
                    on_progress(_frame(rows + prof.rows), {**_meta(dev, grid, models, dtype), "complete": False})
            rows += prof.rows
    return _frame(rows), {**_meta(dev, grid, models, dtype), "complete": True}


def _frame(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    for col in KEY_COLUMNS[3:]:  # keys an op does not use are 0 (kernel_table.py)
        df[col] = df[col].fillna(0).astype(np.int64) if col in df else 0
    return df


def _meta(device: torch.device, grid: Grid, models: list[ModelSpec], dtype: str) -> dict:
    import platform

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    on_gpu = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if on_gpu else f"cpu ({platform.processor() or 'unknown'})",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": str(torch.__version__),
        "triton": str(triton_version),
        "cuda": str(torch.version.cuda) if on_gpu else "none",
        "models": [m.name for m in models],
        "grid": grid.name,
        "dtype": dtype,
        "flush_bytes": FLUSH_BYTES.get(device.type, 64 << 20),
        "path": "triton kernels" if on_gpu else "pytorch reference (CPU engine path)",
        "threads": torch.get_num_threads(),
        "upgrades": "asynchronous" if on_gpu else "synchronous",
        # The CPU path multiplies a layer's routed experts in one call (weights.py), the GPU's
        # kernels one launch per precision class (kernels/moe_gemm.py).
        "moe_calls": "per precision class" if on_gpu else "per layer",
        "notes": list(NOTES),
    }
