# kvpilot: every set-up step lives here, so `make demo` and `make test` work on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Caches live outside the clone so repeated runs (and CI on a clean clone) reuse them.
export PIP_CACHE_DIR ?= $(HOME)/.cache/pip
export KVPILOT_CACHE_DIR ?= $(HOME)/.cache/kvpilot
# Python's default, where an environment turned it off (PYTHONDONTWRITEBYTECODE=1, as some CI
# images do): compiled modules are kept in __pycache__ (ignored by git and by the image's
# build), so the test workers and the hundreds of servers and CLIs they start do not compile
# kvpilot afresh each time (make test-fast: 262 s -> 246 s here).
export PYTHONDONTWRITEBYTECODE :=
include e2e/cluster.mk

.PHONY: dev lint test test-fast image demo autotune-bench gateway-bench clean

# uv installs from its cache (~/.cache/uv, outside the clone) by hard links, so a clean clone's
# `make dev` takes seconds once the cache is warm, where pip unpacked several GB of torch wheels
# each time (about 2.5 min here). pip does it where uv cannot be had or fails.
export UV_CACHE_DIR ?= $(HOME)/.cache/uv
define venv_install
	@# `python -m` puts the working directory on sys.path, where operator/ would shadow the
	@# standard library's `operator`: bootstrap from / and use the venv's scripts.
	@test -x $(PY) || (cd / && $(PYTHON) -m venv $(CURDIR)/$(VENV))
	@$(VENV)/bin/pip install --quiet 'uv>=0.9,<1' || echo "uv unavailable: installing with pip"
	@if test -x $(VENV)/bin/uv && $(VENV)/bin/uv pip install --python $(PY) --system-certs \
	    $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) -e '.[$(1)]'; then :; else \
	  $(VENV)/bin/pip install --upgrade --quiet pip && \
	  $(VENV)/bin/pip install --progress-bar on -e '.[$(1)]'; fi
	@touch $@
endef

$(VENV)/.installed: pyproject.toml
	$(call venv_install,dev)

dev: $(VENV)/.installed

# The demo's own process drives the cluster, the load and the plot: the operator's packages and
# matplotlib, not torch (a few hundred MB instead of several GB). `make dev` adds the rest.
$(VENV)/.installed-demo: pyproject.toml
	$(call venv_install,demo)

lint: dev
	$(VENV)/bin/ruff check .

# The e2e tests (e2e/, the local cluster) with the unit tests (tests/) beside them under nice:
# the e2e tests mostly wait on pods and the autotuner's windows. Prints each part's 20 slowest
# tests and the whole run's time, so a CI log shows where its minutes go. JOBS: xdist workers
# for the unit tests.
JOBS ?= 2
test: dev lint node-deps
	@JOBS=$(JOBS) e2e/test-all.sh

# The unit tests alone: no cluster, no GPU; xdist over the machine's cores.
test-fast: dev
	$(VENV)/bin/pytest -q -n $(JOBS) --dist loadfile --durations=20 tests

# kvpilot's two images from the Containerfile's targets, kvpilot/operator:<version> (no torch)
# and kvpilot/engine:<version>, built on this machine without a registry (buildah; Debian bases
# made with mmdebstrap; root). Writes an OCI archive each for `ctr -n k8s.io images import`
# under $(KVPILOT_CACHE_DIR)/images and prints their paths; rebuilt only when an input changes.
image: node-deps
	e2e/image/build.sh

# The product's front door: local cluster, chart, a mis-tuned LLMDeployment in mode Auto,
# load and a live table until the autotuner fixes it; KEEP=1 leaves it all running.
demo: $(VENV)/.installed-demo node-deps
	$(PY) e2e/demo.py

# The headline benchmark. First, in virtual time on a SIMULATED H100 (minutes): a day of
# traffic with every contender (defaults, a static sweep, KEDA/WVA/HPA rules, Auto) and the
# field guide's three failure cases. Then the same day compressed to 15 minutes in real time
# on the local cluster (simulated H100 pods, real operator, Prometheus, HPA controller and
# KEDA), against the same compressed day in virtual time. Last, the stationary run on the
# tiny model's real engine pods. Writes results/.
# Before those: public production traces (Azure LLM inference 2023, conversation and code,
# each at its real rate and with arrivals x4), each with a 50 % split and clients that give up
# after 60 s, and the day; today's figures printed beside the ones before issue 38
# (docs/autotune-bench-before.json). The traces are downloaded once into $(TRACES).
CONTEST := $(VENV)/bin/kvpilot autotune contest --out results
TRACES ?= $(KVPILOT_CACHE_DIR)/traces
AZURE_TRACES := https://raw.githubusercontent.com/Azure/AzurePublicDataset/master/data
TRACE_CONTEST := $(VENV)/bin/kvpilot autotune contest --out results/traces --split 0.5 --sweep
autotune-bench: dev node-deps
	@mkdir -p $(TRACES) results/traces
	$(VENV)/bin/pytest -q -m keda e2e/test_keda.py  # the real KEDA scales, kvpilot leaves replicas to it
	for f in conv code; do test -s $(TRACES)/AzureLLMInferenceTrace_$$f.csv || curl -fsSL -o $(TRACES)/AzureLLMInferenceTrace_$$f.csv $(AZURE_TRACES)/AzureLLMInferenceTrace_$$f.csv || exit 1; done
	for f in conv code; do for x in 1 4; do $(TRACE_CONTEST) --trace $(TRACES)/AzureLLMInferenceTrace_$$f.csv --trace-format azure2023 --trace-rate-scale $$x --client-timeout 60 || exit 1; done; done
	$(TRACE_CONTEST) --scenario day --sweep-seqs 128,256 --sweep-mbt 8192 --sweep-lens 32768
	$(VENV)/bin/kvpilot autotune bench-table results/traces/contest-*.json --before docs/autotune-bench-before.json
	$(CONTEST) --scenario day --sweep --sweep-seqs 128,256 --sweep-lens 32768
	for s in preemption long-max-model-len scheduler-bound; do $(CONTEST) --scenario $$s || exit 1; done
	$(PY) e2e/day_contest.py --out results
	$(PY) e2e/autotune_bench.py

# The gateway's figures: prefix-aware vs round-robin vs least-loaded on four SIMULATED L4 engines
# (local processes), its overhead against direct-to-engine on a real tiny-model engine at
# concurrency 64, and 20 cold starts from zero through the gateway on the local cluster.
gateway-bench: dev node-deps
	@mkdir -p results
	$(VENV)/bin/kvpilot gateway-bench prefix --json results/gateway-prefix.json
	$(VENV)/bin/kvpilot gateway-bench overhead --json results/gateway-overhead.json -- --model builtin:tiny --max-model-len 512
	$(PY) e2e/scale_from_zero_bench.py --cold-starts 20

clean:
	rm -rf $(VENV) build *.egg-info
