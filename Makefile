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

.PHONY: venv test lint unit test-slow test-gpu demo synth convert engine serve bench bench-decode bench-mtp bench-long-context bench-serving train bench-needle bench-acceptance clean

venv: $(STAMP)

# torch is pinned here, before the project, so that pip takes the CPU build from local disk
# instead of resolving the loose range in pyproject.toml to a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[dev]'
	# The Triton server binary and its Python backend; --no-deps: its numpy<2 pin would downgrade the venv
	# (the stubs get their own NumPy 1 environment, model_repo/serve.py).
	$(VENV)/bin/pip install -q --no-deps nvidia-pytriton==0.7.0
	touch $@

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

unit: $(STAMP)
	$(PY) -m pytest -q -m "not gpu and not slow" --durations=25 tests

test: lint unit

# The longest CPU cases (tests/conftest.py SLOW), left out of `make test` to keep CI under 20 minutes.
test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow and not gpu" tests

test-gpu:
	$(PY) -m pytest -q -m gpu tests

# inkling-tiny, the real Inkling at toy widths, in the published layout (BF16).
$(TINY)/config.json: $(STAMP)
	$(PY) -m inkling.published.synth --preset inkling-tiny --out $(TINY) --seed $(SEED) --force

synth: $(TINY)/config.json

# The published NVFP4 layout: routed experts but the first MoE layer's quantized with ModelOpt,
# calibrated on built-in text through transformers.
$(TINY_FP4)/config.json: $(TINY)/config.json
	$(PY) -m convert.published --model_dir $(TINY) --output_dir $(TINY_FP4) --force

convert: $(TINY_FP4)/config.json

# Our users' build step: CKPT= and ENGINE= point elsewhere; BUILD_ARGS= passes builder flags.
engine: $(STAMP) $(if $(filter $(TINY_FP4),$(CKPT)),$(TINY_FP4)/config.json)
	$(PY) -m builder --checkpoint_dir $(CKPT) --output_dir $(ENGINE) --force $(BUILD_ARGS)

# Synthesize, convert, build the engine; a text+image+audio prompt through the runtime (checked against
# the reference model), then through Triton Inference Server with tritonclient, streamed.
demo: engine
	$(PY) -m runtime.demo --engine_dir $(ENGINE) --model_dir $(CKPT)
	$(PY) -m model_repo.demo --engine_dir $(ENGINE)

HOST ?= 127.0.0.1
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 8080
SERVE_ARGS ?=
# Triton on ENGINE= (build it with `make engine`); SERVE_ARGS= e.g. --instances preprocessing=2 --num-blocks N
serve: $(STAMP)
	$(PY) -m model_repo.serve --engine $(ENGINE) --host $(HOST) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) --openai-port $(OPENAI_PORT) $(SERVE_ARGS)

# The end-to-end workload (8K in / 1K out) on inkling-bench (the real Inkling's six NVFP4 MoE layers at full
# width), synthesized and built in GPU memory: `make GPU=1 bench` on the GPU host; BENCH_ARGS= to change
# shapes (e.g. the CPU smoke shape of tests/e2e/test_bench_smoke.py). Two parts of at most ten minutes each on
# one H200 (each one `make bench-PART` of its own where a machine is lent ten minutes at a time), then one
# table and plot of both in $(BENCH_DIR)/results.md and e2e.png: first tokens and decode batches; MTP with 3
# drafts every step. The decode batches sample (temperature 1, a seed per user).
BENCH_ARGS ?= --preset inkling-bench --device cuda --cuda_graphs
BENCH_DIR ?= build/bench-e2e
bench: bench-decode bench-mtp
	$(PY) -m bench.e2e --merge --out $(BENCH_DIR)

bench-decode: $(STAMP)
	$(PY) -m bench.e2e $(BENCH_ARGS) --decode_budget_s 45 --temperature 1 --out $(BENCH_DIR)/decode

bench-mtp: $(STAMP)
	$(PY) -m bench.e2e $(BENCH_ARGS) --num_draft_tokens 3 --fixed_drafts \
		--tune_max_tokens 256 --decode_budget_s 30 --temperature 1 --out $(BENCH_DIR)/mtp

# The long path on inkling-bench (one GPU, at most ten minutes): first tokens and inter-token latency at 8K,
# 128K, 256K and 1M against their bounds, a short request beside a 256K prompt, 4 users at 256K.
bench-long-context: $(STAMP)
	$(PY) -m bench.long_context --out $(BENCH_DIR)/long_context

# AIPerf (NVIDIA's load generator) lives in a venv of its own: it brings 1.2 GB of dependencies the
# project does not need.
AIPERF_VENV ?= build/aiperf-venv
$(AIPERF_VENV)/bin/aiperf:
	python3 -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install -q aiperf==0.13.0

bench-serving: $(STAMP) $(AIPERF_VENV)/bin/aiperf
	$(PY) -m bench.serving --engine $(ENGINE) --aiperf $(AIPERF_VENV)/bin/aiperf

# The small trained real Inkling (train/published.py): data/inkling-small-published was made this way on one
# H200 (`make GPU=1 train` on the GPU host, with transformers on PYTHONPATH); TRAIN_ARGS= to change it.
TRAIN_ARGS ?= --steps 1035 --qk_norm_lr_scale 10
train: $(STAMP)
	$(PY) -m train.published --out build/inkling-small-published --force $(TRAIN_ARGS)

# Needle in a haystack (engine beside transformers) and MTP acceptance on data/inkling-small-published (CPU,
# float32; bench.long_needle's GPU run goes to 1M tokens).
bench-needle: $(STAMP)
	$(PY) -m bench.long_needle --device cpu --lengths 512,1024,2048,4096 --depths 0.1,0.5,0.9 --out build/needle

bench-acceptance: $(STAMP)
	$(PY) -m bench.acceptance --out build/acceptance

clean:
	rm -rf build
