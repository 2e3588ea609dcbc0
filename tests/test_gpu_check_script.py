"""scripts/gpu_check.sh on a machine without a GPU: it stops at once with exit status 2
and a message naming what is missing, and writes no results folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(path: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": path, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "HOME": str(tmp_path)}
    return subprocess.run(["/bin/bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)


def test_without_nvidia_smi_it_fails_fast_and_says_why(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    done = _run(str(empty), tmp_path)
    assert done.returncode == 2
    assert "gpu_check: no nvidia-smi on PATH" in done.stderr
    assert "nothing was run" in done.stderr
    assert not (tmp_path / "out").exists()


def test_with_a_driver_but_no_cuda_device_for_torch_it_fails_fast_too(tmp_path):
    assert not torch.cuda.is_available()  # describes this machine
    tools = tmp_path / "bin"
    tools.mkdir()
    smi = tools / "nvidia-smi"  # a driver tool that answers, while PyTorch has no device
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI stand-in'\n")
    smi.chmod(0o755)
    done = _run(f"{tools}{os.pathsep}/usr/bin{os.pathsep}/bin", tmp_path)
    assert done.returncode == 2
    assert "sees no CUDA device" in done.stderr
    assert not (tmp_path / "out").exists()
