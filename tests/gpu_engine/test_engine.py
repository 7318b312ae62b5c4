"""The engine loop on CPU: generation parity, sampling, aborts, memory pressure and results."""

import json

import numpy as np
import pandas as pd
import pytest
import torch

from pagedweight.core.pool import OWNER_KV
from pagedweight.core.runtime import CoreConfig
from pagedweight.core.scheduler import FINISHED, REJECTED
from pagedweight.core.spec import PRECISION_ID
from pagedweight.policy.controller import DOWNGRADE, UPGRADE, Change, ControllerSettings
from pwgpu.attention import build_batch
from pwgpu.default_model import write_random_mixtral
from pwgpu.engine import Engine, EngineConfig
from pwgpu.sampling import SamplingParams

PAGE_BYTES = 1 << 15


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_random_mixtral(tmp_path_factory.mktemp("tiny"), seed=0)


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.parametrize("family", ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"))
def test_engine_greedy_matches_transformers(checkpoints, family):
    """Two requests batched together (different lengths, so prefill and decode share steps)
    through paged experts and the paged KV cache give transformers' greedy tokens."""
    path, hf = checkpoints[family]
    eng = Engine(path, EngineConfig(CoreConfig(budget_bytes=8 << 20, page_bytes=1 << 14), policy="static-fp16"))
    prompts = [[5, 17, 42, 9, 33, 71, 2, 60], [7, 3, 88, 19, 64, 21, 50, 11, 45, 8, 30, 1, 2]]
    ers = [eng.add(p, greedy(32)) for p in prompts]
    eng.run()
    for p, er in zip(prompts, ers, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert er.output_ids == ref[0, len(p) :].tolist()


def test_sampling_seed_and_stop(tiny):
    eng = Engine(tiny, EngineConfig(CoreConfig(budget_bytes=16 << 20, page_bytes=PAGE_BYTES), policy="static-int8"))
    prompt = list(range(40, 60))
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, seed=123, ignore_eos=True)
    a, b, c = eng.add(prompt, p), eng.add(prompt, p), eng.add(prompt, SamplingParams(max_tokens=12, seed=7))
    eng.run()
    assert a.output_ids == b.output_ids and len(a.output_ids) == 12
    assert c.output_ids != a.output_ids
    stop = a.output_ids[3]
    d = eng.add(prompt, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, seed=123, stop_token_ids=(stop,)))
    eng.run()
    assert d.output_ids == a.output_ids[: a.output_ids.index(stop) + 1] and d.finish_reason == "stop"
    assert d.req.state == FINISHED


def test_abort_frees_kv_and_rejects_impossible(tiny):
    eng = Engine(tiny, EngineConfig(CoreConfig(budget_bytes=16 << 20, page_bytes=PAGE_BYTES), policy="static-fp16"))
    er = eng.add(list(range(100)), greedy(200))
    for _ in range(3):
        eng.step()
    assert eng.core.pool.num_owned(OWNER_KV) > 0
    eng.cancel(er)
    eng.step()
    assert eng.core.pool.num_owned(OWNER_KV) == 0 and er.finish_reason == "abort"
    huge = eng.add(list(range(50)), greedy(10**6))
    assert huge.req.state == REJECTED and "context limit" in huge.req.reject_reason


def test_cpu_engine_makes_every_experts_copy_when_built(tiny, monkeypatch):
    """The CPU path's dense copies exist before the first request: its step dequantises nothing
    (the simulator charges a run's first step no copies either), and the copies are the ones a
    first use would have made."""
    from pwgpu.cpu_kernels import dense_expert
    from pwgpu.kernels.paging import PagedExperts

    eng = Engine(tiny, EngineConfig(CoreConfig(budget_bytes=16 << 20, page_bytes=PAGE_BYTES), policy="static-int8"))
    store, pt = eng.store, eng.core.page_table
    for layer, experts in enumerate(store.layers):
        for e, (pages, w13, w2) in enumerate(store._dense[layer]):
            assert pages is pt.pages[layer * store.num_experts + e]
            ref13, ref2 = dense_expert(experts, e, eng.dtype)
            assert torch.equal(w13, ref13) and torch.equal(w2, ref2)
    calls = []
    monkeypatch.setattr(PagedExperts, "dequantize_matrix", lambda *a, **k: calls.append(a))
    er = eng.add(list(range(30)), greedy(4))
    eng.run()
    assert len(er.output_ids) == 4 and not calls


