"""The data model shared by the evaluation suite's generators, clients and reports.

A *workload* is a list of *apps* arriving over time.  An app is a small DAG of
*calls*; each call is a prompt template in Parrot's syntax whose placeholders
are filled by constants or by the outputs of earlier calls of the same app.
The same :class:`AppSpec` is run two ways:

* by Parrot's client (``clients.run_parrot_app``): every call is submitted as a
  semantic function, dependencies travel as semantic variables on the server,
  and only the app's ``outputs`` are fetched;
* by the baseline client (``clients.run_baseline_app``): the app is rendered
  client-side, one OpenAI ``/v1/completions`` request per call, each dependent
  call waiting for its producers' text to come back first.

Invariants (checked by :func:`check_app`):

- ``calls`` are in topological order and names are unique;
- a call's template has exactly one ``{{output:<name>}}`` placeholder, at its
  very end, whose name is the call's own name;
- every ``{{input:x}}`` in a template is a key of ``consts`` or of ``deps``
  (never both), and every ``deps`` value names an earlier call;
- ``outputs`` name calls of the app.

No chat template is applied anywhere: the prompt text is sent as written, so
every system sees the same tokens.  Sampling is greedy with ``ignore_eos`` so
that output lengths are the ``max_tokens`` asked for, where a system supports it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["AppRecord", "AppSpec", "CallRecord", "CallSpec", "RunRecord", "Workload", "check_app"]

_PLACEHOLDER = re.compile(r"\{\{(input|output):([A-Za-z_][A-Za-z0-9_]*)\}\}")

Criteria = Literal["latency", "throughput"]


@dataclass(frozen=True)
class CallSpec:
    """One LLM call: ``template`` with constants and upstream outputs substituted, then generation."""

    name: str
    template: str
    max_tokens: int
    consts: Mapping[str, str] = field(default_factory=dict)
    deps: Mapping[str, str] = field(default_factory=dict)  # placeholder -> name of the producing call


@dataclass(frozen=True)
class AppSpec:
    """One application instance: a DAG of calls, its final outputs and when it arrives."""

    app_id: str
    kind: str  # e.g. "chain", "map_reduce", "chat", "shared_prompt", "agents"
    calls: tuple[CallSpec, ...]
    outputs: tuple[str, ...]
    arrival_s: float = 0.0  # offset from the start of the workload
    criteria: Criteria = "latency"


@dataclass(frozen=True)
class Workload:
    """A named, seeded list of apps for one point of one figure."""

    figure: str  # "fig11", "fig12a", ..., "fig19"
    name: str  # unique within a suite run, e.g. "fig11/out=50,chunk=1024"
    params: Mapping[str, Any]
    apps: tuple[AppSpec, ...]
    engines: int = 1  # how many engines the system under test should run


@dataclass
class CallRecord:
    """One call's times, relative to the workload start.

    ``ready_s``: when the serving system had it and could run it (Parrot: its
    inputs existed, from the session graph; baseline: its request was sent);
    ``start_s``: Parrot: placed on an engine; baseline: sent (= ``ready_s``);
    ``first_token_s``: its first generated token reached the manager (Parrot) or
    the client (baseline, streamed); ``end_s``: its output was complete.
    So ``ready <= start <= first_token <= end`` where known."""

    name: str
    start_s: float  # relative to the workload start
    end_s: float
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    engine: str | None = None  # Parrot: the engine it ran on (from the session graph)
    ready_s: float | None = None
    first_token_s: float | None = None


@dataclass
class AppRecord:
    app_id: str
    kind: str
    arrival_s: float
    start_s: float
    end_s: float
    # every call (Parrot: from the session graph; only the fetched outputs if it is unavailable)
    calls: list[CallRecord] = field(default_factory=list)
    error: str | None = None
    delays: int = 0  # emulated network delays the app paid (on its critical path or beside it)
    delay_s: float = 0.0  # their sum

    @property
    def latency_s(self) -> float:
        return self.end_s - self.arrival_s


@dataclass
class RunRecord:
    """One workload run on one system (one repeat)."""

    system: str  # "parrot", "vllm", "fastchat", "parrot-baseline-latency", ...
    workload: str
    figure: str
    params: dict[str, Any]
    repeat: int
    wall_s: float
    apps: list[AppRecord]
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. KV memory figures


def check_app(app: AppSpec) -> None:
    """Raise ValueError unless ``app`` satisfies the invariants in the module docstring."""
    seen: set[str] = set()
    for call in app.calls:
        if call.name in seen:
            raise ValueError(f"{app.app_id}: duplicate call name {call.name!r}")
        if call.max_tokens < 1:
            raise ValueError(f"{app.app_id}/{call.name}: max_tokens must be >= 1")
        found = _PLACEHOLDER.findall(call.template)
        outs = [n for kind, n in found if kind == "output"]
        if outs != [call.name] or not call.template.endswith(f"{{{{output:{call.name}}}}}"):
            raise ValueError(f"{app.app_id}/{call.name}: template must end with {{{{output:{call.name}}}}}")
        ins = {n for kind, n in found if kind == "input"}
        if set(call.consts) & set(call.deps):
            raise ValueError(f"{app.app_id}/{call.name}: a placeholder is both a constant and a dependency")
        if ins != set(call.consts) | set(call.deps):
            raise ValueError(f"{app.app_id}/{call.name}: inputs {sorted(ins)} != consts + deps")
        for dep in call.deps.values():
            if dep not in seen:
                raise ValueError(f"{app.app_id}/{call.name}: depends on {dep!r}, not an earlier call")
        seen.add(call.name)
    for out in app.outputs:
        if out not in seen:
            raise ValueError(f"{app.app_id}: output {out!r} is not a call")
