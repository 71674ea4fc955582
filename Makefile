# Each target bootstraps .venv: the pinned CPU build of torch first (a bare
# `torch` would pull a multi-GB CUDA build), then the project with test extras.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.zhflow-installed

.PHONY: run test test-fast bench bench-smoke clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)        ## the default pipeline on the built-in corpus
	$(BIN)/zhflow run $(ARGS)

test: $(STAMP)       ## the whole suite, slow tests included (the 15 slowest listed at the end)
	$(BIN)/python -m pytest -m "not bench" --durations=15 $(ARGS)

test-fast: $(STAMP)  ## unit tests only
	$(BIN)/python -m pytest -m "not slow" $(ARGS)

bench: $(STAMP)      ## benchmarks -> BENCHMARKS.md (ARGS=--quick for a short run)
	$(BIN)/python -m bench $(ARGS)

bench-smoke: $(STAMP)  ## every benchmark section on the smallest inputs, into a temporary report (about 20 minutes on 2 cores)
	$(BIN)/python -m pytest -m bench --durations=0 tests/test_bench.py $(ARGS)

clean:
	rm -rf .zhflow mlflow.db mlruns
