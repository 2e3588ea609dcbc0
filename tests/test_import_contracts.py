"""Import contracts between Parrot's layers: which of Parrot's packages each layer may
import, and which heavy third-party modules it must not.

The layers, bottom to top (an arrow may only point down):

- ``protocol``: the wire types, shared by everyone; imports nothing else of Parrot.
- ``frontend`` (the client library) and the root ``parrot`` package: ``protocol`` only
  (the root re-exports the frontend); ``integrations``: the frontend and the root.
- ``engine.core``: the engine's torch-free bookkeeping (planner, block pool, contexts,
  prefix cache, latency fit); ``protocol`` only, and no torch, numpy or triton.
- ``engine``: the torch engine; ``engine.core`` and ``protocol``, never the manager,
  the simulator or the frontend.
- ``sim`` (simulated engines) and ``manager``: ``engine.core`` and ``protocol``, never the
  torch engine (nor each other), and no torch or triton: a manager or a simulation
  runs without them.
- ``cli`` (``parrot.cli``, ``parrot.cli_args``, ``parrot.cli_backend``): the entry point, above everything.

Checked statically over the source files (every import, also inside functions; an
import under ``if TYPE_CHECKING:`` is exempt from the third-party rules, as it never
runs, but not from the layer rules) and, for the no-torch rules, by importing every
module of the layer in a fresh interpreter and looking at ``sys.modules``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

LAYERS: dict[str, tuple[str, ...]] = {
    "root": ("parrot",),  # the package's __init__ alone (matched exactly)
    "protocol": ("parrot.protocol",),
    "frontend": ("parrot.frontend",),
    "integrations": ("parrot.integrations",),
    "engine.core": ("parrot.engine.core",),
    "engine": ("parrot.engine",),
    "sim": ("parrot.sim",),
    "manager": ("parrot.manager",),
    "cli": ("parrot.cli", "parrot.cli_args", "parrot.cli_backend"),
}
"""Each layer's modules by prefix; a module is in the layer of its longest matching prefix."""


@dataclass(frozen=True)
class Contract:
    may_import: frozenset[str]  # the layers it may import besides its own
    forbidden: frozenset[str] = frozenset()  # third-party top-level modules it must not import


NO_TORCH = frozenset({"torch", "triton"})
CONTRACTS: dict[str, Contract] = {
    "protocol": Contract(frozenset(), NO_TORCH),
    "frontend": Contract(frozenset({"protocol"}), NO_TORCH),
    "root": Contract(frozenset({"protocol", "frontend"}), NO_TORCH),
    "integrations": Contract(frozenset({"root", "protocol", "frontend"}), NO_TORCH),
    "engine.core": Contract(frozenset({"protocol"}), NO_TORCH | {"numpy"}),
    "engine": Contract(frozenset({"protocol", "engine.core"})),
    "sim": Contract(frozenset({"protocol", "engine.core"}), NO_TORCH),
    "manager": Contract(frozenset({"protocol", "engine.core"}), NO_TORCH),
    "cli": Contract(frozenset(LAYERS)),
}


@dataclass(frozen=True)
class Violation:
    file: Path
    line: int
    importer: str
    imported: str
    why: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.importer} imports {self.imported} ({self.why})"


def layer_of(module: str) -> str | None:
    """The layer of a ``parrot`` module (None: not Parrot's, or in no layer)."""
    best: tuple[int, str] | None = None
    for layer, prefixes in LAYERS.items():
        exact_only = layer == "root"
        for p in prefixes:
            matches = module == p or (not exact_only and module.startswith(p + "."))
            if matches and (best is None or len(p) > best[0]):
                best = (len(p), layer)
    return None if best is None else best[1]


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool, root: Path) -> list[tuple[int, str, bool]]:
    """``(line, imported module, type-checking only)`` for every import in ``tree``;
    ``from a import b`` counts as importing ``a.b`` when that is a module under ``root``."""
    found: list[tuple[int, str, bool]] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, typing_only)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, typing_only) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                up = package[: len(package) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                as_path = root.joinpath(*sub.split("."))
                is_module = as_path.with_suffix(".py").is_file() or (as_path / "__init__.py").is_file()
                found.append((node.lineno, sub if is_module else base, typing_only))
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only)

    visit(tree, False)
    return list(dict.fromkeys(found))  # one entry per module a statement imports


