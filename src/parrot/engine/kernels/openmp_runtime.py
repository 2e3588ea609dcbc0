"""Which OpenMP runtime Parrot's C ops link: the one PyTorch already loaded, found.

The C ops run on OpenMP threads beside PyTorch's own.  Two OpenMP runtimes in one
process means two thread pools that spin against each other, so the ops must use the
runtime PyTorch uses.  Which one that is depends on the wheel: the CPU wheels ship a
``libgomp.so.1`` in ``torch/lib``, other builds a hashed ``libgomp-<hash>.so.1``,
Intel's ``libiomp5.so`` or LLVM's ``libomp.so`` (both also provide the GNU ``GOMP_*``
entry points GCC's code calls).  Linking ``-lgomp`` and hoping the soname matches is
what this replaces:

* :func:`loaded` lists the OpenMP runtimes mapped into this process (``/proc/self/maps``);
* :func:`choose` picks the one under PyTorch's package directory (else the first
  loaded) and links that file by path, with an rpath to its directory, so the ops'
  library names the very runtime already in the process;
* where none is loaded (PyTorch not imported, a build without OpenMP, no
  ``/proc``), the build falls back to the compiler's default (``-fopenmp``, the
  system libgomp), and :attr:`OpenMPRuntime.reason` says why (logged by
  :mod:`parrot.engine.kernels.native`).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OpenMPRuntime", "choose", "find", "loaded"]

# libgomp.so.1, libgomp-a34b3233.so.1, libgomp.so.1.0.0, libiomp5.so, libomp.so.5 ...
_NAME = re.compile(r"lib(?:gomp|iomp5|omp)(?:-[0-9a-f]+)?\.so(?:\.\d+)*")


@dataclass(frozen=True)
class OpenMPRuntime:
    """The runtime a build links: ``path``, a runtime file already loaded in this
    process, or None for the compiler's default (``-fopenmp``); ``reason``: why."""

    path: str | None
    reason: str

    def link_args(self) -> tuple[str, ...]:
        """Linker arguments that make the library depend on this runtime."""
        if self.path is None:
            return ("-fopenmp",)
        return (self.path, f"-Wl,-rpath,{Path(self.path).parent}")


def loaded(maps: str | None = None) -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process, in ``/proc/self/maps``
    order, each once (``maps``: that file's text, for tests); [] where it cannot be
    read.  Deleted files are left out (they cannot be linked)."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return []
    out: list[str] = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        path = fields[5] if len(fields) == 6 else ""
        if path.startswith("/") and _NAME.fullmatch(Path(path).name) and path not in out:
            out.append(path)
    return out


def _torch_dir() -> str | None:
    """PyTorch's package directory where it is imported, else None."""
    torch = sys.modules.get("torch")
    file = getattr(torch, "__file__", None)
    return str(Path(file).parent) if file else None


def choose(runtimes: list[str], torch_dir: str | None) -> OpenMPRuntime:
    """The runtime to link among the loaded ``runtimes``: the first under ``torch_dir``
    (PyTorch's package directory, None when it is not imported), else the first; the
    compiler's default when there is none."""
    if not runtimes:
        why = "PyTorch is not imported" if torch_dir is None else "PyTorch loaded no OpenMP runtime"
        return OpenMPRuntime(None, f"{why}: linking the compiler's default OpenMP runtime (-fopenmp)")
    torch_own = [p for p in runtimes if torch_dir and p.startswith(torch_dir.rstrip("/") + "/")]
    path = (torch_own or runtimes)[0]
    whose = "PyTorch's" if torch_own else "the first loaded in this process (none under PyTorch's directory)"
    others = [p for p in runtimes if p != path]
    note = f"; also loaded: {', '.join(others)}" if others else ""
    return OpenMPRuntime(path, f"{whose}: {path}{note}")


def find() -> OpenMPRuntime:
    """The runtime to link in this process now (see :func:`choose`)."""
    return choose(loaded(), _torch_dir())
