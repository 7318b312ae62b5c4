"""numba, for the few per-element loops that numpy cannot express in whole-array passes (the
routing sampler's, the roofline's, the CSV writer's, the prefix cache's key map's). Imported on
first use, so that commands which never reach such a loop do not pay its import (~0.4 s); every
loop keeps a plain-Python or numpy form that runs where numba is not installed."""

from __future__ import annotations

import functools


@functools.cache
def numba_module():
    """numba, imported on first use; None where it is not installed."""
    try:
        import numba
    except ImportError:  # a platform without numba's wheels
        return None
    return numba


def available() -> bool:
    """Whether numba is installed, so that the compiled loops run."""
    return numba_module() is not None
