"""The suite's load accounting (benchmarks/suite/load.py) on real processes of this machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(_ROOT))

from benchmarks.suite import load  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux /proc")


def test_usage_attributes_what_the_run_did_not_use_to_others() -> None:
    before = load.Sample(0.0, [1.0, 1.0, 1.0], busy_s=100.0, self_s=1.0, tested_s=10.0, idle_s=5.0)
    after = load.Sample(10.0, [2.0, 1.5, 1.0], busy_s=118.0, self_s=2.0, tested_s=24.0, idle_s=5.5)
    got = load.usage(before, after, cores=2)
    # 18 s busy: 1 + 14 the run, 0.5 its idle systems, 2.5 others = 12.5% of 2 cores x 10 s
    assert got["run_cpu_s"] == 15.0 and got["idle_systems_cpu_s"] == 0.5
    assert got["foreign_cpu_s"] == 2.5 and got["foreign_share"] == 0.125 and got["flagged"]
    quiet = load.usage(before, load.Sample(10.0, [1, 1, 1], 115.5, 2.0, 24.0, 5.5), cores=2)
    assert quiet["foreign_cpu_s"] == 0.0 and not quiet["flagged"]  # clipped, never negative
    assert got["steal_cpu_s"] == 0.0  # samples without steal readings: none


def test_time_the_hypervisor_stole_is_recorded_but_not_flagged() -> None:
    before = load.Sample(0.0, [1.0] * 3, busy_s=100.0, self_s=1.0, tested_s=10.0, idle_s=5.0, steal_s=40.0)
    after = load.Sample(10.0, [1.0] * 3, busy_s=115.0, self_s=2.0, tested_s=24.0, idle_s=5.0, steal_s=44.0)
    got = load.usage(before, after, cores=2)
    assert got["steal_cpu_s"] == 4.0 and got["steal_share"] == 0.2 and not got["flagged"]
    assert load.machine_steal_s() >= 0.0


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


@pytest.mark.timing
def test_group_cpu_tells_a_spinning_process_from_a_sleeping_one() -> None:
    spinner = _child("import time\nend = time.time() + 30\nwhile time.time() < end: pass")
    sleeper = _child("import time; time.sleep(30)")
    try:
        spin = load.idle_cpu_share([spinner.pid], 1.0)
        rest = load.idle_cpu_share([sleeper.pid], 1.0)
    finally:
        for proc in (spinner, sleeper):
            proc.kill()
            proc.wait(timeout=10)
    assert spin > 0.3  # a whole core, less what the other tests on this machine take
    assert rest < load.IDLE_CPU_LIMIT
    assert load.group_cpu_s([]) == 0.0
    assert load.machine_busy_s() > 0.0
