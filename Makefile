# Two commands for a fresh machine: `make demo` (set up, then chat once with the default model) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# On these machines torch==2.13.0 is a CPU build on local disk; elsewhere override, e.g. TORCH_SPEC='torch>=2.5'.
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= Give me three tips for writing clear Python code.

.PHONY: install demo test lint
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q '$(TORCH_SPEC)'
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

demo: install
	$(VENV)/bin/dspark chat --once "$(PROMPT)" --max-tokens 256 --temperature 0.3 --top-p 0.9

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check dspark tests
	$(VENV)/bin/ruff format --check dspark tests
	$(VENV)/bin/lint-imports
