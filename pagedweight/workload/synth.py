"""Synthetic trace presets fitted to published statistics (``pwsim trace synth --kind NAME``).

Each preset is an ordinary ``kind: synthetic`` workload, so a scenario can use the same numbers
inline. Lengths are lognormals fitted to a median and p90 (the body and the upper tail that
drives KV demand), clipped to the observed range; the realised figures are in traces/README.md.

Sources (figures as summarised in ../shared/traces/PROVENANCE.md, computed over every row):

- Mooncake conversation trace: Qin et al., "Mooncake: Trading More Storage for Less Computation -
  A KVCache-centric Architecture for Serving LLM Chatbot", FAST 2025 (kvcache-ai/Mooncake,
  FAST25-release/traces). Input tokens mean 12,035 / median 6,909 / p90 27,367 / min 891;
  output median 350 / p90 597 / max 2,000; 3.40 req/s with a per-3 s count CV of 0.33, which is
  what Poisson arrivals give at that rate (1/sqrt(10.2) = 0.31).
- Azure LLM inference trace 2023, conversation: Patel et al., "Splitwise: Efficient generative LLM
  inference using phase splitting", ISCA 2024 (Azure/AzurePublicDataset). 5.530 req/s, IAT CV 1.09;
  prompt median 1,020 / p90 2,734.5 / min 2 / max 14,050; output median 129 / p90 424 / min 7 /
  max 1,000.
- Burstiness: Wang et al., "BurstGPT: A Real-world Workload Dataset to Optimize LLM Serving
  Systems" (2024) fit Gamma inter-arrival times with shape < 1 to production ChatGPT/GPT-4 traffic;
  the Azure 2023 code trace has an IAT CV of 13.15; ServeGen (Xiang et al., arXiv:2505.09999)
  reports a rate-weighted mean per-client IAT CV of 3.58 (p90 5.52) on Alibaba Bailian.

``multiturn`` (``multi_turn_chat``) is no fitted preset but a generator of conversations whose
turns share prefixes, as chat clients resend the whole conversation every turn: each turn's
prompt is the previous prompt, the previous answer and a new user message, after one of a few
system prompts shared by every conversation. It writes Mooncake-format ``hash_ids`` (one id per
512-token block; a block wholly inside the previous turn's prompt keeps its id, a system
prompt's full blocks have the same ids in every conversation), so prefix caching has something
to find. Answer lengths are the Azure conversation lognormal below; the other figures (turns per
conversation, think time, message and system prompt lengths) are assumptions stated in
``MULTITURN``, not fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from pydantic import ValidationError

from pagedweight.config.workload import SyntheticWorkload, parse_workload
from pagedweight.errors import ConfigError, format_validation_error

if TYPE_CHECKING:
    from pagedweight.workload.traces import RequestTrace

_AZURE_CONV_LENGTHS = {
    "kind": "lognormal",
    "prompt": {"median": 1020, "p90": 2734.5, "min": 2, "max": 14050},
    "output": {"median": 129, "p90": 424, "min": 7, "max": 1000},
}


@dataclass(frozen=True)
class SynthPreset:
    workload: SyntheticWorkload
    max_context_tokens: int
    description: str


def _preset(arrival: dict, lengths: dict, description: str) -> SynthPreset:
    """Ten minutes of ``arrival`` and ``lengths``, fitted to a 32,768-token context (Mixtral's)."""
    workload = parse_workload({"kind": "synthetic", "arrival": arrival, "lengths": lengths, "duration_s": 600})
    return SynthPreset(workload, max_context_tokens=32768, description=description)


SYNTH_PRESETS: dict[str, SynthPreset] = {
    "longctx": _preset(
        # Mooncake served 3.4 req/s on a cluster; 2 req/s of ~10k-token prompts is enough to
        # fill an H200's KV space beside FP16 Mixtral-8x7B weights.
        {"kind": "poisson", "rate_qps": 2.0},
        {
            "kind": "lognormal",
            # Clipped so prompt + output fits Mixtral-8x7B's 32,768-token context.
            "prompt": {"median": 6909, "p90": 27367, "min": 891, "max": 30000},
            "output": {"median": 350, "p90": 597, "min": 1, "max": 2000},
        },
        "long prompts like Mooncake's conversation trace (FAST'25), Poisson 2 req/s, 10 min",
    ),
    "chat": _preset(
        {"kind": "gamma", "rate_qps": 5.53, "cv": 1.09},
        _AZURE_CONV_LENGTHS,
        "Azure 2023 conversation-like (Splitwise, ISCA'24): Gamma 5.53 req/s, CV 1.09, 10 min",
    ),
    # Same mean rate and lengths as chat: only the burstiness differs. A 10-minute sample
    # underestimates a heavy-tailed CV (over 200 seeds, process CV 4.0 measured a median of
    # 3.97, 10th percentile 3.74; CV 4.5 measured 4.44, 10th percentile 4.14), so the process
    # uses 4.5 for the shipped file to measure >= 4.
    "burst": _preset(
        {"kind": "gamma", "rate_qps": 5.53, "cv": 4.5},
        _AZURE_CONV_LENGTHS,
        "bursty (BurstGPT-style Gamma arrivals, CV 4.5) with Azure conversation lengths, 10 min",
    ),
}


@dataclass(frozen=True)
class MultiTurnSettings:
    conversation_rate_qps: float = 1.0  # new conversations per second (Poisson)
    mean_turns: float = 4.0  # turns per conversation: geometric, at most max_turns
    max_turns: int = 20
    mean_think_s: float = 20.0  # gap between a turn's arrival and the next (exponential)
    num_system_prompts: int = 4
    system_tokens: tuple[float, float, int, int] = (1200, 3000, 100, 8000)  # median, p90, min, max
    user_tokens: tuple[float, float, int, int] = (150, 600, 5, 4000)
    output_tokens: tuple[float, float, int, int] = (129, 424, 7, 1000)  # Azure conversation
    duration_s: float = 600.0
    max_context_tokens: int = 32768  # a conversation ends before a turn would exceed it
    block_tokens: int = 512  # Mooncake's hash_ids block


MULTITURN = MultiTurnSettings()
MULTITURN_DESCRIPTION = (
    "multi-turn chat: 1 conversation/s, ~4 turns 20 s apart, each turn resending the conversation "
    "after one of 4 shared system prompts; Mooncake hash_ids; 10 min"
)


def _lognormal_tokens(rng: np.random.Generator, spec: tuple[float, float, int, int], n: int | None = None):
    median, p90, lo, hi = spec
    sigma = np.log(p90 / median) / 1.2815515655446004  # z of the 90th percentile
    x = np.clip(np.rint(rng.lognormal(np.log(median), sigma, size=n)), lo, hi)
    return x.astype(np.int64) if n is not None else int(x)


def multi_turn_chat(
    seed: int, settings: MultiTurnSettings = MULTITURN, duration_s: float | None = None
) -> RequestTrace:
    """Conversations whose turns share prefixes (module docstring), in arrival order."""
    from pagedweight.workload.traces import RequestTrace

    rng = np.random.default_rng(seed)
    st = settings
    horizon_s = st.duration_s if duration_s is None else duration_s
    bt = st.block_tokens
    next_id = 0

    def new_ids(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    system_len = _lognormal_tokens(rng, st.system_tokens, st.num_system_prompts)
    system_ids = [new_ids(int(n) // bt) for n in system_len]
    rows: list[tuple[float, int, int, list[int]]] = []
    t = rng.exponential(1.0 / st.conversation_rate_qps)
    while t < horizon_s:
        s = int(rng.integers(0, st.num_system_prompts))
        turns = min(int(rng.geometric(1.0 / st.mean_turns)), st.max_turns)
        prev_len, prev_ids = int(system_len[s]), system_ids[s]  # the shared part: full blocks only
        history, arrival = int(system_len[s]), t
        for _ in range(turns):
            prompt = history + _lognormal_tokens(rng, st.user_tokens)
            output = _lognormal_tokens(rng, st.output_tokens)
            if prompt + output > st.max_context_tokens or arrival >= horizon_s:
                break
            # A block wholly inside the previous prompt (or the system prompt) is the same block.
            keep = min(prev_len // bt, len(prev_ids))
            ids = prev_ids[:keep] + new_ids(-(-prompt // bt) - keep)
            rows.append((arrival, prompt, output, ids))
            prev_len, prev_ids = prompt, ids
            history = prompt + output
            arrival += rng.exponential(st.mean_think_s)
        t += rng.exponential(1.0 / st.conversation_rate_qps)
    if not rows:
        raise ConfigError(f"multi-turn chat: no conversation starts within {horizon_s:g} s")
    rows.sort(key=lambda r: r[0])  # stable: a conversation's turns keep their order
    arrival_s = np.array([r[0] for r in rows])
    hash_ids = np.empty(len(rows), dtype=object)
    for i, r in enumerate(rows):
        hash_ids[i] = np.asarray(r[3], dtype=np.int64)
    return RequestTrace(
        arrival_s=np.round((arrival_s - arrival_s[0]) * 1000) / 1000,  # whole ms, as the file keeps
        prompt_tokens=np.array([r[1] for r in rows], dtype=np.int64),
        output_tokens=np.array([r[2] for r in rows], dtype=np.int64),
        source=f"synth:multiturn:seed={seed}",
        hash_ids=hash_ids,
    )


def synthesize(
    kind: str,
    seed: int,
    *,
    duration_s: float | None = None,
    num_requests: int | None = None,
    rate_qps: float | None = None,
    cv: float | None = None,
) -> RequestTrace:
    """Generate the preset ``kind`` with optional overrides; the same seed gives the same trace."""
    from pagedweight.workload.build import build_workload  # pandas-backed; kept out of the CLI's start-up

    if kind == "multiturn":
        if num_requests is not None or rate_qps is not None or cv is not None:
            raise ConfigError("kind multiturn takes only --duration-s among the overrides")
        return multi_turn_chat(seed, duration_s=duration_s)
    if kind not in SYNTH_PRESETS:
        raise ConfigError(f"kind(={kind!r}) must be one of {', '.join([*SYNTH_PRESETS, 'multiturn'])}")
    preset = SYNTH_PRESETS[kind]
    data = preset.workload.model_dump()
    if duration_s is not None or num_requests is not None:
        data["duration_s"], data["num_requests"] = duration_s, num_requests
    if rate_qps is not None:
        data["arrival"]["rate_qps"] = rate_qps
    if cv is not None:
        data["arrival"] = {"kind": "gamma", "rate_qps": data["arrival"]["rate_qps"], "cv": cv}
    try:
        workload = parse_workload(data)
    except ValidationError as e:  # an override out of range: name it, as a scenario error would
        raise ConfigError(format_validation_error(e, "the overrides", SyntheticWorkload, data)) from None
    trace = build_workload(workload, ".", preset.max_context_tokens, np.random.default_rng(seed))
    return trace.with_changes(source=f"synth:{kind}:seed={seed}")
