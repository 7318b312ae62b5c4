"""PagedWeight's shared core: specs, the unified page pool, scheduling, policy and metrics.

Pure Python + numpy; it never imports torch, triton or simpy, so that both runtimes
(``pwsim`` and ``pwgpu``) run exactly this code.
"""

__version__ = "0.1.0"
