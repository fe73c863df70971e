# Set-up and entry points. Every target installs what it needs into $(VENV) first.
# torch is installed before verl: a bare torch requirement would pull a multi-GB CUDA build.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
STAMP   := $(VENV)/.verl-lrstab-installed
TORCH   ?= torch==2.13.0
# verl 0.9.1's main_ppo imports these at run time without declaring them (CPU_PATH.md);
# the verl[...] extras would replace the CPU torch, so they are not used.
VERL    ?= verl==0.9.1 cachetools fastapi uvicorn TransferQueue==0.1.11

.PHONY: install demo test test-unit test-e2e bench repro repro-ci clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet $(VERL)
	$(PIP) install --quiet -e '.[test,plot]'
	$(PY) -c "import torch, verl, verl_lrstab; print('torch', torch.__version__, '| verl', verl.__version__, '| verl-lrstab', verl_lrstab.__version__)"
	touch $(STAMP)

## The main job: verl's real main_ppo on CPU with lr_scheduler_type=length_surge (< 10 min).
demo: install
	$(PY) scripts/demo.py

## What CI runs: unit tests + the smallest end-to-end runs of verl's trainer.
test: install
	$(PY) -m pytest -m "not slow" -q -rs

test-unit: install
	$(PY) -m pytest -m "not e2e" -q

## Every end-to-end check, larger forms included (V0 and V1, resume, stock parity).
test-e2e: install
	$(PY) -m pytest -m e2e -q -rs

bench: install
	$(PY) scripts/bench_overhead.py
	$(PY) scripts/bench_detector.py

## CPU-scale reproduction of the paper's comparison (scripts/repro/README.md): 6 arms x 3 seeds;
## repro-ci is its small form (also run by make test as tests/e2e/test_repro_ci.py).
repro: install
	$(PY) scripts/repro/all.py

repro-ci: install
	$(PY) scripts/repro/all.py --ci

clean:
	rm -rf $(VENV) .assets outputs .pytest_cache
