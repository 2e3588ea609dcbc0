"""Real ``parrot`` processes on loopback for tests: start, wait, signal, kill.

Every process logs to a file; failures quote the log's tail.  Waits are
bounded and poll; nothing here blocks without a deadline.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

from parrot.protocol.cluster import CLUSTER_SECRET_ENV, CLUSTER_SECRET_HEADER

T = TypeVar("T")
TEST_CLUSTER_SECRET = "test-cluster-secret-0123456789"
"""The cluster secret every process started here gets (managers and engines)."""
OPERATOR = {CLUSTER_SECRET_HEADER: TEST_CLUSTER_SECRET}
"""Headers of the operator's requests to those managers."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parrot_command() -> list[str]:
    script = Path(sys.executable).with_name("parrot")
    return [str(script)] if script.exists() else [sys.executable, "-m", "parrot.cli"]


class Proc:
    """One child process with its combined stdout/stderr in a log file."""

    def __init__(self, name: str, args: list[str], log_dir: Path):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in kill()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", CLUSTER_SECRET_ENV: TEST_CLUSTER_SECRET}
        self.popen = subprocess.Popen(
            [*parrot_command(), "--log-level", "info", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        self.url: str | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self, tail: int = 4000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"<no log: {exc}>"
        return text[-tail:]

    def describe(self) -> str:
        rc = self.popen.poll()
        state = "running" if rc is None else f"exited with {rc}"
        return f"--- {self.name} (pid {self.pid}, {state}) log tail:\n{self.log()}\n---"

    def wait_for_log(self, pattern: str, timeout: float) -> re.Match[str]:
        """Wait until the log matches ``pattern``; fail if the process exits first."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            found = rx.search(self.log(tail=1_000_000))
            if found:
                return found
            if self.popen.poll() is not None:
                raise AssertionError(f"{self.name} exited before logging {pattern!r}\n{self.describe()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not log {pattern!r} in {timeout}s\n{self.describe()}")
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL (works on stopped processes too) and reap; idempotent."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=10)
        self._log.close()


class Procs:
    """Starts manager/engine processes; :meth:`kill_all` ends every one of them."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.started: list[Proc] = []

    def _start(self, name: str, args: list[str]) -> Proc:
        proc = Proc(name, args, self.log_dir)
        self.started.append(proc)
        return proc

    def manager(
        self,
        *,
        heartbeat_interval: float = 0.5,
        heartbeat_timeout: float = 5.0,
        engine_wait: float = 1.0,
        timeout: float = 30,
    ) -> Proc:
        port = free_port()
        proc = self._start(
            f"manager-{len(self.started)}",
            [
                "serve",
                "--no-engine",
                "--port",
                str(port),
                "--heartbeat-interval",
                str(heartbeat_interval),
                "--heartbeat-timeout",
                str(heartbeat_timeout),
                "--engine-wait",
                str(engine_wait),
            ],
        )
        found = proc.wait_for_log(r"manager ready at (http://127\.0\.0\.1:\d+)", timeout)
        proc.url = found.group(1)
        assert proc.url == f"http://127.0.0.1:{port}", proc.describe()
        return proc

    def engine(self, manager: Proc, *extra: str, timeout: float = 60) -> Proc:
        """Start ``parrot engine`` and wait until the manager lists it."""
        proc = self._start(
            f"engine-{len(self.started)}",
            # one torch thread each: several engine processes on two cores would
            # otherwise oversubscribe them (OpenMP threads spin against each other)
            [
                "engine",
                "--manager",
                str(manager.url),
                "--model",
                "tiny",
                "--port",
                "0",
                "--threads",
                "1",
                *extra,
            ],
        )
        proc.url = proc.wait_for_log(r"serving at (http://127\.0\.0\.1:\d+)", timeout).group(1)
        wait_until(
            lambda: engine_by_url(manager, proc.url),
            timeout,
            lambda: f"engine at {proc.url} never registered\n{proc.describe()}\n{manager.describe()}",
        )
        return proc

    def kill_all(self) -> None:
        for proc in reversed(self.started):
            proc.kill()


def wait_until(check: Callable[[], T], timeout: float, message: Callable[[], str], interval=0.05) -> T:
    """Poll ``check`` until it returns something truthy; fail with ``message()`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s: {message()}")
        time.sleep(interval)


def engines(manager: Proc) -> list[dict]:
    resp = httpx.get(f"{manager.url}/v1/engines", timeout=10, headers=OPERATOR)
    resp.raise_for_status()
    return resp.json()


def engine_by_url(manager: Proc, url: str | None) -> dict | None:
    return next((e for e in engines(manager) if e["url"] == url), None)
