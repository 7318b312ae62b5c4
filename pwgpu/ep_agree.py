"""Expert-parallel ranks agree on every step (``pwgpu.ep``): rank 0 leads, the others follow.

Every rank serves the same requests (attention is replicated), so every rank must compute the
same batch each step, or the MoE layers' collectives pair up different tokens or hang. Each rank
still has its own pool and its own controller (the policy decides per rank: a rank whose KV
fills first downgrades its own experts first), so their schedulers, left alone, could admit or
preempt differently. Instead:

- Requests enter at rank 0 only (``Engine.add``, a server's inbox). Each message rank 0 sends
  (``Engine.step`` / ``idle_tick``) carries the requests it took in and aborted since the last;
  every rank adds them under rank 0's request ids and a request any rank must refuse (its KV
  could never fit there) is refused on all (an all-reduce MIN of who accepted it).
- Every rank plans its own precision changes (``RuntimeCore.plan_step``), then rank 0's scheduler
  decides the batch while the others wait (``RuntimeCore.decide_batch``). Rank 0 schedules on a
  view of its KV allocator (``KvView``) that holds the free blocks of the *tightest* rank: an
  all-reduce MIN of every rank's free blocks less what the batch so far takes. When the view is
  short, rank 0's pressure hook asks every rank to make that room with its own controller
  (downgrading its own experts) and takes the MIN again; only then does the scheduler preempt.
  So no rank is asked for KV it does not have.
- Rank 0 sends the batch (preempted request ids and whether each was swapped, then request ids
  and token counts); the others replay it on their own schedulers: the same preemptions (each
  rank swapping its own KV where rank 0 swapped), the same admissions, blocks from their own
  pools.
- Rank 0 samples and sends the tokens; the others take them (same tokens, same stop decisions)
  without computing logits.

Prefix caching is off under expert parallelism: which cached blocks survive depends on each
rank's pool, so a prefix hit could differ between ranks (``pwgpu.ep_launch`` turns it off).
Messages are small Python objects (``broadcast_object_list``), the MINs one int64 tensor, on the
group's device (CPU for gloo, the rank's GPU for NCCL).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pagedweight.core.scheduler import RUNNING, WAITING, Batch, Request
from pagedweight.errors import PagedWeightError


class Channel:
    """Rank 0's messages to every rank, and MIN all-reduces, over the default process group."""

    def __init__(self, device: torch.device):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = device if device.type == "cuda" else torch.device("cpu")

    def bcast(self, obj=None):
        """Rank 0's ``obj`` on every rank (the others pass nothing)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def min_ints(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return t.cpu().tolist()

    def min_int(self, value: int) -> int:
        return self.min_ints([value])[0]

    def gather(self, obj) -> list:
        """Every rank's ``obj``, on every rank."""
        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


