#!/usr/bin/env bash
# GPU check of length_surge on megatron-core: cuda/nccl, bf16, DistributedOptimizer, dist-checkpoint
# save/load (scripts/gpu_check_megatron.py; one line per check, under 2 minutes). For a one-GPU
# machine with Python 3.12 and a CUDA torch but no internet, verl, ray or megatron:
#   scripts/gpu_check_megatron.sh --download   # here (PyPI): the wheels below into .wheels/
#   scripts/gpu_check_megatron.sh              # there, with .wheels/ carried along with the tree
# Wheels (cp312, manylinux x86_64), each installed only if its import is missing there:
#   megatron-core==0.19.2 (2.4 MB), numpy, packaging (its requirements), psutil (its dist-checkpoint
#   writer needs it); 18 MB in all
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.wheels}
if [ "${1:-}" = "--download" ]; then
  pip download --quiet --only-binary=:all: --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64 \
    -d "$WHEELS" megatron-core==0.19.2 numpy packaging psutil
  ls -l "$WHEELS"
  exit 0
fi
VENV=${VENV:-/tmp/lrstab-gpu-venv}
test -x "$VENV/bin/python" || "${PYTHON:-python3}" -m venv --system-site-packages "$VENV"
for pkg in numpy:numpy packaging:packaging psutil:psutil megatron.core:megatron-core; do
  "$VENV/bin/python" -c "import ${pkg%%:*}" 2>/dev/null ||
    "$VENV/bin/pip" install --quiet --no-index --no-deps --find-links "$WHEELS" "${pkg##*:}"
done
PYTHONPATH=. timeout 110 "$VENV/bin/python" scripts/gpu_check_megatron.py
