"""One scheduler step (schedule + finish_step + step shape) with 256 running requests.

    pytest benchmarks/bench_scheduler.py --benchmark-only

Cases: a pure decode step (the common case: 256 requests, one token each, a KV block every 16
tokens), and a mixed step with a chunked prefill beside the decodes. The numbers bound the
simulator's speed: an hour of a busy trace is ~150,000 steps.
"""

import pytest

from pagedweight.core.kv_blocks import KvBlockAllocator
from pagedweight.core.pool import PagePool
from pagedweight.core.scheduler import Request, Scheduler, SchedulerConfig

MiB = 2**20


def running_scheduler(num_running: int, prompt_tokens: int) -> Scheduler:
    # Mixtral-8x7B's KV: 128 KiB per token, 16-token blocks = one 2 MiB page each.
    pool = PagePool(60_000 * 2 * MiB, 2 * MiB)
    kv = KvBlockAllocator(pool, 16, 128 * 1024)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=512), kv, max_kv_blocks=60_000)
    for i in range(num_running):
        sched.add(Request(i, 0.0, prompt_tokens, 1_000_000 // num_running))
    now = 0.0
    while len(sched.running) < num_running or any(r.num_output_tokens == 0 for r in sched.running):
        sched.finish_step(sched.schedule(now), now + 0.01)
        now += 0.01
    return sched


def one_step(sched: Scheduler, clock: list[float]) -> None:
    batch = sched.schedule(clock[0])
    batch.shape()
    sched.finish_step(batch, clock[0] + 0.01)
    clock[0] += 0.01


@pytest.mark.parametrize("num_running", [256])
def test_decode_step(benchmark, num_running):
    sched = running_scheduler(num_running, prompt_tokens=500)
    benchmark.extra_info["num_running"] = num_running
    benchmark(one_step, sched, [1.0])
    assert len(sched.running) == num_running


def test_decode_step_with_a_prefill_chunk(benchmark):
    sched = running_scheduler(256, prompt_tokens=500)
    clock = [1.0]

    def step_with_arrival():
        sched.add(Request(-1, clock[0], 4000, 1))  # finishes in the step after its prefill
        one_step(sched, clock)

    benchmark(step_with_arrival)
