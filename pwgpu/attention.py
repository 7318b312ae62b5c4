"""The KV cache in the unified arena, and attention that reads it through block tables.

KV block ``b`` (``pagedweight.core.kv_blocks.KvBlockAllocator``: ``b = page * blocks_per_page + slot``)
lives at byte ``page * page_bytes + slot * block_bytes`` of the arena and holds, for its
``block_tokens`` tokens, every layer's K and V: ``[L, 2, T_blk, Hkv, D]`` in the KV dtype. One
block per token range for all layers keeps a block's size equal to the scheduler's
``block_tokens * kv_bytes_per_token``, the unit the pool counts. Multi-head latent attention
(DeepSeek-V2/V3) caches one part per token instead of two: the compressed latent and the
shared RoPE key, ``[L, 1, T_blk, 1, kv_lora_rank + qk_rope_head_dim]`` (``pwgpu.mla``).

- ``paged_attention``: every request with one new token (the decodes, also in a batch mixed
  with prefill chunks) goes through one batched ``paged_decode`` call (Triton on CUDA; on a CPU
  the compiled ``cpu_decode.paged_decode``, or ``cpu_kernels.paged_decode_sdpa`` for a KV dtype
  or a platform it does not take; all are tested against ``paged_decode_ref``);
  each prefill chunk gathers its request's context and uses SDPA with a causal mask offset by
  the tokens already cached.

Shape legend: T = new tokens, B = requests, Hq / Hkv = query / KV heads, D = head dim,
L = layers, M = max blocks per request, T_blk = tokens per block, C = context tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F_

from pagedweight.errors import ConfigError
from pwgpu import cpu_decode
from pwgpu.cpu_kernels import decode_groups, paged_decode_sdpa


@dataclass
class AttentionBatch:
    """Where the new tokens of one step go and what they attend to."""

    query_starts: list[int]  # [B + 1] offsets of each request's new tokens in the flat batch
    context_lens: torch.Tensor  # [B] int64: tokens in the cache after this step
    block_tables: torch.Tensor  # [B, M] int64 KV block ids (padded with 0)
    slot_blocks: torch.Tensor  # [T] int64: block id of each new token
    slot_offsets: torch.Tensor  # [T] int64: position inside that block
    context_lens_host: list[int]  # the same on the host: prefill chunks slice by it per layer
    all_decode: bool  # every request adds exactly one token
    # Requests adding exactly one token: one batched decode call takes them all, so a mixed
    # step costs one decode call plus one call per prefill chunk (what the simulator times).
    # Built once per step, used by every layer.
    decode_seqs: list[int]
    decode_idx: torch.Tensor  # [B_dec] int64 on the device: decode_seqs
    decode_rows: torch.Tensor  # [B_dec] int64 on the device: their rows in the flat batch
    # On a CPU, the KV blocks each decode request reads (None on a GPU): what ``decode_groups``
    # is made of, if the step's decodes go the PyTorch way.
    decode_blocks: list[int] | None = None

    @functools.cached_property
    def decode_context(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode requests' block tables [B_dec, M] and context lengths [B_dec], selected
        once per step (every layer's decode call reads the same)."""
        if self.all_decode:
            return self.block_tables, self.context_lens
        return self.block_tables[self.decode_idx], self.context_lens[self.decode_idx]

    @functools.cached_property
    def decode_ranges(self) -> list[tuple[int, int]]:
        """The compiled CPU decode's ranges of requests, one per thread (``cpu_decode.ranges``),
        cut once per step."""
        return cpu_decode.ranges(self.decode_context[1].numpy(), torch.get_num_threads())

    @functools.cached_property
    def decode_groups(self) -> list[tuple[torch.Tensor | None, int]] | None:
        """The PyTorch CPU path's decode requests in groups of similar context length
        (positions among ``decode_seqs``, None for all of them, and the table columns the group
        needs), so that none is padded to a much longer context (``cpu_kernels.decode_groups``);
        made on first use, once per step. None: one group as wide as the table (a GPU's kernel
        and the compiled CPU one read each context's own blocks)."""
        blocks = self.decode_blocks
        if not blocks:
            return None
        found = decode_groups(blocks)
        if len(found) == 1:
            return [(None, blocks[found[0][0]])]
        return [(torch.tensor(g, dtype=torch.int64), blocks[g[0]]) for g in found]


