#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The session page's browser tests (tests/test_dag_page.py) drive the system's Chromium
# through its ChromeDriver: install both when missing (never a downloaded browser).
# Where that cannot be done the run stops here, unless PARROT_SKIP_BROWSER_TESTS=1 asks
# for those tests to skip (they then say why).
if ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1; then
    as_root=()
    if [ "$(id -u)" -ne 0 ]; then as_root=(sudo -n); fi
    if ! { command -v apt-get >/dev/null \
        && "${as_root[@]}" apt-get update -qq \
        && "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; }; then
        if [ "${PARROT_SKIP_BROWSER_TESTS:-}" != 1 ]; then
            echo "scripts/test.sh: could not install chromium and chromium-driver for the browser tests;" \
                "set PARROT_SKIP_BROWSER_TESTS=1 to run without them" >&2
            exit 1
        fi
        echo "scripts/test.sh: no browser; the browser tests will skip (PARROT_SKIP_BROWSER_TESTS=1)" >&2
    fi
fi
. .venv/bin/activate
# Bytecode is cached for this run even where the machine sets PYTHONDONTWRITEBYTECODE: the
# workers, and the servers and engines the tests start as processes, then compile Parrot and
# pytest's rewritten test modules once, not each in turn (collection alone went from 16 s to 8 s).
unset PYTHONDONTWRITEBYTECODE
ruff check src tests examples
# Two workers (pytest-xdist), a test file each at a time (a module's fixtures, such as its
# model or server, are built once), the longest files first (tests/xdist_order.py); tests
# marked ``timing`` run with no other test beside them (tests/xdist_timing.py).
# PARROT_TEST_WORKERS=0 runs in this process, one at a time.
if [ "${PARROT_TEST_WORKERS:-2}" = 0 ]; then
    python -m pytest "$@"
else
    python -m pytest -n "${PARROT_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
fi
# (Both builds of the C ops, native and portable, are exercised inside the tests
# themselves: the kernel tests parametrize over them, on every CPU.)
