# `make test` and `make demo` create .venv if missing and install unbroken with what it needs.
# torch is pinned to a CPU build that installs offline here; override with e.g.
# `make test TORCH=torch==2.15.0` (any torch >= 2.4 works).
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.unbroken-installed

.PHONY: test demo demo-loader bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test,bench,demo]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) demo/train_digits.py

demo-loader: $(STAMP)
	$(PY) demo/resume_demo.py

bench: $(STAMP)
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/resume_latency.py
	$(PY) benchmarks/checkpoint_blocking.py
	$(PY) benchmarks/trainer_overhead.py
	$(PY) benchmarks/stream_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis demo_output bench_output
