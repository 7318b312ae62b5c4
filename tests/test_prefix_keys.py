"""Block keys for prefix caching: token-id hash chains, a trace's hash_ids mapped to KV blocks
(and which of them no other request can hold), Mooncake traces' ids through windows, the
multi-turn generator whose turns resend their conversation, and the simulator hitting only
where a trace's keys say."""

import json

import numpy as np
import pytest

from pagedweight.core.prefix import TraceBlockKeys, token_block_keys
from pagedweight.workload.build import take, window
from pagedweight.workload.traces import load_mooncake


def test_token_keys_are_a_chain_of_full_blocks():
    a = token_block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = token_block_keys([1, 2, 3, 4, 5, 6, 7, 9], 4)
    c = token_block_keys([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2  # the partial last block has no key
    assert a[0] == b[0] and a[1] != b[1]
    assert c[0] != a[0] and c[1] != a[1]  # same tokens 4..7, other prefix: other key


def test_trace_keys_map_512_token_blocks_to_kv_blocks():
    keys = TraceBlockKeys([[7, 8], [7, 9], [5, 8]])
    a, b, c = (keys.keys(i, 1000, 16).tolist() for i in range(3))
    assert len(a) == 1000 // 16
    # KV blocks 0..31 lie in trace block 0 (id 7 for a and b): shared; from block 32 on they differ.
    assert a[:32] == b[:32] and all(x != y for x, y in zip(a[32:], b[32:], strict=True))
    # Trace block 1 has id 8 in a and c, but the first blocks differ: nothing is shared.
    assert not set(a) & set(c)
    # A KV block straddling two trace blocks (24 tokens: block 21 spans 504..528) takes the later one.
    a24, b24 = keys.keys(0, 1000, 24).tolist(), keys.keys(1, 1000, 24).tolist()
    assert a24[:21] == b24[:21] and a24[21] != b24[21]
    # Only blocks inside both the prompt and the trace's ids get a key.
    assert len(keys.keys(0, 100, 16)) == 6 and len(keys.keys(0, 5000, 16)) == 1024 // 16


@pytest.mark.parametrize("block_tokens", [16, 24, 48, 512, 700])
def test_trace_keys_are_numbered_densely_and_name_one_prefix_each(block_tokens):
    """Keys are small non-negative numbers (the allocator's array), below chain nodes x KV blocks
    per trace block, and two blocks share a key exactly when their prompts agree on every trace
    block up to the one holding the block's last token and the blocks sit at the same place."""
    ids = [[7, 8, 4], [7, 9], [5, 8], [7, 8, 6], [7, 8, 4, 1, 2], []]
    keys = TraceBlockKeys(ids)
    nodes = len({tuple(r[: t + 1]) for r in ids for t in range(len(r))})
    named: dict[int, tuple] = {}
    key_of: dict[tuple, int] = {}
    for r, row in enumerate(ids):
        got = keys.keys(r, 3000, block_tokens)
        assert got.dtype == np.int64 and len(got) == min(3000, 512 * len(row)) // block_tokens
        for j, key in enumerate(got.tolist()):
            assert 0 <= key < nodes * -(-512 // block_tokens)
            t = ((j + 1) * block_tokens - 1) // 512
            prefix = (tuple(row[: t + 1]), j)
            assert named.setdefault(key, prefix) == prefix and key_of.setdefault(prefix, key) == key


def test_trace_keys_are_private_from_the_first_trace_block_no_other_request_holds():
    keys = TraceBlockKeys([[7, 8, 4], [7, 9], [5, 8], [7, 8, 6], []])
    # a and d share trace blocks 0 and 1 (b only block 0), so a is private from trace block 2:
    # KV block 64 with 16 tokens (tokens 1024..1039), 42 with 24 (1008..1031: its last token is there).
    assert keys.private_from(0, 2000, 16) == 64 and keys.private_from(0, 2000, 24) == 42
    assert keys.private_from(0, 1000, 16) == len(keys.keys(0, 1000, 16))  # every key shared
    assert keys.private_from(1, 2000, 16) == 32  # b's trace block 1 is its own
    assert keys.private_from(2, 2000, 16) == 0  # c shares nothing
    assert keys.private_from(4, 2000, 16) == 0 == len(keys.keys(4, 2000, 16))
    for r in range(5):  # the first private key, and every one after it, is in no other request
        mine = keys.keys(r, 2000, 16).tolist()
        others = {k for o in range(5) if o != r for k in keys.keys(o, 2000, 16).tolist()}
        first = keys.private_from(r, 2000, 16)
        assert not others & set(mine[first:]) and (first == 0 or mine[first - 1] in others)


def test_mooncake_hash_ids_are_read_and_follow_windows(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]},
        {"timestamp": 5, "input_length": 100, "output_length": 3, "hash_ids": [1]},
        {"timestamp": 9, "input_length": 700, "output_length": 3, "hash_ids": [1, 3]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    trace = load_mooncake(path)
    assert [list(h) for h in trace.hash_ids] == [[1, 2], [1], [1, 3]]
    assert [list(h) for h in window(trace, 1.0 / 1000, None).hash_ids] == [[1], [1, 3]]
    assert [list(h) for h in take(trace, 1).hash_ids] == [[1, 2]]
    rows[1]["hash_ids"] = "x"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(Exception, match=r"t.jsonl:2: column 'hash_ids'"):
        load_mooncake(path)
    rows[1]["hash_ids"] = [1, 1 << 63]  # past int64: the same one line, not an overflow
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(Exception, match=r"t.jsonl:2: column 'hash_ids'.*within 64 bits"):
        load_mooncake(path)


def test_multi_turn_turns_share_their_conversation_prefix():
    from pagedweight.workload.stats import prefix_stats
    from pagedweight.workload.synth import multi_turn_chat

    trace = multi_turn_chat(seed=3, duration_s=120)
    assert len(trace) > 50 and (np.diff(trace.arrival_s) >= 0).all()
    for ids, prompt in zip(trace.hash_ids, trace.prompt_tokens, strict=True):
        assert len(ids) == -(-int(prompt) // 512)
    # Some request's full blocks reappear at the start of a later, longer prompt (its next turn).
    firsts = {}
    resent = 0
    for ids, prompt in zip(trace.hash_ids, trace.prompt_tokens, strict=True):
        full = tuple(ids[: int(prompt) // 512].tolist())
        resent += any(full[:k] in firsts for k in range(2, len(full) + 1))
        for k in range(2, len(full) + 1):
            firsts[full[:k]] = True
    assert resent > 10
    stats = prefix_stats(trace)
    assert 0.3 < stats["prefix_hit_rate"] < 1 and stats["block_ids_seen_before_share"] > 0.3
    assert prefix_stats(trace, capacity_blocks=4)["prefix_hit_rate"] < stats["prefix_hit_rate"]


def test_shipped_multiturn_trace_regenerates_exactly(tmp_path):
    from pathlib import Path

    from pagedweight.workload.synth import synthesize
    from pagedweight.workload.traces import write_jsonl

    shipped = Path(__file__).resolve().parents[1] / "traces" / "multiturn.jsonl"
    write_jsonl(synthesize("multiturn", seed=1), tmp_path / "t.jsonl")
    assert (tmp_path / "t.jsonl").read_bytes() == shipped.read_bytes()
    back = load_mooncake(tmp_path / "t.jsonl")
    assert back.hash_ids is not None and len(back) == len(back.hash_ids)


def test_simulator_hits_only_where_the_trace_says(tmp_path):
    """The shipped multi-turn scenario hits; the same requests without hash_ids hit only
    themselves after a preemption (none here), and caching off hits nothing."""
    from pathlib import Path

    from pagedweight.config.run import scenario_run
    from pagedweight.config.scenario import load_scenario
    from pwsim.latency import build_latency_model
    from pwsim.run import scenario_engine

    root = Path(__file__).resolve().parents[1]
    plain = tmp_path / "plain.jsonl"
    rows = [json.loads(line) for line in (root / "traces" / "multiturn.jsonl").read_text().splitlines()[:300]]
    plain.write_text("".join(json.dumps({k: r[k] for k in r if k != "hash_ids"}) + "\n" for r in rows))
    hits = {}
    for label, sets in {
        "on": [],
        "off": ["memory.prefix_caching=false"],
        "no ids": [f"workload.path={plain}"],
    }.items():
        loaded = load_scenario(root / "scenarios" / "multiturn.yaml", ["workload.max_requests=300", *sets])
        run = scenario_run(loaded, ["static-int4"])
        lat = build_latency_model(loaded.scenario.latency, loaded.model, loaded.gpu, loaded.base_dir)
        eng = scenario_engine(run, "static-int4", lat, loaded.scenario.routing)
        eng.run()
        assert sum(r.num_preemptions for r in eng.requests) == 0
        hits[label] = eng.core.scheduler.prefix_hit_tokens
    assert hits["on"] > 0 and hits["off"] == 0 and hits["no ids"] == 0
