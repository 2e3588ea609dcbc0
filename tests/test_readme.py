"""The README's application example runs as written (against the tiny model)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_example_runs(live, monkeypatch, capsys):
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## An application\n\n```python\n(.*?)```", readme, re.S)
    assert block, "README lost its application example"
    code = block.group(1).replace("http://127.0.0.1:9000", live.url)
    monkeypatch.chdir(ROOT)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    printed = capsys.readouterr().out
    assert printed.strip()
    sid_calls = [r for r in live.requests if r[0] == "POST" and r[1].endswith("/calls")]
    paragraphs = (ROOT / "examples/data/lighthouses.txt").read_text().split("\n\n")
    assert len(sid_calls) == len(paragraphs)
