"""The real engine: the ``pagedweight`` scheduler and controller driving a PyTorch model whose
routed experts and KV cache share one paged arena.

Each step is the core's (``RuntimeCore.step``, the loop the simulator runs too): poll landed
upgrades -> plan -> schedule -> ``_execute`` (forward pass, the router's real per-expert token
counts, sampling) -> observe routing -> finish -> record. The step loop is not thread-safe: a
server calls it from one thread and hands requests in through ``submit`` / ``cancel`` (queues
drained at the start of each step).

The engine's clock is wall time by default. ``FixedStepClock`` makes every step take a fixed
time instead, as the simulator's constant latency model does, so that the decisions of the two
runtimes can be compared step by step.
"""

from __future__ import annotations

import dataclasses
import queue
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from pagedweight.config.scenario import rank_model
from pagedweight.core.prefix import token_block_keys
from pagedweight.core.runtime import CoreConfig, Executed, RuntimeCore, Step
from pagedweight.core.scheduler import FINISHED, REJECTED, Request
from pagedweight.errors import ConfigError, PagedWeightError
from pagedweight.policy.importance import ImportanceTable, on_ladder, read_table, synthetic_table
from pagedweight.results.metrics import Slo
from pagedweight.results.writer import ResultsWriter, policy_summary, run_meta
from pwgpu import cpu_decode
from pwgpu.attention import PagedKvCache, build_batch
from pwgpu.host_allocator import keep_host_temporaries
from pwgpu.loader import DTYPES, default_dtype_name, expert_masters, load_checkpoint, pinned_weights
from pwgpu.model import MoeTransformer
from pwgpu.sampling import RequestSampler, SamplingParams, TokenLogprobs, sample
from pwgpu.weights import WeightStore


@dataclass(frozen=True)
class EngineConfig:
    """The core's configuration (budget, pages, scheduler limits, controller; its model None, or
    a scenario's, which the checkpoint must match) and what only the engine has."""

    core: CoreConfig
    policy: str = "pagedweight"
    device: str | None = None  # default: cuda if available, else cpu
    dtype: str | None = None  # activations and KV; default bfloat16 on cuda, float32 on cpu
    importance: str | None = None  # importance table CSV; default: a synthetic table (marked so)
    moe_kernel: str | None = None  # "triton" or "reference"; default: triton on cuda, reference on cpu
    # Memory bandwidth for pagedweight's step-time model under a TPOT SLO (weights read per
    # step); default: the built-in spec of the device (device_memory_bandwidth).
    memory_bandwidth_bytes_per_s: float | None = None
    # Host <-> device copy bandwidth (pinned), which prices a swap against a recompute under
    # pagedweight's kv_offload; default: the built-in spec of the device (device_h2d_bandwidth).
    h2d_bandwidth_bytes_per_s: float | None = None


# Built-in GPU specs by a word of the CUDA device's name (pagedweight/data/gpus).
_GPU_SPEC_OF_NAME = (("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-80gb"), ("l40s", "l40s"))


def _device_spec(device: torch.device):
    """The built-in ``GpuSpec`` of ``device`` (``cpu`` for a CPU), or None for a GPU without one."""
    from pagedweight.core.spec import load_gpu

    if device.type == "cpu":
        return load_gpu("cpu")
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    spec = next((s for word, s in _GPU_SPEC_OF_NAME if word in name), None)
    return None if spec is None else load_gpu(spec)


def device_memory_bandwidth(device: torch.device) -> float | None:
    """The memory bandwidth of ``device`` from its built-in spec (``cpu`` for a CPU), or None
    for a GPU without one (then pagedweight weighs memory only, as before)."""
    spec = _device_spec(device)
    return None if spec is None else spec.hbm_bandwidth_bytes_per_s


def device_h2d_bandwidth(device: torch.device) -> float | None:
    """The pinned host-to-device copy bandwidth of ``device`` from its built-in spec, or None
    for a GPU without one (then kv_offload never swaps)."""
    spec = _device_spec(device)
    return None if spec is None else spec.h2d_bandwidth_bytes_per_s


def _check_ladder_top(table: ImportanceTable, master_precision: str, model_dir: Path) -> None:
    """A table handed in (a scenario's) must start its ladder at the format of the checkpoint's
    experts, the most precise bytes the engine has (16-bit, fp16 and bf16 alike, or fp8-b128)."""
    top = table.ladder[0]
    sixteen_bit = ("bf16", "fp16")
    if top != master_precision and not (top in sixteen_bit and master_precision in sixteen_bit):
        raise ConfigError(
            f"importance table {table.source or '(scenario)'}: its precision ladder {list(table.ladder)} starts at "
            f"{top}; the routed experts of {model_dir} are {master_precision}, which must be the ladder's top"
        )


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on the engine's clock."""

    def step_done(self, start_s: float) -> None:
        """The step that started at ``start_s`` has been computed."""

    def idle(self, until_s: float) -> None:
        """Nothing to compute: wait, at most until ``until_s``."""

    def describe(self, device: str) -> str:
        """What times the run's steps, for summary.json."""


