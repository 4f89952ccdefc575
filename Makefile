# Two commands do everything on a fresh machine: `make demo` and `make test`.
# GPU=1 uses the GPU host's own python3 with the project on PYTHONPATH: no venv, no installs.

SHELL := /bin/bash
VENV ?= .venv
GPU ?= 0
SEED ?= 0
TINY ?= build/inkling-tiny
TINY_FP4 ?= build/inkling-tiny-nvfp4
CKPT ?= $(TINY_FP4)
ENGINE ?= build/engine-tiny

ifeq ($(GPU),1)
PY := PYTHONPATH=$(CURDIR):$$PYTHONPATH python3
STAMP :=
else
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
endif

.PHONY: venv test lint unit test-gpu demo synth convert engine clean

venv: $(STAMP)

# torch is pinned here, before the project, so that pip takes the CPU build from local disk
# instead of resolving the loose range in pyproject.toml to a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $@

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

unit: $(STAMP)
	$(PY) -m pytest -q -m "not gpu" tests

test: lint unit

test-gpu:
	$(PY) -m pytest -q -m gpu tests

$(TINY)/config.json: $(STAMP)
	$(PY) -m inkling.synth --preset inkling-tiny --out $(TINY) --seed $(SEED) --force

synth: $(TINY)/config.json

# The NVFP4 checkpoint: routed experts quantized with ModelOpt, calibrated on built-in text.
$(TINY_FP4)/config.json: $(TINY)/config.json
	$(PY) -m convert --model_dir $(TINY) --output_dir $(TINY_FP4) --quant nvfp4 --force

convert: $(TINY_FP4)/config.json

# Our users' build step: CKPT= and ENGINE= point elsewhere; BUILD_ARGS= passes builder flags.
engine: $(STAMP) $(if $(filter $(TINY_FP4),$(CKPT)),$(TINY_FP4)/config.json)
	$(PY) -m builder --checkpoint_dir $(CKPT) --output_dir $(ENGINE) --force $(BUILD_ARGS)

# Synthesize, convert, build the engine, run a text+image+audio prompt through the runtime.
demo: engine
	$(PY) -m runtime.demo --engine_dir $(ENGINE) --model_dir $(CKPT)

clean:
	rm -rf build
