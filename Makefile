# The two entry points the README gives. `make test` is also exactly what CI runs (.ci/run).
PY ?= python3

.PHONY: test deps check run
test: deps check  ## install, then run both test tiers

deps:  ## the CPU build of torch first (a plain `torch` requirement pulls a CUDA build), then the project
	$(PY) -m pip install -q torch==2.13.0 && $(PY) -m pip install -q -e '.[dev,gpu]'

check:  ## both test tiers, nothing installed: the default tier, then the end-to-end one
	$(PY) -m pytest
	$(PY) -m pytest -m 'e2e and not slow and not gpu'

run:  ## install the simulator and run the main scenario
	$(PY) -m pip install -q -e . && pwsim run scenarios/longctx.yaml
