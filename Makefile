# Two entry points a newcomer needs: `make demo` and `make test` (see README.md).
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-slow lint clean vllm-env test-vllm

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/muser demo

test: $(STAMP)
	$(VENV)/bin/muser fixtures build
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest

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

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) $(VLLM_VENV)
