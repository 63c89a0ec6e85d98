# `make test` and `make demo` create .venv if missing and install unbroken with what it needs.
# torch is pinned to a CPU build that installs offline here; override with e.g.
# `make test TORCH=torch==2.15.0` (any torch >= 2.4 works).
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.unbroken-installed
# What the demos need alone (`make demo` on a fresh machine installs no test or benchmark tools).
DEMO_STAMP := $(VENV)/.unbroken-demo-installed

.PHONY: test test-fast docs wheel demo demo-loader demo-ddp demo-stream demo-spot demo-hf bench bench-stream mutate clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test,bench,demo]"
	touch $(STAMP) $(DEMO_STAMP)

$(DEMO_STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[demo]"
	touch $(DEMO_STAMP)

# The type checker and the linter first (seconds), then the suite.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q --durations=25

# The development tier (TESTING.md): no test that starts processes of its own, no torchrun,
# S3 server, Lightning or transformers.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not distributed and not s3 and not lightning and not hf"

# The documentation site, strict: a broken link, anchor or API reference fails the build.
DOCS_STAMP := $(VENV)/.unbroken-docs-installed
$(DOCS_STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# A wheel of this checkout (dist/unbroken-VERSION-py3-none-any.whl) to install on other machines:
# pip install "dist/unbroken-0.1.0-py3-none-any.whl[hf]". Needs only pip (it fetches setuptools).
wheel:
	$(PYTHON) -m pip wheel -q --disable-pip-version-check --no-deps -w dist .

demo: $(DEMO_STAMP)
	$(PY) demo/train_digits.py

demo-loader: $(DEMO_STAMP)
	$(PY) demo/resume_demo.py

# torchrun on 2 CPU processes (gloo): one rank SIGKILLed 3 times, then resumed on 1 and 3 ranks.
demo-ddp: $(DEMO_STAMP)
	$(PY) demo/train_digits_ddp.py

# A local S3 server (moto): digits streamed from Parquet shards, SIGKILLed 4 times, cache emptied once.
demo-stream: $(STAMP)
	$(PY) demo/train_digits_stream.py

# The run directory on a local S3 server (moto); every restart a new machine with an empty disk:
# SIGKILLed 4 times (once mid-upload) and preempted once (SIGTERM, then SIGKILL after a grace).
demo-spot: $(STAMP)
	$(PY) demo/train_digits_spot.py

# transformers.Trainer with unbroken.hf: SIGKILLed mid-epoch and inside a checkpoint write,
# resumed, compared with an uninterrupted run (installs transformers and accelerate once).
HF_STAMP := $(VENV)/.unbroken-hf-installed
$(HF_STAMP): $(DEMO_STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e ".[demo,hf]"
	touch $(HF_STAMP)

demo-hf: $(HF_STAMP)
	$(PY) demo/train_hf.py

# Every side-by-side benchmark, in RESULTS.md's order (~84 min on 2 idle cores, goodput.py ~47 of
# them: 4 failure traces x 9 configurations of a 45-s job, run one at a time; goodput_ranks.py ~8;
# stream_peers.py creates .venv-peers/ once), each writing bench_output/NAME.json; then
# benchmarks/report.py draws benchmarks/plots/*.png and rewrites the generated section of
# benchmarks/RESULTS.md. A failing benchmark does not stop the others, but make fails at the end.
# `make bench-quick`: the same with every script's --quick (~12 min, 3 of them stream_peers.py's,
# 3.5 goodput.py's, 2.5 goodput_ranks.py's; checks the pipeline, its numbers are noise).
# BENCH_FLAGS: more flags for every script; BENCHMARKS="a b": only those.
BENCHMARKS := overhead resume_latency trainer_overhead trainer_ddp cold_calls loader_tiny lightning_resume hf_resume checkpoint_blocking \
	stream_overhead ddp_loader ddp_checkpoint ddp_reduction stream_peers remote_checkpoint goodput \
	goodput_ranks unit_costs save_keep
BENCH_FLAGS ?=
define run-benchmarks
@failed=""; for b in $(BENCHMARKS); do \
	rm -f bench_output/$$b.json; \
	cmd="$(PY) benchmarks/$$b.py --json bench_output/$$b.json $(strip $(1))"; \
	echo "=== $$cmd"; $$cmd || failed="$$failed $$b"; \
done; \
$(PY) benchmarks/report.py --failed "$$failed" --flags="$(strip $(1))" || failed="$$failed report.py"; \
if [ -n "$$failed" ]; then echo "make bench: failed:$$failed" >&2; exit 1; fi
endef

bench: $(STAMP)
	$(call run-benchmarks,$(BENCH_FLAGS))

.PHONY: bench-quick
bench-quick: $(STAMP)
	$(call run-benchmarks,--quick $(BENCH_FLAGS))

# On a CUDA machine (450 s at most): the Trainer vs a hand DDP loop with NCCL on every GPU and
# in one process, exact_reduce vs DDP's all-reduce with 3+ GPUs, and a SIGKILLed CUDA job resumed
# bit for bit; all in bench_output/gpu.json. Offline: no install, this checkout's src/ first on
# the path, with .venv's python if there is one, else GPU_PY (a python whose torch has CUDA).
# Without a GPU it says so and exits 0; BENCH_FLAGS=--device=cpu runs a dry run on CPU.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
.PHONY: bench-gpu
bench-gpu:
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) benchmarks/gpu.py \
		--json bench_output/gpu.json $(BENCH_FLAGS)

# unbroken vs MosaicML Streaming and LitData from a local S3 server (creates .venv-peers/ once).
bench-stream: $(STAMP)
	$(PY) benchmarks/stream_peers.py

# A 3-rank torchrun job under 5 SIGKILLs and a SIGSTOP of one rank at a time, periodic saves vs
# just-in-time saves (~8 min): bench_output/goodput_ranks.json, which bench-goodput-sim reads.
.PHONY: bench-goodput-ranks
bench-goodput-ranks: $(STAMP)
	$(PY) benchmarks/goodput_ranks.py $(BENCH_FLAGS)

# Goodput of a 1,000- and a 16,384-GPU job at Llama 3's failure rate, simulated (seconds): fixed,
# auto and just-in-time saves. With bench_output/goodput_ranks.json (the 3-rank goodput runs), also
# with their measured costs, and their failures replayed against their measured goodput.
.PHONY: bench-goodput-sim
bench-goodput-sim: $(STAMP)
	f=bench_output/goodput_ranks.json; \
	$(PY) benchmarks/goodput_sim.py $$(test -f $$f && echo --measured $$f --check $$f) $(BENCH_FLAGS)

# Mutation testing of the core modules with mutmut (slow: see TESTING.md). Configured in
# pyproject.toml's [tool.mutmut]; `make mutate MUTANTS="unbroken.data.bijection*"` runs one module,
# MUTATE_CHILDREN sets the parallel workers. PYTHONPATH makes the tests' subprocesses import the
# mutated copy too. Results: `.venv/bin/mutmut results`, `.venv/bin/mutmut show NAME`.
MUTATE_CHILDREN ?= 1
MUTANTS ?=
mutate: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test,bench,demo,mutate]"
	PYTHONPATH=$(CURDIR)/mutants/src $(VENV)/bin/mutmut run --max-children $(MUTATE_CHILDREN) $(MUTANTS)
	$(VENV)/bin/mutmut results

clean:
	rm -rf $(VENV) .venv-peers .pytest_cache .hypothesis demo_output bench_output mutants site
