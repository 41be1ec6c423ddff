# Two commands do all the set-up on a fresh machine:
#   make demo   convert the real all-MiniLM-L6-v2, distil it for a few minutes, report fidelity before and after
#   make test   run the test suite
# Both create .venv with the CPU build of torch first (an unpinned torch pulls gigabytes of CUDA packages).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench fidelity clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e ".[dev,demo,bench]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) finetune/minilm_demo.py --out outputs/demo

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check performer_hf tests benchmarks conversion finetune

bench: $(STAMP)
	$(PY) benchmarks/attention.py --out benchmarks/results/attention_cpu

fidelity: $(STAMP)
	$(PY) conversion/minilm_fidelity.py --seeds 3 --out conversion/results

clean:
	rm -rf $(VENV) outputs .pytest_cache