class KvView:
    """Rank 0's KV allocator as its scheduler sees it under expert parallelism: the free blocks
    of the tightest rank. ``deficit`` (set at each agreement) is how many fewer the tightest
    rank has than rank 0; ``taken`` counts the blocks this step's batch has taken so far on
    rank 0 (allocated less freed), which the other ranks take only when they replay the batch."""

    def __init__(self, real):
        self.real = real
        self.deficit = 0
        self.taken = 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    @property
    def num_free_blocks(self) -> int:
        return max(0, self.real.num_free_blocks - self.deficit)

    def num_growable_blocks(self) -> int:
        return min(self.real.num_growable_blocks(), self.num_free_blocks)

    def allocate_each(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_growable_blocks():
            raise PagedWeightError(f"asked for {num_blocks} KV blocks; the tightest rank has {self.num_free_blocks}")
        out = self.real.allocate_each(num_blocks)
        self.taken += num_blocks
        return out

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free_blocks:
            raise PagedWeightError(f"asked for {num_blocks} KV blocks; the tightest rank has {self.num_free_blocks}")
        out = self.real.allocate(num_blocks)
        self.taken += num_blocks
        return out

    def free(self, block_ids: list[int]) -> None:
        self.real.free(block_ids)
        self.taken -= len(block_ids)


def _room(kv, hook, want: int | None, taken: int) -> int:
    """This rank's free blocks beyond ``taken``, after its own pressure hook (its controller's
    downgrades) has tried to bring them up to ``want``."""
    free = kv.num_free_blocks - taken
    if want is not None and free < want and hook is not None:
        hook(want - free)
        free = kv.num_free_blocks - taken
    return free


class EpLeader:
    """Rank 0's side (module docstring): its engine takes requests in and decides each step."""

    is_leader = True

    def __init__(self, engine, channel: Channel):
        self.engine, self.ch = engine, channel
        self._added: list = []  # (request id, prompt ids, sampling params) since the last message
        self._aborted: list[int] = []
        core = engine.core
        self.sched = sched = core.scheduler
        self.kv = core.kv
        self.view = KvView(self.kv)
        sched.kv = self.view
        self._own_hook = sched.pressure_hook
        if self._own_hook is not None:
            sched.pressure_hook = self._pressure
        core.decide_batch = self._decide
        engine.agreement = self

    # ---- requests ---------------------------------------------------------------------------
    def added(self, er) -> None:
        self._added.append((er.req.request_id, er.prompt_ids, er.params))

    def aborted(self, er) -> None:
        self._aborted.append(er.req.request_id)

    def begin(self, kind: str) -> None:
        """Tell every rank what comes next (``step`` or ``idle``) with the requests since the last
        message; a request some rank refuses is refused here too."""
        added, aborted = self._added, self._aborted
        self._added, self._aborted = [], []
        self.ch.bcast((kind, added, aborted))
        if not added:
            return
        accepted = self.ch.min_ints([1] * len(added))
        eng = self.engine
        for (rid, _, _), ok in zip(added, accepted, strict=True):
            er = eng._by_req.get(rid)
            if not ok and er is not None:
                eng.refuse(er, "its KV can never fit on another expert-parallel rank")

    def close(self) -> None:
        """The followers stop (their engine is done)."""
        self.ch.bcast(("stop", [], []))

    # ---- one step ---------------------------------------------------------------------------
    def _agree_room(self, want: int | None) -> None:
        """Every rank makes room for ``want`` free blocks beyond the batch so far (its own
        pressure hook), then the view takes the tightest rank's free blocks."""
        self.ch.bcast(("room", want, self.view.taken))
        tightest = self.ch.min_int(_room(self.kv, self._own_hook, want, 0))
        self.view.deficit = self.kv.num_free_blocks - tightest

    def _pressure(self, blocks_short: int) -> None:
        self._agree_room(self.view.num_free_blocks + blocks_short)

    def _decide(self, now_s: float) -> Batch:
        self.view.taken = 0
        self._agree_room(None)
        batch = self.sched.schedule(now_s)
        plan = (
            [(r.request_id, r.swapped_tokens > 0) for r in batch.preempted],  # and whether swapped
            [(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)],
        )
        self.ch.bcast(("batch", plan))
        self.view.deficit = self.view.taken = 0
        return batch

    def tokens(self, tokens: list[int]) -> list[int]:
        self.ch.bcast(tokens)
        return tokens


class EpFollower:
    """Another rank's side: it takes rank 0's requests, batches and tokens (``follow``)."""

    is_leader = False

    def __init__(self, engine, channel: Channel):
        self.engine, self.ch = engine, channel
        core = engine.core
        self.sched, self.kv = core.scheduler, core.kv
        core.decide_batch = self._decide
        engine.agreement = self

    def added(self, er) -> None:
        pass

    def aborted(self, er) -> None:
        pass

    def begin(self, kind: str) -> None:
        pass

    def follow(self) -> None:
        """Step as rank 0 says until it stops."""
        eng = self.engine
        while True:
            kind, added, aborted = self.ch.bcast()
            if kind == "stop":
                return
            if added:
                ours = []
                for rid, prompt_ids, params in added:
                    eng._next_id = rid  # rank 0's ids: the batches name requests by them
                    ours.append(eng.add(prompt_ids, params))
                accepted = self.ch.min_ints([int(er.finish_reason != "rejected") for er in ours])
                for er, ok in zip(ours, accepted, strict=True):
                    if not ok and er.finish_reason != "rejected":
                        eng.refuse(er, "its KV can never fit on another expert-parallel rank")
            for rid in aborted:
                er = eng._by_req.get(rid)
                if er is not None:
                    eng.abort(er, "aborted on rank 0")
            if kind == "step":
                eng.step()
            else:
                eng.idle_tick()

    def _decide(self, now_s: float) -> Batch:
        hook = self.sched.pressure_hook
        while True:
            msg = self.ch.bcast()
            if msg[0] == "batch":
                return self._replay(*msg[1], now_s)
            _, want, taken = msg
            self.ch.min_int(_room(self.kv, hook, want, taken))

    def _replay(self, preempted: list[tuple[int, bool]], entries: list[tuple[int, int]], now_s: float) -> Batch:
        """Rank 0's batch on this rank's scheduler: its preemptions (by swap where rank 0
        swapped: this rank copies its own KV out), then each request's tokens (an admission for
        a waiting one), KV from this rank's pool."""
        sched, by_id = self.sched, self.engine._by_req
        batch = Batch()
        for rid, swapped in preempted:
            sched._preempt(by_id[rid].req, batch, now_s, swap=swapped)
        for rid, num_new in entries:
            req: Request = by_id[rid].req
            if req.state is WAITING:
                start = req.swapped_tokens  # a swapped-out request resumes where it stopped
                req.num_computed_tokens = start
                self._reserve(req, num_new)
                if start:
                    batch.swapped_in_tokens += start
                    req.swapped_tokens = 0
                sched.waiting.remove(req)
                req.state = RUNNING
                if req.first_scheduled_s is None:
                    req.first_scheduled_s = now_s
                sched.running.append(req)
                batch.add(req, num_new, req.num_tokens - start)
                continue
            self._reserve(req, num_new)
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining == 1:
                batch.requests.append(req)
                batch.num_new_tokens.append(1)
                batch.decode_kv_lens.append(req.num_computed_tokens + 1)
            else:
                batch.add(req, num_new, remaining)
        return batch

    def _reserve(self, req: Request, num_new: int) -> None:
        if not self.sched._reserve(req, num_new):
            raise PagedWeightError(
                f"expert-parallel rank {self.ch.rank}: rank 0's batch gives request {req.request_id} "
                f"{num_new} tokens; this rank has only {self.kv.num_free_blocks} free KV blocks"
            )

    def tokens(self, tokens) -> list[int]:
        return self.ch.bcast()


def attach(engine) -> EpLeader | EpFollower:
    """Make ``engine`` (built with its ``EpGroup``) agree with the other ranks' engines."""
    ch = Channel(engine.device)
    return EpLeader(engine, ch) if ch.rank == 0 else EpFollower(engine, ch)