@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_memory_pressure_downgrades_then_restores(tiny, tmp_path, device):
    """KV demand beyond what fits beside bf16 experts: the controller downgrades experts, the
    freed pages become KV pages, nothing is preempted or rejected, and once the load is gone
    the experts go back to bf16. On a GPU the device memory stays that of the arena throughout."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    probe = Engine(
        tiny,
        EngineConfig(CoreConfig(budget_bytes=64 << 20, page_bytes=PAGE_BYTES), policy="static-fp16", device=device),
    )
    usage = probe.core.pool.usage()
    del probe
    num_pages = usage["pinned"] + usage["weight:bf16"] + 40
    ctl = ControllerSettings(horizon_steps=4, min_dwell_s=0.0, plan_interval_s=0.0, copy_budget_bytes_per_s=1e12)
    core = CoreConfig(budget_bytes=num_pages * PAGE_BYTES, page_bytes=PAGE_BYTES, controller=ctl)
    cfg = EngineConfig(core, policy="pagedweight", device=device)
    eng = Engine(tiny, cfg)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        arena_bytes = torch.cuda.memory_allocated()
    pool, bf16 = eng.core.pool, PRECISION_ID["bf16"]
    assert (eng.core.page_table.precision_ids == bf16).all()
    # 6 requests x (64 + 64) tokens = 48 KV pages (16 tokens a page); beside bf16 experts 40 fit.
    rng = np.random.default_rng(0)
    ers = [eng.add(rng.integers(0, 256, 64).tolist(), greedy(64)) for _ in range(6)]
    max_kv_pages = 0
    while eng.has_work():
        eng.step()
        pool.check()
        eng.core.page_table.check()
        eng.core.kv.check()
        max_kv_pages = max(max_kv_pages, pool.num_owned(OWNER_KV))
    assert all(er.req.state == FINISHED and len(er.output_ids) == 64 for er in ers)
    assert sum(er.req.num_preemptions for er in ers) == 0
    assert max_kv_pages > 40, "KV never grew past the room bf16 experts leave"
    if device == "cuda":  # KV took pages inside the arena; beyond it only per-step temporaries
        assert torch.cuda.max_memory_allocated() < arena_bytes + (64 << 20)
    steps = eng.core.steps.columns()
    assert steps["num_downgrades"].sum() > 0 and steps["weight_pages_int4"].max() > 0
    # Every page is accounted for at every step.
    owned = steps["kv_pages"] + steps["kv_cached_pages"] + steps["pinned_pages"] + steps["transition_pages"]
    owned = owned + steps["free_pages"]
    owned = owned + sum(steps[c] for c in steps if c.startswith("weight_pages_"))
    assert (owned == pool.num_pages).all()
    # Load gone: precision comes back.
    for _ in range(200):
        eng.idle_tick()
        if (eng.core.page_table.precision_ids == bf16).all():
            break
    assert (eng.core.page_table.precision_ids == bf16).all()
    assert any(t.kind is UPGRADE for t in eng.core.transitions)
    meta = eng.write_results(tmp_path / "run")
    assert meta["runtime"] == "pwgpu" and meta["policies"]["pagedweight"]["completed"] == 6
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["runtime"] == "pwgpu"
    assert len(pd.read_csv(tmp_path / "run" / "requests.csv")) == 6
    assert (pd.read_csv(tmp_path / "run" / "transitions.csv")["kind"] == "downgrade").any()


def test_downgraded_expert_is_read_from_its_new_pages(tiny):
    """After a downgrade the forward pass uses the int4 bytes now in the pages: the logits move
    away from bf16 and equal those of an engine that started at int4."""
    core = CoreConfig(budget_bytes=16 << 20, page_bytes=PAGE_BYTES)
    a = Engine(tiny, EngineConfig(core, policy="static-fp16"))
    b = Engine(tiny, EngineConfig(core, policy="static-int4"))
    prompt = list(range(10, 40))
    before = _last_logits(a, prompt)
    a.core.apply([Change(DOWNGRADE, i, PRECISION_ID["int4"]) for i in range(a.core.page_table.num_experts)])
    after = _last_logits(a, prompt)
    assert not torch.allclose(before, after, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(after, _last_logits(b, prompt))


@pytest.mark.parametrize("family", ("mixtral", "qwen2_moe"))
def test_triton_moe_through_the_arena_matches_reference(checkpoints, family):
    """The fused Triton MoE kernel (interpreter on CPU) reads the engine's arena and page tables:
    experts at mixed precisions, pages scattered, give the reference path's logits."""
    path, _ = checkpoints[family]
    core = CoreConfig(budget_bytes=8 << 20, page_bytes=1 << 12)
    engines = [
        Engine(path, EngineConfig(core, "static-fp16", dtype="bfloat16", moe_kernel=k)) for k in ("reference", "triton")
    ]
    mix = [PRECISION_ID[p] for p in ("int4", "int8", "fp8", "int4")]  # every 5th expert stays bf16
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    logits = []
    for eng in engines:
        n = eng.core.page_table.num_experts
        eng.core.apply([Change(DOWNGRADE, i, mix[i % 5]) for i in range(n) if i % 5 < 4])
        logits.append(_last_logits(eng, prompt))
    torch.testing.assert_close(logits[1], logits[0], rtol=2e-2, atol=2e-2)


