"""The per-expert pass of the roofline's MoE time (``pwsim.roofline``), compiled.

Per step and rank, ``moe_s`` needs each routed expert's time (its tokens at the compute roof or
its weight read, whichever is longer; 0 when no token routes to it) and how many (layer,
precision class) kernel launches the active ones take. As numpy passes that is 4-10 calls a
step (a mask, a product, a maximum, a cast, an index, a bincount, two counts), each paying its
dispatch: ~18 us a step on Mixtral-8x7B in a running simulation.
Here it is one loop compiled with numba; the sum of the times stays numpy's (``np.dot``, whose
order is BLAS's), so each rank's total is the same float as before: a product ``x * 1.0`` or
``x * 0.0`` is exact, so the dot of the masked times with ones is the dot of the times with the
mask. ``tests/test_latency.py`` checks it against the numpy passes, which run where numba is not
installed. Compiled on first use, like ``pwsim.routing_kernels``' loops.
"""

from __future__ import annotations

import functools

import numpy as np

from pagedweight.compiled import available, numba_module


def _expert_times_loop(tokens, s_per_token, read_s, keys, num_keys, out, num_calls):
    seen = np.zeros(num_keys, dtype=np.bool_)
    for r in range(tokens.shape[0]):
        calls = 0
        for e in range(tokens.shape[1]):
            t = tokens[r, e]
            if t > 0:
                a = t * s_per_token[r, e]
                b = read_s[r, e]
                out[r, e] = a if a >= b else b  # np.maximum (no NaN here)
                k = keys[r, e]
                if not seen[k]:
                    seen[k] = True
                    calls += 1
            else:
                out[r, e] = 0.0
        num_calls[r] = calls


@functools.cache
def _loop():
    return numba_module().njit(cache=True)(_expert_times_loop)


def _expert_times_numpy(tokens, s_per_token, read_s, keys, num_keys, out, num_calls):
    active = tokens > 0
    np.multiply(tokens, s_per_token, out=out)
    np.maximum(out, read_s, out=out)
    out *= active
    num_calls[:] = np.count_nonzero(np.bincount(keys[active], minlength=num_keys).reshape(len(num_calls), -1), axis=1)


def expert_times_into(compiled: bool | None = None):
    """The pass of ``expert_times`` writing into the caller's ``out`` and ``num_calls``:
    ``f(tokens, s_per_token, read_s, keys, num_keys, out, num_calls)``, the numba loop (default
    where numba is installed) or the numpy passes. A caller that times every step keeps its
    buffers and calls it directly: the allocations and this module's dispatch were half the
    pass's cost on Mixtral-8x7B (1.5 against 0.7 us)."""
    return _loop() if (available() if compiled is None else compiled) else _expert_times_numpy


def expert_times(tokens, s_per_token, read_s, keys, num_keys, compiled: bool | None = None):
    """Per rank (rows of the 2-D inputs, each rank's experts flattened): the experts' times
    (``out``, 0 where inactive) and the distinct active ``keys`` (launches);
    ``keys`` of different ranks must not collide, all below ``num_keys``. ``compiled``: the
    numba loop (default where numba is installed) or the numpy passes (the same values)."""
    out = np.empty(tokens.shape)
    num_calls = np.empty(tokens.shape[0], dtype=np.int64)
    expert_times_into(compiled)(tokens, s_per_token, read_s, keys, num_keys, out, num_calls)
    return out, num_calls
