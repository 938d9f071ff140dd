# Two entry points a newcomer needs: `make demo` and `make test` (see README.md).
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-slow lint clean vllm-env test-vllm llama-env

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/muser demo

# Two workers, one torch thread each (and in every daemon a test starts): the suite's tests
# are single-threaded, so on 2 cores it takes ~15 min instead of ~27. The fixtures are built
# first, so no two workers ever build one. `pytest tests/some_file.py` still runs serially.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(VENV)/bin/muser fixtures build
	$(VENV)/bin/ruff check .
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -n $(TEST_WORKERS)

test-slow: $(STAMP)
	$(VENV)/bin/pytest -m slow

# The vLLM target backend runs in its own environment (requirements-vllm.txt): vLLM pins
# its own torch and transformers, and .venv must never get it.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_UNWANTED := torchvision torchaudio torchcodec

$(VLLM_STAMP): pyproject.toml requirements-vllm.txt
	$(PY) -m venv --clear $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet -r requirements-vllm.txt -e '.[dev]'
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes $(VLLM_UNWANTED)
	$(VLLM_VENV)/bin/python -c "import torch, vllm; assert torch.version.cuda is None, torch.__version__"
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/muser fixtures build
	$(VLLM_VENV)/bin/pytest -m vllm

# llama.cpp, a bench peer only (muser_app/bench/llama_peer.py): its source comes vendored in
# the llama-cpp-python sdist; two tools are built with cmake into .llama (6 min on 2 cores).
LLAMA_DIR := .llama
LLAMA_VERSION := 0.3.36
LLAMA_SRC := $(LLAMA_DIR)/llama_cpp_python-$(LLAMA_VERSION)/vendor/llama.cpp
LLAMA_STAMP := $(LLAMA_DIR)/.built

$(LLAMA_STAMP):
	mkdir -p $(LLAMA_DIR)
	$(PY) -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_VERSION) -d $(LLAMA_DIR)
	tar -xzf $(LLAMA_DIR)/llama_cpp_python-$(LLAMA_VERSION).tar.gz -C $(LLAMA_DIR)
	cmake -S $(LLAMA_SRC) -B $(LLAMA_DIR)/build -G Ninja -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
	cmake --build $(LLAMA_DIR)/build --target llama-speculative llama-lookup
	touch $(LLAMA_STAMP)

llama-env: $(LLAMA_STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMA_DIR)
