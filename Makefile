# radixgate: the two commands of the README are `make demo` and `make test`.
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: setup engine demo up up-two-models up-sim test lint unit clean

setup:            ## gateway virtualenv (.venv) + Debian redis-server
	bash scripts/setup_gateway.sh

engine:           ## SGLang CPU engine virtualenv + converted SmolLM2-135M-Instruct (in $RADIXGATE_HOME, default ~/.cache/radixgate)
	bash scripts/engine/setup.sh

demo: setup engine  ## Redis + a CPU SGLang worker + the gateway; real requests; stops everything at the end
	$(PY) scripts/demo.py $(ARGS)

up: setup engine    ## like demo, but keeps the stack running until Ctrl-C
	$(PY) scripts/demo.py --keep $(ARGS)

up-two-models: setup engine  ## like up, with two models: SmolLM2 on the CPU worker and a simulated sim-llama-3.1-8b (docs/models.md)
	$(PY) scripts/two_models.py --keep $(ARGS)

up-sim: setup      ## compose.yaml's sim topology as local processes: Redis, 2 gateway processes, 3 simulated workers, Prometheus (docs/scaling.md); until Ctrl-C
	$(PY) scripts/up_sim.py --keep $(ARGS)

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check service tenancy policies loadgen tests scripts
	.venv/bin/mypy

unit: setup       ## tests that need no engine (Redis is started by the fixtures)
	$(PY) -m pytest -q -m "not engine and not deep_fuzz and not soak"

test: setup engine lint  ## everything CI runs
	$(PY) -m pytest -q -ra --durations=25

clean:
	rm -rf .venv .run .pytest_cache .mypy_cache .ruff_cache
