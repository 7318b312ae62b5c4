"""The server's plumbing in-process: tokenizing and detokenizing happen on the worker pool, not
on the event loop; a metrics scrape does not grow with history; a server's records, steps and
transitions are bounded by its history window."""

import asyncio
import threading

import httpx
import pytest

from pagedweight.core.runtime import CoreConfig
from pwgpu.default_model import write_random_mixtral
from pwgpu.engine import Engine, EngineConfig
from pwgpu.engine_thread import EngineThread
from pwgpu.sampling import SamplingParams
from pwgpu.serve_metrics import RequestTiming, ServerMetrics
from pwgpu.server import ServerSettings, build_app
from pwgpu.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_mixtral(tmp_path_factory.mktemp("internals"), seed=0)


class RecordingTokenizer(Tokenizer):
    """Notes the thread of every encode and decode."""

    def __init__(self, model_dir):
        super().__init__(model_dir)
        self.threads: list[tuple[str, int]] = []

    def encode(self, text):
        self.threads.append(("encode", threading.get_ident()))
        return super().encode(text)

    def decode(self, ids):
        self.threads.append(("decode", threading.get_ident()))
        return super().decode(ids)


def test_tokenizing_and_detokenizing_run_off_the_event_loop(model_dir):
    engine = Engine(model_dir, EngineConfig(CoreConfig(budget_bytes=24 << 20)))
    runner = EngineThread(engine).start()
    tok = RecordingTokenizer(model_dir)
    app = build_app(runner, tok, ServerSettings(model_name="m", max_prompt_tokens=400, max_tokens_limit=100))

    async def main() -> tuple[int, list]:
        loop_thread = threading.get_ident()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for path, body in (("/v1/completions", {"prompt": "Hello there", "max_tokens": 5, "echo": True}),
                               ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3, "echo": True}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 4, "logprobs": True})):  # fmt: skip
                r = await client.post(path, json=dict(body, ignore_eos=True))
                assert r.status_code == 200, r.text
        return loop_thread, tok.threads

    try:
        loop_thread, threads = asyncio.run(main())
    finally:
        runner.stop()
        app.state.pool.shutdown()
    kinds = {kind for kind, _ in threads}
    assert kinds == {"encode", "decode"}
    assert all(ident != loop_thread for _, ident in threads), threads


def test_metrics_scrape_does_not_grow_with_history(model_dir):
    """Counters and histograms are updated in place: the scrape after 100,000 requests has the
    same series as after one, and it never walks the transitions log."""
    engine = Engine(model_dir, EngineConfig(CoreConfig(budget_bytes=24 << 20)))

    class NoScan(list):
        def __iter__(self):
            raise AssertionError("/metrics walked the transitions log")

    engine.core.transitions = NoScan()
    m = ServerMetrics("m")

    def one(i: int) -> None:
        t = RequestTiming(("stop", "length", "abort")[i % 3], 0.0, 2.0, 10, 5, 16, scheduled_s=0.1,
                          first_token_s=0.5, engine_first_token_s=0.4, engine_last_token_s=1.9)  # fmt: skip
        m.first_token(t)
        m.token_gap(0.01, 4)
        m.finish(t)

    one(0)
    first = m.render(engine)
    for i in range(1, 100_000):
        one(i)
    last = m.render(engine)
    assert len(last.splitlines()) == len(first.splitlines())
    series = {line.split(" ")[0] for line in last.splitlines() if not line.startswith("#")}
    assert series == {line.split(" ")[0] for line in first.splitlines() if not line.startswith("#")}
    assert 'vllm:request_success_total{model_name="m",finished_reason="stop"} 33334' in last
    assert 'vllm:e2e_request_latency_seconds_count{model_name="m"} 100000' in last
    assert 'vllm:generation_tokens_total{model_name="m"} 500000' in last


def test_history_window_bounds_records_steps_and_transitions(model_dir, tmp_path):
    """40 requests and 32 precision changes through an engine that keeps a window of 10:
    records, steps and transitions stay at 10 while the counters go on, and the results say
    what they cover."""
    import pandas as pd

    from pagedweight.core.spec import PRECISION_ID
    from pagedweight.policy.controller import DOWNGRADE, Change

    engine = Engine(model_dir, EngineConfig(CoreConfig(budget_bytes=24 << 20, history_window=10), policy="static-fp16"))
    for i in range(40):  # one at a time: two steps each
        engine.add([1 + i % 50] * 8, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        engine.run()
    core = engine.core
    core.apply([Change(DOWNGRADE, i, PRECISION_ID["int8"]) for i in range(core.page_table.num_experts)])
    assert len(engine.records) == 10 and [r.request_id for r in engine.records] == list(range(30, 40))
    assert len(core.steps) == 10 and core.steps.num_recorded > 10
    assert core.num_transitions[DOWNGRADE] == core.page_table.num_experts > 10 and len(core.transitions) == 10
    meta = engine.write_results(tmp_path / "out")
    assert "the newest 10 of 40 requests" in meta["trace"]["notes"][0]
    steps = pd.read_csv(tmp_path / "out" / "steps.csv")
    assert len(steps) == 10 and steps["step"].iloc[-1] == core.steps.num_recorded - 1
    assert len(pd.read_csv(tmp_path / "out" / "requests.csv")) == 10
    assert len(pd.read_csv(tmp_path / "out" / "transitions.csv")) == 10
