"""``pwgpu run --ep N`` (``pwgpu.ep_launch``) and the ranks' agreement on every step
(``pwgpu.ep_agree``), on two gloo ranks of the trained tiny model on the CPU.

- A scenario with ``parallel: {ep: 2}`` runs on two ranks by itself and gives the greedy tokens
  of the single-process run (``--ep 1`` overrides the key).
- Two ranks with different budgets (so different pools, and only the tight one's controller
  downgrades) still agree on every batch: every request finishes, no hang, the KV in use is the
  same on both ranks every step, and the roomy rank 0 admits only what the tight rank can hold.
- kv-swap under KV pressure: every rank swaps its own KV, and the tokens are those of one
  process without preemption.
- Bad ``--ep`` values fail in one line (exit 2) before any rank starts.

Each command runs in a process group of its own (``tests/proc.py``): on a hang or a failure the
group, rank processes included, is killed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pagedweight.core.spec import load_model

import proc

HERE = Path(__file__).resolve().parent
MODEL = HERE.parents[1] / "models" / "tiny-moe"
TEXT = HERE.parents[1] / "data" / "eval" / "shakespeare.txt"
WORKER = HERE / "ep_launch_worker.py"
MIB = 1 << 20

needs_model = pytest.mark.skipif(not (MODEL / "model.safetensors").is_file(), reason="needs models/tiny-moe")

# fp32 compute (the spec counts 4-byte pinned weights and KV), so that the ranks' summed expert
# outputs match one process's to rounding and greedy tokens agree exactly.
SCENARIO = {
    "name": "ep-launch",
    "model": "tiny-moe-fp32.yaml",
    "gpu": "cpu",
    "memory": {"budget": "64 MiB", "page_bytes": "64 KiB", "kv_block_tokens": 16,
               "precisions": ["bf16", "fp8", "int8", "int4"]},
    "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_qps": 200.0},
                 "lengths": {"kind": "fixed", "prompt_tokens": 64, "output_tokens": 8}, "num_requests": 6},
    "scheduler": {"max_num_batched_tokens": 512, "max_num_seqs": 8},
    "policies": ["static-fp16"],
}  # fmt: skip


def _scenario(tmp_path: Path, **changes) -> Path:
    spec = load_model("tiny-moe").model_dump(mode="json") | {"dtype_bytes": 4}
    (tmp_path / "tiny-moe-fp32.yaml").write_text(yaml.safe_dump(spec))
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump({**SCENARIO, **changes}))
    return path


def _pwgpu_run(scenario: Path, out: Path, *extra: str, quiet_s: float = 15):
    """``pwgpu run --scenario`` on one torch thread per process (each of two ranks gets one of the
    two cores anyway): a process whose second thread is descheduled by other jobs waits at every op."""
    cmd = [sys.executable, "-m", "pwgpu.cli", "run", "--scenario", scenario, "--model", MODEL, "--dtype", "float32",
           "--out", out, *extra]  # fmt: skip
    return proc.run(cmd, quiet_s=quiet_s, env=dict(os.environ, OMP_NUM_THREADS="1"))


def _tokens(out: Path) -> dict[int, list[int]]:
    rows = [json.loads(line) for line in (out / "tokens.jsonl").read_text().splitlines()]
    return {r["request_id"]: r["output_ids"] for r in rows if r["kind"] == "request"}


@pytest.mark.e2e
@needs_model
def test_scenario_parallel_ep_gives_the_single_process_tokens(tmp_path):
    scenario = _scenario(tmp_path, parallel={"ep": 2})
    one = _pwgpu_run(scenario, tmp_path / "one", "--ep", "1", "--prompt-text", TEXT)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _pwgpu_run(scenario, tmp_path / "two", "--prompt-text", TEXT)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "static-fp16   6/6 done" in two.stdout
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["expert_parallel"]["ranks"] == 2 and summary["expert_parallel"]["backend"] == "gloo"
    assert summary["model"] == "tiny-moe/ep2"
    assert "expert_parallel" not in json.loads((tmp_path / "one" / "summary.json").read_text())
    single, ep = _tokens(tmp_path / "one"), _tokens(tmp_path / "two")
    assert len(single) == 6 and all(len(t) == 8 for t in single.values())
    assert ep == single


@pytest.mark.e2e
@needs_model
def test_kv_swap_on_two_ranks_gives_the_unpreempted_tokens(tmp_path):
    """kv-swap on two ranks, each with room for 15 KV pages beside its pinned weights and half
    of the experts (177 + 192 pages): greedy admission preempts, every rank swaps its own KV
    (the followers replay rank 0's preemptions) and the tokens are those of one process with
    room to spare. Without the copies the preempted requests generate other tokens."""
    lengths = {"kind": "fixed", "prompt_tokens": 64, "output_tokens": 24}
    workload = {**SCENARIO["workload"], "lengths": lengths}
    ref = _scenario(tmp_path, workload=workload)
    one = _pwgpu_run(ref, tmp_path / "one", "--ep", "1", "--prompt-text", TEXT)
    assert one.returncode == 0, one.stderr[-3000:]
    swap = _scenario(
        tmp_path, workload=workload, policies=["kv-swap"], parallel={"ep": 2},
        memory={**SCENARIO["memory"], "budget": "24 MiB"},
        scheduler={**SCENARIO["scheduler"], "admission": "greedy"},
    )  # fmt: skip
    two = _pwgpu_run(swap, tmp_path / "two", "--prompt-text", TEXT)
    assert two.returncode == 0, two.stderr[-3000:]
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["policies"]["kv-swap"]["num_preemptions"] > 0, "the run must preempt"
    assert summary["policies"]["kv-swap"]["h2d_bytes"] > 0  # the swapped-in KV
    single, ep = _tokens(tmp_path / "one"), _tokens(tmp_path / "two")
    assert len(single) == 6 and all(len(t) == 24 for t in single.values())
    assert ep == single


@pytest.mark.e2e
@needs_model
def test_ranks_with_different_pools_agree_on_every_batch(tmp_path):
    """Rank 1 gets less than half rank 0's budget: under the dynamic policy only its controller
    downgrades. Scheduling on rank 0's pool alone would admit what rank 1 cannot hold."""
    scenario = _scenario(
        tmp_path,
        policies=["static-fp16", "pagedweight"],
        workload={**SCENARIO["workload"], "lengths": {"kind": "fixed", "prompt_tokens": 256, "output_tokens": 16},
                  "num_requests": 12},
    )  # fmt: skip
    out = tmp_path / "out"
    done = proc.run([sys.executable, WORKER, scenario, MODEL, out, 64 * MIB, 28 * MIB], quiet_s=20)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for policy in ("static-fp16", "pagedweight"):
        first, second = ranks[0][policy], ranks[1][policy]
        assert len(first["states"]) == 12
        assert set(first["states"].values()) == set(second["states"].values()) == {"finished"}
        assert first["kv_blocks_used"] == second["kv_blocks_used"]  # the same batches, step by step
    dyn = [r["pagedweight"]["num_transitions"]["downgrade"] for r in ranks]
    assert dyn[0] == 0 and dyn[1] > 0  # their precision maps differ
    # Static: rank 1's pool bounds the KV in use; dynamic: rank 1 downgrades to make room for more.
    static_kv = max(ranks[0]["static-fp16"]["kv_blocks_used"])
    assert static_kv < max(ranks[0]["pagedweight"]["kv_blocks_used"])
    summary = json.loads((out / "summary.json").read_text())
    assert {p: s["completed"] for p, s in summary["policies"].items()} == {"static-fp16": 12, "pagedweight": 12}


@pytest.mark.e2e
@needs_model
def test_an_error_on_the_ranks_is_the_commands_one_line(tmp_path):
    """static-fp16's experts do not fit a rank's budget: infeasible on every rank, so no policy
    runs; the ranks stop and the command says so in one line (exit 2)."""
    scenario = _scenario(tmp_path, memory={**SCENARIO["memory"], "budget": "18 MiB"}, parallel={"ep": 2})
    done = _pwgpu_run(scenario, tmp_path / "out", quiet_s=10)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"pwgpu run: error: no policy fits in {18 * MIB} bytes") and "static-fp16" in last
    assert "Traceback" not in done.stderr


