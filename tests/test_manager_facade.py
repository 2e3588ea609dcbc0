"""The manager's rooms and its facade, checked over the sources' ASTs.

- The routers (``parrot.manager.api``, ``parrot.manager.openai``) call
  :class:`~parrot.manager.service.Manager` methods only: no attribute named
  ``executor`` or ``pool`` is read anywhere in them.
- The sub-packages import only those below them: ``dag`` and ``backends`` nothing of the
  manager outside themselves, ``sched`` only ``dag`` and ``backends``, the core (the
  modules at ``parrot.manager``'s top) never a router package.
- The core's modules import one another without a cycle (imports under
  ``TYPE_CHECKING`` and inside functions included): what one needs of a module above
  it is a protocol of its own (``metrics.ObservedManager``,
  ``engine_ops.SchedulingRounds``).

Each rule is also shown failing on a planted violation, reported with its file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

MANAGER = Path(__file__).resolve().parents[1] / "src" / "parrot" / "manager"

ROUTER_PACKAGES = ("api", "openai")
BEHIND_THE_FACADE = frozenset({"executor", "pool"})

ROOMS: dict[str, frozenset[str]] = {
    # room -> the manager rooms it may import besides itself ("core": the top-level modules)
    "dag": frozenset(),
    "backends": frozenset(),
    "sched": frozenset({"dag", "backends"}),
    "core": frozenset({"dag", "backends", "sched"}),
    "api": frozenset({"core", "dag", "backends", "openai"}),
    "openai": frozenset({"core", "dag", "backends"}),
}


def facade_breaches(source: str, filename: str) -> list[str]:
    """``file:line: .name`` for every read of an attribute behind the facade in ``source``."""
    return [
        f"{filename}:{node.lineno}: .{node.attr}"
        for node in ast.walk(ast.parse(source, filename))
        if isinstance(node, ast.Attribute) and node.attr in BEHIND_THE_FACADE
    ]


def room_of(module: str) -> str | None:
    """The manager room of a ``parrot.manager...`` module (None: not the manager's)."""
    parts = module.split(".")
    if parts[:2] != ["parrot", "manager"]:
        return None
    if len(parts) > 3 and parts[2] in ROOMS:
        return parts[2]
    if len(parts) == 3 and (MANAGER / parts[2]).is_dir():
        return parts[2]  # ``from parrot.manager.sched import saturation``
    return "core"


def upward_imports(source: str, filename: str, room: str) -> list[str]:
    """``file:line: module`` for every import in ``source`` of a manager room that ``room``
    may not import."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        for name in names:
            target = room_of(name)
            if target is not None and target != room and target not in ROOMS[room]:
                found.append(f"{filename}:{node.lineno}: {name}")
    return found


def _sources(room: str) -> list[Path]:
    if room == "core":
        return sorted(MANAGER.glob("*.py"))
    return sorted((MANAGER / room).rglob("*.py"))


def test_every_manager_module_is_in_a_room() -> None:
    rooms = {p for room in ROOMS for p in _sources(room)}
    assert set(MANAGER.rglob("*.py")) == rooms


def test_the_routers_call_only_manager_methods() -> None:
    breaches = [
        breach
        for package in ROUTER_PACKAGES
        for path in _sources(package)
        for breach in facade_breaches(path.read_text(), str(path.relative_to(MANAGER)))
    ]
    assert not breaches, "routers reach past the Manager facade:\n" + "\n".join(breaches)


def test_a_router_reaching_the_executor_or_the_pool_is_reported() -> None:
    planted = "async def heartbeat(manager, engine_id, stats):\n    manager.pool.heartbeat(engine_id, stats)"
    assert facade_breaches(planted, "api/engines.py") == ["api/engines.py:2: .pool"]
    planted = "def commit(self):\n    self.manager.executor.dispatch(call)\n"
    assert facade_breaches(planted, "api/batch.py") == ["api/batch.py:2: .executor"]


def test_each_room_imports_only_the_rooms_below_it() -> None:
    found = [
        hit
        for room in ROOMS
        for path in _sources(room)
        for hit in upward_imports(path.read_text(), str(path.relative_to(MANAGER)), room)
    ]
    assert not found, "imports against the manager's layering:\n" + "\n".join(found)


def test_an_upward_import_is_reported() -> None:
    planted = "from parrot.manager.graph_helpers import x\nfrom parrot.manager.service import Manager\n"
    assert upward_imports(planted, "dag/graph.py", "dag") == [
        "dag/graph.py:1: parrot.manager.graph_helpers",
        "dag/graph.py:2: parrot.manager.service",
    ]
    planted = "from parrot.manager.api import app\n"
    assert upward_imports(planted, "executor.py", "core") == ["executor.py:1: parrot.manager.api"]


def core_imports(sources: dict[str, str]) -> dict[str, set[str]]:
    """Core module -> the core modules it imports, every import counted (``TYPE_CHECKING``
    and function-level ones too), from ``sources`` (core module name -> its text)."""
    graph: dict[str, set[str]] = {name: set() for name in sources}
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source, f"{name}.py")):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[:2] == ["parrot", "manager"] and len(parts) > 2 and parts[2] in sources:
                    graph[name].add(parts[2])
        graph[name].discard(name)
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or [] if it is a DAG."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt, path)):
                return cycle
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            return cycle
    return []


def test_the_core_modules_import_one_another_without_a_cycle() -> None:
    graph = core_imports({p.stem: p.read_text() for p in _sources("core")})
    assert "service" in graph and "executor" in graph["service"]  # the graph is really read
    assert import_cycle(graph) == [], "the manager's core modules import one another in a cycle"


def test_a_core_import_cycle_is_reported() -> None:
    planted = {
        "metrics": "if TYPE_CHECKING:\n    from parrot.manager.service import Manager\n",
        "service": "from parrot.manager.executor import Executor\n",
        "executor": "def f():\n    from parrot.manager import metrics\n",
    }
    assert import_cycle(core_imports(planted)) == ["executor", "metrics", "service", "executor"]
    del planted["metrics"]
    assert import_cycle(core_imports(planted)) == []