class WallClock:
    """Seconds since the engine started. An idle wait sleeps at most 10 ms, so that landed
    upgrades are noticed."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def step_done(self, start_s: float) -> None:
        pass

    def idle(self, until_s: float) -> None:
        time.sleep(max(0.0, min(until_s - self.now(), 0.01)))

    def describe(self, device: str) -> str:
        return f"measured on {device}"


class FixedStepClock:
    """Every step takes ``step_s``; idle time jumps to the event waited for. Runs become
    reproducible, and comparable with ``pwsim``'s constant latency model step by step."""

    def __init__(self, step_s: float):
        if not step_s > 0:
            raise ConfigError(f"step_s(={step_s}) must be > 0")
        self.step_s = step_s
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def step_done(self, start_s: float) -> None:
        self.t = start_s + self.step_s

    def idle(self, until_s: float) -> None:
        self.t = max(self.t, until_s)

    def describe(self, device: str) -> str:
        return f"fixed {self.step_s * 1e3:g} ms steps (computed on {device})"


@dataclass(eq=False)
class EngineRequest:
    """A request as the engine sees it: token ids and sampling on top of the scheduler's record."""

    req: Request
    prompt_ids: list[int]
    params: SamplingParams
    on_event: Callable[[EngineRequest, list[int], bool], None] | None = None  # (request, new ids, finished)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    sampler: RequestSampler | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token, when asked for


