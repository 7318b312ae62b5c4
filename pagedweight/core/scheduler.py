"""Continuous batching in the manner of vLLM's V1 scheduler, with KV blocks from the page pool.

One step: ``schedule(now_s)`` picks running requests first (decodes and unfinished prefill
chunks, oldest first), then admits waiting requests FCFS, within a token budget
(``max_num_batched_tokens``) and ``max_num_seqs``, and by default only when their forecast KV
demand fits beside the running requests' (``admission``; docs/DESIGN.md). Prefill is chunked
to what the budget leaves. When KV blocks run out it first calls the memory-pressure hook (the
precision controller downgrades experts there, freeing pages) and only then preempts,
newest first: by recompute, by swap (``kv-swap``), or per victim (``cost``: pagedweight's
``kv_offload``). ``finish_step(batch, end_s)`` appends the sampled tokens and releases finished
requests.

Token model (as in vLLM): a request holds ``prompt + num_output_tokens`` tokens, of which
``num_computed_tokens`` have KV. A step computes ``[num_computed, num_computed + n)``; when it
reaches the last token, one new token is sampled. After a preemption the KV is dropped and
prompt + generated tokens are recomputed; generated tokens are kept.

Prefix caching (``prefix_caching=True``, vLLM's automatic prefix caching): a request that
carries content keys for its full prompt blocks (``Request.block_hashes``, see
``pagedweight.core.prefix``) starts from the longest run of its leading blocks that is cached,
holding those blocks instead of computing them (at least its last prompt token is computed, for
its first token's logits); the blocks it computes are registered as they complete. A request
without keys neither hits nor registers. The methods under "prefix caching" are all of it.

No torch and no SimPy here: both runtimes drive this class with their own clocks.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from itertools import islice

from pagedweight.core.kv_blocks import KvBlockAllocator
from pagedweight.core.step import StepShape
from pagedweight.errors import ConfigError, PoolError


class RequestState(Enum):
    """Where a request is in its lifecycle; ``value`` is the name written to requests.csv."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    REJECTED = "rejected"  # refused on arrival, or aborted


WAITING, RUNNING, FINISHED, REJECTED = (
    RequestState.WAITING,
    RequestState.RUNNING,
    RequestState.FINISHED,
    RequestState.REJECTED,
)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    # Prompt + output tokens of one request; None: no limit of its own (RuntimeCore sets the
    # model's context when the configuration leaves it open).
    max_model_len: int | None = None
    # recompute: a preempted request's KV is dropped and recomputed on resume (vLLM's default).
    # swap: its KV is copied to host memory and back (the ``kv-swap`` policy); the runtime
    # times the copies from ``Batch.swapped_out_tokens`` / ``swapped_in_tokens``.
    # cost: per victim, swap if ``Scheduler.swap_preferred`` says so, else recompute (the
    # pagedweight controller's ``kv_offload``: swap when the copies cost less than recomputing).
    preemption_mode: str = "recompute"
    # forecast: a waiting request is admitted only when its whole prompt and the next
    # ``admission_reserve_tokens`` output tokens (at most its own) fit beside what the running
    # requests have been promised the same way (see ``_admits``). greedy: vLLM's rule, admitted
    # when its first prefill chunk fits, which under KV pressure preempts and recomputes the
    # same long prompts again and again.
    admission: str = "forecast"
    admission_reserve_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.admission not in ("forecast", "greedy"):
            raise ConfigError(f"admission(={self.admission!r}) must be 'forecast' or 'greedy'")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "admission_reserve_tokens"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name}(={getattr(self, name)}) must be > 0")
        if self.preemption_mode not in ("recompute", "swap", "cost"):
            raise ConfigError(f"preemption_mode(={self.preemption_mode!r}) must be 'recompute', 'swap' or 'cost'")


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
        "swapped_tokens",
        "preempted_at_s",
        "block_hashes",
        "num_cached_blocks",
        "cached_tokens",
        "private_from",
    )

    def __init__(self, request_id: int, arrival_s: float, prompt_tokens: int, max_output_tokens: int):
        self.request_id = request_id
        self.arrival_s = arrival_s
        self.prompt_tokens = prompt_tokens
        self.max_output_tokens = max_output_tokens
        self.state: RequestState = WAITING
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.block_ids: list[int] = []
        self.first_scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        # End of the step that produced each output token. A list, not array("d"): its append
        # is 30 ns against 85 (once per token of every request), and the step's end is one
        # float object shared by every request of the step, so it holds 8 bytes a token as well.
        self.token_times_s: list[float] = []
        self.num_preemptions = 0
        self.reject_reason: str | None = None
        self.stop_early = False  # set by a real engine on EOS/stop string; the simulator never does
        self.swapped_tokens = 0  # tokens of KV held in host memory while preempted (swap mode)
        self.preempted_at_s: list[float] = []  # when each preemption happened
        # Prefix caching: content keys of the prompt's full KV blocks (None: never shared), how
        # many leading blocks of ``block_ids`` are cached ones, and the prompt tokens served from
        # the cache when it was first scheduled (vLLM's ``cached_tokens``).
        self.block_hashes: Sequence[int] | None = None
        self.num_cached_blocks = 0
        self.cached_tokens = 0
        # The first of ``block_hashes`` that no other request can have (None: any may be shared;
        # the simulator knows, from the whole trace, pagedweight.core.prefix). Until its first
        # preemption nothing can look those up, so they are registered only if it is preempted,
        # and when it finishes they stay in the cache as keyless evictable blocks: the cache's
        # memory and eviction order are those of the registered blocks, without the cost of
        # keys nobody asks for.
        self.private_from: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.num_output_tokens

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, {self.state.value}, prompt={self.prompt_tokens}, "
            f"out={self.num_output_tokens}/{self.max_output_tokens}, computed={self.num_computed_tokens})"
        )


