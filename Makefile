# Two entry points a newcomer needs: `make demo` and `make test` (see README.md).
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-slow lint clean

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

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV)
