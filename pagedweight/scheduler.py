"""Continuous batching in the manner of vLLM's V1 scheduler, with KV blocks from the page pool.

One step: ``schedule(now_s)`` picks running requests first (decodes and unfinished prefill
chunks, oldest first), then admits waiting requests FCFS, within a token budget
(``max_num_batched_tokens``) and ``max_num_seqs``. Prefill is chunked to what the budget
leaves. When KV blocks run out it first calls the memory-pressure hook (the precision
controller downgrades experts there, freeing pages) and only then preempts by recompute,
newest first. ``finish_step(batch, end_s)`` appends the sampled tokens and releases finished
requests.

Token model (as in vLLM): a request holds ``prompt + num_output_tokens`` tokens, of which
``num_computed_tokens`` have KV. A step computes ``[num_computed, num_computed + n)``; when it
reaches the last token, one new token is sampled. After a preemption the KV is dropped and
prompt + generated tokens are recomputed; generated tokens are kept.

No torch and no SimPy here: both runtimes drive this class with their own clocks.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pagedweight.pool import KvBlockAllocator
from pagedweight.step import StepShape

WAITING, RUNNING, FINISHED, REJECTED = "waiting", "running", "finished", "rejected"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 32768  # prompt + output tokens of one request

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}(={getattr(self, name)}) must be > 0")


class Request:
    """One request and its lifecycle. Times are seconds on the runtime's clock."""

    __slots__ = (
        "request_id",
        "arrival_s",
        "prompt_tokens",
        "max_output_tokens",
        "state",
        "num_computed_tokens",
        "num_output_tokens",
        "block_ids",
        "first_scheduled_s",
        "first_token_s",
        "finish_s",
        "token_times_s",
        "num_preemptions",
        "reject_reason",
        "stop_early",
    )

    def __init__(self, request_id: int, arrival_s: float, prompt_tokens: int, max_output_tokens: int):
        self.request_id = request_id
        self.arrival_s = arrival_s
        self.prompt_tokens = prompt_tokens
        self.max_output_tokens = max_output_tokens
        self.state = WAITING
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.block_ids: list[int] = []
        self.first_scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.token_times_s = array("d")  # end of the step that produced each output token
        self.num_preemptions = 0
        self.reject_reason: str | None = None
        self.stop_early = False  # set by a real engine on EOS/stop string; the simulator never does

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.num_output_tokens

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, {self.state}, prompt={self.prompt_tokens}, "
            f"out={self.num_output_tokens}/{self.max_output_tokens}, computed={self.num_computed_tokens})"
        )


@dataclass(slots=True)
class Batch:
    """What one step computes: ``num_new_tokens[i]`` tokens of ``requests[i]``."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def shape(self) -> StepShape:
        """The step's shape for the latency model; call it before ``finish_step``."""
        pre_tok, pre_kv, dec_kv = [], [], []
        for req, n in zip(self.requests, self.num_new_tokens, strict=True):
            kv_len = req.num_computed_tokens + n
            if n == 1 and kv_len == req.prompt_tokens + req.num_output_tokens:
                dec_kv.append(kv_len)
            else:
                pre_tok.append(n)
                pre_kv.append(kv_len)
        return StepShape(
            np.array(pre_tok, dtype=np.int64), np.array(pre_kv, dtype=np.int64), np.array(dec_kv, dtype=np.int64)
        )