@dataclass(slots=True, init=False)
class Batch:
    """What one step computes: ``num_new_tokens[i]`` tokens of ``requests[i]``."""

    requests: list[Request]
    num_new_tokens: list[int]
    preempted: list[Request]
    swapped_out_tokens: int  # KV tokens to copy device -> host before this step (swap mode)
    swapped_in_tokens: int  # KV tokens to copy host -> device before this step
    # Filled while scheduling, so that shape() needs no second pass over the batch.
    prefill_tokens: list[int]
    prefill_kv_lens: list[int]
    decode_kv_lens: list[int]

    def __init__(self) -> None:
        # An empty batch, filled by the scheduler. Written out: the generated __init__ with six
        # default factories cost 1.2 us a step, this 0.4.
        self.requests, self.num_new_tokens, self.preempted = [], [], []
        self.swapped_out_tokens = self.swapped_in_tokens = 0
        self.prefill_tokens, self.prefill_kv_lens, self.decode_kv_lens = [], [], []

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def shape(self) -> StepShape:
        """The step's shape for the latency model."""
        return StepShape(
            self.prefill_tokens,
            self.prefill_kv_lens,
            self.decode_kv_lens,
            sum(self.prefill_tokens),  # Python sums of the lists: cheaper than numpy's here
            sum(self.decode_kv_lens),
        )

    def add(self, req: Request, num_new: int, remaining: int) -> None:
        """Append ``num_new`` tokens of ``req``; ``remaining`` tokens of it were left to compute."""
        self.requests.append(req)
        self.num_new_tokens.append(num_new)
        if remaining == 1:
            self.decode_kv_lens.append(req.num_computed_tokens + 1)
        else:
            self.prefill_tokens.append(num_new)
            self.prefill_kv_lens.append(req.num_computed_tokens + num_new)


# A memory-pressure hook gets the number of KV blocks missing and may free pages (e.g. by
# downgrading experts) before the scheduler resorts to preemption.
PressureHook = Callable[[int], None]
# A step limits hook gets the step's start time and returns (token budget, most running requests).
StepLimits = Callable[[float], tuple[int, int]]
# A swap-out hook gets a request being preempted by swap while it still holds its blocks, with
# ``num_computed_tokens`` of KV in them: a runtime that holds real KV copies it out there.
SwapOutHook = Callable[[Request], None]


