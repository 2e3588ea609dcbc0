"""The OpenMP runtime of Parrot's C ops: found in the process, not assumed
(parrot.engine.kernels.openmp_runtime).

The choice is checked on made-up process maps, and the real build on this machine:
the library names the runtime PyTorch loaded (its soname, an rpath to its directory)
and loading it adds no second runtime; where no runtime is found or linking it fails,
the build links the compiler's default and logs why.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from parrot.engine.kernels import native, openmp_runtime
from parrot.engine.kernels.openmp_runtime import OpenMPRuntime

TORCH_DIR = str(Path(torch.__file__).parent)

MAPS = """\
7f0000000000-7f0000001000 r-xp 00000000 08:01 11 /usr/lib/x86_64-linux-gnu/libm.so.6
7f0000001000-7f0000002000 r-xp 00000000 08:01 12 /opt/venv/torch/lib/libgomp-a34b3233.so.1
7f0000002000-7f0000003000 r--p 00001000 08:01 12 /opt/venv/torch/lib/libgomp-a34b3233.so.1
7f0000003000-7f0000004000 r-xp 00000000 08:01 13 /usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0
7f0000004000-7f0000005000 r-xp 00000000 08:01 14 /opt/intel/lib/libiomp5.so
7f0000005000-7f0000006000 r-xp 00000000 08:01 15 /tmp/libomp.so.5 (deleted)
7f0000006000-7f0000007000 rw-p 00000000 00:00 0 [heap]
7f0000007000-7f0000008000 r-xp 00000000 08:01 16 /usr/lib/libgompish.so
"""


def _dynamic(path: str) -> str:
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.fail("no 'readelf' (binutils) on this machine: the library's links cannot be read")
    return subprocess.run(
        [readelf, "-d", path], capture_output=True, text=True, check=True, timeout=60
    ).stdout


def _entries(path: str, tag: str) -> list[str]:
    """The bracketed values of ``path``'s dynamic entries of ``tag`` (NEEDED, SONAME, RUNPATH)."""
    return [line.split("[", 1)[1].rstrip("]") for line in _dynamic(path).splitlines() if f"({tag})" in line]


def test_loaded_lists_each_runtime_once_in_map_order() -> None:
    assert openmp_runtime.loaded(MAPS) == [
        "/opt/venv/torch/lib/libgomp-a34b3233.so.1",
        "/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0",
        "/opt/intel/lib/libiomp5.so",
    ]  # not libm, not a deleted file, not a name that only starts like one


def test_pytorchs_runtime_is_chosen_over_others() -> None:
    runtimes = ["/usr/lib/libgomp.so.1", "/opt/venv/torch/lib/libgomp-a34b3233.so.1"]
    chosen = openmp_runtime.choose(runtimes, "/opt/venv/torch")
    assert chosen.path == "/opt/venv/torch/lib/libgomp-a34b3233.so.1"
    assert "PyTorch's" in chosen.reason and "/usr/lib/libgomp.so.1" in chosen.reason
    assert chosen.link_args() == (chosen.path, "-Wl,-rpath,/opt/venv/torch/lib")
    assert openmp_runtime.choose(runtimes, "/opt/venv/torchvision").path == "/usr/lib/libgomp.so.1"


def test_without_a_loaded_runtime_the_compilers_default_is_chosen_with_a_reason() -> None:
    for torch_dir, why in [
        (None, "PyTorch is not imported"),
        ("/opt/torch", "PyTorch loaded no OpenMP runtime"),
    ]:
        chosen = openmp_runtime.choose([], torch_dir)
        assert chosen.path is None and chosen.reason.startswith(why) and "-fopenmp" in chosen.reason
        assert chosen.link_args() == ("-fopenmp",)


def test_the_library_links_the_runtime_pytorch_loaded() -> None:
    """This machine's PyTorch has OpenMP: the library's dependency is that file's soname,
    found through an rpath to its directory, and loading it adds no other runtime."""
    assert torch.backends.openmp.is_available()
    runtime = openmp_runtime.find()
    assert runtime.path is not None and runtime.path.startswith(TORCH_DIR + "/"), runtime
    lib = native.build()
    (soname,) = _entries(runtime.path, "SONAME")
    assert soname in _entries(lib._name, "NEEDED")
    assert _entries(lib._name, "RUNPATH") == [str(Path(runtime.path).parent)]
    assert openmp_runtime.loaded() == [runtime.path]


@pytest.mark.parametrize("case", ["none loaded", "link fails"])
def test_the_build_falls_back_to_the_compilers_runtime_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    if case == "none loaded":
        runtime = openmp_runtime.choose([], None)
    else:  # a "runtime" the linker cannot use
        (tmp_path / "libgomp.so.1").write_text("not a shared library")
        runtime = OpenMPRuntime(str(tmp_path / "libgomp.so.1"), "a test's broken runtime")
    monkeypatch.setattr(openmp_runtime, "find", lambda: runtime)
    with caplog.at_level(logging.WARNING, logger="parrot.engine.kernels.native"):
        lib = native.build(portable=True, cache_dir=tmp_path / "cache")
    messages = " | ".join(r.getMessage() for r in caplog.records)
    expected = "PyTorch is not imported" if case == "none loaded" else "failed"
    assert expected in messages and "-fopenmp" in messages
    assert "libgomp.so.1" in _entries(lib._name, "NEEDED") and not _entries(lib._name, "RUNPATH")
    assert lib.parrot_f32_linear_supported() == 0  # loaded and bound: the portable build
