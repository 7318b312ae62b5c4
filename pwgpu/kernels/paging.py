"""One MoE layer's experts stored in a page pool: the tensors the MoE kernel reads (layout and
table format in ``layout.py``) plus the host-side copy of each expert's precision, which the
launcher uses to pick one specialised kernel per precision class without a device sync.

Shape legend: E = experts, H = hidden size, F = expert FFN size; matrices w1, w3 [F, H], w2 [H, F].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pwgpu.kernels.layout import matrix_layout
from pwgpu.kernels.reference import dequantize_ref, gather_pages_ref, quantize_ref


@dataclass
class PagedExperts:
    pool: torch.Tensor  # uint8 [pool_bytes]
    page_offsets: torch.Tensor  # int64 [num_pages]: byte offset of each listed page in pool
    first_page: torch.Tensor  # int32 [E, 3]: index in page_offsets of matrix (e, j)'s first page
    precisions: tuple[str, ...]  # [E], host side
    hidden_size: int  # H
    ffn_size: int  # F
    page_bytes: int

    @property
    def num_experts(self) -> int:
        return len(self.precisions)

    def matrix_shape(self, j: int) -> tuple[int, int]:
        """(N, K) of matrix j: w1 and w3 are [F, H], w2 is [H, F]."""
        return (self.ffn_size, self.hidden_size) if j < 2 else (self.hidden_size, self.ffn_size)

    def check(self) -> None:
        """Every matrix's pages are listed, 16-byte aligned and inside the pool (host-side, syncs:
        for tests and debugging; the kernels trust the table)."""
        if self.page_bytes < 16 or self.page_bytes & (self.page_bytes - 1):
            raise ValueError(f"page_bytes(={self.page_bytes}) must be a power of two >= 16")
        offsets = self.page_offsets.cpu()
        if ((offsets % 16) != 0).any() or (offsets < 0).any() or (offsets + self.page_bytes > self.pool.numel()).any():
            raise ValueError("page_offsets must be 16-byte aligned pages inside the pool")
        first = self.first_page.cpu()
        if tuple(first.shape) != (self.num_experts, 3):
            raise ValueError(f"first_page has shape {tuple(first.shape)}, expected ({self.num_experts}, 3)")
        for e, prec in enumerate(self.precisions):
            for j in range(3):
                num_pages = -(-matrix_layout(prec, *self.matrix_shape(j)).total_bytes // self.page_bytes)
                if not 0 <= int(first[e, j]) <= offsets.numel() - num_pages:
                    raise ValueError(
                        f"expert {e} matrix {j} ({prec}) needs {num_pages} pages from entry {int(first[e, j])}"
                    )

    def dequantize_matrix(self, e: int, j: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Matrix j of expert e, dense, read page by page (the CPU path; no Triton)."""
        n, k = self.matrix_shape(j)
        lay = matrix_layout(self.precisions[e], n, k)
        first = int(self.first_page[e, j])
        blob = gather_pages_ref(self.pool, self.page_offsets, first, lay.total_bytes, self.page_bytes)
        return dequantize_ref(blob, self.precisions[e], n, k, dtype)

    @classmethod
    def from_dense(
        cls,
        w1: list[torch.Tensor],
        w3: list[torch.Tensor],
        w2: list[torch.Tensor],
        precisions: list[str] | tuple[str, ...],
        page_bytes: int = 1 << 21,
        scatter_seed: int | None = 0,
        spare_pages: int = 0,
        quantizer: str = "reference",
    ) -> PagedExperts:
        """Quantise each expert to its precision and place its pages in a fresh pool.

        ``scatter_seed`` shuffles the pages over the pool (None: in order, contiguous), so tests
        see matrices whose pages are neither adjacent nor ascending. ``quantizer`` is
        ``"reference"`` (PyTorch, any device) or ``"triton"`` (``quant.quantize_into``).
        """
        num_experts = len(precisions)
        if not (len(w1) == len(w3) == len(w2) == num_experts):
            raise ValueError(f"{len(w1)}, {len(w3)}, {len(w2)} matrices for {num_experts} experts")
        ffn_size, hidden_size = w1[0].shape
        device = w1[0].device
        mats = [(w1, 0), (w3, 1), (w2, 2)]
        pages_of = np.zeros((num_experts, 3), dtype=np.int64)
        for e, prec in enumerate(precisions):
            for ws, j in mats:
                n, k = ws[e].shape
                pages_of[e, j] = -(-matrix_layout(prec, n, k).total_bytes // page_bytes)
        num_pages = int(pages_of.sum())
        total_pages = num_pages + spare_pages
        physical = np.arange(total_pages)
        if scatter_seed is not None:
            physical = np.random.default_rng(scatter_seed).permutation(total_pages)
        page_offsets = torch.tensor(physical[:num_pages] * page_bytes, dtype=torch.int64, device=device)
        first = np.concatenate([[0], np.cumsum(pages_of.reshape(-1))[:-1]]).reshape(num_experts, 3)
        pool = torch.zeros(total_pages * page_bytes, dtype=torch.uint8, device=device)
        out = cls(
            pool=pool,
            page_offsets=page_offsets,
            first_page=torch.tensor(first, dtype=torch.int32, device=device),
            precisions=tuple(precisions),
            hidden_size=hidden_size,
            ffn_size=ffn_size,
            page_bytes=page_bytes,
        )
        for e, prec in enumerate(precisions):
            for ws, j in mats:
                out.write_matrix(ws[e], prec, int(first[e, j]), quantizer)
        return out

    def write_matrix(self, w: torch.Tensor, precision: str, first_page: int, quantizer: str = "reference") -> None:
        """Quantise ``w`` into the pages listed from ``page_offsets[first_page]`` on."""
        if quantizer == "triton":
            from pwgpu.kernels.quant import quantize_into

            quantize_into(w.contiguous(), precision, self.pool, self.page_offsets, first_page, self.page_bytes)
            return
        if quantizer != "reference":
            raise ValueError(f"quantizer {quantizer!r} unknown; allowed: reference, triton")
        blob = quantize_ref(w, precision)
        offsets = self.page_offsets[first_page : first_page + -(-blob.numel() // self.page_bytes)].tolist()
        for i, off in enumerate(offsets):
            chunk = blob[i * self.page_bytes : (i + 1) * self.page_bytes]
            self.pool[off : off + chunk.numel()] = chunk
