# The two commands of the README (`make demo`, `make test`) do all the set-up on a fresh
# machine: they create .venv, install the pinned CPU stack and the package, then run.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# DeepSpeed JIT-builds a small op on first start; keep it in an ignored folder that is reused.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/build/torch_extensions
# Two cores: let torch's intra-op pool use them, but do not oversubscribe in multi-rank tests.
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv system-deps test demo lint format clean bench

venv: $(STAMP)

$(STAMP): requirements/cpu.txt requirements/dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/cpu.txt -r requirements/dev.txt
	# English punkt_tab sentence-splitter data ships inside this wheel; it is a data
	# carrier only, so none of its (many) dependencies are needed.
	$(PY) -m pip install -q --no-deps llama-index-core==0.14.25
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

# SLURM and munge (Debian's slurm-wlm, munge) for tests/e2e/test_slurm.py, which starts a
# one-node cluster of its own. Installed as root where apt-get exists and they are missing;
# elsewhere that test skips and says why.
system-deps:
	@export PATH="$$PATH:/usr/sbin:/sbin"; \
	if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
	    && command -v munged >/dev/null && command -v sbatch >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	        apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null; \
	else echo "system-deps: no slurm-wlm/munge and no root apt-get: the SLURM tests will skip"; fi

test: venv system-deps
	$(PY) -m pytest -q tests

demo: venv
	bash examples/demo.sh

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Every benchmarks/bench_*.py, then one table of their ratios and goals (benchmarks/run_all.py).
bench: venv
	$(PY) benchmarks/run_all.py

clean:
	rm -rf build demo_output .pytest_cache
