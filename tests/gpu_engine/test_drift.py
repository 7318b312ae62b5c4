"""Routing drift on the real engine: the router's per-expert token counts of every step reach the
controller (``RuntimeCore.observe_routing``), whose tracker re-scales the losses, so that serving
one domain's text and then another's moves precision to the experts the new text uses.

The trained tiny model routes code and prose differently (data/calib/). The importance table
here gives every expert the same losses and the same offline routing frequency, so that only the
observed routing can order the experts; a fixed-step clock makes the run reproducible."""

from pathlib import Path

import numpy as np
import pytest

from pagedweight.core.runtime import CoreConfig
from pagedweight.core.spec import PRECISION_NAMES, PRECISIONS
from pagedweight.policy.controller import ControllerSettings
from pagedweight.policy.importance import synthetic_table
from pwgpu.engine import Engine, EngineConfig, FixedStepClock
from pwgpu.sampling import SamplingParams
from pwgpu.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "tiny-moe"
PROMPTS, PROMPT_TOKENS = 8, 256  # per phase: 4,096 routed assignments per layer (top-2)
LADDER = ("bf16", "int8", "int4")


def flat_table(spec):
    """Every expert alike: equal losses per precision, uniform offline routing."""
    t = synthetic_table(spec, LADDER)
    n = t.num_rows
    per_level = np.array([0.0, 1e-3, 1e-2])
    uniform = np.full(n, spec.top_k / spec.num_experts)
    return t.replace(
        routing_freq=uniform,
        routing_weight_mass=uniform.copy(),
        importance=np.ones(n),
        dloss=np.tile(per_level, (n, 1)),
        source="flat: equal losses, uniform routing",
    )


def shares(counts, num_layers):
    """Tokens per expert as a fraction of their layer's, flat."""
    per_layer = counts.reshape(num_layers, -1)
    return (per_layer / per_layer.sum(axis=1, keepdims=True)).reshape(-1)


def bits(precision_ids):
    return np.array([PRECISIONS[PRECISION_NAMES[i]].weight_bits for i in precision_ids], dtype=float)


def serve_phase(eng, ids, routing):
    """Serve PROMPTS prompts cut from ``ids``; return the phase's tokens per expert, flat."""
    start = len(routing)
    for i in range(PROMPTS):
        eng.add(ids[i * PROMPT_TOKENS : (i + 1) * PROMPT_TOKENS], SamplingParams(max_tokens=2, temperature=0.0))
    eng.run()
    for _ in range(50):  # load gone: let the controller finish moving precision
        before = eng.core.page_table.precision_ids.copy()
        eng.idle_tick()
        if np.array_equal(before, eng.core.page_table.precision_ids) and not eng.core.page_table.in_flight:
            break
    return np.sum(routing[start:], axis=0).reshape(-1)


@pytest.mark.skipif(not (MODEL / "model.safetensors").is_file(), reason="needs models/tiny-moe")
def test_serving_new_text_moves_precision_to_the_experts_it_uses():
    tok = Tokenizer(MODEL)
    code = tok.encode((ROOT / "data" / "calib" / "code.txt").read_text())
    prose = tok.encode((ROOT / "data" / "calib" / "shakespeare.txt").read_text())
    probe = Engine(MODEL, EngineConfig(CoreConfig(budget_bytes=256 << 20), "static-fp16", dtype="float32"))
    spec, page_bytes = probe.spec, probe.page_bytes
    pinned_pages, bf16_pages = probe.core.pool.usage()["pinned"], probe.core.pool.usage()["weight:bf16"]
    del probe
    # Room for 40% of the experts' bf16 bytes beside a phase's KV: precision must be shared out.
    kv_pages = -(-PROMPTS * (PROMPT_TOKENS + 2) * spec.kv_bytes_per_token() // page_bytes) + PROMPTS
    budget_pages = pinned_pages + int(0.4 * bf16_pages) + kv_pages
    ctl = ControllerSettings(
        min_dwell_s=0.0, plan_interval_s=0.0, rescale_interval_s=0.01, copy_budget_bytes_per_s=1e15
    )
    cfg = EngineConfig(
        CoreConfig(budget_bytes=budget_pages * page_bytes, controller=ctl), "pagedweight", dtype="float32"
    )
    eng = Engine(MODEL, cfg, table=flat_table(spec), clock=FixedStepClock(0.02))
    routing = []
    eng.core.on_step = lambda step: routing.append(step.routing)

    code_counts = serve_phase(eng, code, routing)
    after_code = eng.core.page_table.precision_ids.copy()
    prose_counts = serve_phase(eng, prose, routing)
    after_prose = eng.core.page_table.precision_ids.copy()

    layers = spec.num_moe_layers
    code_share = (code_counts.reshape(layers, -1) / code_counts.reshape(layers, -1).sum(1, keepdims=True)).reshape(-1)
    prose_share = (prose_counts.reshape(layers, -1) / prose_counts.reshape(layers, -1).sum(1, keepdims=True)).reshape(
        -1
    )
    up = np.flatnonzero(bits(after_prose) > bits(after_code))
    down = np.flatnonzero(bits(after_prose) < bits(after_code))
    assert len(up) and len(down), "serving prose after code moved no precision"
    # The experts that gained bits serve prose more (relative to code) than those that lost bits.
    gain = prose_share - code_share
    assert gain[up].mean() > gain[down].mean(), (gain[up], gain[down])
    # Bits per routed token of prose went up.
    assert prose_share @ bits(after_prose) > prose_share @ bits(after_code)
