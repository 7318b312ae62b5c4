"""pwgpu: the real engine (PyTorch + Triton) running the same ``pagedweight`` scheduler and
controller as ``pwsim``, plus the profiler that writes the latency tables ``pwsim`` reads."""
