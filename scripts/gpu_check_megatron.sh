#!/usr/bin/env bash
# The megatron-core part of the GPU check: check 1 of scripts/gpu_check.sh (docs/gpu_check.md), which installs
# the carried wheels with `python3 -m pip install --no-index --no-deps --target` (a `venv --system-site-packages`
# made from the GPU machine's python3, itself a venv, does not see its torch).
#   scripts/gpu_check_megatron.sh --download   # here (PyPI): the wheels into .wheels/ (scripts/gpu_check.sh --download)
#   scripts/gpu_check_megatron.sh              # there, with .wheels/ carried along with the tree
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--download" ]; then exec scripts/gpu_check.sh --download; fi
exec scripts/gpu_check.sh --only 1 "$@"
