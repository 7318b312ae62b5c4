"""The OpenAI API surface of ``pwgpu serve`` beyond plain generation, through the official
``openai`` client: log-probabilities (checked against the model's own forward pass), n > 1,
penalties (checked against a greedy decode that applies their definitions to the model's
logits), min_tokens, per-request seeds, echo, usage in the stream, chat content as text parts.

Experts stay at full precision (static-fp16 in a roomy budget), so the server's numbers can be
compared with a forward pass of the same weights."""

import functools
import math

import pytest
import torch
from server_process import API_KEY, serve

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    from openai import OpenAI

    from pwgpu.default_model import write_random_mixtral

    tmp = tmp_path_factory.mktemp("serve_api")
    model = write_random_mixtral(tmp / "model")
    args = ("--model", str(model), "--mem-budget", "32MiB", "--policy", "static-fp16", "--max-model-len", "256")
    with serve(tmp, *args) as (url, _proc):
        client = OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        yield client, client.models.list().data[0].id, model


@pytest.fixture(scope="module")
def reference(api):
    """The engine's model in-process, fp32 with dense experts: ``logits(ids)`` -> [len, V]."""
    from pwgpu.attention import PagedKvCache, build_batch
    from pwgpu.loader import dense_expert_weights, load_checkpoint, pinned_weights
    from pwgpu.model import DenseExperts, MoeTransformer
    from pwgpu.tokenizer import Tokenizer

    model_dir = api[2]
    ckpt = load_checkpoint(model_dir)
    a, cpu, dt = ckpt.arch, torch.device("cpu"), torch.float32
    model = MoeTransformer(
        a, pinned_weights(ckpt, dt, cpu), DenseExperts(*dense_expert_weights(ckpt, dt), a.hidden_act), cpu
    )
    block = 16
    block_bytes = a.num_layers * 2 * block * a.num_kv_heads * a.head_dim * 4
    blocks = list(range(16))

    @functools.lru_cache(maxsize=256)
    def cached(ids: tuple[int, ...]) -> torch.Tensor:
        kv = PagedKvCache(torch.zeros(16 * block_bytes, dtype=torch.uint8), block_bytes, block, 1, a.num_layers,
                          a.num_kv_heads, a.head_dim, dt)  # fmt: skip
        batch, pos = build_batch([(blocks, 0, len(ids))], block, cpu)
        with torch.no_grad():
            return model.logits(model.forward(torch.tensor(ids), pos, batch, kv)).float()

    return (lambda ids: cached(tuple(ids))), Tokenizer(model_dir)


def penalized(x: torch.Tensor, prompt: list[int], out: list[int], rep=1.0, freq=0.0, pres=0.0) -> torch.Tensor:
    """Logits ``x`` after the penalties as defined: repetition scales the logits of tokens seen
    in the prompt or the output (divide if positive, multiply if negative); frequency and
    presence subtract f x count and p x (count > 0), over the output only."""
    counts = torch.zeros_like(x)
    for t in out:
        counts[t] += 1
    seen = counts > 0
    seen[prompt] = True
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - freq * counts - pres * (counts > 0).float()


def greedy_reference(logits_fn, prompt: list[int], steps: int) -> list[int]:
    out: list[int] = []
    for _ in range(steps):
        out.append(int(logits_fn(prompt + out)[-1].argmax()))
    return out


def token_ids(content) -> list[int]:
    """Chat log-probability entries asked for with ``return_tokens_as_token_ids`` -> token ids."""
    return [int(e.token.removeprefix("token_id:")) for e in content]


def test_completion_logprobs_are_the_models_log_softmax(api, reference):
    client, model, _ = api
    logits_fn, tok = reference
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    lp = r.choices[0].logprobs
    prompt = tok.encode(PROMPT)
    ids = greedy_reference(logits_fn, prompt, 5)
    assert lp.tokens == [tok.token_text(t) for t in ids] and r.choices[0].text == tok.decode(ids)
    for k, t in enumerate(ids):
        ref = torch.log_softmax(logits_fn(prompt + ids[:k])[-1], -1)
        assert math.isclose(lp.token_logprobs[k], float(ref[t]), abs_tol=2e-3)
        top = ref.topk(3)
        want = {tok.token_text(int(i)): float(v) for v, i in zip(top.values, top.indices, strict=True)}
        assert set(lp.top_logprobs[k]) == set(want)
        for name, v in want.items():
            assert math.isclose(lp.top_logprobs[k][name], v, abs_tol=2e-3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(5)]


