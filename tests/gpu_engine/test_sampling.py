"""Sampling rules on hand-made logits (no model)."""

import math

import pytest
import torch

from pwgpu.sampling import RequestSampler, SamplingParams, sample

LOGITS = torch.tensor([[0.0, 2.0, 1.9, -1.0], [3.0, 0.0, 0.0, 2.9]])


def draw(logits, params, seeds):
    """Tokens for ``params`` (one per row) with each row's random stream seeded by ``seeds``."""
    samplers = []
    for p, seed in zip(params, seeds, strict=True):
        s = RequestSampler(p, [], logits.shape[1], torch.device("cpu"))
        s.generator = None if seed is None else torch.Generator().manual_seed(seed)
        samplers.append(s)
    return sample(logits, samplers)[0]


def test_greedy_and_tiny_top_p_take_the_argmax():
    greedy = [SamplingParams(temperature=0.0)] * 2
    assert draw(LOGITS, greedy, [None, None]) == [1, 0]
    nucleus = [SamplingParams(temperature=1.0, top_p=1e-6)] * 2
    for seed in range(20):
        assert draw(LOGITS, nucleus, [seed, seed + 1]) == [1, 0]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    """Token 1 (p=0.47) and 2 (p=0.43) reach 0.8 together; tokens 0 and 3 are never drawn."""
    params = [SamplingParams(temperature=1.0, top_p=0.8)]
    drawn = {draw(LOGITS[:1], params, [s])[0] for s in range(200)}
    assert drawn == {1, 2}


def test_seed_reproduces_and_temperature_spreads():
    p = [SamplingParams(temperature=1.5, seed=5)]
    a = [draw(LOGITS[:1], p, [s])[0] for s in range(50)]
    b = [draw(LOGITS[:1], p, [s])[0] for s in range(50)]
    assert a == b and len(set(a)) >= 3


@pytest.mark.parametrize(
    "bad",
    [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(min_p=1.5),
     dict(min_tokens=20, max_tokens=10), dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
     dict(repetition_penalty=0.0), dict(logprobs=21)],
)  # fmt: skip
def test_invalid_params_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_first_stop_is_the_earliest_match_in_the_new_tail():
    from pwgpu.server import first_stop

    assert first_stop("x", "ab", ["b", "a"]) == 1  # the earliest, not the first listed
    assert first_stop("hello wor", "ld!", ["world"]) == 6  # a stop that began in earlier text
    assert first_stop("abc", "d", ["xyz"]) is None and first_stop("abc", "", ["c"]) is None
    assert first_stop("abc", "d", []) is None and first_stop("", "q", [""]) is None


def test_top_k_and_min_p_cut_the_tail():
    """Row 0's probabilities are about (.06, .47, .43, .02): top-k=1 keeps token 1 only; min-p=0.5
    keeps the tokens within half the top probability (1 and 2)."""
    assert {draw(LOGITS[:1], [SamplingParams(top_k=1)], [s])[0] for s in range(50)} == {1}
    assert {draw(LOGITS[:1], [SamplingParams(min_p=0.5)], [s])[0] for s in range(200)} == {1, 2}
    assert {draw(LOGITS[:1], [SamplingParams(top_k=3, top_p=0.5)], [s])[0] for s in range(200)} == {1, 2}


def _adjusted(params, prompt, outputs, logits):
    s = RequestSampler(params, prompt, len(logits), torch.device("cpu"))
    for t in outputs:
        s.observe(t)
    return s.adjust(logits.clone())


def test_penalties_follow_the_definitions():
    """Repetition divides positive logits of seen tokens (prompt or output) and multiplies
    negative ones; frequency subtracts f x count and presence p once, output tokens only."""
    logits = torch.tensor([1.0, -1.0, 2.0, 0.5, -0.5])
    rep = _adjusted(SamplingParams(repetition_penalty=2.0), [0, 1], [2, 2], logits)
    assert rep.tolist() == [0.5, -2.0, 1.0, 0.5, -0.5]
    freq = _adjusted(SamplingParams(frequency_penalty=0.5), [0, 1], [2, 2, 3], logits)
    assert freq.tolist() == [1.0, -1.0, 1.0, 0.0, -0.5]
    pres = _adjusted(SamplingParams(presence_penalty=0.25), [0, 1], [2, 2, 3], logits)
    assert pres.tolist() == [1.0, -1.0, 1.75, 0.25, -0.5]
    both = _adjusted(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25), [4], [2, 2],
                     logits)  # fmt: skip
    assert both.tolist() == [1.0, -1.0, 2.0 / 2 - 0.5 * 2 - 0.25, 0.5, -1.0]


def test_min_tokens_bans_stop_tokens_until_reached():
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(1,))
    s = RequestSampler(params, [], 4, torch.device("cpu"), eos_token_ids=(0,))
    tokens = []
    for _ in range(3):
        tok = sample(torch.tensor([[5.0, 4.0, 1.0, 0.0]]), [s])[0][0]
        s.observe(tok)
        tokens.append(tok)
    assert tokens == [2, 2, 0]  # EOS (0) and the stop id (1) only once two tokens are out
    ignore = RequestSampler(SamplingParams(min_tokens=2, ignore_eos=True), [], 4, torch.device("cpu"), (0,))
    assert ignore.banned_until_min == []


def test_logprobs_are_the_models_log_softmax():
    """The sampled token's log-probability and the top-k come from the raw logits, before
    penalties and temperature."""
    params = SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.5)
    s = RequestSampler(params, [1], 4, torch.device("cpu"))
    tokens, lps = sample(LOGITS[:1], [s])
    ref = torch.log_softmax(LOGITS[0], -1)
    lp = lps[0]
    assert tokens == [2] and lp.token_id == 2  # the penalty moved the argmax from 1 to 2
    assert math.isclose(lp.logprob, float(ref[2]), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [1, 2] and math.isclose(lp.top[0][1], float(ref[1]), rel_tol=1e-6)
    none = RequestSampler(SamplingParams(logprobs=None), [], 4, torch.device("cpu"))
    zero = RequestSampler(SamplingParams(logprobs=0, temperature=0.0), [], 4, torch.device("cpu"))
    _, lps = sample(LOGITS, [none, zero])
    assert lps[0] is None and lps[1].top == () and lps[1].token_id == 0
