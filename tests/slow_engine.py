"""Slowing an in-process engine's steps, for tests that need a call still running when
its client gives up (a disconnect or a timeout mid-generation)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from parrot.engine.local import LocalEngine


def slow_each_step(monkeypatch: pytest.MonkeyPatch, engine: LocalEngine, seconds: float = 0.003) -> None:
    """Make every forward step of ``engine`` sleep ``seconds`` first, so that ``n`` steps
    take at least ``n * seconds`` whatever the machine.  ``monkeypatch`` restores the
    engine's own step at the end of the test (the engine fixture is shared)."""
    forward = engine.runner._forward

    def slowed() -> Any:
        time.sleep(seconds)
        return forward()

    monkeypatch.setattr(engine.runner, "_forward", slowed)
