"""The example applications run end to end (against the tiny model, so fast)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("app", ["chain_summary.py", "map_reduce.py"])
def test_example_app_runs(live, app):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / app),
            "--url",
            live.url,
            "--max-tokens",
            "8",
            "--chunk-words",
            "150",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    # the tiny model's tokenizer is byte-level, so chunks must be small to fit its context
    chunks = int(re.search(r"words in (\d+) chunks", out.stdout).group(1))
    assert chunks > 5 and "Final summary:" in out.stdout
    submits = [r for r in live.requests if r[0] == "POST" and r[1].endswith("/calls")]
    assert len(submits) == chunks + (app == "map_reduce.py")  # one call per chunk (+ the reduce)
