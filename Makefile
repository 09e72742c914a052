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

.PHONY: venv system-deps test demo lint format clean bench gpu-test gpu-wheels

venv: $(STAMP)

$(STAMP): requirements/cpu.txt requirements/dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/cpu.txt -r requirements/dev.txt
	# English punkt_tab sentence-splitter data ships inside this wheel; it is a data
	# carrier only, so none of its (many) dependencies are needed.
	$(PY) -m pip install -q --no-deps $(LLAMA_INDEX_CORE)
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

# The GPU tier (tests/gpu; README "GPUs"). `make gpu-test` runs where $(GPU_PYTHON) (default
# python3 on PATH, e.g. an activated venv) already has torch's CUDA build: it installs the
# other dependencies offline from $(GPU_WHEELS) when that folder is there (else they must be
# installed, README "GPU install"), the package itself, then tests/gpu, and writes one report,
# $(GPU_REPORT)/report.md and report.json. `make gpu-wheels`, on a machine that reaches PyPI
# with the same Python version and platform, fills $(GPU_WHEELS) (ignored by git: copy it
# along with the tree): a wheel of every dependency but torch and its CUDA libraries, pinned
# as the CPU venv resolved them, DeepSpeed as a pure-Python wheel (its ops not prebuilt:
# DeepSpeed JIT-builds an op on first use, and this project uses none on GPUs).
GPU_PYTHON ?= python3
GPU_WHEELS ?= build/gpu_wheels
GPU_REPORT ?= build/gpu_report
LLAMA_INDEX_CORE := llama-index-core==0.14.25

# What gpu-test needs besides torch, the pins of requirements/cpu.txt and dev.txt (what
# gpu-wheels packs): without them pytest or an import would fail halfway, with a traceback.
# Not needed to run the tier: the linter, and MPICH's wheel (a cluster may use its own MPI).
define GPU_DEPS_CHECK
import importlib.metadata as meta, re, sys
pins = [re.split(r"[=<>~!; ]", line.strip())[0] for name in ("cpu", "dev")
        for line in open(f"requirements/{name}.txt") if line.strip()[:1] not in ("", "#")]
missing = []
for pin in pins:
    try:
        meta.distribution(pin)
    except meta.PackageNotFoundError:
        missing.append(pin)
missing = [pin for pin in missing if pin not in ("torch", "ruff", "mpich")]
if missing:
    print(f"gpu-test: {sys.executable} lacks {', '.join(missing)}: install them (pip install "
          "-r <(grep -v '^torch' requirements/cpu.txt) -r requirements/dev.txt), or run make "
          "gpu-wheels where PyPI is reachable and copy its folder here", file=sys.stderr)
    sys.exit(2)
endef
export GPU_DEPS_CHECK

gpu-wheels: venv
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PY) -m pip freeze --exclude-editable \
	    | grep -viE '^(torch|triton|nvidia-[a-z0-9-]*|deepspeed)(==| @)' > $(GPU_WHEELS)/pinned.txt
	grep -iE '^setuptools==' requirements/dev.txt >> $(GPU_WHEELS)/pinned.txt
	$(PY) -m pip wheel -q --no-deps --wheel-dir $(GPU_WHEELS) -r $(GPU_WHEELS)/pinned.txt
	DS_BUILD_OPS=0 $(PY) -m pip wheel -q --no-deps --no-build-isolation --wheel-dir $(GPU_WHEELS) \
	    $$(grep -iE '^deepspeed==' requirements/cpu.txt)
	{ grep -v '^torch' requirements/cpu.txt; cat requirements/dev.txt; } > $(GPU_WHEELS)/requirements.txt
	$(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])' > $(GPU_WHEELS)/python-version
	@echo "gpu-wheels: $$(ls $(GPU_WHEELS)/*.whl | wc -l) wheels, $$(du -sh $(GPU_WHEELS) | cut -f1), in $(GPU_WHEELS)"

gpu-test:
	@$(GPU_PYTHON) -c 'import torch' 2>/dev/null || { echo "gpu-test: $(GPU_PYTHON) cannot import \
	torch: install torch's CUDA build first (README, GPU install), or set GPU_PYTHON"; exit 2; }
	@if [ -d $(GPU_WHEELS) ]; then \
	    want=$$(cat $(GPU_WHEELS)/python-version); \
	    have=$$($(GPU_PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
	    if [ "$$want" != "$$have" ]; then echo "gpu-test: $(GPU_WHEELS) holds wheels for \
	Python $$want, $(GPU_PYTHON) is Python $$have: run make gpu-wheels with Python $$have"; \
	        exit 2; fi; \
	    $(GPU_PYTHON) -m pip install -q --no-index --find-links $(GPU_WHEELS) \
	        -r $(GPU_WHEELS)/requirements.txt && \
	    $(GPU_PYTHON) -m pip install -q --no-index --find-links $(GPU_WHEELS) --no-deps \
	        $(LLAMA_INDEX_CORE) || exit 2; \
	fi
	@$(GPU_PYTHON) -c "$$GPU_DEPS_CHECK"
	$(GPU_PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	GPU_REPORT_DIR=$(GPU_REPORT) $(GPU_PYTHON) -m pytest -q -rs tests/gpu; \
	    status=$$?; echo "gpu-test: report in $(GPU_REPORT)/report.md"; exit $$status

clean:
	rm -rf build demo_output .pytest_cache
