"""The machine's load while the suite runs: whose CPU time went where (Linux ``/proc``).

The suite compares systems measured one after another on the same cores, so
anything else using those cores biases a comparison.  For every workload run
the runner takes a :class:`Sample` before and after and records, with
:func:`usage`: the load average, the machine's busy CPU seconds, those of the
run itself (the suite's process and the systems it started, by process
group), and what is left, the *foreign* CPU seconds of processes that are not
part of the run.  Idle servers of the run that stay up between their turns
are counted apart (``idle_systems_cpu_s``): they should cost nothing.  On a
virtual machine the hypervisor may also run other guests on the cores: the
time it *stole* from this one (``steal_cpu_s``, ``/proc/stat``'s steal) makes
every process slower without showing up as anyone's CPU time, so it is recorded
too (not flagged: nothing on the machine can stop it, but runs with much of it
are slower, and runs of different systems are compared within a repeat).

Invariants: every function returns zeros (never raises) where ``/proc`` is
missing or unreadable; ``foreign_cpu_s >= 0`` (clipped: the readings are not
atomic).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "FOREIGN_WARN_SHARE",
    "IDLE_CPU_LIMIT",
    "Sample",
    "group_cpu_s",
    "idle_cpu_share",
    "machine_busy_s",
    "machine_steal_s",
    "sample",
    "usage",
]

PROC = Path("/proc")
#: A workload is flagged when foreign processes used more than this share of the machine's CPU time.
FOREIGN_WARN_SHARE = 0.05
#: An idle system using more than this share of one core is stopped between its turns.
IDLE_CPU_LIMIT = 0.05


def _ticks() -> float:
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return float(os.sysconf("SC_CLK_TCK"))
    return 100.0


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy since boot (``/proc/stat``: all but idle and iowait)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = (PROC / "stat").read_text().splitlines()[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[:7])
        return (
            user + nice + system + irq + softirq
        ) / _ticks()  # guest time is inside user; steal is not ours
    return 0.0


def machine_steal_s() -> float:
    """CPU seconds the hypervisor gave other guests while this machine wanted them, since boot
    (``/proc/stat``'s eighth field; 0 on bare metal or where it is not reported)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int((PROC / "stat").read_text().splitlines()[0].split()[8]) / _ticks()
    return 0.0


def _stat_fields(pid: str) -> list[str] | None:
    try:
        text = (PROC / pid / "stat").read_text()
    except OSError:
        return None
    # the command name is in parentheses and may hold spaces: split after its closing one
    return text.rsplit(")", 1)[1].split()


def group_cpu_s(pgids: Iterable[int]) -> float:
    """CPU seconds (user + system, with reaped children) of the live processes in process groups ``pgids``."""
    wanted = {str(g) for g in pgids}
    if not wanted:
        return 0.0
    total = 0
    with contextlib.suppress(OSError):
        for entry in PROC.iterdir():
            if not entry.name.isdigit():
                continue
            fields = _stat_fields(entry.name)
            # after the name: state ppid pgrp session ... utime(12) stime(13) cutime(14) cstime(15)
            if fields is None or len(fields) < 15 or fields[2] not in wanted:
                continue
            total += sum(int(v) for v in fields[11:15])
    return total / _ticks()


def _self_cpu_s() -> float:
    fields = _stat_fields("self")
    if fields is None or len(fields) < 13:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _ticks()


def _loadavg() -> list[float]:
    with contextlib.suppress(OSError, ValueError):
        return [float(v) for v in (PROC / "loadavg").read_text().split()[:3]]
    return [0.0, 0.0, 0.0]


@dataclass(frozen=True)
class Sample:
    at: float  # time.monotonic()
    loadavg: list[float]
    busy_s: float  # the machine
    self_s: float  # the suite's own process
    tested_s: float  # the system under test
    idle_s: float  # the run's other systems, up but idle
    steal_s: float = 0.0  # the machine's time taken by the hypervisor


def sample(tested: Iterable[int], idle: Iterable[int] = ()) -> Sample:
    """A reading now; ``tested`` and ``idle`` are process groups of the run's systems."""
    return Sample(
        time.monotonic(),
        _loadavg(),
        machine_busy_s(),
        _self_cpu_s(),
        group_cpu_s(tested),
        group_cpu_s(idle),
        machine_steal_s(),
    )


def usage(before: Sample, after: Sample, cores: int) -> dict[str, Any]:
    """What happened between two samples (JSON-ready); ``flagged`` when foreign processes
    used more than :data:`FOREIGN_WARN_SHARE` of the machine's CPU time."""
    wall = max(after.at - before.at, 1e-9)
    busy = after.busy_s - before.busy_s
    own = (after.self_s - before.self_s) + (after.tested_s - before.tested_s)
    idle = after.idle_s - before.idle_s
    foreign = max(0.0, busy - own - idle)
    share = foreign / (wall * max(1, cores))
    steal = max(0.0, after.steal_s - before.steal_s)
    return {
        "wall_s": round(wall, 3),
        "loadavg_before": before.loadavg,
        "loadavg_after": after.loadavg,
        "machine_busy_cpu_s": round(busy, 3),
        "run_cpu_s": round(own, 3),
        "idle_systems_cpu_s": round(max(0.0, idle), 3),
        "foreign_cpu_s": round(foreign, 3),
        "foreign_share": round(share, 4),
        "steal_cpu_s": round(steal, 3),
        "steal_share": round(steal / (wall * max(1, cores)), 4),
        "flagged": share > FOREIGN_WARN_SHARE,
    }


def idle_cpu_share(pgids: Iterable[int], seconds: float = 3.0) -> float:
    """Share of one core the process groups ``pgids`` use over ``seconds`` (while nothing is sent to them)."""
    groups = list(pgids)
    start, t0 = group_cpu_s(groups), time.monotonic()
    time.sleep(seconds)
    return max(0.0, group_cpu_s(groups) - start) / max(time.monotonic() - t0, 1e-9)
