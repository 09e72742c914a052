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

.PHONY: venv system-deps test test-fast demo lint format clean bench bench-list gpu-test gpu-wheels gpu-rehearsal

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

# Two workers (pytest-xdist), a file at a time each: most tests wait on processes they
# started, so two at once on 2 cores finish in ~2/3 of the time (docs/benchmarks.md).
XDIST := -n 2 --dist loadfile --no-loadscope-reorder

test: venv system-deps
	$(PY) -m pytest -q $(XDIST) tests

# The unit tier alone (a few minutes on 2 cores), for the edit-run loop; `make test` is the
# whole suite (docs/benchmarks.md: what each tier costs and the mutations it catches).
test-fast: venv
	$(PY) -m pytest -q $(XDIST) tests/unit

demo: venv
	bash examples/demo.sh

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Every benchmark that runs on its defaults, then one table of their ratios and goals
# (benchmarks/run_all.py); `make bench-list` prints what each measures and its goal.
bench: venv
	$(PY) -m benchmarks.run_all

bench-list: venv
	$(PY) -m benchmarks.run_all --list

# The GPU tier (tests/gpu; docs/gpus.md). `make gpu-test` runs where $(GPU_PYTHON) (default
# python3 on PATH) already has torch's CUDA build (>= 2.6) and sees a GPU. It checks that first
# (else every test would skip and the run pass), and that
# $(GPU_WHEELS), when there, was built for its Python and platform; installs those wheels
# with --no-deps into the private folder $(GPU_SITE), first on PYTHONPATH with the tree
# (nothing of the machine's own packages is replaced, no package install, no bundled mpirun);
# checks requirements/gpu.txt is met; runs tests/gpu; writes $(GPU_REPORT)/report.md and
# report.json. `make gpu-wheels` (on a machine that reaches PyPI) fills $(GPU_WHEELS) for
# the target's Python $(GPU_TARGET_PYTHON) and platform $(GPU_TARGET_PLATFORM), with what
# requirements/gpu.txt needs and $(GPU_INSTALLED), the target's `pip list --format=freeze`,
# lacks (the default: the lent GPU nodes' list); it prints the size (at most 64 MiB carried).
GPU_PYTHON ?= python3
GPU_WHEELS ?= build/gpu_wheels
GPU_SITE ?= build/gpu_site
GPU_REPORT ?= build/gpu_report
GPU_TARGET_PYTHON ?= 3.12
GPU_TARGET_PLATFORM ?= manylinux_2_28_x86_64
GPU_INSTALLED ?= requirements/gpu_node_py312.txt
LLAMA_INDEX_CORE := llama-index-core==0.14.25

gpu-wheels: venv
	$(PY) tools/gpu_wheels.py build --python-version $(GPU_TARGET_PYTHON) \
	    --platform $(GPU_TARGET_PLATFORM) --installed $(GPU_INSTALLED) --out $(GPU_WHEELS)