def _registrable(req: Request) -> int:
    """How many of ``req``'s prompt blocks it registers as they are computed: all, or the shared
    ones until it is first preempted (``Request.private_from``)."""
    keys = req.block_hashes
    if req.private_from is None or req.num_preemptions or req.private_from >= len(keys):
        return len(keys)
    return req.private_from


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KvBlockAllocator,
        max_kv_blocks: int,
        pressure_hook: PressureHook | None = None,
        prefix_caching: bool = False,
    ):
        """``max_kv_blocks``: the most KV blocks this runtime can ever give one request (the
        pool less pinned weights and experts at the lowest precision the policy allows); a
        request needing more is rejected on arrival instead of waiting forever."""
        self.config = config
        self.kv = kv
        self.max_kv_blocks = max_kv_blocks
        self.pressure_hook = pressure_hook
        # Step limits hook: called at the start of ``schedule(now_s)``, returns this step's token
        # budget and most running requests (in place of ``max_num_batched_tokens`` and
        # ``max_num_seqs``) and may reorder ``waiting``. None: the configured limits, FCFS. The
        # pagedweight controller sets it (``Controller.step_limits``: SLO-aware batches).
        self.step_limits: StepLimits | None = None
        # Swap-out hook (swap mode): called in ``_preempt`` before the victim's blocks are freed,
        # which the same ``schedule`` may hand to another request or, through the pressure
        # hook's downgrades, to expert weights. The engine copies the KV to host memory there.
        self.swap_out_hook: SwapOutHook | None = None
        # Preemption mode ``cost``: whether a victim is swapped (True) or recomputed (False),
        # asked with the victim before it lets go of anything (``Controller.prefer_swap``).
        self.swap_preferred: Callable[[Request], bool] | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_caching = prefix_caching
        # Prompt tokens looked up in the prefix cache at admission, and those found (every
        # admission, a resumed one too, as vLLM counts its prefix cache queries and hits).
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        # Running requests with prompt blocks still to register as they are computed.
        self._prefix_pending: dict[Request, None] = {}
        # The promised blocks as the controller's forecast found them just before this step's
        # schedule (``forecast_kv_blocks``), so that admission need not count them again; any
        # change to the running requests outside ``schedule`` forgets it.
        self._promised_memo: int | None = None

    # ---- arrivals -------------------------------------------------------------------------
    def add(self, req: Request) -> bool:
        """Queue ``req``, or reject it with a reason. Returns whether it was queued."""
        total = req.prompt_tokens + req.max_output_tokens
        if req.prompt_tokens < 1 or req.max_output_tokens < 1:
            req.reject_reason = "prompt and output must each be at least 1 token"
        elif self.config.max_model_len is not None and total > self.config.max_model_len:
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
        free = kv.num_free_blocks
        if need > free and self.pressure_hook is not None:
            self.pressure_hook(need - free)
            free = kv.num_free_blocks
        if need > free:
            return False
        req.block_ids.extend(kv.allocate(need))
        return True

    def _swaps(self, req: Request) -> bool:
        """Whether preempting ``req`` swaps its KV out (else it is recomputed on resume)."""
        mode = self.config.preemption_mode
        if mode == "swap":
            return True
        return mode == "cost" and self.swap_preferred is not None and self.swap_preferred(req)

    def _preempt(self, req: Request, batch: Batch, now_s: float, swap: bool | None = None) -> None:
        """Preempt ``req``: by swap or by recompute as ``swap`` says (None: as ``_swaps`` decides;
        an expert-parallel follower replays rank 0's decision)."""
        self._promised_memo = None
        if self.running[-1] is req:  # the newest, as schedule() picks: no scan of the list
            self.running.pop()
        else:
            self.running.remove(req)
        req.preempted_at_s.append(now_s)
        if self._swaps(req) if swap is None else swap:
            if self.swap_out_hook is not None:
                self.swap_out_hook(req)
            req.swapped_tokens = req.num_computed_tokens
            batch.swapped_out_tokens += req.num_computed_tokens
        if req.private_from is not None and not req.num_preemptions and len(req.block_hashes):
            self._cache_private_blocks(req)  # what it computed, for its own recompute
        self.kv.free(req.block_ids)
        req.block_ids = []
        req.num_cached_blocks = 0
        self._prefix_pending.pop(req, None)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.state = WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        batch.preempted.append(req)

    def schedule(self, now_s: float) -> Batch:
        memo, self._promised_memo = self._promised_memo, None
        batch = Batch()
        budget, max_seqs = self.config.max_num_batched_tokens, self.config.max_num_seqs
        if self.step_limits is not None:  # the pagedweight controller's SLO-aware limits
            budget, max_seqs = self.step_limits(now_s)
        running, block_tokens = self.running, self.kv.block_tokens
        add_kv = batch.decode_kv_lens.append
        # The hot loop of both runtimes (~0.2 us per running request): most requests decode
        # with room left in their last block, so that case comes first and calls nothing but
        # one append (bound once). Every request the loop passes joins the batch in order
        # unless it is itself preempted, which ends the loop: the batch's requests are the
        # first ``taken`` of ``running``, sliced once after the loop, each with one new token
        # but the prefill chunks (``chunks``: position and tokens).
        # A decode whose last block is full needs one more (one in ``block_tokens`` steps, ~10
        # a step in a batch of 150). While the allocator can hand such blocks out one by one
        # without a shortage (``KvBlockAllocator.num_growable_blocks``), they are taken together
        # (``_grow``), the same blocks in the same order, without ``_reserve``'s checks each;
        # before anything else reserves (and so may allocate, preempt or ask the pressure
        # hook), the requests passed so far get theirs.
        # Victims of a preemption are popped from the end, which the iteration has not reached.
        grow: list[Request] = []
        room = None  # asked of the allocator when the first decode needs a block
        chunks: list[tuple[int, int]] = []
        taken = None  # None: every request the loop passed (it ran to the end)
        for req in running:
            computed = req.num_computed_tokens
            remaining = req.prompt_tokens + req.num_output_tokens - computed
            if remaining == 1 and computed < len(req.block_ids) * block_tokens:
                add_kv(computed + 1)
                budget -= 1
                if budget <= 0:
                    taken = running.index(req) + 1
                    break
                continue
            num_new = remaining if remaining <= budget else budget
            if computed + num_new > len(req.block_ids) * block_tokens:
                if remaining == 1 and room is None:
                    room = self.kv.num_growable_blocks()
                if remaining == 1 and len(grow) < room:
                    grow.append(req)
                    if memo is not None:  # its promise lacks one block fewer (it is past its blocks)
                        memo -= 1
                else:
                    if grow:
                        self._grow(grow)
                        grow = []
                    held = len(req.block_ids)
                    preempted_self = False
                    while not self._reserve(req, num_new):
                        victim = running[-1]  # newest first
                        self._preempt(victim, batch, now_s)
                        if victim is req:
                            preempted_self = True
                            break
                    if preempted_self:
                        break  # nothing older is left to preempt; ``running`` is what it passed
                    if memo is not None:  # its promise now lacks fewer blocks
                        promise = self._promise(req)
                        memo += max(0, promise - len(req.block_ids)) - max(0, promise - held)
                    room = None
            if remaining == 1:
                add_kv(computed + 1)
            else:
                chunks.append((running.index(req), num_new))
                batch.prefill_tokens.append(num_new)
                batch.prefill_kv_lens.append(computed + num_new)
            budget -= num_new
            if budget <= 0:
                taken = running.index(req) + 1
                break
        if grow:
            self._grow(grow)
        taken = len(running) if taken is None else taken
        batch.requests = running[:taken]
        batch.num_new_tokens = new_tokens = [1] * taken
        for position, num_new in chunks:
            new_tokens[position] = num_new
        # Victims are taken from the end of ``running``, beyond the loop, so none of them is in
        # the batch already. As in vLLM, a step that had to preempt admits nobody new.
        if batch.preempted:
            return batch
        forecast = self.config.admission == "forecast"
        promised = memo  # None until counted: a queue that cannot fit at all never needs it
        while self.waiting and budget > 0 and len(self.running) < max_seqs:
            req = self.waiting[0]
            if forecast:
                if promised is None:
                    if self.running and self.pressure_hook is None and self._promise(req) > self.kv.num_free_blocks:
                        break  # does not fit beside no promise at all, and nothing can free memory
                    promised = self._promised_blocks()
                need = self._admits(req, promised)
                if need is None:
                    break
                promised += need
            # A swapped-out request resumes where it stopped once its KV is copied back.
            resume_at = req.swapped_tokens
            hit = 0
            if self.prefix_caching and req.block_hashes is not None and len(req.block_hashes) and not resume_at:
                hit = self._acquire_prefix(req, budget)
                if hit < 0:
                    break  # does not fit even with its cached prefix
            start = resume_at + hit
            num_new = min(req.num_tokens - start, budget)
            req.num_computed_tokens = start
            if not self._reserve(req, num_new):
                if hit:
                    self._release_prefix(req)
                req.num_computed_tokens = 0
                break
            if req.block_hashes is not None and self.prefix_caching:
                self._count_prefix(req, hit, not resume_at, now_s)
            if resume_at:
                batch.swapped_in_tokens += resume_at
                req.swapped_tokens = 0
            self.waiting.popleft()
            req.state = RUNNING
            if req.first_scheduled_s is None:
                req.first_scheduled_s = now_s
            self.running.append(req)
            batch.add(req, num_new, req.num_tokens - start)
            budget -= num_new
        return batch

    def _grow(self, reqs: list[Request]) -> None:
        """One more KV block for each of ``reqs``, in one call (see ``schedule``)."""
        for req, block in zip(reqs, self.kv.allocate_each(len(reqs)), strict=True):
            req.block_ids.append(block)

    # ---- admission by forecast KV demand ------------------------------------------------------
    # The rule that keeps preempted prefills from being recomputed again and again: memory is
    # promised, not just free. Each running request is promised the blocks for the rest of its
    # prompt and its next ``admission_reserve_tokens`` output tokens; a waiting request is
    # admitted only if its own promise fits in the free blocks beside them (after the pressure
    # hook, i.e. downgrades, has had its say). Under the greedy rule a long prompt is admitted
    # as soon as its first chunk fits, the running decodes then grow into its blocks, it is
    # preempted (newest first) and readmitted at once: its whole prefill again, every cycle.
    def _promise(self, req: Request) -> int:
        """Blocks ``req`` is promised in all: its prompt (and tokens to recompute) plus its next
        ``admission_reserve_tokens`` outputs, capped at its own output length."""
        ahead = req.max_output_tokens - req.num_output_tokens
        reserve = self.config.admission_reserve_tokens
        return -(-(req.num_tokens + (ahead if ahead < reserve else reserve)) // self.kv.block_tokens)

    def _promised_blocks(self) -> int:
        """Blocks promised to running requests beyond those they hold."""
        out, bt, reserve = 0, self.kv.block_tokens, self.config.admission_reserve_tokens
        for req in self.running:  # _promise, inlined
            outputs = req.num_output_tokens
            ahead = req.max_output_tokens - outputs
            extra = -(-(req.prompt_tokens + outputs + (ahead if ahead < reserve else reserve)) // bt)
            extra -= len(req.block_ids)
            if extra > 0:
                out += extra
        return out

    def _admits(self, req: Request, promised: int) -> int | None:
        """The blocks ``req``'s admission promises, or None if they do not fit beside
        ``promised``. With nothing running there is nothing to wait for: it is admitted, as
        under the greedy rule, if its first chunk fits (``_reserve`` decides)."""
        need = self._promise(req)
        if not self.running:
            return need
        short = promised + need - self.kv.num_free_blocks
        if short > 0 and self.pressure_hook is not None:
            self.pressure_hook(short)
            short = promised + need - self.kv.num_free_blocks
        return None if short > 0 else need

    def finish_step(self, batch: Batch, end_s: float) -> list[Request]:
        """Record the step's results at ``end_s``; returns the requests that finished."""
        self._promised_memo = None
        finished: list[Request] = []
        for req, num_new in zip(batch.requests, batch.num_new_tokens, strict=True):
            computed = req.num_computed_tokens + num_new
            req.num_computed_tokens = computed
            outputs = req.num_output_tokens
            if computed < req.prompt_tokens + outputs:
                continue  # a prefill chunk that did not reach the last token
            outputs += 1
            req.num_output_tokens = outputs
            req.token_times_s.append(end_s)
            if outputs == 1:
                req.first_token_s = end_s
            if outputs >= req.max_output_tokens or req.stop_early:
                req.state = FINISHED
                req.finish_s = end_s
                finished.append(req)
        if self._prefix_pending:  # before the finished let go: their last blocks are cached too
            self._cache_computed_blocks()
        if finished:
            kv = self.kv
            for req in finished:
                if req.private_from is not None and not req.num_preemptions:  # private blocks unkeyed
                    kv.retire(req.block_ids, len(req.block_hashes), req.private_from)
                else:
                    kv.free(req.block_ids)
                req.block_ids = []
            if len(finished) <= 8:  # list.remove compares identities in C: no Python pass
                for req in finished:
                    self.running.remove(req)
            else:
                self.running = [r for r in self.running if r.state is RUNNING]
        return finished

    def abort(self, req: Request, end_s: float, reason: str) -> None:
        """Drop a request (e.g. its client went away), freeing its KV at once."""
        self._promised_memo = None
        if req.state is RUNNING:
            self.running.remove(req)
        elif req.state is WAITING:
            self.waiting.remove(req)
        if req.private_from is not None and not req.num_preemptions and len(req.block_hashes):
            computed = min(len(req.block_hashes), req.num_computed_tokens // self.kv.block_tokens)
            shared = min(req.private_from, computed)
            self.kv.retire(req.block_ids, computed, shared)
        else:
            self.kv.free(req.block_ids)
        req.block_ids = []
        req.num_cached_blocks = 0
        self._prefix_pending.pop(req, None)
        req.state = REJECTED
        req.reject_reason = reason
        req.finish_s = end_s

    # ---- prefix caching -------------------------------------------------------------------------
    def _acquire_prefix(self, req: Request, budget: int) -> int:
        """Hold the cached blocks of ``req``'s longest cached prefix; returns its tokens, or -1
        (nothing taken) when the request cannot get the blocks for the rest of this step's
        chunk even after the pressure hook: checked before taking anything, so that a request
        left waiting does not take and give back its prefix every step. At least the last
        prompt token is left to compute: its logits give the first token."""
        kv = self.kv
        bt = kv.block_tokens
        limit = min(len(req.block_hashes), (req.prompt_tokens - 1) // bt)
        if limit <= 0:
            return 0
        if self.pressure_hook is None:  # cheap bound first: even a whole hit would not fit
            best = -(-(limit * bt + min(req.num_tokens - limit * bt, budget)) // bt) - limit
            if best > kv.num_free_blocks:
                return -1
        n, idle = kv.lookup(req.block_hashes, limit)
        num_new = min(req.num_tokens - n * bt, budget)
        need = -(-(n * bt + num_new) // bt) - n
        free = kv.free_after_acquire(idle)
        if need > free and self.pressure_hook is not None:
            self.pressure_hook(need - free)
            n, idle = kv.lookup(req.block_hashes, limit)  # the hook may have reclaimed cached pages
            need = -(-(n * bt + min(req.num_tokens - n * bt, budget)) // bt) - n
            free = kv.free_after_acquire(idle)
        if need > free:
            return -1
        blocks = kv.acquire(req.block_hashes, n) if n else []
        req.block_ids = blocks
        req.num_cached_blocks = len(blocks)
        return len(blocks) * bt

    def _release_prefix(self, req: Request) -> None:
        """Undo ``_acquire_prefix`` for a request that could not be admitted after all."""
        self.kv.release(req.block_ids)
        req.block_ids = []
        req.num_cached_blocks = 0

    def _count_prefix(self, req: Request, hit_tokens: int, looked_up: bool, now_s: float) -> None:
        """An admitted request: count its lookup (a swapped-out one resuming made none), and its
        blocks missed that were evicted lately (the allocator's ghost list, when kept), and
        register its blocks as they complete."""
        if looked_up:
            self.prefix_query_tokens += req.prompt_tokens
            self.prefix_hit_tokens += hit_tokens
            if req.first_scheduled_s is None:
                req.cached_tokens = hit_tokens
            ghosts = self.kv.ghosts
            if ghosts is not None:
                bt = self.kv.block_tokens
                limit = min(len(req.block_hashes), (req.prompt_tokens - 1) // bt)
                ghosts.count_hits(req.block_hashes, hit_tokens // bt, limit, now_s)
        if req.num_cached_blocks < _registrable(req):
            self._prefix_pending[req] = None

    def _cache_private_blocks(self, req: Request) -> None:
        """Register the private prompt blocks a request has computed (it is being preempted for
        the first time; it finds them again if they are not evicted before it is readmitted):
        the blocks a request with shared keys registers step by step, and, with nobody else
        holding these keys, every registration succeeds as it would have then. From here on
        the request registers step by step like any other."""
        keys, done = req.block_hashes, req.num_cached_blocks
        full = min(len(keys), req.num_computed_tokens // self.kv.block_tokens)
        if full > done:
            self.kv.cache_blocks(req.block_ids[done:full], keys[done:full])
            req.num_cached_blocks = full

    def _cache_computed_blocks(self) -> None:
        """Register the prompt blocks completed so far by the requests that still had some to
        compute (called after a step, before finished requests let go of their blocks)."""
        bt, kv, pending = self.kv.block_tokens, self.kv, self._prefix_pending
        for req in list(pending):
            keys, done = req.block_hashes, req.num_cached_blocks
            full = req.num_computed_tokens // bt
            last = _registrable(req)
            if full >= last:
                full = last
                del pending[req]
            if full > done:
                kv.cache_blocks(req.block_ids[done:full], keys[done:full])
                req.num_cached_blocks = full

    def check_prefix_cache(self) -> None:
        """Raise ``PoolError`` if an invariant across requests is broken (tests call it every
        step): a cached block is held by as many requests as its count says, a private block by
        one; no request holds an evictable block; and every cached block a request holds sits at
        the position of its key in that request's keys, so a hit never serves another prompt's KV."""
        kv = self.kv
        held = Counter(b for r in self.running for b in r.block_ids)
        for block, n in held.items():
            want = kv.holders(block) if kv.key_of(block) is not None else 1
            if n != want:
                raise PoolError(f"KV block {block} held by {n} requests; expected {want}")
        if len(held) != kv.num_used_blocks:
            raise PoolError(f"{len(held)} blocks held; the allocator counts {kv.num_used_blocks}")
        for r in self.running:
            for j, block in enumerate(r.block_ids):
                key = kv.key_of(block)
                keys = r.block_hashes
                if key is not None and (keys is None or j >= len(keys) or keys[j] != key):
                    raise PoolError(f"request {r.request_id} holds block {block} of another prefix at {j}")

    # ---- what the controller plans with -----------------------------------------------------
    def forecast_kv_blocks(self, horizon_steps: int) -> int:
        """KV blocks needed within ``horizon_steps`` steps beyond those held: running requests
        growing by one token a step (capped at their output length), and the queue's prompts."""
        bt = self.kv.block_tokens
        # Under forecast admission the running requests' promises count too: weights that took
        # those blocks back would be downgraded again at the next admission. A promise covers
        # the next ``admission_reserve_tokens`` outputs (or all that are left), so within that
        # horizon it covers the growth too: the promised blocks are the answer.
        promise = self.config.admission == "forecast"
        reserve = self.config.admission_reserve_tokens
        if promise and horizon_steps <= reserve:
            need = self._promised_memo = self._promised_blocks()
        else:
            need = self._growth_blocks(horizon_steps, promise)
        room = self.config.max_num_seqs - len(self.running)
        if room > 0:
            for req in islice(self.waiting, room):
                need += -(-(req.prompt_tokens + req.num_output_tokens + horizon_steps) // bt)
        return need

    def _growth_blocks(self, horizon_steps: int, promise: bool) -> int:
        """Blocks the running requests need beyond those held to grow ``horizon_steps`` tokens
        each (capped at their output length), or their promises if larger."""
        bt = self.kv.block_tokens
        reserve = self.config.admission_reserve_tokens
        need = 0
        for req in self.running:  # ``_promise`` inlined: this loop runs at every plan
            prompt, outputs, max_outputs = req.prompt_tokens, req.num_output_tokens, req.max_output_tokens
            target = prompt + outputs + horizon_steps
            final = prompt + max_outputs - 1
            blocks = -(-(target if target < final else final) // bt)
            if promise:
                ahead = max_outputs - outputs
                promised = -(-(prompt + outputs + (ahead if ahead < reserve else reserve)) // bt)
                blocks = promised if promised > blocks else blocks
            extra = blocks - len(req.block_ids)
            if extra > 0:
                need += extra
        return need
