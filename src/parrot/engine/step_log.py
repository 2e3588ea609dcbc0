"""A log of the steps an engine runs while it serves: what each computed and how long it took.

Enabled by the engine option ``step_log`` (``parrot serve|engine --step-log
FILE``), it appends one JSON line per step that ran a forward::

    {"prefill_tokens": 412, "decode_seqs": 9, "kv_tokens_read": 5120,
     "prefill_pairs": 61234, "seconds": 0.183, "at": 1796201234.512}

The quantities are :func:`~parrot.engine.core.step_work.step_work`'s for the step as
planned; ``seconds`` runs from the start of the step (reaping, admission,
planning) to the end of its sampling, so it holds everything the worker does per
step in a served run, with the rest of the server sharing the cores; ``at`` is
the wall-clock time (Unix seconds) the step ended, which places steps in a run
and shows the time the engine sat idle between them.  The
simulator's calibration fits its cost model to such lines
(``python -m benchmarks.sim.calibrate --from-step-log FILE``).  Steps of the
latency probe's fabricated contexts are not logged.

The file is opened once, line-buffered, and written from the engine's worker
thread only; a write that fails (disk full, say) turns the log off with one
warning and never fails a step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import IO

from parrot.engine.core.step_work import StepWork

log = logging.getLogger(__name__)

__all__ = ["StepLog", "read_step_log"]


class StepLog:
    """Appends a JSON line per step to ``path`` (created with its parent folders)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.steps = 0

    def record(self, work: StepWork, seconds: float) -> None:
        if self._file is None:
            return
        line = json.dumps({**asdict(work), "seconds": round(seconds, 6), "at": round(time.time(), 3)})
        try:
            self._file.write(line + "\n")
        except OSError as exc:
            log.warning("step log %s: %s; no more steps are logged", self.path, exc)
            self.close()
            return
        self.steps += 1

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            with contextlib.suppress(OSError):  # what it could not write is lost, as the warning said
                file.close()


def read_step_log(path: str | Path) -> list[tuple[StepWork, float]]:
    """The (work, seconds) of every line of a step log (``at``, where a line has it, is
    left out); a line that is not one (for instance the last, cut short by a crash)
    raises ValueError naming its number."""
    out: list[tuple[StepWork, float]] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                seconds = float(row.pop("seconds"))
                row.pop("at", None)
                work = StepWork(**row)
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}:{number}: not a step-log line ({exc})") from None
            out.append((work, seconds))
    return out