def test_chat_logprobs_and_streamed_logprobs(api, reference):
    client, model, _ = api
    logits_fn, tok = reference
    msgs = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    content = r.choices[0].logprobs.content
    prompt = tok.encode("user: Hi\nassistant:")
    ids = greedy_reference(logits_fn, prompt, 4)
    for k, t in enumerate(ids):
        ref = torch.log_softmax(logits_fn(prompt + ids[:k])[-1], -1)
        assert content[k].token == tok.token_text(t) and content[k].bytes == list(tok.token_bytes(t))
        assert math.isclose(content[k].logprob, float(ref[t]), abs_tol=2e-3)
        assert len(content[k].top_logprobs) == 2 and content[k].top_logprobs[0].token == tok.token_text(t)
    stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                            top_logprobs=2, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    assert bytes(b for e in content for b in e.bytes).decode("utf-8", "replace") == tok.decode(ids)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # The same tokens; the log-probabilities to float noise (the second request's prompt is a
    # prefix-cache hit, so its prefill runs on fewer positions, in another order of sums).
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4) for a, b in zip(streamed, content, strict=True))
    plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})  # fmt: skip
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(
    "penalty", [dict(repetition_penalty=1.8), dict(frequency_penalty=1.5), dict(presence_penalty=2.0)]
)
def test_penalties_follow_their_definitions(api, reference, penalty):
    """Every greedy token with a penalty is the argmax of the model's logits with the penalty
    applied as defined (given the tokens before it), and the penalty changed some choice."""
    client, model, _ = api
    logits_fn, tok = reference
    msgs = [{"role": "user", "content": "aaaa aaaa"}]
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True, **penalty}
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0, logprobs=True,
                                       extra_body=extra)  # fmt: skip
    prompt = tok.encode("user: aaaa aaaa\nassistant:")
    out = token_ids(r.choices[0].logprobs.content)
    assert len(out) == 12
    logits = logits_fn(prompt + out)[len(prompt) - 1 :]
    names = {"repetition_penalty": "rep", "frequency_penalty": "freq", "presence_penalty": "pres"}
    kw = {names[k]: v for k, v in penalty.items()}
    assert [int(penalized(logits[k], prompt, out[:k], **kw).argmax()) for k in range(12)] == out
    assert [int(logits[k].argmax()) for k in range(12)] != out


def test_n_choices_with_seeds(api):
    client, model, _ = api
    kw = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    r = client.completions.create(n=3, **kw)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len(set(texts)) == 3 and r.usage.completion_tokens == 24
    again = client.completions.create(n=3, **kw)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts  # seeded: reproducible
    single = client.completions.create(**kw)
    assert single.choices[0].text == texts[0]  # choice 0 draws from the seed itself
    other = client.completions.create(**dict(kw, seed=8))
    assert other.choices[0].text == texts[1]  # choice i draws from seed + i
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], n=2,
                                                 max_tokens=5, seed=3, stream=True,
                                                 extra_body={"ignore_eos": True}))  # fmt: skip
    by_index = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            by_index[ch.index] += ch.delta.content or ""
    finished = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finished == ["length", "length"] and all(by_index.values())


def test_min_tokens_and_stop_token_ids(api, reference):
    client, model, _ = api
    logits_fn, tok = reference
    prompt = tok.encode(PROMPT)
    first = greedy_reference(logits_fn, prompt, 1)[0]
    r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"stop_token_ids": [first]})  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"stop_token_ids": [first], "min_tokens": 3})  # fmt: skip
    assert r.usage.completion_tokens >= 3
    lp = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, logprobs=0,
                                   extra_body={"stop_token_ids": [first], "min_tokens": 3})  # fmt: skip
    assert lp.choices[0].logprobs.tokens[0] != tok.token_text(first)  # banned until 3 tokens are out


def test_seed_per_request_and_echo(api):
    client, model, _ = api
    kw = dict(model=model, prompt=PROMPT, max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    a = [client.completions.create(seed=s, **kw).choices[0].text for s in (1, 1, 2)]
    assert a[0] == a[1] and a[0] != a[2]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].text == PROMPT + plain.choices[0].text
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True)
    streamed = "".join(c.choices[0].text for c in stream)
    assert streamed == r.choices[0].text


def test_stream_include_usage_and_text_parts(api):
    client, model, _ = api
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=5, stream=True, temperature=0,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == len(PROMPT) and all(c.usage is None for c in chunks[:-1])
    no_usage = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=3, stream=True))
    assert all(c.choices for c in no_usage)
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    a = client.chat.completions.create(model=model, messages=[{"role": "user", "content": parts}], max_tokens=6,
                                       temperature=0)  # fmt: skip
    b = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello\nthere"}],
                                       max_tokens=6, temperature=0)  # fmt: skip
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
