# The two commands of the README: `make run` (the main job) and `make test`.
# Both create .venv on first use; nothing else needs installing by hand.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev,ray,wandb,trl,verifiers]'
	touch $@

.PHONY: setup run test lint
setup: $(VENV)/.installed

# exit 3: the run was already finished (nothing ran; libra train says how to go on)
run: setup
	$(VENV)/bin/libra train examples/cpu-train.toml || [ $$? -eq 3 ]

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
