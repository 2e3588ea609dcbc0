"""The longest test files reach the xdist workers first (tests/xdist_order.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

import pytest

from tests import xdist_order


@dataclass
class _Item:
    nodeid: str


def test_files_go_longest_first_and_each_keeps_its_order() -> None:
    items = [_Item(n) for n in ("a.py::1", "a.py::2", "b.py::1", "new.py::1", "c.py::1", "c.py::2")]
    seconds = {"a.py": 0.5, "b.py": 30.0, "c.py": 4.0}
    ordered = xdist_order.longest_first(cast(Any, items), seconds)
    assert [i.nodeid for i in ordered] == ["b.py::1", "c.py::1", "c.py::2", "new.py::1", "a.py::1", "a.py::2"]


def test_an_unreadable_seconds_file_orders_nothing(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    for text in ("not json", "[1, 2]"):
        bad = tmp_path / "file_seconds.json"
        bad.write_text(text)
        monkeypatch.setattr(xdist_order, "SECONDS_FILE", bad)
        assert xdist_order.file_seconds() == {}


def test_the_committed_seconds_name_only_files_that_exist() -> None:
    root = xdist_order.SECONDS_FILE.parent.parent
    known = json.loads(xdist_order.SECONDS_FILE.read_text())
    assert known and all((root / name).is_file() for name in known)
