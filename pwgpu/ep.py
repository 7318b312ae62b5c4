"""Expert parallelism in the engine over ``torch.distributed``: one process per rank.

Each rank is a whole ``Engine`` over its share of the model: attention, dense layers and every
pinned weight replicated, the routed experts split contiguously (rank r holds experts
``r*E/N .. (r+1)*E/N - 1`` of every MoE layer, ``pagedweight.core.placement``), in its own page
arena, with its own ``RuntimeCore`` (pool, page table, KV, scheduler, controller) over
``rank_model`` and its rows of the importance table: the policy decides per rank, from the same
code. Every rank serves the same requests (attention replicated, so each holds the KV of all of
them), and the MoE layers exchange tokens by all-to-all:

1. each rank takes every N-th token of the step (rank r: tokens r, r + N, ...);
2. dispatch: each of its (token, expert) pairs goes to the rank holding the expert
   (``all_to_all_single``: counts first, then the hidden rows, the local expert ids and the
   routing weights);
3. the rank runs its experts on what it received (its ``WeightStore``, at each expert's
   current precision), each row weighted by its routing weight;
4. combine: the outputs go back the same way, are summed per token, and every rank gathers
   every token's output (``all_gather``), since attention needs them all.

Every rank must compute the same batch each step. Left alone, their schedulers agree only while
their pools match; ``pwgpu.ep_agree`` makes them agree whatever each rank's controller does
(rank 0 decides every batch within the tightest rank's free KV, the others replay it). The
process group is gloo on CPU (tests) or NCCL on GPUs; ``spawn_ranks`` starts the processes,
``pwgpu.ep_launch`` the commands' ranks (``pwgpu run --ep N``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from pagedweight.config.scenario import rank_model
from pagedweight.core.placement import place_experts, rank_table
from pagedweight.core.spec import ModelSpec
from pagedweight.errors import ConfigError
from pagedweight.policy.importance import ImportanceTable


@dataclass
class EpGroup:
    """This process's place in an expert-parallel group (the default process group)."""

    rank: int
    world: int

    @classmethod
    def current(cls) -> EpGroup:
        if not dist.is_initialized():
            raise ConfigError("expert parallelism needs torch.distributed initialised (see pwgpu.ep.spawn_ranks)")
        return cls(dist.get_rank(), dist.get_world_size())

    def share(self, masters, table: ImportanceTable, spec: ModelSpec):
        """This rank's experts' masters, importance rows and model share."""
        from pwgpu.weights import ExpertMasters

        if spec.num_experts % self.world:
            raise ConfigError(
                f"{spec.name}: {spec.num_experts} experts per layer do not split across {self.world} ranks"
            )
        per = spec.num_experts // self.world
        lo = self.rank * per
        mats = tuple([m[lo : lo + per] for m in ms] for ms in masters.mats)
        local = ExpertMasters(masters.precision, mats, masters.ffn_size, masters.hidden_size)
        placement = place_experts(np.ones((spec.num_moe_layers, spec.num_experts)), self.world, "contiguous")
        self.first_expert, self.num_local = lo, per
        return local, rank_table(table, placement[self.rank]), rank_model(spec, self.world)

    def local_counts(self, counts: np.ndarray) -> np.ndarray:
        """The router's counts (every rank routes every token) for this rank's experts."""
        return np.ascontiguousarray(counts[:, self.first_expert : self.first_expert + self.num_local])


class EpExperts:
    """The ``ExpertRunner`` of a rank: dispatch, local experts, combine (module docstring)."""

    def __init__(self, store, group: EpGroup):
        self.store, self.group = store, group

    def moe_ffn(self, moe_layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        g, per = self.group, self.group.num_local
        t, k = topk_ids.shape
        mine = torch.arange(g.rank, t, g.world, device=x.device)
        tok = mine.repeat_interleave(k)  # (pairs,) token index of each of my (token, expert) pairs
        ids = topk_ids[mine].reshape(-1)
        w = topk_w[mine].reshape(-1).to(x.dtype)
        dest = torch.div(ids, per, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)
        tok, ids, w, dest = tok[order], ids[order], w[order], dest[order]
        send = torch.bincount(dest, minlength=g.world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        send_l, recv_l = send.tolist(), recv.tolist()
        num_recv = sum(recv_l)
        x_recv = x.new_empty((num_recv, x.shape[1]))
        dist.all_to_all_single(x_recv, x[tok].contiguous(), recv_l, send_l)
        meta = torch.stack([ids - dest * per, w.float().view(torch.int32).to(torch.int64)], dim=1)
        meta_recv = meta.new_empty((num_recv, 2))
        dist.all_to_all_single(meta_recv, meta.contiguous(), recv_l, send_l)
        local_ids = meta_recv[:, 0:1]
        local_w = meta_recv[:, 1].to(torch.int32).view(torch.float32).to(x.dtype)[:, None]
        y_recv = self.store.moe_ffn(moe_layer, x_recv, local_ids, local_w) if num_recv else x_recv
        y_back = x.new_empty((len(tok), x.shape[1]))
        dist.all_to_all_single(y_back, y_recv.contiguous(), send_l, recv_l)
        # Sum each of my tokens' expert outputs, then every rank gathers every token's.
        y_mine = x.new_zeros((len(mine), x.shape[1]))
        y_mine.index_add_(0, torch.div(tok - g.rank, g.world, rounding_mode="floor"), y_back)
        rows = -(-t // g.world)
        padded = x.new_zeros((rows, x.shape[1]))
        padded[: len(mine)] = y_mine
        gathered = [torch.empty_like(padded) for _ in range(g.world)]
        dist.all_gather(gathered, padded)
        y = x.new_empty(x.shape)
        for r, part in enumerate(gathered):
            n = len(range(r, t, g.world))
            y[r :: g.world] = part[:n]
        return y


def spawn_ranks(world: int, fn, args: tuple, init_file: str, backend: str = "gloo", join: bool = True):
    """Run ``fn(rank, world, *args)`` in ``world`` processes joined in one process group
    (initialised from ``init_file``, which must not exist yet); returns when all are done and
    raises if any failed. ``join=False``: returns at once with the processes'
    ``ProcessContext`` (``.processes``; ``.join()`` until it returns True)."""
    import torch.multiprocessing as mp

    return mp.spawn(_rank_main, args=(world, fn, args, init_file, backend), nprocs=world, join=join)


def _rank_main(rank: int, world: int, fn, args: tuple, init_file: str, backend: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
