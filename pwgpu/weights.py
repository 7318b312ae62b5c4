"""The weight store: one device arena for the whole page pool, the host master copy of every
routed expert, and the physical half of precision changes (``RuntimeCore``'s backend).

Arena (one ``uint8`` tensor of ``pool.total_bytes``): page ``p`` is bytes
``[p * page_bytes, (p + 1) * page_bytes)``. The pool hands out the low pages first, so the
pinned weights (embeddings, attention, norms, routers, shared experts, dense FFNs) are packed
into the first pages as views; routed experts live in the pages the page table lists, in the
packed layout of ``pwgpu.kernels.layout``; KV blocks take the rest (``pwgpu.attention``).

Host master copy (``ExpertMasters``): every routed expert in the checkpoint's own format, the
top of its precision ladder: 16-bit for a bf16/fp16 checkpoint; for an FP8 block-scaled one the
checkpoint's E4M3 codes and 128 x 128 block scales themselves (``fp8-b128``), whose ladder goes
on to INT4 (INT8 would be as large and less precise).

Precision changes (``RuntimeCore.apply`` decides the order: reserve pages, fill, flip, free):
- downgrade: quantise the host master to the new precision into the new pages, synchronously
  (an FP8 master is dequantised on the device first);
- upgrade: copy from the host master on a side stream (CUDA) and flip only when the copy's
  event has completed (``poll``), so a forward pass never reads a half-written expert; an
  upgrade to the master's own format copies its bytes unchanged. On a CPU the copy is
  synchronous but still flips at the next ``poll``, as on a GPU.

Forward pass: on CUDA the fused Triton MoE kernel reads the arena through the page table. On a
CPU each used expert is dequantised from its pages by the kernels' reference path and kept
dense (16-bit experts in their own format, others in fp32) until the expert's table entry
changes (host RAM only; the arena stays the truth); ``cpu_kernels.moe_ffn_grouped`` runs them.

Shape legend: E = experts per layer, F = expert FFN size, H = hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from pagedweight.core.pagetable import Transition
from pagedweight.core.pool import OWNER_PINNED
from pagedweight.core.spec import DEFAULT_LADDER, FP8_BLOCK_LADDER, PRECISION_NAMES
from pagedweight.errors import ConfigError
from pwgpu.kernels.paging import PagedExperts
from pwgpu.kernels.reference import dequantize_ref
from pwgpu.model import PinnedWeights

ALIGN_BYTES = 16  # every packed tensor and page offset is 16-byte aligned (vector loads)


@dataclass
class ExpertMasters:
    """The host master copy of every routed expert, per matrix (w1, w3, w2) and MoE layer:
    dense ``[E, N, K]`` tensors in ``precision`` (bf16 or fp16), or for ``fp8-b128`` each expert's
    packed blob ``uint8 [E, matrix_bytes]`` (``pwgpu.kernels.layout``)."""

    precision: str
    mats: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]
    ffn_size: int = 0  # F and H: read from the dense tensors unless packed
    hidden_size: int = 0

    def __post_init__(self) -> None:
        if not self.packed:
            _, self.ffn_size, self.hidden_size = self.mats[0][0].shape

    @property
    def packed(self) -> bool:
        return self.precision == "fp8-b128"

    @property
    def ladder(self) -> tuple[str, ...]:
        """The precisions these experts may take, most precise (the master's own) first."""
        return FP8_BLOCK_LADDER if self.packed else (self.precision, *DEFAULT_LADDER[1:])

    @property
    def num_layers(self) -> int:
        return len(self.mats[0])

    @property
    def num_experts(self) -> int:
        return self.mats[0][0].shape[0]

    def shape(self, j: int) -> tuple[int, int]:
        return (self.ffn_size, self.hidden_size) if j < 2 else (self.hidden_size, self.ffn_size)

    def dense(self, j: int, layer: int, e: int, device: torch.device) -> torch.Tensor:
        """Matrix j of expert e on ``device``, dense (an FP8 master dequantised there, in fp32:
        the exact products of its codes and scales, for the quantiser to start from)."""
        w = self.mats[j][layer][e].to(device, non_blocking=True)
        if device.type == "cuda":
            # Keep the staging copy alive until the stream that uses it (maybe the side stream
            # of an upgrade) is done with it.
            w.record_stream(torch.cuda.current_stream(device))
        if self.packed:
            w = dequantize_ref(w, self.precision, *self.shape(j), torch.float32)
        return w


class WeightStore:
    def __init__(
        self,
        masters: ExpertMasters,
        page_bytes: int,
        device: torch.device,
        moe_kernel: str | None = None,
        activation: str = "silu",
    ):
        """``masters``: the host master copy of every routed expert; ``activation``: of their
        gated FFN (``MoeArch.hidden_act``).
        ``moe_kernel``: "triton" (fused MoE GEMM through the page table) or "reference"
        (dequantise, then dense PyTorch); default: triton on CUDA, reference elsewhere."""
        if moe_kernel not in (None, "triton", "reference"):
            raise ConfigError(f"moe_kernel {moe_kernel!r} unknown; allowed: triton, reference")
        self.moe_kernel = moe_kernel or ("triton" if device.type == "cuda" else "reference")
        self.activation = activation
        if page_bytes & (page_bytes - 1) or page_bytes < ALIGN_BYTES:
            raise ConfigError(f"page_bytes(={page_bytes}) must be a power of two >= {ALIGN_BYTES}")
        if device.type == "cuda":  # pinned, one layer at a time (no second copy of them all)
            for ws in masters.mats:
                for i, w in enumerate(ws):
                    ws[i] = w.pin_memory()
        self.masters = masters
        self.page_bytes, self.device = page_bytes, device
        self.num_layers, self.num_experts = masters.num_layers, masters.num_experts
        self.ffn_size, self.hidden_size = masters.ffn_size, masters.hidden_size
        self.core = None
        self.arena: torch.Tensor | None = None
        self.layers: list[PagedExperts] = []
        self._dirty: set[int] = set()
        self._copies: list[tuple[Transition, object]] = []  # upgrades in flight: (transition, event or None)
        self._side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # CPU: MoE layer -> per expert None or (the pages array it was dequantised from,
        # w1 over w3 [2F, H], w2 [H, F])
        self._dense: dict[int, list] = {}
        self.h2d_bytes = 0
        self.pinned_outside_bytes = 0

    # ---- set-up ---------------------------------------------------------------------------
    def attach(self, core, pinned: PinnedWeights) -> PinnedWeights:
        """Allocate the arena for ``core``'s pool, fill every expert at its initial precision and
        pack ``pinned`` into the pinned pages. Returns the pinned weights as views of the arena."""
        self.core = core
        pool = core.pool
        self.arena = torch.zeros(pool.total_bytes, dtype=torch.uint8, device=self.device)
        pt = core.page_table
        for idx in range(pt.num_experts):
            self._write_expert(idx, int(pt.precision_ids[idx]), pt.pages[idx])
        self._dirty = set(range(self.num_layers))
        self.refresh()
        return self._pack_pinned(pinned)

    def _pack_pinned(self, pinned: PinnedWeights) -> PinnedWeights:
        pool = self.core.pool
        num_pinned = pool.num_owned(OWNER_PINNED)
        if any(pool.owner_of(p) != OWNER_PINNED for p in range(num_pinned)):
            raise RuntimeError("pinned pages are not the first pages of the pool")
        limit, offset = num_pinned * self.page_bytes, 0
        views: dict[int, torch.Tensor] = {}
        for t in pinned.tensors():
            if id(t) in views:
                continue
            nbytes = t.numel() * t.element_size()
            if offset + nbytes > limit:
                # The spec's pinned count leaves out small extras (q/k/v biases, OLMoE's full-width
                # q/k norms); those few KiB stay outside the arena and are reported.
                views[id(t)] = t.to(self.device)
                self.pinned_outside_bytes += nbytes
                continue
            view = self.arena[offset : offset + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            views[id(t)] = view
            offset += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES

        def swap(v):
            if isinstance(v, torch.Tensor):
                return views[id(v)]
            if isinstance(v, tuple):
                return tuple(views[id(x)] for x in v)
            return v

        for lw in pinned.layers:
            for f in fields(lw):
                setattr(lw, f.name, swap(getattr(lw, f.name)))
        return PinnedWeights(swap(pinned.embed), swap(pinned.final_norm), swap(pinned.lm_head), pinned.layers)

    # ---- the page table the kernels read --------------------------------------------------
    def refresh(self) -> None:
        """Rebuild the tables of layers whose experts flipped since the last forward pass."""
        pt = self.core.page_table
        e_num = self.num_experts
        while len(self.layers) < self.num_layers:
            self.layers.append(None)
        for layer in sorted(self._dirty):
            ids = pt.precision_ids[layer * e_num : (layer + 1) * e_num].tolist()
            precisions = tuple(PRECISION_NAMES[i] for i in ids)
            offsets, first = [], np.zeros((e_num, 3), dtype=np.int32)
            for e in range(e_num):
                for j, pages in enumerate(pt.matrix_pages(ids[e], pt.pages[layer * e_num + e])):
                    first[e, j] = len(offsets)
                    offsets.extend((pages * self.page_bytes).tolist())
            self.layers[layer] = PagedExperts(
                pool=self.arena,
                page_offsets=torch.tensor(offsets, dtype=torch.int64, device=self.device),
                first_page=torch.from_numpy(first).to(self.device),
                precisions=precisions,
                hidden_size=self.hidden_size,
                ffn_size=self.ffn_size,
                page_bytes=self.page_bytes,
            )
        self._dirty.clear()

    def make_dense_copies(self, dtype: torch.dtype) -> None:
        """CPU path: every expert's dense copy now, as the engine is built (for activations in
        ``dtype``), not inside the first steps that route to it. Made there, the copies (and the
        fresh memory they fill) took a run's first step to 1.1-1.5x the latency table's time,
        and every request queued behind that step waited for them, as a server's first requests
        would; a server makes its weights ready before it takes traffic. Precision changes later
        make theirs on first use, as before."""
        for layer in range(len(self.layers)):
            dense = self._dense.setdefault(layer, [None] * self.num_experts)
            for e in range(self.num_experts):
                dense[e] = self._dense_copy(layer, e, dtype)

    def _dense_copy(self, moe_layer: int, e: int, dtype: torch.dtype) -> tuple:
        """(the pages array it is made from, w1 over w3, w2): expert ``e``'s CPU-path copy."""
        from pwgpu.cpu_kernels import dense_expert

        pages = self.core.page_table.pages[moe_layer * self.num_experts + e]
        return (pages, *dense_expert(self.layers[moe_layer], e, dtype))

    def moe_ffn(self, moe_layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        if self.moe_kernel == "triton":
            from pwgpu.kernels.moe_gemm import fused_moe

            return fused_moe(x, topk_ids, topk_w, self.layers[moe_layer], activation=self.activation)
        from pwgpu.cpu_kernels import moe_ffn_grouped

        # CPU path: dequantise each used expert from its pages once and keep the dense copy
        # until the page table points the expert elsewhere (a flip gives it a new pages array).
        # Dequantising every used expert on every step cost 80% of a step (96 int4 matrices:
        # ~400 ms per step of the default model on two cores).
        pt, e_num = self.core.page_table, self.num_experts
        counts = torch.bincount(topk_ids.reshape(-1), minlength=e_num).tolist()
        dense = self._dense.setdefault(moe_layer, [None] * e_num)
        for e, n in enumerate(counts):
            pages = pt.pages[moe_layer * e_num + e]
            if n and (dense[e] is None or dense[e][0] is not pages):
                dense[e] = self._dense_copy(moe_layer, e, x.dtype)
        w13 = [None if d is None else d[1] for d in dense]
        w2 = [None if d is None else d[2] for d in dense]
        return moe_ffn_grouped(x, topk_ids, topk_w, w13, w2, counts, self.activation)

    # ---- writing experts ------------------------------------------------------------------
    def _write_expert(self, idx: int, precision_id: int, pages: np.ndarray) -> None:
        layer, e = divmod(idx, self.num_experts)
        precision = PRECISION_NAMES[precision_id]
        quantizer = "triton" if self.moe_kernel == "triton" else "reference"
        for j, mpages in enumerate(self.core.page_table.matrix_pages(precision_id, pages)):
            offsets = mpages * self.page_bytes
            if precision == self.masters.precision and self.masters.packed:
                self._copy_blob(self.masters.mats[j][layer][e], offsets)  # the checkpoint's bytes
                continue
            w = self.masters.dense(j, layer, e, self.device)
            target = PagedExperts(
                pool=self.arena,
                page_offsets=torch.tensor(offsets, dtype=torch.int64, device=self.device),
                first_page=torch.zeros(1, 3, dtype=torch.int32, device=self.device),
                precisions=(precision,),
                hidden_size=self.hidden_size,
                ffn_size=self.ffn_size,
                page_bytes=self.page_bytes,
            )
            target.write_matrix(w, precision, 0, quantizer)
        self._dirty.add(layer)

    def _copy_blob(self, blob: torch.Tensor, offsets: np.ndarray) -> None:
        """A packed host blob into the pages at ``offsets`` (each page's share, in order)."""
        src = blob.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            src.record_stream(torch.cuda.current_stream(self.device))
        for i, off in enumerate(offsets.tolist()):
            chunk = src[i * self.page_bytes : (i + 1) * self.page_bytes]
            self.arena[off : off + chunk.numel()].copy_(chunk)

    # ---- TransitionBackend ----------------------------------------------------------------
    def downgrade(self, t: Transition) -> None:
        self._write_expert(t.expert, t.to_id, t.pages)

    def start_upgrade(self, t: Transition) -> None:
        self.h2d_bytes += t.num_bytes
        if self._side_stream is None:
            self._write_expert(t.expert, t.to_id, t.pages)
            self._copies.append((t, None))
            return
        self._side_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side_stream):
            self._write_expert(t.expert, t.to_id, t.pages)
            event = torch.cuda.Event()
            event.record(self._side_stream)
        self._copies.append((t, event))

    def abort_upgrade(self, t: Transition) -> None:
        for i, (c, event) in enumerate(self._copies):
            if c is t:
                if event is not None:
                    event.synchronize()  # its pages are freed next and may become KV blocks
                del self._copies[i]
                return

    def poll(self) -> int:
        """Flip every upgrade whose copy has landed; returns how many flipped."""
        done = [(t, ev) for t, ev in self._copies if ev is None or ev.query()]
        if not done:
            return 0
        landed = {id(t) for t, _ in done}
        self._copies = [c for c in self._copies if id(c[0]) not in landed]
        flipped = 0
        for t, _ in done:
            if self.core.complete_upgrade(t):
                self._dirty.add(t.expert // self.num_experts)
                flipped += 1
        return flipped

    @property
    def upgrades_in_flight(self) -> int:
        return len(self._copies)
