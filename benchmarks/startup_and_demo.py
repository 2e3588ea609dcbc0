"""Measure `parrot serve` start-up time (warm model cache) and the demo's wall time.

Usage: python benchmarks/startup_and_demo.py [--repeats 3] [--port 9100]

Start-up is the time from launching `parrot serve` to its first successful
`/healthz` answer; the first launch warms the model cache and is reported
separately.  Each demo app is timed as a whole process (`python examples/...`).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"parrot serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return time.perf_counter()
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError("parrot serve did not become healthy")


def launch(port: int) -> tuple[subprocess.Popen, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "parrot.cli", "--log-level", "warning", "serve", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ready = wait_healthy(f"http://127.0.0.1:{port}", proc)
    return proc, ready - t0


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=9100)
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    proc, first = launch(args.port)
    stop(proc)
    print(f"first start (fills the model cache if empty): {first:.2f}s")
    times = []
    for _ in range(args.repeats):
        proc, t = launch(args.port)
        times.append(t)
        stop(proc)
    print(
        f"warm start over {args.repeats} runs: median {statistics.median(times):.2f}s, "
        f"min {min(times):.2f}s, max {max(times):.2f}s"
    )
    proc, _ = launch(args.port)
    try:
        for app in ("chain_summary.py", "map_reduce.py"):
            t0 = time.perf_counter()
            subprocess.run(
                [sys.executable, str(ROOT / "examples" / app), "--url", url],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            print(f"{app}: {time.perf_counter() - t0:.2f}s wall")
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