def _last_logits(eng, prompt):
    eng.store.refresh()
    blocks = eng.core.kv.allocate(-(-len(prompt) // eng.core.kv.block_tokens))
    hidden = eng.model.forward(*_one_pass(eng, prompt, blocks))
    eng.core.kv.free(blocks)
    return eng.model.logits(hidden[-1:])


def _one_pass(eng, prompt, blocks):
    batch, pos = build_batch([(blocks, 0, len(prompt))], eng.core.kv.block_tokens, eng.device)
    return torch.tensor(prompt), pos, batch, eng.kv_cache


def test_offline_run_writes_one_directory_for_all_policies(tiny, tmp_path):
    from pwgpu.cli import main

    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,30,6\n0.05,40,4\n0.3,20,5\n")
    out = tmp_path / "run"
    args = ["run", "--model", str(tiny), "--trace", str(trace), "--mem-budget", "9MiB", "--out", str(out)]
    assert main([*args, "--policies", "static-fp16,static-int4,pagedweight"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runtime"] == "pwgpu" and set(summary["policies"]) == {"static-fp16", "static-int4", "pagedweight"}
    for s in summary["policies"].values():
        assert s["completed"] == 3 and s["total_output_tokens"] == 15
    steps = pd.read_csv(out / "steps.csv")
    assert (steps[steps["policy"] == "static-int4"]["weight_pages_bf16"] == 0).all()
    assert (out / "report.html").is_file()


def test_default_model_resolution(tmp_path, monkeypatch):
    """$PWGPU_DEFAULT_MODEL wins; else the checkout's trained model; else a random checkpoint
    created once in the cache, with a tokenizer that round-trips any text."""
    from pwgpu import default_model
    from pwgpu.tokenizer import Tokenizer

    monkeypatch.setenv("PAGEDWEIGHT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PWGPU_DEFAULT_MODEL", str(tmp_path / "mine"))
    assert default_model.default_model_dir() == tmp_path / "mine"
    monkeypatch.delenv("PWGPU_DEFAULT_MODEL")
    monkeypatch.setattr(default_model, "TRAINED_DIR", tmp_path / "no-such-model")
    d = default_model.default_model_dir()
    assert d == tmp_path / "cache" / default_model.NAME and (d / "model.safetensors").is_file()
    assert default_model.default_model_dir() == d
    tok = Tokenizer(d)
    assert tok.decode(tok.encode("héllo, wörld\n")) == "héllo, wörld\n"
    monkeypatch.setattr(default_model, "TRAINED_DIR", d)
    monkeypatch.setenv("PAGEDWEIGHT_CACHE", str(tmp_path / "other"))
    assert default_model.default_model_dir() == d


def test_a_table_on_its_own_ladder_starts_at_the_checkpoint_format(tiny):
    """paper-greedy's FP16/INT8/INT4 (the table of a scenario with that ladder): a 16-bit top is
    the master's 16-bit format and the rest are its quantisations; another top is refused."""
    from pagedweight.errors import ConfigError
    from pagedweight.policy.importance import on_ladder

    core = CoreConfig(budget_bytes=16 << 20, page_bytes=PAGE_BYTES)
    full = Engine(tiny, EngineConfig(core, policy="static-fp16")).table
    paper = Engine(tiny, EngineConfig(core, policy="paper-greedy"), on_ladder(full, ("bf16", "int8", "int4")))
    assert paper.table.ladder == ("bf16", "int8", "int4")
    with pytest.raises(ConfigError, match="must be the ladder's top"):
        Engine(tiny, EngineConfig(core, policy="paper-greedy"), on_ladder(full, ("int8", "int4")))


def test_on_logits_sees_what_each_request_samples_from(tiny):
    eng = Engine(tiny, EngineConfig(CoreConfig(budget_bytes=16 << 20, page_bytes=PAGE_BYTES), policy="static-int8"))
    seen: dict[int, list[torch.Tensor]] = {}
    eng.on_logits = lambda ers, logits: [
        seen.setdefault(er.req.request_id, []).append(row) for er, row in zip(ers, logits, strict=True)
    ]
    a = eng.add(list(range(5, 25)), greedy(4))
    b = eng.add(list(range(30, 37)), greedy(3))
    eng.run()
    for er in (a, b):
        rows = seen[er.req.request_id]
        assert [int(r.argmax()) for r in rows] == er.output_ids  # greedy: the argmax of what was seen


def test_engine_gives_pagedweight_a_step_time_model(tiny):
    """Under a TPOT SLO the engine's pagedweight prices precision in step time as the
    simulator's does: from each step's routed experts and the device's memory bandwidth. An SLO
    far below any step makes it downgrade the experts in use with no KV pressure at all."""
    # A plan every step: on a fast machine the whole run can take less than one plan interval.
    settings = ControllerSettings(tpot_slo_s=1e-6, min_dwell_s=0.0, plan_interval_s=0.0)
    core = CoreConfig(budget_bytes=64 << 20, page_bytes=PAGE_BYTES, controller=settings)
    eng = Engine(tiny, EngineConfig(core, policy="pagedweight", memory_bandwidth_bytes_per_s=1e6))
    model = eng.core.controller.step_time_s
    assert model is not None and model(eng.core.page_table.precision_ids) == 0.0  # no step yet
    eng.add([1, 2, 3, 4, 5], greedy(24))
    while eng.has_work():
        eng.step()
    assert model(eng.core.page_table.precision_ids) > 0
    assert any(t.kind is DOWNGRADE for t in eng.core.transitions)
    assert eng.core.kv.num_used_blocks == 0


def test_decode_groups_leave_the_engines_tokens_unchanged(tiny, monkeypatch):
    """Prompts of very different lengths decoding together. The compiled CPU decode reads each
    context in place; the PyTorch way (a platform without numba, an fp16 cache) attends over
    them in groups of similar context length (``AttentionBatch.decode_groups``). Every request's
    greedy tokens are the same all three ways: compiled, in groups, and in one group padded to
    the longest."""
    from pagedweight.compiled import available
    from pwgpu import attention, cpu_decode, cpu_kernels

    prompts = [list(range(3, 3 + n)) for n in (150, 4, 90, 9, 40)]

    def tokens(compiled: bool):
        eng = Engine(tiny, EngineConfig(CoreConfig(budget_bytes=16 << 20, page_bytes=PAGE_BYTES), policy="static-fp16"))
        assert eng.kv_cache.compiled_decode is compiled  # the way this run is meant to take
        ers = [eng.add(p, greedy(12)) for p in prompts]
        eng.run()
        return [er.output_ids for er in ers]

    compiled = tokens(available())
    monkeypatch.setattr(cpu_decode, "supports", lambda kv: False)
    seen = []
    real = cpu_kernels.decode_groups
    monkeypatch.setattr(attention, "decode_groups", lambda blocks: seen.append(real(blocks)) or seen[-1])
    grouped = tokens(False)
    assert max(map(len, seen)) >= 2  # the long and the short prompts were apart
    one_group = lambda blocks: [sorted(range(len(blocks)), key=lambda i: -blocks[i])]  # noqa: E731
    monkeypatch.setattr(attention, "decode_groups", one_group)
    assert tokens(False) == grouped == compiled
