"""The real engine: the ``pagedweight`` scheduler and controller driving a PyTorch model whose
routed experts and KV cache share one paged arena.

One step, as in the simulator (``pwsim/engine.py``) and the design's loop:
``poll`` landed upgrades -> ``plan_step`` -> ``schedule`` -> forward + sample -> ``finish_step``
-> ``record_step``. The step loop is not thread-safe: a server calls it from one thread and
hands requests in through ``submit`` / ``cancel`` (queues drained at the start of each step).
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedweight.core.runtime import CoreConfig, RuntimeCore
from pagedweight.core.scheduler import FINISHED, REJECTED, Request, SchedulerConfig
from pagedweight.errors import ConfigError, PagedWeightError
from pagedweight.policy.controller import ControllerSettings
from pagedweight.policy.importance import ImportanceTable, on_ladder, read_table, synthetic_table
from pagedweight.results.metrics import Slo
from pagedweight.results.writer import ResultsWriter, policy_summary
from pwgpu.attention import PagedKvCache, build_batch
from pwgpu.loader import DTYPES, default_dtype_name, expert_masters, load_checkpoint, pinned_weights
from pwgpu.model import MoeTransformer
from pwgpu.sampling import RequestSampler, SamplingParams, TokenLogprobs, sample
from pwgpu.weights import WeightStore


@dataclass(frozen=True)
class EngineConfig:
    budget_bytes: int  # the whole arena: pinned weights, routed experts and KV blocks
    policy: str = "pagedweight"
    page_bytes: int | None = None  # default: the smallest power of two >= 32 KiB holding one KV block
    kv_block_tokens: int = 16
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 32
    max_model_len: int | None = None  # default: the checkpoint's max_position_embeddings
    controller: ControllerSettings = ControllerSettings()
    device: str | None = None  # default: cuda if available, else cpu
    dtype: str | None = None  # activations and KV; default bfloat16 on cuda, float32 on cpu
    importance: str | None = None  # importance table CSV; default: a synthetic table (marked so)
    moe_kernel: str | None = None  # "triton" or "reference"; default: triton on cuda, reference on cpu
    # The ladder, most precise first (e.g. the paper's FP16/INT8/INT4 for paper-greedy); its top
    # names the checkpoint's own format. Default: the master's ladder.
    precisions: tuple[str, ...] | None = None
    # Keep only the newest this many request records, steps and transitions (a server runs for
    # days; its results then cover the window); None keeps all (offline runs).
    history_window: int | None = None


def _own_ladder(precisions: tuple[str, ...], master_ladder: tuple[str, ...]) -> tuple[str, ...]:
    """A requested ladder on this checkpoint: its top, a 16-bit name or the master's own format,
    is the master's format; the rest are formats the master is quantised to."""
    from pagedweight.core.spec import PRECISION_NAMES

    top, masters = master_ladder[0], ("bf16", "fp16", "fp8-b128")
    if precisions[0] not in ("bf16", "fp16", top):
        raise ConfigError(f"precisions {list(precisions)}: the first must be the checkpoint's format ({top})")
    rest = tuple(precisions[1:])
    allowed = [p for p in PRECISION_NAMES if p not in masters]
    bad = [p for p in rest if p not in allowed]
    if bad:
        raise ConfigError(f"precisions {list(precisions)}: {bad[0]!r} is not allowed below {top}; allowed: "
                          f"{', '.join(allowed)}")  # fmt: skip
    return (top, *rest)


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
    def __init__(self, model_dir: str | Path, cfg: EngineConfig):
        self.cfg = cfg
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
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
        ladder = masters.ladder
        if cfg.precisions:
            ladder = _own_ladder(cfg.precisions, ladder)
        self.load_notes = ckpt.notes
        self.table: ImportanceTable = (
            on_ladder(read_table(cfg.importance), ladder, str(cfg.importance))
            if cfg.importance
            else synthetic_table(self.spec, ladder)
        )
        if (self.table.num_layers, self.table.num_experts) != (self.spec.num_moe_layers, arch.num_experts):
            raise PagedWeightError(
                f"importance table {cfg.importance} has {self.table.num_layers} layers x {self.table.num_experts} "
                f"experts; {self.model_dir} has {self.spec.num_moe_layers} x {arch.num_experts}"
            )
        max_len = min(cfg.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
        # Pages of 32 KiB at least: small enough that the tiny models' expert matrices span
        # several pages (so a downgrade frees some), large enough to hold a whole KV block.
        block_bytes = cfg.kv_block_tokens * self.spec.kv_bytes_per_token()
        self.page_bytes = cfg.page_bytes or max(1 << 15, 1 << (block_bytes - 1).bit_length())
        core_cfg = CoreConfig(
            model=self.spec,
            budget_bytes=cfg.budget_bytes,
            page_bytes=self.page_bytes,
            kv_block_tokens=cfg.kv_block_tokens,
            scheduler=SchedulerConfig(cfg.max_num_batched_tokens, cfg.max_num_seqs, max_len),
            controller=cfg.controller,
            history_window=cfg.history_window,
        )
        self.store = WeightStore(masters, self.page_bytes, self.device, cfg.moe_kernel, arch.hidden_act)
        self._t0 = time.perf_counter()
        self.core = RuntimeCore(core_cfg, cfg.policy, self.table, self.store, clock=self.now)
        pinned = self.store.attach(self.core, pinned_weights(ckpt, self.dtype, torch.device("cpu")))
        del ckpt
        self.model = MoeTransformer(arch, pinned, self.store, self.device)
        kv = self.core.kv
        parts, heads, dims = arch.kv_cache_geometry  # K and V, or MLA's one latent
        self.kv_cache = PagedKvCache(
            self.store.arena, self.page_bytes, cfg.kv_block_tokens, kv.blocks_per_page,
            arch.num_layers, heads, dims, self.dtype, parts,
        )  # fmt: skip
        # The scheduler records of the requests (of the newest ``history_window`` with one), for
        # the results; not their token ids.
        self.records: list[Request] | deque[Request] = deque(maxlen=cfg.history_window) if cfg.history_window else []
        self._by_req: dict[int, EngineRequest] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._next_id = 0
        # Called with the requests and the logits they sample from, every step that samples
        # (``pwgpu.served.TokenLog`` keeps them to score what was served).
        self.on_logits: Callable[[list[EngineRequest], torch.Tensor], None] | None = None

    def now(self) -> float:
        """Seconds since the engine started: the clock of every request and step record."""
        return time.perf_counter() - self._t0

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
        bad = [t for t in prompt_ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            req.state, req.reject_reason = (
                REJECTED,
                f"token id {bad[0]} outside the vocabulary of {self.arch.vocab_size}",
            )
        self.records.append(req)
        if req.state == REJECTED or not self.core.scheduler.add(req):
            req.finish_s = self.now()
            er.finish_reason = "rejected"
            self._emit(er, [], True)
            return er
        self._by_req[req.request_id] = er
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
        er.finish_reason = "abort"
        self._by_req.pop(er.req.request_id, None)
        self._emit(er, [], True)

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
                for er in list(self._by_req.values()):
                    if er.on_event is msg[2]:
                        self.abort(er, "client disconnected")

    def idle_tick(self) -> None:
        """What an idle engine still does: take in requests, flip landed upgrades and let the
        controller restore precision now that KV has room (no step is recorded)."""
        self._drain_inbox()
        self.store.poll()
        self.core.plan_step()

    def has_work(self) -> bool:
        return self.core.scheduler.has_work() or not self._inbox.empty()

    # ---- the step loop ----------------------------------------------------------------------
    def step(self) -> bool:
        """One engine step; returns False when there was nothing to compute."""
        self._drain_inbox()
        core, sched = self.core, self.core.scheduler
        self.store.poll()
        start_s = self.now()
        core.plan_step()
        batch = sched.schedule(start_s)
        if not batch.requests:
            return False
        shape = batch.shape()
        sampled = self._execute(batch)
        end_s = self.now()
        sched.finish_step(batch, end_s)
        core.record_step(start_s, end_s - start_s, batch, shape)
        for er, tok in sampled:
            done = er.req.state == FINISHED
            if done:
                er.finish_reason = er.finish_reason or "length"
                self._by_req.pop(er.req.request_id, None)
            self._emit(er, [tok], done)
        return True

    def _execute(self, batch) -> list[tuple[EngineRequest, int]]:
        """Forward the batch's new tokens and sample one token for each request whose last
        token was computed; sets ``stop_early`` on stop tokens before ``finish_step``."""
        self.store.refresh()
        ids, seqs, last_rows, ers = [], [], [], []
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
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
        attn, positions = build_batch(seqs, self.cfg.kv_block_tokens, self.device)
        hidden = self.model.forward(torch.tensor(ids, device=self.device), positions, attn, self.kv_cache)
        if not ers:
            return []
        logits = self.model.logits(hidden[torch.tensor(last_rows, device=self.device)])
        if self.on_logits is not None:
            self.on_logits(ers, logits)
        tokens, logprobs = sample(logits, [er.sampler for er in ers])
        out = []
        for er, tok, lp in zip(ers, tokens, logprobs, strict=True):
            er.output_ids.append(tok)
            er.sampler.observe(tok)
            if lp is not None:
                er.logprobs.append(lp)
            p = er.params
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.arch.eos_token_ids):
                er.req.stop_early = True
                er.finish_reason = "stop"
            out.append((er, tok))
        return out

    def _emit(self, er: EngineRequest, new_ids: list[int], finished: bool) -> None:
        if er.on_event is not None:
            er.on_event(er, new_ids, finished)

    def run(self, max_steps: int | None = None) -> None:
        """Step until every request is done (offline use and tests)."""
        steps = 0
        while self.has_work() and (max_steps is None or steps < max_steps):
            if self.step():
                steps += 1
            elif not self.store.upgrades_in_flight and self._inbox.empty() and not self.core.scheduler.running:
                raise PagedWeightError(
                    f"{self.cfg.policy}: stalled with {len(self.core.scheduler.waiting)} requests waiting "
                    "and no memory coming free"
                )

    # ---- results ----------------------------------------------------------------------------
    def write_results(self, out_dir: str | Path, scenario: str = "serve", trace: dict | None = None) -> dict:
        """The results directory ``pagedweight.results.report`` reads (runtime ``pwgpu``)."""
        reqs = list(self.records)
        notes = []
        if len(reqs) < self._next_id:
            steps = self.core.steps
            window = f"history window {self.cfg.history_window}"
            notes.append(f"the newest {len(reqs)} of {self._next_id} requests, {len(steps)} of {steps.num_recorded} "
                         f"steps ({window})")  # fmt: skip
        device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        writer = ResultsWriter(
            Path(out_dir),
            {
                "runtime": "pwgpu",
                "scenario": scenario,
                "model": self.spec.name,
                "gpu": device_name,
                "budget_bytes": self.core.pool.total_bytes,
                "page_bytes": self.page_bytes,
                "latency_model": f"measured on {device_name} ({self.dtype})",
                "importance": self.table.provenance,
                # Small pinned tensors the spec does not count (biases, full-width q/k norms).
                "pinned_outside_arena_bytes": self.store.pinned_outside_bytes,
                "checkpoint_notes": self.load_notes,
                "trace": trace or {"source": "live requests", "num_requests": len(reqs), "notes": notes},
            },
        )
        summary = policy_summary(reqs, self.core, Slo(), self.now(), self.store.h2d_bytes)
        writer.add(self.cfg.policy, reqs, self.core, summary)
        return writer.write()
