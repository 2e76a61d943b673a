# The two commands a newcomer needs:  `make serve`  and  `make test`.
VENV   ?= .venv
PYTHON ?= python3
BIN    := $(VENV)/bin

.PHONY: install serve test lint bench
install: $(VENV)/.installed

# torch first, pinned: that CPU build lies on the machine's disk (see DEVELOPERS.md);
# any other torch request pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

# The embedded default: gateway on 127.0.0.1:8000, small and large demo engines, SQLite.
serve: install
	$(BIN)/tollway serve

test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy
