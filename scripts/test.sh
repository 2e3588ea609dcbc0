#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check src tests examples
python -m pytest "$@"
# (Both builds of the C ops, native and portable, are exercised inside the tests
# themselves: the kernel tests parametrize over them, on every CPU.)
