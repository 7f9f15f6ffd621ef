# Two commands do all the set-up on a fresh machine (see README):
#   make run   -- create .venv, install slogym, run the quick leaderboard on embedded scenarios (no downloads)
#   make test  -- install the dev dependencies and run the test suite (what CI runs, via .ci/run)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check

.PHONY: run test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.core: pyproject.toml | $(BIN)/python
	$(PIP) -e .
	touch $@

# torch first and pinned (the CPU wheel); an unpinned resolve would pull CUDA builds. The rl extra lets the
# learned agents run (on the leaderboard too).
$(VENV)/.rl: pyproject.toml $(VENV)/.core
	$(PIP) torch==2.13.0
	$(PIP) -e ".[rl]"
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.rl
	$(PIP) -e ".[dev,rl,ray]"
	touch $@

run: $(VENV)/.rl
	$(BIN)/slogym leaderboard --quick --out out/leaderboard

test: $(VENV)/.dev
	$(BIN)/python -m pytest tests

bench: $(VENV)/.rl
	taskset -c 0 $(BIN)/python scripts/bench/sim_speed.py

clean:
	rm -rf $(VENV) .pytest_cache