# A memory-pressure hook gets the number of KV blocks missing and may free pages (e.g. by
# downgrading experts) before the scheduler resorts to preemption.
PressureHook = Callable[[int], None]


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KvBlockAllocator,
        max_kv_blocks: int,
        pressure_hook: PressureHook | None = None,
    ):
        """``max_kv_blocks``: the most KV blocks this runtime can ever give one request (the
        pool less pinned weights and experts at the lowest precision the policy allows); a
        request needing more is rejected on arrival instead of waiting forever."""
        self.config = config
        self.kv = kv
        self.max_kv_blocks = max_kv_blocks
        self.pressure_hook = pressure_hook
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- arrivals -------------------------------------------------------------------------
    def add(self, req: Request) -> bool:
        """Queue ``req``, or reject it with a reason. Returns whether it was queued."""
        total = req.prompt_tokens + req.max_output_tokens
        if req.prompt_tokens < 1 or req.max_output_tokens < 1:
            req.reject_reason = "prompt and output must each be at least 1 token"
        elif total > self.config.max_model_len:
            req.reject_reason = (
                f"prompt + output = {total} tokens exceeds the context limit of {self.config.max_model_len}"
            )
        elif self.kv.blocks_for_tokens(total) > self.max_kv_blocks:
            req.reject_reason = (
                f"needs {self.kv.blocks_for_tokens(total)} KV blocks; at most {self.max_kv_blocks} can ever be free"
            )
        if req.reject_reason:
            req.state = REJECTED
            return False
        req.state = WAITING
        self.waiting.append(req)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------------
    def _reserve(self, req: Request, num_new: int) -> bool:
        """Give ``req`` the blocks for ``num_new`` more tokens, asking the hook if short."""
        kv = self.kv
        need = -(-(req.num_computed_tokens + num_new) // kv.block_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > kv.num_free_blocks and self.pressure_hook is not None:
            self.pressure_hook(need - kv.num_free_blocks)
        if need > kv.num_free_blocks:
            return False
        req.block_ids.extend(kv.allocate(need))
        return True

    def _preempt(self, req: Request, batch: Batch) -> None:
        self.running.remove(req)
        self.kv.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.state = WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        batch.preempted.append(req)

    def schedule(self, now_s: float) -> Batch:
        batch = Batch()
        budget = self.config.max_num_batched_tokens
        running, block_tokens = self.running, self.kv.block_tokens
        out_reqs, out_tokens = batch.requests, batch.num_new_tokens
        i = 0
        # The hot loop of both runtimes (~1 us per running request): most decodes still have
        # room in their last block, so the block check is inlined before calling _reserve.
        while i < len(running) and budget > 0:
            req = running[i]
            num_new = req.prompt_tokens + req.num_output_tokens - req.num_computed_tokens
            if num_new > budget:
                num_new = budget
            if req.num_computed_tokens + num_new > len(req.block_ids) * block_tokens:
                preempted_self = False
                while not self._reserve(req, num_new):
                    victim = running[-1]  # newest first
                    self._preempt(victim, batch)
                    if victim is req:
                        preempted_self = True
                        break
                if preempted_self:
                    break  # nothing older is left to preempt
            out_reqs.append(req)
            out_tokens.append(num_new)
            budget -= num_new
            i += 1
        # Victims are taken from the end of ``running``, beyond ``i``, so none of them is in
        # the batch already. As in vLLM, a step that had to preempt admits nobody new.
        if batch.preempted:
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._reserve(req, num_new):
                break
            self.waiting.popleft()
            req.state = RUNNING
            if req.first_scheduled_s is None:
                req.first_scheduled_s = now_s
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return batch

    def finish_step(self, batch: Batch, end_s: float) -> list[Request]:
        """Record the step's results at ``end_s``; returns the requests that finished."""
        finished: list[Request] = []
        for req, num_new in zip(batch.requests, batch.num_new_tokens, strict=True):
            computed = req.num_computed_tokens + num_new
            req.num_computed_tokens = computed
            if computed < req.prompt_tokens + req.num_output_tokens:
                continue  # a prefill chunk that did not reach the last token
            req.num_output_tokens += 1
            req.token_times_s.append(end_s)
            if req.first_token_s is None:
                req.first_token_s = end_s
            if req.num_output_tokens >= req.max_output_tokens or req.stop_early:
                req.state = FINISHED
                req.finish_s = end_s
                self.kv.free(req.block_ids)
                req.block_ids = []
                finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.state == RUNNING]
        return finished

    def abort(self, req: Request, end_s: float, reason: str) -> None:
        """Drop a request (e.g. its client went away), freeing its KV at once."""
        if req.state == RUNNING:
            self.running.remove(req)
        elif req.state == WAITING:
            self.waiting.remove(req)
        self.kv.free(req.block_ids)
        req.block_ids = []
        req.state = REJECTED
        req.reject_reason = reason
        req.finish_s = end_s

    # ---- what the controller plans with -----------------------------------------------------
    def forecast_kv_blocks(self, horizon_steps: int) -> int:
        """KV blocks needed within ``horizon_steps`` steps beyond those held: running requests
        growing by one token a step (capped at their output length), and the queue's prompts."""
        bt = self.kv.block_tokens
        need = 0
        for req in self.running:
            final = req.prompt_tokens + req.max_output_tokens - 1
            target = min(final, req.num_tokens + horizon_steps)
            need += max(0, -(-target // bt) - len(req.block_ids))
        room = self.config.max_num_seqs - len(self.running)
        for req in self.waiting:
            if room <= 0:
                break
            need += -(-(req.num_tokens + horizon_steps) // bt)
            room -= 1
        return need
