#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The session page's browser tests (tests/test_dag_page.py) drive the system's Chromium
# through its ChromeDriver: install both when missing (never a downloaded browser).
# Where that cannot be done, those tests skip and say why.
if ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1 && command -v apt-get >/dev/null; then
    as_root=()
    if [ "$(id -u)" -ne 0 ]; then as_root=(sudo -n); fi
    { "${as_root[@]}" apt-get update -qq \
        && "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } \
        || echo "scripts/test.sh: could not install chromium and chromium-driver; the browser tests will skip" >&2
fi
. .venv/bin/activate
ruff check src tests examples
python -m pytest "$@"
if [ $# -eq 0 ]; then
    # The engine's kernel tests again with the portable build of the C ops as the
    # engine's library (no -march=native, no AVX-512/AMX code: what other CPUs run).
    # (test_amx_linear, test_f32_linear and test_shared_kernel build the native library
    # themselves and check that the portable one refuses: the run above covers them.)
    PARROT_CPU_KERNEL=portable python -m pytest tests/test_cpu_kernel.py tests/test_fused_ops.py \
        tests/test_decode_forward.py tests/test_attention.py
fi
