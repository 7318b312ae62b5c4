# The two entry points the README gives. `make test` is also exactly what CI runs (.ci/run).
PY ?= python3

.PHONY: test run
test:  ## install (CPU build of torch first: a plain `torch` requirement pulls a CUDA build) and run the tests
	$(PY) -m pip install -q torch==2.13.0 && $(PY) -m pip install -q -e '.[dev,gpu]' && $(PY) -m pytest

run:  ## install the simulator and run the main scenario
	$(PY) -m pip install -q -e . && pwsim run scenarios/longctx.yaml
