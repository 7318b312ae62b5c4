"""The engine's ``kv-swap`` policy: a request preempted by swap has its KV copied to host memory
and back into its new blocks when it resumes, so it generates exactly what it would have
generated without preemption (GQA's K and V, and MLA's latent cache alike)."""

import numpy as np
import pytest

from pagedweight.core.pool import OWNER_KV
from pagedweight.core.runtime import CoreConfig
from pagedweight.core.scheduler import FINISHED, SchedulerConfig
from pagedweight.policy.controller import ControllerSettings
from pwgpu.engine import Engine, EngineConfig
from pwgpu.sampling import SamplingParams

PAGE_BYTES = 1 << 14
# Greedy admission: a long prompt is admitted as soon as its first chunk fits, and the running
# decodes then outgrow the KV left, which preempts (newest first) again and again.
GREEDY_ADMISSION = SchedulerConfig(admission="greedy")


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def engine(path, policy, kv_pages=None, sched=GREEDY_ADMISSION, controller=None, **engine_cfg):
    """An engine on ``path`` whose pool holds the pinned weights and full-precision experts and
    ``kv_pages`` pages more (None: room to spare)."""
    budget = 64 << 20
    if kv_pages is not None:
        probe = Engine(path, EngineConfig(CoreConfig(budget_bytes=budget, page_bytes=PAGE_BYTES), "static-fp16"))
        usage = probe.core.pool.usage()
        del probe
        budget = (usage["pinned"] + usage["weight:bf16"] + kv_pages) * PAGE_BYTES
    controller = controller or ControllerSettings()
    core = CoreConfig(budget_bytes=budget, page_bytes=PAGE_BYTES, scheduler=sched, controller=controller)
    return Engine(path, EngineConfig(core, policy=policy, **engine_cfg))


def prompts(vocab: int, n: int = 5, length: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(2, vocab, length + 7 * i).tolist() for i in range(n)]


def run(eng, ps, max_tokens=40, check=False):
    ers = [eng.add(p, greedy(max_tokens)) for p in ps]
    while eng.has_work():
        eng.step()
        if check:
            eng.core.kv.check()
            eng.core.pool.check()
    assert all(er.req.state is FINISHED and len(er.output_ids) == max_tokens for er in ers)
    return ers


@pytest.mark.parametrize("family", ("mixtral", "deepseek_v2"))
def test_swapped_requests_generate_what_they_would_without_preemption(checkpoints, family):
    """Five requests in 8 KV pages, where they want 20: requests are preempted by swap and
    resume with their KV copied back; every one generates the tokens it generates with room to
    spare. Each step's ``bytes_swapped`` is its swapped tokens' KV, as the simulator counts it."""
    path, _ = checkpoints[family]
    ps = prompts(96)
    want = [er.output_ids for er in run(engine(path, "static-fp16"), ps)]
    eng = engine(path, "kv-swap", kv_pages=8)
    batches = []
    eng.core.on_step = lambda step: batches.append((step.batch.swapped_out_tokens, step.batch.swapped_in_tokens))
    ers = run(eng, ps, check=True)
    assert sum(er.req.num_preemptions for er in ers) > 0, "the run must preempt"
    for i, (er, tokens) in enumerate(zip(ers, want, strict=True)):
        assert er.output_ids == tokens, f"request {i} (preempted {er.req.num_preemptions}x) generated other tokens"
    assert not eng._swapped
    assert eng.kv_cache.token_bytes == eng.spec.kv_bytes_per_token()
    swapped = eng.core.steps.columns()["bytes_swapped"]
    assert list(swapped) == [(o + i) * eng.kv_cache.token_bytes for o, i in batches]
    assert swapped.sum() > 0 and eng.swap_in_bytes == sum(i for _, i in batches) * eng.kv_cache.token_bytes


def test_abort_while_swapped_out_drops_its_host_copy(checkpoints):
    """A request aborted while its KV is on the host: the copy goes with it, nothing leaks, and
    the others still generate their tokens."""
    path, _ = checkpoints["mixtral"]
    ps = prompts(96)
    want = [er.output_ids for er in run(engine(path, "static-fp16"), ps)]
    eng = engine(path, "kv-swap", kv_pages=8)
    ers = [eng.add(p, greedy(40)) for p in ps]
    victim = None
    while victim is None and eng.has_work():
        eng.step()
        victim = next((er for er in ers if er.req.request_id in eng._swapped), None)
    assert victim is not None and victim.req.swapped_tokens > 0, "no request was swapped out"
    eng.cancel(victim)
    while eng.has_work():
        eng.step()
        eng.core.kv.check()
    assert victim.finish_reason == "abort" and not eng._swapped
    assert eng.core.pool.num_owned(OWNER_KV) == 0 and eng.core.kv.num_used_blocks == 0
    for er, tokens in zip(ers, want, strict=True):
        if er is not victim:
            assert er.req.state is FINISHED and er.output_ids == tokens


@pytest.mark.parametrize("h2d", [None, 1.0], ids=["device-spec", "copies-too-slow"])
def test_pagedweight_offloads_kv_when_copies_are_cheaper(checkpoints, h2d):
    """pagedweight with kv_offload under the same pressure (the tiny model's experts take a page
    whatever their precision, so downgrades free nothing and it must preempt): at the CPU
    spec's copy bandwidth (10 GB/s) its victims' copies cost less than their recompute and it
    swaps; at 1 B/s it recomputes. Either way the tokens are those without preemption."""
    path, _ = checkpoints["mixtral"]
    ps = prompts(96, n=6, length=60)
    want = [er.output_ids for er in run(engine(path, "static-fp16"), ps)]
    offload = ControllerSettings(kv_offload=True)
    # 3 pages more: the headroom a dynamic policy keeps for one downgrade's new pages.
    eng = engine(path, "pagedweight", kv_pages=13, controller=offload, h2d_bandwidth_bytes_per_s=h2d)
    assert eng.core.scheduler.config.preemption_mode == "cost"
    ers = run(eng, ps, check=True)
    assert sum(er.req.num_preemptions for er in ers) > 0, "the run must preempt"
    assert [er.output_ids for er in ers] == want
    swapped = int(eng.core.steps.columns()["bytes_swapped"].sum())
    assert (swapped > 0) == (h2d is None) and not eng._swapped