gpu-test:
	@$(GPU_PYTHON) tools/gpu_wheels.py check --wheels $(GPU_WHEELS)
	@if [ -f $(GPU_WHEELS)/wheelhouse.json ]; then rm -rf $(GPU_SITE) && \
	    $(GPU_PYTHON) -m pip install -q --no-index --no-deps --target $(GPU_SITE) \
	        $(GPU_WHEELS)/*.whl || exit 2; fi
	@PYTHONPATH=$(CURDIR)/$(GPU_SITE):$(CURDIR) $(GPU_PYTHON) tools/gpu_wheels.py deps
	PYTHONPATH=$(CURDIR)/$(GPU_SITE):$(CURDIR) GPU_REPORT_DIR=$(GPU_REPORT) \
	    $(GPU_PYTHON) -m pytest -q -rs -p no:cacheprovider tests/gpu; \
	    status=$$?; echo "gpu-test: report in $(GPU_REPORT)/report.md"; exit $$status

# A rehearsal on CPU of the lent nodes' stack (docs/gpus.md; not part of `make test`): a venv
# of $(GPU_REHEARSAL_PYTHON) with $(GPU_INSTALLED)'s versions from PyPI (torch's wheel there is
# its CUDA build: with its CUDA libraries ~5 GiB), rebuilt when that list changes; the
# wheelhouse built for it and installed as gpu-test does; the CPU tiers' other packages at
# requirements/cpu.txt and dev.txt pins; then, one at a time, the CPU tests that touch
# versioned APIs (torch, transformers, numpy, DeepSpeed) and the collection of tests/gpu.
GPU_REHEARSAL ?= build/gpu_rehearsal
GPU_REHEARSAL_PYTHON ?= python3.12
GPU_REHEARSAL_TESTS ?= tests/unit \
    tests/distributed/test_engine_zero.py tests/distributed/test_engine_device.py \
    tests/distributed/test_taco_tp.py tests/distributed/test_sas_tp.py \
    tests/e2e/test_export_hf.py tests/e2e/test_wordpiece.py tests/e2e/test_word_order_probe.py
REHEARSAL_PY := $(GPU_REHEARSAL)/venv/bin/python
REHEARSAL_ENV := PYTHONPATH=$(CURDIR)/$(GPU_REHEARSAL)/site:$(CURDIR) \
    TORCH_EXTENSIONS_DIR=$(CURDIR)/$(GPU_REHEARSAL)/torch_extensions

# The node's packages alone (no test extras yet): what the wheelhouse is built against.
$(GPU_REHEARSAL)/installed.txt: $(GPU_INSTALLED)
	rm -rf $(GPU_REHEARSAL)/venv && $(GPU_REHEARSAL_PYTHON) -m venv $(GPU_REHEARSAL)/venv
	$(PY) tools/gpu_wheels.py rehearsal --installed $(GPU_INSTALLED) \
	    --wheels /nonexistent --out $(GPU_REHEARSAL)
	$(REHEARSAL_PY) -m pip install -q --only-binary=:all: -r $(GPU_REHEARSAL)/node.txt
	$(REHEARSAL_PY) -m pip list --format=freeze > $@.tmp && mv $@.tmp $@

gpu-rehearsal: venv $(GPU_REHEARSAL)/installed.txt
	$(PY) tools/gpu_wheels.py build --platform $(GPU_TARGET_PLATFORM) \
	    --python-version $$($(REHEARSAL_PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])') \
	    --installed $(GPU_REHEARSAL)/installed.txt --out $(GPU_REHEARSAL)/wheels
	$(PY) tools/gpu_wheels.py rehearsal --installed $(GPU_INSTALLED) \
	    --wheels $(GPU_REHEARSAL)/wheels --out $(GPU_REHEARSAL)
	$(REHEARSAL_PY) -m pip install -q --only-binary=:all: -r $(GPU_REHEARSAL)/extras.txt \
	    -c $(GPU_REHEARSAL)/node.txt
	$(REHEARSAL_PY) -m pip install -q --no-deps $(LLAMA_INDEX_CORE)
	rm -rf $(GPU_REHEARSAL)/site && $(REHEARSAL_PY) -m pip install -q --no-index --no-deps \
	    --target $(GPU_REHEARSAL)/site $(GPU_REHEARSAL)/wheels/*.whl
	$(REHEARSAL_ENV) $(REHEARSAL_PY) tools/gpu_wheels.py deps
	$(REHEARSAL_ENV) $(REHEARSAL_PY) -m pytest -qq -p no:cacheprovider --collect-only tests/gpu
	status=0; for t in $(GPU_REHEARSAL_TESTS); do echo "gpu-rehearsal: $$t"; \
	    $(REHEARSAL_ENV) $(REHEARSAL_PY) -m pytest -q -p no:cacheprovider $$t || status=1; \
	done; exit $$status

clean:
	rm -rf build demo_output .pytest_cache