def check(root: Path, package: str = "parrot") -> list[Violation]:
    """Every import under ``root/package`` that breaks its layer's contract."""
    violations: list[Violation] = []
    for path in sorted((root / package).rglob("*.py")):
        module = _module_name(path, root)
        layer = layer_of(module)
        if layer is None:
            continue
        contract = CONTRACTS[layer]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, imported, typing_only in _imports(tree, module, path.name == "__init__.py", root):
            top = imported.split(".")[0]
            if top == package:
                target = layer_of(imported)
                if target is not None and target != layer and target not in contract.may_import:
                    why = f"layer {layer} may not import layer {target}"
                    violations.append(Violation(path, line, module, imported, why))
            elif top in contract.forbidden and not typing_only:
                why = f"layer {layer} runs without {top}"
                violations.append(Violation(path, line, module, imported, why))
    return violations


# ------------------------------------------------------------------ the contracts hold


def test_every_layer_keeps_its_import_contract() -> None:
    violations = check(SRC)
    assert not violations, "\n".join(map(str, violations))


def test_every_module_is_in_a_layer_with_a_contract() -> None:
    modules = [_module_name(p, SRC) for p in (SRC / "parrot").rglob("*.py")]
    assert [m for m in modules if layer_of(m) is None] == []
    assert set(CONTRACTS) == set(LAYERS)


def _layer_modules(layer: str) -> list[str]:
    return sorted(
        m for m in (_module_name(p, SRC) for p in (SRC / "parrot").rglob("*.py")) if layer_of(m) == layer
    )


@pytest.mark.parametrize("layer", ["engine.core", "sim", "manager", "protocol", "frontend"])
def test_torch_free_layers_import_without_torch(layer: str) -> None:
    """Importing every module of the layer in a fresh interpreter loads none of the
    third-party modules its contract forbids (torch, triton; numpy for engine.core)."""
    modules = _layer_modules(layer)
    forbidden = sorted(CONTRACTS[layer].forbidden)
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(sorted(f for f in {forbidden!r} if f in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{layer} loads {out.stdout.strip()}"


# ------------------------------------------------------------------ the checker catches


def _plant(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")


def test_the_checker_reports_a_planted_upward_import_with_its_file_and_line(tmp_path: Path) -> None:
    _plant(
        tmp_path,
        {
            "parrot/__init__.py": "",
            "parrot/protocol/__init__.py": "",
            "parrot/protocol/schemas.py": """\
                from __future__ import annotations

                from parrot.manager.service import Manager  # upward: protocol -> manager
                """,
            "parrot/manager/__init__.py": "",
            "parrot/manager/service.py": """\
                from typing import TYPE_CHECKING

                from parrot.engine.core.jobs import Job  # allowed
                if TYPE_CHECKING:
                    from parrot.engine.runner import EngineRunner  # a type, still a layer break

                def lazy():
                    import torch  # inside a function: still counted
                """,
            "parrot/engine/__init__.py": "",
            "parrot/engine/runner.py": "",
            "parrot/engine/core/__init__.py": "",
            "parrot/engine/core/jobs.py": """\
                from typing import TYPE_CHECKING

                from .. import runner  # relative and upward: engine.core -> engine
                if TYPE_CHECKING:
                    import torch  # annotations only: allowed
                """,
        },
    )
    found = {(v.file.relative_to(tmp_path).as_posix(), v.line, v.imported) for v in check(tmp_path)}
    assert found == {
        ("parrot/protocol/schemas.py", 3, "parrot.manager.service"),
        ("parrot/manager/service.py", 5, "parrot.engine.runner"),
        ("parrot/manager/service.py", 8, "torch"),
        ("parrot/engine/core/jobs.py", 3, "parrot.engine.runner"),
    }
    message = str(next(v for v in check(tmp_path) if v.imported == "parrot.manager.service"))
    assert message.startswith(str(tmp_path / "parrot/protocol/schemas.py") + ":3: ")
    assert "layer protocol may not import layer manager" in message