class Engine:
    def __init__(
        self,
        model_dir: str | Path,
        cfg: EngineConfig,
        table: ImportanceTable | None = None,
        clock: Clock | None = None,
        ep=None,
    ):
        """``table``: the importance table to plan with (a scenario's); default: the file
        ``cfg.importance`` names, else a synthetic table. ``ep``: this process's
        ``pwgpu.ep.EpGroup`` (expert parallelism: this rank's share of the experts)."""
        self.cfg = cfg
        self.clock = clock or WallClock()
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        keep_host_temporaries()  # as the profiler does: the same op, the same host allocator
        dtype_name = cfg.dtype or default_dtype_name(self.device)
        if dtype_name not in DTYPES:
            raise ConfigError(f"dtype {dtype_name!r} unknown; allowed: {', '.join(DTYPES)}")
        self.dtype = DTYPES[dtype_name]
        ckpt = load_checkpoint(model_dir)
        self.arch = arch = ckpt.arch
        self.model_dir = Path(model_dir)
        self.spec = arch.model_spec(self.model_dir.name, torch.tensor([], dtype=self.dtype).element_size())
        # The host master copy in the checkpoint's format sets the ladder's top: 16-bit (fp16 for
        # fp16 models, else bf16), or an FP8 checkpoint's own block-scaled bytes.
        masters = expert_masters(ckpt, self.dtype)
        self.load_notes = ckpt.notes
        if table is None:
            table = (
                on_ladder(read_table(cfg.importance), masters.ladder, str(cfg.importance))
                if cfg.importance
                else synthetic_table(self.spec, masters.ladder)
            )
        else:
            _check_ladder_top(table, masters.precision, self.model_dir)
        if (table.num_layers, table.num_experts) != (self.spec.num_moe_layers, arch.num_experts):
            raise PagedWeightError(
                f"importance table {cfg.importance or table.source} has {table.num_layers} layers x "
                f"{table.num_experts} experts; {self.model_dir} has {self.spec.num_moe_layers} x {arch.num_experts}"
            )
        self.ep = ep
        if ep is not None:  # this rank's experts, their importance rows and its share of the model
            masters, table, self.spec = ep.share(masters, table, self.spec)
        self.table: ImportanceTable = table
        core_cfg = cfg.core
        if ep is not None and core_cfg.model is not None:  # a scenario's model: this rank's share of it
            core_cfg = dataclasses.replace(core_cfg, model=rank_model(core_cfg.model, ep.world))
        core_cfg = core_cfg.for_model(self.spec)
        self.page_bytes = core_cfg.page_bytes
        self.store = WeightStore(masters, self.page_bytes, self.device, cfg.moe_kernel, arch.hidden_act)
        self.core = RuntimeCore(core_cfg, cfg.policy, table, self.store, clock=self.clock.now)
        bandwidth = cfg.memory_bandwidth_bytes_per_s or device_memory_bandwidth(self.device)
        if bandwidth:  # speed in pagedweight's objective, as the simulator's latency model gives it
            self.core.use_weight_read_model(bandwidth)
        h2d = cfg.h2d_bandwidth_bytes_per_s or device_h2d_bandwidth(self.device)
        if h2d:  # what a swap's copies cost (kv_offload), as the simulator's latency model times them
            self.core.set_copy_time_model(lambda num_bytes: num_bytes / h2d)
        pinned = self.store.attach(self.core, pinned_weights(ckpt, self.dtype, torch.device("cpu")))
        del ckpt
        if self.store.moe_kernel == "reference":
            self.store.make_dense_copies(self.dtype)  # before the first request, not in its step
        experts = self.store
        if ep is not None:
            from pwgpu.ep import EpExperts

            experts = EpExperts(self.store, ep)
        self.model = MoeTransformer(arch, pinned, experts, self.device)
        kv = self.core.kv
        parts, heads, dims = arch.kv_cache_geometry  # K and V, or MLA's one latent
        self.kv_cache = PagedKvCache(
            self.store.arena, self.page_bytes, kv.block_tokens, kv.blocks_per_page,
            arch.num_layers, heads, dims, self.dtype, parts,
        )  # fmt: skip
        if self.kv_cache.compiled_decode:
            cpu_decode.warm_up(self.dtype)  # compiled now, not in the first request's step
        # The scheduler records of the requests (of the newest ``history_window`` with one), for
        # the results; not their token ids.
        window = core_cfg.history_window
        self.records: list[Request] | deque[Request] = deque(maxlen=window) if window else []
        self._by_req: dict[int, EngineRequest] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._next_id = 0
        self._sampled: list[tuple[EngineRequest, int]] = []  # the current step's new tokens
        # Called with the requests and the logits they sample from, every step that samples
        # (``pwgpu.served.TokenLog`` keeps them to score what was served).
        self.on_logits: Callable[[list[EngineRequest], torch.Tensor], None] | None = None
        # Under expert parallelism, how this rank agrees with the others on requests, batches and
        # tokens (``pwgpu.ep_agree.attach``); None in one process.
        self.agreement = None
        # Preemption by swap (kv-swap): the KV of each request preempted by swap, copied to host
        # memory as the scheduler preempts it (before its freed blocks can be reused), until it
        # resumes in new blocks: request id -> (host copy, tokens). Every expert-parallel rank
        # swaps its own KV: its scheduler replays rank 0's preemptions through the same hook.
        self._swapped: dict[int, tuple[torch.Tensor, int]] = {}
        self._swap_bytes = 0  # KV bytes copied either way since the last step's record
        self.swap_in_bytes = 0  # host -> device KV bytes, counted with the upgrades' copies
        if self.core.scheduler.config.preemption_mode in ("swap", "cost"):
            self.core.scheduler.swap_out_hook = self._swap_out

    def now(self) -> float:
        """Seconds on the engine's clock (by default since it started): the clock of every
        request and step record."""
        return self.clock.now()

    # ---- requests ---------------------------------------------------------------------------
    def add(
        self, prompt_ids: list[int], params: SamplingParams, on_event=None, arrival_s: float | None = None
    ) -> EngineRequest:
        """Queue a request (engine thread only). ``arrival_s`` (engine clock; default now) is when
        it arrived, for latencies that include time spent before ``add``. A request that can
        never fit is returned finished with ``finish_reason == "rejected"`` and ``req.reject_reason`` set."""
        now_s = self.now()
        req = Request(self._next_id, now_s if arrival_s is None else min(arrival_s, now_s), len(prompt_ids),
                      params.max_tokens)  # fmt: skip
        self._next_id += 1
        er = EngineRequest(req, list(prompt_ids), params, on_event)
        er.sampler = RequestSampler(params, er.prompt_ids, self.arch.vocab_size, self.device, self.arch.eos_token_ids)
        self.records.append(req)
        bad = [t for t in prompt_ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            req.state, req.reject_reason = (
                REJECTED,
                f"token id {bad[0]} outside the vocabulary of {self.arch.vocab_size}",
            )
            req.finish_s = now_s
        else:
            if self.core.scheduler.prefix_caching:
                req.block_hashes = token_block_keys(er.prompt_ids, self.core.kv.block_tokens)
            if self.core.add(req):
                self._by_req[req.request_id] = er
                if self.agreement is not None:
                    self.agreement.added(er)
                return er
        er.finish_reason = "rejected"
        self._emit(er, [], True)
        return er

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_event, arrival_s: float | None = None) -> None:
        """Thread-safe ``add``: taken in at the start of the next step."""
        self._inbox.put(("add", prompt_ids, params, on_event, arrival_s))

    def cancel(self, er: EngineRequest | None, on_event=None) -> None:
        """Thread-safe abort (the client went away); frees the request's KV at the next step."""
        self._inbox.put(("abort", er, on_event))

    def abort(self, er: EngineRequest, reason: str = "aborted") -> None:
        if er.req.state in (FINISHED, REJECTED):
            return
        self.core.scheduler.abort(er.req, self.now(), reason)
        self._swapped.pop(er.req.request_id, None)  # a swapped-out request's host copy
        er.finish_reason = "abort"
        self._by_req.pop(er.req.request_id, None)
        if self.agreement is not None:
            self.agreement.aborted(er)
        self._emit(er, [], True)

    def refuse(self, er: EngineRequest, reason: str) -> None:
        """Reject a queued request after all (another expert-parallel rank cannot hold it)."""
        self.core.scheduler.abort(er.req, self.now(), reason)
        self._swapped.pop(er.req.request_id, None)
        er.finish_reason = "rejected"
        self._by_req.pop(er.req.request_id, None)
        self._emit(er, [], True)

    def unfinished(self) -> Iterator[EngineRequest]:
        """The requests taken in and not finished yet (a snapshot: safe to abort while iterating)."""
        return iter(list(self._by_req.values()))

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                self.add(*msg[1:])
            elif msg[1] is not None:
                self.abort(msg[1], "client disconnected")
            else:  # abort by callback: the server knows the request only by its callback
                for er in self.unfinished():
                    if er.on_event is msg[2]:
                        self.abort(er, "client disconnected")

    def idle_tick(self) -> None:
        """What an idle engine still does: take in requests, flip landed upgrades and let the
        controller restore precision now that KV has room (no step is recorded)."""
        self._drain_inbox()
        if self.agreement is not None:
            self.agreement.begin("idle")
        self.core.idle_tick()

    def has_work(self) -> bool:
        return self.core.scheduler.has_work() or not self._inbox.empty()

    # ---- the step loop ----------------------------------------------------------------------
    def step(self) -> bool:
        """One engine step (``RuntimeCore.step``); returns False when there was nothing to compute."""
        self._drain_inbox()
        if self.agreement is not None:
            self.agreement.begin("step")
        self._sampled = []
        if self.core.run_step(self._execute) is None:
            return False
        for er, tok in self._sampled:
            done = er.req.state is FINISHED
            if done:
                er.finish_reason = er.finish_reason or "length"
                self._by_req.pop(er.req.request_id, None)
            self._emit(er, [tok], done)
        self._sampled = []
        return True

    def _execute(self, step: Step) -> Executed:
        """Forward the batch's new tokens, count the router's choices and sample one token for
        each request whose last token was computed; sets ``stop_early`` on stop tokens before
        the core finishes the step."""
        self.store.refresh()
        batch = step.batch
        ids, seqs, last_rows, ers = [], [], [], []
        swapped = self._swapped
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            if swapped and req.request_id in swapped:
                self._swap_in(req)
            er = self._by_req[req.request_id]
            start, prompt = req.num_computed_tokens, er.prompt_ids
            # The new tokens, without copying the whole context: prompt first, then outputs.
            ids.extend(prompt[start : start + n])
            if start + n > len(prompt):
                ids.extend(er.output_ids[max(start - len(prompt), 0) : start + n - len(prompt)])
            seqs.append((req.block_ids, start, n))
            if start + n == len(prompt) + len(er.output_ids):
                last_rows.append(len(ids) - 1)
                ers.append(er)
        attn, positions = build_batch(seqs, self.core.kv.block_tokens, self.device)
        counts = torch.zeros(self.spec.num_moe_layers, self.arch.num_experts, dtype=torch.int64, device=self.device)
        hidden = self.model.forward(torch.tensor(ids, device=self.device), positions, attn, self.kv_cache, counts)
        if ers:
            if self.agreement is None or self.agreement.is_leader:
                logits = self.model.logits(hidden[torch.tensor(last_rows, device=self.device)])
                if self.on_logits is not None:
                    self.on_logits(ers, logits)
                tokens, logprobs = sample(logits, [er.sampler for er in ers])
            else:  # an expert-parallel follower takes rank 0's tokens
                tokens, logprobs = None, [None] * len(ers)
            if self.agreement is not None:
                tokens = self.agreement.tokens(tokens)
            for er, tok, lp in zip(ers, tokens, logprobs, strict=True):
                er.output_ids.append(tok)
                er.sampler.observe(tok)
                if lp is not None:
                    er.logprobs.append(lp)
                p = er.params
                if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.arch.eos_token_ids):
                    er.req.stop_early = True
                    er.finish_reason = "stop"
                self._sampled.append((er, tok))
        counts_host = counts.cpu().numpy()  # the step's one copy of the counts to the host
        step.observe_routing(counts_host if self.ep is None else self.ep.local_counts(counts_host))
        self.clock.step_done(step.start_s)
        moved, self._swap_bytes = self._swap_bytes, 0
        return Executed(bytes_swapped=moved)

    @property
    def h2d_bytes(self) -> int:
        """Bytes copied host -> device: upgrades from the host masters and swapped-in KV (as the
        simulator counts them)."""
        return self.store.h2d_bytes + self.swap_in_bytes

    def _swap_out(self, req: Request) -> None:
        """The scheduler preempts ``req`` by swap (``Scheduler.swap_out_hook``): copy the KV of
        its computed tokens to host memory while it still holds its blocks. On CUDA the copy is
        queued on the current stream, ahead of anything that later writes those blocks."""
        tokens = req.num_computed_tokens
        if tokens:
            self._swapped[req.request_id] = (self.kv_cache.copy_out(req.block_ids, tokens), tokens)
            self._swap_bytes += tokens * self.kv_cache.token_bytes

    def _swap_in(self, req: Request) -> None:
        """``req`` resumes after a swap: its host copy into its new blocks, before the forward."""
        host, tokens = self._swapped.pop(req.request_id)
        if req.num_computed_tokens != tokens:
            raise PagedWeightError(
                f"request {req.request_id} resumes at token {req.num_computed_tokens}; {tokens} were swapped out"
            )
        self.kv_cache.copy_in(host, req.block_ids, tokens)
        moved = tokens * self.kv_cache.token_bytes
        self._swap_bytes += moved
        self.swap_in_bytes += moved

    def _emit(self, er: EngineRequest, new_ids: list[int], finished: bool) -> None:
        if er.on_event is not None:
            er.on_event(er, new_ids, finished)

    def run(self, max_steps: int | None = None) -> None:
        """Step until every request is done (offline use and tests)."""
        steps = 0
        while self.has_work() and (max_steps is None or steps < max_steps):
            if self.step():
                steps += 1
            else:
                self.core.check_stall(requests_coming=not self._inbox.empty())

    # ---- results ----------------------------------------------------------------------------
    def results_meta(self, scenario: str, trace: dict, seed: int | None = None) -> dict:
        """The facts summary.json starts with (``pagedweight.results.writer.run_meta``)."""
        device = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return run_meta(
            runtime="pwgpu",
            scenario=scenario,
            model=self.spec.name,
            gpu=device,
            budget_bytes=self.core.pool.total_bytes,
            page_bytes=self.page_bytes,
            latency_model=f"{self.clock.describe(device)} ({self.dtype})",
            importance=self.table.provenance,
            # Small pinned tensors the spec does not count (biases, full-width q/k norms).
            pinned_outside_arena_bytes=self.store.pinned_outside_bytes,
            checkpoint_notes=self.load_notes,
            **self._ep_meta(),
            trace=trace,
            seed=seed,
        )

    def _ep_meta(self) -> dict:
        if self.ep is None:
            return {}
        return {"expert_parallel": {
            "ranks": self.ep.world, "backend": torch.distributed.get_backend(),
            "results_of": "rank 0: its pool, page table, transitions and steps; every rank served every request",
            "prefix_caching": self.core.scheduler.prefix_caching,
        }}  # fmt: skip

    def write_results(self, out_dir: str | Path, scenario: str = "serve", trace: dict | None = None) -> dict:
        """The results directory ``pagedweight.results.report`` reads (runtime ``pwgpu``)."""
        reqs = list(self.records)
        notes = []
        if len(reqs) < self._next_id:
            steps = self.core.steps
            window = f"history window {self.core.config.history_window}"
            notes.append(f"the newest {len(reqs)} of {self._next_id} requests, {len(steps)} of {steps.num_recorded} "
                         f"steps ({window})")  # fmt: skip
        trace = trace or {"source": "live requests", "num_requests": len(reqs), "notes": notes}
        writer = ResultsWriter(Path(out_dir), self.results_meta(scenario, trace))
        summary = policy_summary(reqs, self.core, Slo(), self.now(), self.h2d_bytes)
        writer.add(self.cfg.policy, reqs, self.core, summary)
        return writer.write()