class PagedKvCache:
    def __init__(
        self,
        arena: torch.Tensor,
        page_bytes: int,
        block_tokens: int,
        blocks_per_page: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        num_parts: int = 2,
    ):
        """``num_parts``: 2 (K and V) or 1 (MLA's latent)."""
        elem = torch.tensor([], dtype=dtype).element_size()
        self.block_bytes = num_layers * num_parts * block_tokens * num_kv_heads * head_dim * elem
        if page_bytes % elem or blocks_per_page * self.block_bytes > page_bytes:
            raise ConfigError(f"{blocks_per_page} KV blocks of {self.block_bytes} B do not fit a {page_bytes} B page")
        self.arena, self.dtype = arena, dtype
        self.page_bytes, self.block_tokens, self.blocks_per_page = page_bytes, block_tokens, blocks_per_page
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_parts = num_parts
        num_pages = arena.numel() // page_bytes
        self.typed = typed = arena[: num_pages * page_bytes].view(dtype)  # the arena as KV elements
        tok = num_kv_heads * head_dim
        strides = (
            page_bytes // elem,
            self.block_bytes // elem,
            num_parts * block_tokens * tok,
            block_tokens * tok,
            tok,
            head_dim,
            1,
        )
        size = (num_pages, blocks_per_page, num_layers, num_parts, block_tokens, num_kv_heads, head_dim)
        self.view = torch.as_strided(typed, size, strides)  # [pages, bpp, L, parts, T_blk, Hkv, D]
        # Pages holding their blocks back to back (no slack at the end) make block b start at
        # b * block_bytes: the arena is then rows of one block's one layer's K or V, in order
        # (block, layer, part), and a request's context is gathered by one index_select of
        # whole rows, where indexing by (page, slot) copies element by element.
        self.blocks: torch.Tensor | None = None  # [blocks, L, parts, T_blk, Hkv, D]
        self.rows: torch.Tensor | None = None  # the same, contiguous: [blocks * L * parts, T_blk * Hkv * D]
        if blocks_per_page * self.block_bytes == page_bytes:
            self.blocks = torch.as_strided(typed, (num_pages * blocks_per_page, *size[2:]), strides[1:])
            self.rows = typed.view(-1, block_tokens * tok)
        # Decode attention reads this cache in place, compiled (a CPU cache of fp32 or bf16 K, V).
        self.compiled_decode = cpu_decode.supports(self)

    def write(
        self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None
    ) -> None:
        """k, v [T, Hkv, D] into token ``offsets[i]`` of block ``blocks[i]`` (v is None for MLA)."""
        if self.blocks is not None:
            self.blocks[blocks, layer, 0, offsets] = k.to(self.dtype)
            if v is not None:
                self.blocks[blocks, layer, 1, offsets] = v.to(self.dtype)
            return
        page, slot = blocks // self.blocks_per_page, blocks % self.blocks_per_page
        self.view[page, slot, layer, 0, offsets] = k.to(self.dtype)
        if v is not None:
            self.view[page, slot, layer, 1, offsets] = v.to(self.dtype)

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_table [B, M] -> K, V [B, M * T_blk, Hkv, D]: one indexed copy each; the
        reshape that joins the blocks is a view."""
        return self.gather_part(layer, block_table, 0), self.gather_part(layer, block_table, 1)

    def gather_part(self, layer: int, block_table: torch.Tensor, part: int) -> torch.Tensor:
        """block_table [B, M] -> part ``part`` (0: K or MLA's latent, 1: V) [B, M * T_blk, Hkv, D]."""
        b, m = block_table.shape
        shape = (b, m * self.block_tokens, self.num_kv_heads, self.head_dim)
        if self.rows is not None:
            per_block = self.num_layers * self.num_parts
            rows = block_table.reshape(-1) * per_block + (layer * self.num_parts + part)
            return self.rows.index_select(0, rows).view(shape)
        page, slot = block_table // self.blocks_per_page, block_table % self.blocks_per_page
        return self.view[page, slot, layer, part].reshape(shape)  # [B, M, T_blk, Hkv, D] -> [B, C, Hkv, D]

    # ---- swap: a request's KV out to host memory and back into other blocks ------------------
    @property
    def token_bytes(self) -> int:
        """Bytes of one token's KV over every layer (K and V, or MLA's latent)."""
        return self.block_bytes // self.block_tokens

    def _block(self, block: int) -> torch.Tensor:
        """Block ``block`` as a view [L, parts, T_blk, Hkv, D]."""
        if self.blocks is not None:
            return self.blocks[block]
        return self.view[block // self.blocks_per_page, block % self.blocks_per_page]

    def _index(self, block_ids: list[int]) -> tuple[torch.Tensor, ...]:
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.arena.device)
        if self.blocks is not None:
            return (idx,)
        return idx // self.blocks_per_page, idx % self.blocks_per_page

    def copy_out(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """The KV of the first ``num_tokens`` tokens held in ``block_ids`` (every layer and part)
        copied to a new host tensor [blocks, L, parts, T_blk, Hkv, D] (pinned when the cache is
        on CUDA, the copy asynchronous on the current stream); the slots of the last block past
        ``num_tokens`` are left unset. ``copy_in`` puts it back."""
        full, rest = divmod(num_tokens, self.block_tokens)
        n = full + (rest > 0)
        if n > len(block_ids):
            raise ValueError(f"{num_tokens} tokens need {n} KV blocks; {len(block_ids)} given")
        shape = (n, self.num_layers, self.num_parts, self.block_tokens, self.num_kv_heads, self.head_dim)
        cuda = self.arena.is_cuda
        host = torch.empty(shape, dtype=self.dtype, pin_memory=cuda)
        view = self.blocks if self.blocks is not None else self.view
        if full:
            host[:full].copy_(view[self._index(block_ids[:full])], non_blocking=cuda)
        if rest:
            host[full, :, :, :rest].copy_(self._block(block_ids[full])[:, :, :rest], non_blocking=cuda)
        return host

    def copy_in(self, host: torch.Tensor, block_ids: list[int], num_tokens: int) -> None:
        """The first ``num_tokens`` tokens of ``host`` (from ``copy_out``) into ``block_ids``,
        which may be other blocks than those it was copied from."""
        full, rest = divmod(num_tokens, self.block_tokens)
        if full + (rest > 0) > min(len(block_ids), host.shape[0]):
            raise ValueError(f"{num_tokens} tokens do not fit {len(block_ids)} KV blocks / {host.shape[0]} copied")
        cuda = self.arena.is_cuda
        view = self.blocks if self.blocks is not None else self.view
        if full:
            view[self._index(block_ids[:full])] = host[:full].to(self.arena.device, non_blocking=cuda)
        if rest:
            self._block(block_ids[full])[:, :, :rest].copy_(host[full, :, :, :rest], non_blocking=cuda)

    def block_offsets(self, layer: int, block_table: torch.Tensor) -> torch.Tensor:
        """Element offset of each block's layer-``layer`` K section in the typed arena: [B, M]."""
        elem = self.view.element_size()
        page, slot = block_table // self.blocks_per_page, block_table % self.blocks_per_page
        base = page * (self.page_bytes // elem) + slot * (self.block_bytes // elem)
        return base + layer * self.num_parts * self.block_tokens * self.num_kv_heads * self.head_dim


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., Hkv, D] -> [..., Hq, D] (grouped-query attention)."""
    return x.repeat_interleave(num_heads // x.shape[-2], dim=-2)


def paged_decode_ref(
    q: torch.Tensor, kv: PagedKvCache, layer: int, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per request: q [B, Hq, D] -> [B, Hq, D], attending to ``context_lens`` tokens.
    The G = Hq / Hkv query heads of a KV head attend to it together, so K and V are never
    expanded to Hq heads (that copy was most of a CPU decode step)."""
    k, v = kv.gather(layer, block_tables)  # [B, C, Hkv, D]
    b, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.float().view(b, hkv, hq // hkv, d)
    scores = torch.einsum("bkgd,bckd->bkgc", qg, k.float()) * scale  # [B, Hkv, G, C]
    valid = torch.arange(k.shape[1], device=q.device)[None, :] < context_lens[:, None]  # [B, C]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    # Slots past the context hold whatever the page held before (an expert's weights, which
    # read as bf16 can be NaN or inf): a zero attention weight times NaN is NaN, so they are
    # zeroed, not only masked.
    v = v.float().masked_fill(~valid[:, :, None, None], 0.0)
    out = torch.einsum("bkgc,bckd->bkgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(b, hq, d).to(q.dtype)


def paged_decode(q, kv, layer, scale, batch: AttentionBatch):
    """The step's decode requests (``batch.decode_context``), q [B_dec, Hq, D] -> [B_dec, Hq, D]:
    ``paged_decode_ref``'s contract, by the device's fastest way."""
    block_tables, context_lens = batch.decode_context
    if q.is_cuda:
        from pwgpu.kernels.attention import paged_decode_triton

        return paged_decode_triton(q, kv, layer, block_tables, context_lens, scale)
    if kv.compiled_decode:
        return cpu_decode.paged_decode(q, kv, layer, block_tables, context_lens, scale, batch.decode_ranges)
    return paged_decode_sdpa(q, kv, layer, block_tables, context_lens, scale, batch.decode_groups)


def paged_attention(q: torch.Tensor, kv: PagedKvCache, layer: int, batch: AttentionBatch, scale: float):
    """q [T, Hq, D] of the new tokens (already written to the cache) -> [T, Hq, D]."""
    if batch.all_decode:
        return paged_decode(q, kv, layer, scale, batch)
    out = torch.empty_like(q)
    starts = batch.query_starts
    if batch.decode_seqs:
        rows = batch.decode_rows
        out[rows] = paged_decode(q[rows], kv, layer, scale, batch)
    for i in range(len(starts) - 1):
        s, e, ctx = starts[i], starts[i + 1], batch.context_lens_host[i]
        if e - s == 1:
            continue  # done in the batched decode call above
        n_blocks = -(-ctx // kv.block_tokens)
        k, v = kv.gather(layer, batch.block_tables[i : i + 1, :n_blocks])
        n = e - s
        # Query j sits at position ctx - n + j and sees keys [0, ctx - n + j].
        mask = torch.arange(ctx, device=q.device)[None, :] <= (ctx - n + torch.arange(n, device=q.device))[:, None]
        if q.is_cuda:
            k, v = _expand_kv(k[0, :ctx], q.shape[1]), _expand_kv(v[0, :ctx], q.shape[1])  # [C, Hq, D]
            o = F_.scaled_dot_product_attention(
                q[s:e].transpose(0, 1), k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype), mask, scale=scale
            )
        else:
            # On a CPU: 4-D inputs with grouped-query heads, which ATen's fused CPU kernel takes
            # (3-D inputs went the unfused way, 2-2.5x slower a chunk), and no expanded copy of K, V.
            k, v = (x[0, :ctx].transpose(0, 1)[None].to(q.dtype) for x in (k, v))  # [1, Hkv, C, D]
            qh = q[s:e].transpose(0, 1)[None]
            o = F_.scaled_dot_product_attention(qh, k, v, mask[None, None], scale=scale, enable_gqa=True)[0]
        out[s:e] = o.transpose(0, 1)
    return out


def build_batch(
    seqs: list[tuple[list[int], int, int]], block_tokens: int, device: torch.device
) -> tuple[AttentionBatch, torch.Tensor]:
    """``seqs``: (KV block ids, tokens already cached, new tokens) per request ->
    (AttentionBatch, positions [T] int64 of the new tokens)."""
    starts, positions, ctx = [0], [], []
    for _, computed, n in seqs:
        starts.append(starts[-1] + n)
        positions.extend(range(computed, computed + n))
        ctx.append(computed + n)
    width = max((len(b) for b, _, _ in seqs), default=1) or 1
    table = torch.zeros(len(seqs), width, dtype=torch.int64)
    for i, (blocks, _, _) in enumerate(seqs):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
    pos = torch.tensor(positions, dtype=torch.int64)
    row = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([n for _, _, n in seqs]))
    slot_blocks = table[row, pos // block_tokens]
    decode_seqs = [i for i, (_, _, n) in enumerate(seqs) if n == 1]
    decode_blocks = [-(-ctx[i] // block_tokens) for i in decode_seqs] if device.type == "cpu" else None
    batch = AttentionBatch(
        query_starts=starts,
        context_lens=torch.tensor(ctx, dtype=torch.int64, device=device),
        block_tables=table.to(device),
        slot_blocks=slot_blocks.to(device),
        slot_offsets=(pos % block_tokens).to(device),
        context_lens_host=ctx,
        all_decode=len(decode_seqs) == len(seqs),
        decode_seqs=decode_seqs,
        decode_idx=torch.tensor(decode_seqs, dtype=torch.int64, device=device),
        decode_rows=torch.tensor([starts[i] for i in decode_seqs], dtype=torch.int64, device=device),
        decode_blocks=decode_blocks,
    )
    return batch, pos.to(device)