def _cli(capsys, *args: str) -> tuple[int, str]:
    from pwgpu.cli import main

    code = main(["run", *args])
    return code, capsys.readouterr().err.strip()


@needs_model
def test_ep_that_does_not_split_the_experts_is_one_line(tmp_path, capsys):
    code, err = _cli(capsys, "--scenario", str(_scenario(tmp_path)), "--model", str(MODEL), "--dtype", "float32",
                     "--out", str(tmp_path / "out"), "--ep", "3")  # fmt: skip
    assert code == 2 and "\n" not in err
    assert "8 routed experts per MoE layer" in err and "allowed: 1, 2, 4, 8" in err
    assert not (tmp_path / "out").exists()


@needs_model
def test_ep_on_missing_gpus_is_one_line(tmp_path, capsys):
    found = torch.cuda.device_count()
    want = next((n for n in (2, 4, 8) if n > found), None)
    if want is None:
        pytest.skip("this machine has a GPU for every rank of any --ep the tiny model allows")
    code, err = _cli(capsys, "--scenario", str(_scenario(tmp_path)), "--model", str(MODEL), "--device", "cuda",
                     "--dtype", "float32", "--out", str(tmp_path / "out"), "--ep", str(want))  # fmt: skip
    assert code == 2 and "\n" not in err
    assert f"needs {want} GPUs (one per rank); {found} found" in err


