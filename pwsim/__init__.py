"""pwsim: the SimPy serving simulator. Runs the unchanged ``pagedweight`` scheduler and
controller, timing each step from latency tables instead of executing kernels."""
