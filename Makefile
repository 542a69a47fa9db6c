# Two set-up commands: `make demo` (main job on a built-in default) and `make test` (lint, then the tests).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
export ADVISOR_DATA_DIR ?= $(CURDIR)/.data

.PHONY: demo test lint install bench clean browser

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build. Bring your own CUDA build
# with `make install TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[test,hf]'
	touch $@

install: $(VENV)/.installed

# The main job on a built-in default: tune a small preset on this CPU (local Ray, SQLite store in
# $(ADVISOR_DATA_DIR)), then show the stored best and an estimate for a GPU. A rerun resumes the study.
demo: install
	$(BIN)/advisor tune --workload tiny-gpt2 --workload-arg seq_len=128 --hardware cpu --space quick --trials 6
	$(BIN)/advisor results best
	$(BIN)/advisor estimate --workload gpt2-small --hardware h100-sxm --batch-size 8 --precision bf16

# The page's test drives Debian's Chromium; where it is required (CI) and missing, install it (root).
browser:
	@if [ "$$ADVISOR_TEST_BROWSER" = required ] && ! command -v chromium >/dev/null; then \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
	  || (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null); fi

# ruff's rules and line length are in pyproject.toml; `make test` runs it first.
lint: install
	$(BIN)/ruff check .

# Two pytest workers, each taking whole test files (their module fixtures are set up once): the
# suite waits on subprocesses, Ray and real runs as much as it computes, so two overlap those waits
# well on two cores. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: install lint browser
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The estimator's CPU benchmarks, each into the results file BENCHMARKS.md reads, then the page recomposed.
# Each runs with a data dir of its own, so no stored peak refines it; about two hours on two cores.
bench: install
	ADVISOR_DATA_DIR=$$(mktemp -d) $(BIN)/python bench/estimate_accuracy.py --precisions fp32 --skip maxbatch,speed --out bench/results/accuracy-fp32.json
	ADVISOR_DATA_DIR=$$(mktemp -d) $(BIN)/python bench/estimate_accuracy.py --precisions bf16 --skip maxbatch,speed --out bench/results/accuracy-bf16.json
	ADVISOR_DATA_DIR=$$(mktemp -d) $(BIN)/python bench/estimate_accuracy.py --skip accuracy,speed --out bench/results/maxbatch.json
	ADVISOR_DATA_DIR=$$(mktemp -d) $(BIN)/python bench/estimate_accuracy.py --skip accuracy,maxbatch --out bench/results/speed.json
	$(BIN)/python bench/compose_benchmarks.py

clean:
	rm -rf $(VENV) .data .pytest_cache