@needs_model
def test_scenario_ep_that_does_not_split_the_experts_is_one_line(tmp_path, capsys):
    code, err = _cli(capsys, "--scenario", str(_scenario(tmp_path, parallel={"ep": 3})), "--out", str(tmp_path / "o"))
    assert code == 2 and "\n" not in err and "parallel.ep" in err and "allowed: 1, 2, 4, 8" in err


def test_ep_must_be_positive(tmp_path, capsys):
    code, err = _cli(capsys, "--trace", "x.csv", "--mem-budget", "64MiB", "--out", str(tmp_path / "o"), "--ep", "0")
    assert code == 2 and err.endswith("--ep(=0) must be >= 1")


def _one_process_tokens(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pagedweight.core.runtime import CoreConfig
    from pwgpu.engine import Engine, EngineConfig
    from pwgpu.sampling import SamplingParams

    cfg = EngineConfig(CoreConfig(budget_bytes=64 * MIB), policy="static-fp16", device="cpu", dtype="float32")
    engine = Engine(MODEL, cfg)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ers = [engine.add(p, params) for p in prompts]
    engine.run()
    return [er.output_ids for er in ers]


def _group_ends(pgid: int, quiet_s: float) -> bool:
    """Whether every process of the group is gone within the hang guard of ``quiet_s``."""
    import time

    deadline = time.monotonic() + proc.hang_guard_s(quiet_s)
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.e2e
@needs_model
def test_serve_ep_answers_as_one_process_and_stops_in_order(tmp_path):
    """``pwgpu serve --ep 2``: rank 0 answers HTTP, both ranks compute every step; concurrent
    greedy completions are the single-process engine's; SIGTERM to the command stops rank 0,
    which stops rank 1, writes the results and leaves no process behind."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from server_process import API_KEY, serve

    from pwgpu.tokenizer import Tokenizer

    prompts = [[5, 17, 42, 9, 33, 71, 2, 60], [7, 3, 88, 19, 64, 21, 50, 11, 45, 8, 30, 1, 2], [100, 200, 300]]
    want = [Tokenizer(MODEL).decode(ids) for ids in _one_process_tokens(prompts, 8)]
    args = ("--model", str(MODEL), "--ep", "2", "--policy", "static-fp16", "--dtype", "float32")
    with serve(tmp_path, *args) as (url, server):

        def complete(prompt):
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=120,
                           headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(complete, prompts))
        assert got == want
        server.terminate()
        assert server.wait(timeout=proc.hang_guard_s(8)) == 0
        assert _group_ends(server.pid, quiet_s=1)  # the ranks (and multiprocessing's tracker) end with it
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    assert summary["expert_parallel"]["ranks"] == 2
    assert summary["policies"]["static-fp16"]["completed"] == 3
    assert "rank 0 of 2 expert-parallel ranks" in (tmp_path / "server.log").read_text()


@needs_model
def test_serve_ep_that_does_not_split_the_experts_is_one_line(capsys):
    from pwgpu.cli import main

    assert main(["serve", "--model", str(MODEL), "--ep", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "do not split across 5 ranks; allowed: 1, 2, 4, 8" in err


def test_rank_zeros_view_holds_the_tightest_ranks_free_blocks():
    """``KvView``: rank 0's scheduler sees rank 0's free blocks less the deficit of the tightest
    rank, and counts what the step's batch takes, which the other ranks take later; ``_room``
    asks a rank's own pressure hook for exactly what it lacks."""
    import copy

    from pagedweight.core.kv_blocks import KvBlockAllocator
    from pagedweight.core.pool import PagePool
    from pagedweight.errors import PagedWeightError
    from pwgpu.ep_agree import KvView, _room

    kv = KvBlockAllocator(PagePool(16 << 10, 1 << 10), block_tokens=4, kv_bytes_per_token=128)  # 2 blocks a page
    view = KvView(kv)
    assert view.num_free_blocks == kv.num_free_blocks == 32 and view.block_tokens == 4
    view.deficit = 20
    assert view.num_free_blocks == 12
    blocks = view.allocate(5)
    assert view.taken == 5 and kv.num_free_blocks == 27 and view.num_free_blocks == 7
    view.free(blocks[:2])
    assert view.taken == 3 and view.num_free_blocks == 9
    with pytest.raises(PagedWeightError, match="tightest rank has 9"):
        view.allocate(10)
    asked = []
    assert _room(kv, asked.append, want=None, taken=3) == 26 and asked == []
    assert _room(kv, asked.append, want=30, taken=3) == 26 and asked == [4]  # the hook freed nothing
    assert _room(kv, None, want=30, taken=3) == 26
    assert view.num_growable_blocks() == 0  # two blocks a page: decodes grow one ``_reserve`` each
    # One block a page: decodes growing a block take them together, within the tightest rank.
    kv1 = KvBlockAllocator(PagePool(16 << 10, 1 << 10), block_tokens=4, kv_bytes_per_token=256)
    view1 = KvView(kv1)
    view1.deficit = 10
    assert view1.num_growable_blocks() == 6
    with pytest.raises(PagedWeightError, match="tightest rank has 6"):
        view1.allocate_each(7)
    twin = copy.deepcopy(kv1)
    assert view1.allocate_each(4) == [twin.allocate(1)[0] for _ in range(4)]
    assert view1.taken == 4 and view1.num_growable_blocks() == 2 and kv1.num_free_blocks == 12


def test_the_one_process_library_path_refuses_a_parallel_scenario(tmp_path):
    from pagedweight.config.run import scenario_run
    from pagedweight.config.scenario import load_scenario
    from pagedweight.errors import ConfigError
    from pwgpu.offline import run_scenario

    run = scenario_run(load_scenario(_scenario(tmp_path, parallel={"ep": 2}), require_latency_table=False))
    with pytest.raises(ConfigError, match="parallel.ep=2: this runs one process"):
        run_scenario(run, MODEL, tmp_path / "out")
