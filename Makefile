# `make test` and `make demo` create .venv if missing and install unbroken with what it needs.
# torch is pinned to a CPU build that installs offline here; override with e.g.
# `make test TORCH=torch==2.15.0` (any torch >= 2.4 works).
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.unbroken-installed

.PHONY: test demo demo-loader demo-ddp demo-stream bench bench-stream mutate clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test,bench,demo]"
	touch $(STAMP)

# The type checker and the linter first (seconds), then the suite.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) demo/train_digits.py

demo-loader: $(STAMP)
	$(PY) demo/resume_demo.py

# torchrun on 2 CPU processes (gloo): one rank SIGKILLed 3 times, then resumed on 1 and 3 ranks.
demo-ddp: $(STAMP)
	$(PY) demo/train_digits_ddp.py

# A local S3 server (moto): digits streamed from Parquet shards, SIGKILLed 4 times, cache emptied once.
demo-stream: $(STAMP)
	$(PY) demo/train_digits_stream.py

bench: $(STAMP)
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/resume_latency.py
	$(PY) benchmarks/checkpoint_blocking.py
	$(PY) benchmarks/trainer_overhead.py
	$(PY) benchmarks/stream_overhead.py
	$(PY) benchmarks/ddp_loader.py
	$(PY) benchmarks/ddp_checkpoint.py
	$(PY) benchmarks/stream_peers.py

# unbroken vs MosaicML Streaming and LitData from a local S3 server (creates .venv-peers/ once).
bench-stream: $(STAMP)
	$(PY) benchmarks/stream_peers.py

# Mutation testing of the core modules with mutmut (slow: see TESTING.md). Configured in
# pyproject.toml's [tool.mutmut]; `make mutate MUTANTS="unbroken._shuffle*"` runs one module,
# MUTATE_CHILDREN sets the parallel workers. PYTHONPATH makes the tests' subprocesses import the
# mutated copy too. Results: `.venv/bin/mutmut results`, `.venv/bin/mutmut show NAME`.
MUTATE_CHILDREN ?= 1
MUTANTS ?=
mutate: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test,bench,demo,mutate]"
	PYTHONPATH=$(CURDIR)/mutants/src $(VENV)/bin/mutmut run --max-children $(MUTATE_CHILDREN) $(MUTANTS)
	$(VENV)/bin/mutmut results

clean:
	rm -rf $(VENV) .venv-peers .pytest_cache .hypothesis demo_output bench_output mutants
