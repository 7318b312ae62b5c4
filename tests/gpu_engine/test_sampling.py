"""Sampling rules on hand-made logits (no model)."""

import pytest
import torch

from pwgpu.sampling import SamplingParams, sample

LOGITS = torch.tensor([[0.0, 2.0, 1.9, -1.0], [3.0, 0.0, 0.0, 2.9]])


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_and_tiny_top_p_take_the_argmax():
    greedy = [SamplingParams(temperature=0.0)] * 2
    assert sample(LOGITS, greedy, [None, None]) == [1, 0]
    nucleus = [SamplingParams(temperature=1.0, top_p=1e-6)] * 2
    for seed in range(20):
        assert sample(LOGITS, nucleus, [gen(seed), gen(seed + 1)]) == [1, 0]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    """Token 1 (p=0.47) and 2 (p=0.43) reach 0.8 together; tokens 0 and 3 are never drawn."""
    params = [SamplingParams(temperature=1.0, top_p=0.8)]
    drawn = {sample(LOGITS[:1], params, [gen(s)])[0] for s in range(200)}
    assert drawn == {1, 2}


def test_seed_reproduces_and_temperature_spreads():
    p = [SamplingParams(temperature=1.5, seed=5)]
    a = [sample(LOGITS[:1], p, [gen(s)])[0] for s in range(50)]
    b = [sample(LOGITS[:1], p, [gen(s)])[0] for s in range(50)]
    assert a == b and len(set(a)) >= 3


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5)])
def test_invalid_params_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_first_stop_is_the_earliest_match_in_the_new_tail():
    from pwgpu.server import first_stop

    assert first_stop("x", "ab", ["b", "a"]) == 1  # the earliest, not the first listed
    assert first_stop("hello wor", "ld!", ["world"]) == 6  # a stop that began in earlier text
    assert first_stop("abc", "d", ["xyz"]) is None and first_stop("abc", "", ["c"]) is None
    assert first_stop("abc", "d", []) is None and first_stop("", "q", [""]) is None
