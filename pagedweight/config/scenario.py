"""Scenario files: one YAML document that says what to run and what to compare.

    name: longctx
    model: mixtral-8x7b            # built-in name (``pwsim specs``) or a path to a ModelSpec YAML
    gpu: h200
    memory: {budget: 120 GiB, page_bytes: 2 MiB, kv_block_tokens: 16, prefix_caching: true,
             precisions: [bf16, fp8, int8, int4]}
    workload: {kind: trace, path: ../traces/longctx.jsonl, format: mooncake}
    scheduler: {max_num_batched_tokens: 8192, max_num_seqs: 256}
    latency: {kind: analytic}
    policies: [static-fp16, static-int4, pagedweight]
    slo: {ttft_ms: 2000, tpot_ms: 100}
    seed: 0

Loading is strict: unknown keys, wrong types and impossible values (a budget that cannot hold
the model at its lowest precision, negative rates, a trace file that does not exist) are
rejected with ``file: key.path: what is wrong; what is allowed``. Relative paths inside a
scenario are resolved against the scenario file's directory. Only ``yaml.safe_load`` is used.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from pagedweight.config.latency import AnalyticLatencyConfig, LatencyConfig, RoutingConfig
from pagedweight.config.workload import WorkloadConfig
from pagedweight.core.placement import read_placement
from pagedweight.core.pool import DEFAULT_PAGE_BYTES
from pagedweight.core.runtime import CoreConfig
from pagedweight.core.scheduler import SchedulerConfig
from pagedweight.core.spec import PRECISION_ID, PRECISIONS, ModelSpec, get_precision, ladder, load_gpu, load_model
from pagedweight.errors import (
    ConfigError,
    MissingFileError,
    PagedWeightError,
    ScenarioError,
    format_validation_error,
    read_yaml_mapping,
)
from pagedweight.policy.controller import ControllerSettings
from pagedweight.policy.policies import POLICY_NAMES

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: object) -> int:
    """``123``, ``"2 MiB"``, ``"80GB"``, ``"1.5e9"`` -> bytes. Binary units are powers of 1024."""
    if isinstance(value, bool):
        raise ConfigError("a size in bytes, e.g. 2097152 or '2 MiB'")
    if isinstance(value, int | float):
        out = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"{value!r} is not a size; write e.g. 2097152, '2 MiB' or '80 GB' (units: B, KiB, MiB, GiB, KB, MB, GB)"
            )
        try:
            out = float(m.group(1)) * _UNITS[m.group(2).lower()]
        except ValueError:  # matched the character class but is no number, e.g. "1.2.3"
            raise ConfigError(f"{value!r} is not a size; write e.g. 2097152, '2 MiB' or '80 GB'") from None
    else:
        raise ConfigError("a size in bytes, e.g. 2097152 or '2 MiB'")
    if not math.isfinite(out) or out <= 0:
        raise ConfigError(f"a size must be a finite number > 0 (got {value!r})")
    return int(out)


Bytes = Annotated[int, BeforeValidator(parse_bytes)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MemoryConfig(_Strict):
    """The memory budget shared by weights and KV. Give ``budget`` (bytes or '120 GiB') or
    ``budget_fraction`` (of the GPU's memory), not both."""

    budget: Bytes | None = None
    budget_fraction: float | None = Field(default=None, gt=0, le=1)
    page_bytes: Bytes = DEFAULT_PAGE_BYTES
    kv_block_tokens: int = Field(default=CoreConfig.kv_block_tokens, ge=1)
    # Keep full prompt blocks' KV for later requests with the same prefix (pagedweight.core.prefix):
    # the engine keys blocks by token ids, the simulator by a trace's hash_ids (none: no sharing).
    prefix_caching: bool = CoreConfig.prefix_caching
    precisions: tuple[str, ...] = ("bf16", "fp8", "int8", "int4")
    # paper-greedy's ladder; default (None): the paper's, full precision, INT8 and INT4 (those of
    # ``precisions``). Name others to compare it on a ladder of your own.
    paper_greedy_precisions: tuple[str, ...] | None = None

    @field_validator("precisions", "paper_greedy_precisions")
    @classmethod
    def _known(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is None:
            return None
        if not v:
            raise ConfigError("name at least one precision")
        for name in v:
            if name not in PRECISIONS:
                raise ConfigError(f"unknown precision {name!r}; allowed: {', '.join(PRECISIONS)}")
        return tuple(p.name for p in ladder(list(v)))

    @model_validator(mode="after")
    def _paper_ladder_within(self) -> MemoryConfig:
        extra = [p for p in self.paper_greedy_precisions or () if p not in self.precisions]
        if extra:
            raise ConfigError(
                f"paper_greedy_precisions: {extra} not in precisions; allowed: {', '.join(self.precisions)}"
            )
        return self

    @model_validator(mode="after")
    def _one_budget(self) -> MemoryConfig:
        if (self.budget is None) == (self.budget_fraction is None):
            raise ConfigError("give exactly one of budget (bytes, e.g. '120 GiB') or budget_fraction (0-1 of the GPU)")
        return self


class SchedulerSection(_Strict):
    """Defaults: the scheduler's own (``pagedweight.core.scheduler.SchedulerConfig``)."""

    max_num_batched_tokens: int = Field(default=SchedulerConfig.max_num_batched_tokens, ge=1)
    max_num_seqs: int = Field(default=SchedulerConfig.max_num_seqs, ge=1)
    max_model_len: int | None = Field(default=None, ge=1)  # default: the model's context
    admission: Literal["forecast", "greedy"] = SchedulerConfig.admission
    admission_reserve_tokens: int = Field(default=SchedulerConfig.admission_reserve_tokens, ge=1)


class SyntheticImportance(_Strict):
    """A synthetic importance table (see ``pagedweight.policy.importance``), marked synthetic in outputs."""

    kind: Literal["synthetic"] = "synthetic"
    seed: int = Field(default=0, ge=0)
    zipf_exponent: float = Field(default=0.8, ge=0)  # skew of routing frequencies within a layer


class FileImportance(_Strict):
    kind: Literal["file"]
    path: str

    def resolved_path(self, base_dir: Path) -> Path:
        p = Path(self.path)
        return p if p.is_absolute() else base_dir / p


class MeasuredImportance(_Strict):
    """The default: the table measured for the model if the project ships one
    (``traces/importance/<model>.csv``, made by ``pwgpu importance``), else a synthetic table
    (seed 0), marked so in every output."""

    kind: Literal["measured-or-synthetic"] = "measured-or-synthetic"


# Where measured tables live: beside the package in a checkout (``pip install -e``).
MEASURED_IMPORTANCE_DIR = Path(__file__).resolve().parents[2] / "traces" / "importance"

ImportanceConfig = Annotated[MeasuredImportance | SyntheticImportance | FileImportance, Field(discriminator="kind")]


_CTL = ControllerSettings


class ControllerConfig(_Strict):
    """Knobs of the run-time precision controller (``pagedweight.policy.controller``); the
    defaults are ``ControllerSettings``'s and ``CoreConfig``'s."""

    horizon_steps: int = Field(default=_CTL.horizon_steps, ge=1)  # KV forecast look-ahead
    low_watermark: float = Field(default=_CTL.low_watermark, ge=0, lt=1)  # free pool fraction kept for KV growth
    high_watermark: float = Field(default=_CTL.high_watermark, gt=0, lt=1)  # upgrades only while more is free
    copy_budget_bytes_per_s: Bytes = _CTL.copy_budget_bytes_per_s  # host-to-device bytes/s the upgrades may use
    max_in_flight: Bytes = _CTL.max_in_flight_bytes  # bytes of upgrades in flight at once
    min_dwell_s: float = Field(default=_CTL.min_dwell_s, ge=0)  # an expert keeps a new precision at least this long
    plan_interval_s: float = Field(default=_CTL.plan_interval_s, ge=0)  # at most one (non-emergency) plan per interval
    rescale_interval_s: float = Field(default=_CTL.rescale_interval_s, ge=0)  # routing-drift re-scaling (0: off)
    # Under slo.tpot_ms, upgrades stop where the predicted step is within this fraction of it.
    latency_margin: float = Field(default=_CTL.latency_margin, ge=0, lt=1)
    # Prefix caching under pagedweight: loss units that 1 s of prefix recompute per second is worth,
    # as a multiple of the whole ladder's loss (ControllerSettings.recompute_weight; 0: cached
    # prefixes always give way first, as under every other policy).
    recompute_weight: float = Field(default=_CTL.recompute_weight, ge=0)
    # Serving under the SLOs (pagedweight; ControllerSettings): a backlog (the queue's projected
    # wait past this fraction of slo.ttft_ms) puts the experts at the step's fastest precision
    # until the queue has been calm this long; under slo.tpot_ms each step's prefill tokens and
    # the running batch are capped at the learnt step time (at least min_prefill_tokens a step),
    # and requests past slo.ttft_ms wait behind those that can still meet it (slo_batching).
    backlog_fraction: float = Field(default=_CTL.backlog_fraction, gt=0, le=1)
    backlog_calm_s: float = Field(default=_CTL.backlog_calm_s, ge=0)
    slo_batching: bool = _CTL.slo_batching
    min_prefill_tokens: int = Field(default=_CTL.min_prefill_tokens, ge=1)
    # How long a request past slo.ttft_ms may wait behind on-time ones (null: no cap).
    late_wait_max_s: float | None = Field(default=_CTL.late_wait_max_s, gt=0)
    # KV offload (pagedweight): a preempted request is swapped to host memory rather than
    # recomputed when its copies over PCIe cost less time than its recompute.
    kv_offload: bool = _CTL.kv_offload
    # static-mixed: the fixed weight budget, as a fraction of every expert at the top precision.
    static_mixed_fraction: float = Field(default=CoreConfig.static_mixed_fraction, gt=0, le=1)

    @model_validator(mode="after")
    def _ordered(self) -> ControllerConfig:
        if self.high_watermark <= self.low_watermark:
            raise ConfigError(
                f"high_watermark(={self.high_watermark}) must be > low_watermark(={self.low_watermark}) (hysteresis)"
            )
        return self


class SloConfig(_Strict):
    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    e2el_ms: float | None = Field(default=None, gt=0)


class ParallelConfig(_Strict):
    """Expert parallelism across the GPUs of one replica (``pwsim.parallel``): ``ep`` GPUs, each
    with its own page pool, budget (``memory.budget`` is per GPU) and controller; attention is
    data-parallel (each GPU runs its own requests and KV), routed experts are split across the
    GPUs and tokens cross the interconnect twice per MoE layer (dispatch, combine)."""

    ep: int = Field(default=1, ge=1)
    tp: Literal[1] = 1  # tensor parallelism is not modelled
    # Which experts each GPU holds, per MoE layer: ``contiguous`` (GPU r holds experts
    # r*E/ep .. (r+1)*E/ep - 1) or ``balanced`` (by the importance table's routing frequencies,
    # hottest first onto the GPU with the least traffic so far, E/ep experts each) or ``file``
    # (``placement_file``: a CSV ``layer,expert,gpu``, a row per routed expert; relative to the
    # scenario's folder).
    placement: Literal["contiguous", "balanced", "file"] = "contiguous"
    placement_file: str | None = None
    # Which GPU's attention takes an arriving request.
    request_router: Literal["least-outstanding", "round-robin", "least-kv"] = "least-outstanding"
    # Bytes per hidden value sent in the all-to-all (2: bf16 activations; 1: fp8 dispatch).
    a2a_bytes_per_value: int = Field(default=2, ge=1, le=4)

    @model_validator(mode="after")
    def _placement_file(self) -> ParallelConfig:
        if (self.placement == "file") != (self.placement_file is not None):
            raise ConfigError("placement: file goes with placement_file: PATH, and placement_file with placement: file")
        return self

    def resolved_placement_file(self, base_dir: Path) -> Path | None:
        if self.placement_file is None:
            return None
        p = Path(self.placement_file)
        return p if p.is_absolute() else base_dir / p


class ClusterConfig(_Strict):
    """``replicas`` identical replicas (each one GPU, or ``parallel.ep`` GPUs) behind a request
    router (``pwsim.cluster``). ``round-robin`` does not look at the replicas, so they run
    independently (in parallel worker processes); the others route by the replicas' state at
    each arrival and run together."""

    replicas: int = Field(default=1, ge=1)
    router: Literal["round-robin", "least-outstanding", "least-kv"] = "round-robin"


class Scenario(_Strict):
    name: str = Field(min_length=1)
    description: str = ""
    model: str
    gpu: str
    memory: MemoryConfig
    workload: WorkloadConfig
    scheduler: SchedulerSection = SchedulerSection()
    latency: LatencyConfig = AnalyticLatencyConfig()
    routing: RoutingConfig = RoutingConfig()
    importance: ImportanceConfig = MeasuredImportance()
    controller: ControllerConfig = ControllerConfig()
    policies: tuple[str, ...] = POLICY_NAMES
    slo: SloConfig = SloConfig()
    parallel: ParallelConfig = ParallelConfig()
    cluster: ClusterConfig = ClusterConfig()
    seed: int = Field(default=0, ge=0)

    @field_validator("policies")
    @classmethod
    def _known_policies(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ConfigError(f"name at least one policy; allowed: {', '.join(POLICY_NAMES)}")
        for name in v:
            if name not in POLICY_NAMES:
                raise ConfigError(f"unknown policy {name!r}; allowed: {', '.join(POLICY_NAMES)}")
        if len(set(v)) != len(v):
            raise ConfigError("a policy is listed twice")
        return v


class LoadedScenario:
    """A validated scenario with everything it refers to resolved."""

    def __init__(self, scenario: Scenario, source: Path, model: ModelSpec, gpu):
        self.scenario = scenario
        self.source = source
        self.base_dir = source.parent
        self.model = model
        self.gpu = gpu

    @property
    def budget_bytes(self) -> int:
        mem = self.scenario.memory
        return mem.budget if mem.budget is not None else int(mem.budget_fraction * self.gpu.hbm_bytes)

    @property
    def max_model_len(self) -> int:
        return self.scenario.scheduler.max_model_len or self.model.max_context_tokens

    @property
    def gpu_model(self) -> ModelSpec:
        """What one GPU holds: the model, or under expert parallelism one rank's share of it
        (``rank_model``)."""
        ep = self.scenario.parallel.ep
        return self.model if ep == 1 else rank_model(self.model, ep)

    def min_budget_bytes(self) -> int:
        """Pages for pinned weights, every expert at the lowest precision, and one KV page (on
        each GPU under expert parallelism)."""
        return _min_budget(self.gpu_model, self.scenario.memory)


def rank_model(model: ModelSpec, ep: int) -> ModelSpec:
    """One expert-parallel rank's share of ``model``: ``num_experts / ep`` routed experts per
    layer, every pinned weight replicated (routers keep all their rows). ``top_k`` stays the
    model's (what a token picks); the copy skips validation, since ``top_k`` may exceed the
    rank's experts."""
    if model.num_experts % ep:
        raise ConfigError(f"{model.name} has {model.num_experts} experts per layer, not divisible by ep={ep}")
    per_rank = model.num_experts // ep
    router_rows = model.num_moe_layers * (model.num_experts - per_rank) * model.hidden_size
    return model.model_copy(
        update={
            "name": f"{model.name}/ep{ep}",
            "num_experts": per_rank,
            "extra_pinned_params": model.extra_pinned_params + router_rows,
        }
    )


def _min_budget(model: ModelSpec, mem: MemoryConfig) -> int:
    from pagedweight.core.pagetable import expert_pages_by_id  # the page table's own count

    lowest = PRECISION_ID[get_precision(mem.precisions[-1]).name]
    expert_pages = int(expert_pages_by_id(model, mem.page_bytes)[lowest])
    pinned_pages = -(-model.pinned_bytes() // mem.page_bytes)
    return (pinned_pages + model.num_experts_total * expert_pages + 1) * mem.page_bytes


def apply_overrides(raw: dict, overrides: list[str], source: str) -> dict:
    """``--set key.path=value`` (value parsed as YAML) applied to the raw mapping."""
    for item in overrides:
        if "=" not in item:
            raise ScenarioError(f"--set {item!r}: expected key.path=value")
        path, value = item.split("=", 1)
        keys = path.strip().split(".")
        node = raw
        for k in keys[:-1]:
            if not isinstance(node.get(k, {}), dict):
                raise ScenarioError(f"{source}: --set {path}: {k} is not a mapping")
            node = node.setdefault(k, {})
        try:
            node[keys[-1]] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ScenarioError(f"{source}: --set {item!r}: the value is not valid YAML ({e})") from None
    return raw


def load_scenario(
    path: str | Path, overrides: list[str] | None = None, require_latency_table: bool = True
) -> LoadedScenario:
    """``require_latency_table=False`` for readers that do not time by the table: the profiler
    that measures it, and the real engine."""
    path = Path(path)
    src = str(path)
    if not path.is_file():
        raise ScenarioError(f"scenario file {src} does not exist")
    raw = read_yaml_mapping(path, ScenarioError, list(Scenario.model_fields))
    raw = apply_overrides(raw, overrides or [], src)
    try:
        scenario = Scenario.model_validate(raw)
    except ValidationError as e:
        raise ScenarioError(format_validation_error(e, src, Scenario, raw)) from None
    return check(scenario, path, require_latency_table)


def check(scenario: Scenario, source: Path, require_latency_table: bool = True) -> LoadedScenario:
    """What a schema cannot see: names that must exist, files that must be there, and a
    budget that must hold the model."""
    src = str(source)
    base = source.parent

    def fail(key: str, msg: str) -> ScenarioError:
        return ScenarioError(f"{src}: {key}: {msg}")

    try:
        model = load_model(
            scenario.model if not scenario.model.endswith((".yaml", ".yml")) else str(base / scenario.model)
        )
    except PagedWeightError as e:
        raise fail("model", str(e)) from None
    try:
        gpu = load_gpu(scenario.gpu if not scenario.gpu.endswith((".yaml", ".yml")) else str(base / scenario.gpu))
    except PagedWeightError as e:
        raise fail("gpu", str(e)) from None
    loaded = LoadedScenario(scenario, source, model, gpu)
    mem = scenario.memory
    gib = 2**30
    ep = scenario.parallel.ep
    if model.num_experts % ep:
        divisors = [d for d in range(1, model.num_experts + 1) if model.num_experts % d == 0]
        raise fail(
            "parallel.ep",
            f"{model.name} has {model.num_experts} experts per layer, not divisible by {ep}; "
            f"allowed: {', '.join(map(str, divisors))}",
        )
    placement_file = scenario.parallel.resolved_placement_file(base)
    if placement_file is not None:
        try:
            read_placement(placement_file, ep, model.num_moe_layers, model.num_experts)
        except PagedWeightError as e:
            raise fail("parallel.placement_file", str(e)) from None
    if loaded.budget_bytes > gpu.hbm_bytes:
        raise fail(
            "memory.budget", f"{loaded.budget_bytes / gib:.1f} GiB exceeds {gpu.name}'s {gpu.hbm_bytes / gib:.1f} GiB"
        )
    need = loaded.min_budget_bytes()
    if loaded.budget_bytes < need:
        raise fail(
            "memory.budget",
            f"{loaded.budget_bytes / gib:.2f} GiB cannot hold {loaded.gpu_model.name} even with every expert at "
            f"{mem.precisions[-1]} (pinned {loaded.gpu_model.pinned_bytes() / gib:.2f} GiB + experts + one KV page "
            f"= {need / gib:.2f} GiB); allowed: >= {need / gib:.2f} GiB, or add a lower precision",
        )
    block_bytes = mem.kv_block_tokens * model.kv_bytes_per_token()
    if block_bytes > mem.page_bytes:
        fits = max(1, mem.page_bytes // model.kv_bytes_per_token())
        raise fail(
            "memory.kv_block_tokens",
            f"{mem.kv_block_tokens} tokens x {model.kv_bytes_per_token()} B/token = {block_bytes} B exceeds "
            f"page_bytes {mem.page_bytes}; allowed: <= {fits} tokens, or larger pages",
        )
    if loaded.max_model_len > model.max_context_tokens:
        raise fail(
            "scheduler.max_model_len",
            f"{loaded.max_model_len} exceeds {model.name}'s context of {model.max_context_tokens} tokens",
        )
    files = []
    if scenario.workload.kind == "trace":
        files.append(("workload.path", scenario.workload.resolved_path(base)))
    lengths = getattr(scenario.workload, "lengths", None)
    if lengths is not None and getattr(lengths, "kind", None) == "file":
        files.append(("workload.lengths.path", lengths.resolved_path(base)))
    if scenario.latency.kind == "table" and require_latency_table:
        files.append(("latency.path", scenario.latency.resolved_path(base)))
    if scenario.importance.kind == "file":
        files.append(("importance.path", scenario.importance.resolved_path(base)))
    for key, p in files:
        if not p.is_file():
            raise MissingFileError(
                f"{src}: {key}: file {p} does not exist (relative paths are resolved against {base})"
            )
    return loaded


def importance_path(loaded: LoadedScenario) -> Path | None:
    """The importance table file a scenario uses, or None for a synthetic table. Both runtimes
    call this, so the engine and the simulator plan with the same table."""
    cfg = loaded.scenario.importance
    if cfg.kind == "file":
        return cfg.resolved_path(loaded.base_dir)
    if cfg.kind == "measured-or-synthetic":
        measured = MEASURED_IMPORTANCE_DIR / f"{loaded.model.name}.csv"
        return measured if measured.is_file() else None
    return None


def importance_table(loaded: LoadedScenario):
    """The scenario's importance table, restricted to its precision ladder. A file table must
    describe the scenario's model and cover every precision of the ladder."""
    from pagedweight.policy.importance import ImportanceError, on_ladder, read_table, synthetic_table

    sc = loaded.scenario
    ladder_names = sc.memory.precisions
    cfg = sc.importance
    path = importance_path(loaded)
    if path is None:
        seed, zipf = (cfg.seed, cfg.zipf_exponent) if cfg.kind == "synthetic" else (0, 0.8)
        return synthetic_table(loaded.model, ladder_names, seed, zipf_exponent=zipf)
    table = read_table(path)
    where = f"{loaded.source}: importance.path ({path})"
    if (table.num_layers, table.num_experts) != (loaded.model.num_moe_layers, loaded.model.num_experts):
        raise ScenarioError(
            f"{where}: table has {table.num_layers} layers x {table.num_experts} experts; "
            f"{loaded.model.name} has {loaded.model.num_moe_layers} x {loaded.model.num_experts}"
        )
    try:
        return on_ladder(table, ladder_names, where)
    except ImportanceError as e:
        raise ScenarioError(str(e)) from None
