"""Parrot's C ops for CPU (``csrc/*.c``), built on first use with the system C compiler.

PyTorch's eager CPU ops each make their own pass over memory and pay a dispatch
per call; at decode sizes (tens of rows) that overhead rivals the arithmetic.  The
C sources hold the few ops where fusing pays: paged decode attention reading the
cache in place (``decode_rows.c``; ``shared_rows.c`` for a prefix shared by many
queries; see :mod:`parrot.engine.kernels.attention.cpu_kernel`), a decoder layer's
elementwise steps (``layer_ops.c``, see :mod:`parrot.engine.kernels.fused`), bf16
linear layers at decode sizes on AMX tiles or AVX-512 BF16 dot products
(``bf16_linear.c``, see :mod:`parrot.engine.kernels.bf16_linear`) and fp32 linear
layers that stream their weights while computing (``f32_linear.c``, see
:mod:`parrot.engine.kernels.f32_linear`).

Build: ``$CC`` (default ``cc``) with ``-O3 -march=native -fopenmp``, all sources
into one shared library, once per source / compiler / flags / CPU, cached in the
engine's ``kernel_cache`` folder (default ``~/.cache/parrot/kernels``), then loaded
with :mod:`ctypes`.  No PyTorch headers are needed, so it compiles in about a second.
Where that fails (no compiler, another OS) or the engine's ``cpu_kernel`` option is
``off``, :func:`library` returns None, :func:`status` says why (logged once as a
warning), and every caller keeps its PyTorch path: the library is never required.

The portable build (``build(portable=True)``) leaves out ``-march=native`` and the
AVX-512 / AMX code: the portable C that CPUs without them run, for any CPU of the
compiler's default target.  The tests compile both builds and run the kernels on
both.

Which build the engine uses is its ``cpu_kernel`` option
(:class:`~parrot.engine.kernels.options.KernelOptions`): ``native``, ``portable`` or
``off``.  A loaded library is a resource of the process (one per build, one OpenMP
runtime); the engine selects its build (:func:`select`) when it starts, on the thread
that then runs its steps, and :func:`library` without an argument returns the calling
thread's selection to the code that runs inside the model's forward (attention, the
fused elementwise ops), so two engines of one process, each on its own thread, each
run their own build.  A thread that never selected one gets the process's latest
selection.  The projections, the C forward and the prompt attention are handed their
library explicitly.  :func:`using` selects one for a block (tests).

The boundary is declared once, in ``csrc/parrot_ops.h``: every exported function's
prototype and every struct shared with Python.  Every source includes it, and the
build makes an implicit declaration, an exported function missing from the header and
a pointer or integer mismatch at a call errors (a definition conflicting with its
prototype always is), so C cannot drift from the header.  Python cannot either:
:mod:`parrot.engine.kernels.c_boundary` parses the header into the functions' ctypes
argument and return types and the structs' ctypes Structures, and the build compiles
a generated check that those Structures' sizes and offsets are the compiler's.

OpenMP: the ops must share PyTorch's OpenMP runtime (two runtimes are two thread
pools competing for the cores), and which runtime that is depends on the PyTorch
build, so it is found, not assumed (:mod:`parrot.engine.kernels.openmp_runtime`): the sources
are compiled with ``-fopenmp``, and the library is linked against the runtime file
PyTorch has loaded in this process (``/proc/self/maps``; libgomp, a hashed libgomp,
libiomp5 or libomp), by path with an rpath to its directory.  Where none is loaded
(PyTorch not imported, no ``/proc``) or that link fails, it links the compiler's
default runtime instead and logs why as a warning; a warning also says if loading the
library brought a second runtime into the process.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

from parrot.engine.kernels import c_boundary, openmp_runtime

__all__ = ["MODES", "build", "compile_flags", "library", "require", "select", "selected", "status", "using"]

log = logging.getLogger(__name__)

SOURCES = (
    "decode_rows.c",
    "layer_ops.c",
    "shared_rows.c",
    "bf16_linear.c",
    "prefill_bf16.c",
    "f32_linear.c",
    "decode_forward.c",
)
HEADERS = (
    "simd.h",
    "cache_row.h",
    "amx_tiles.h",
    "bf16_scalar.h",
    "parrot_ops.h",
)  # included by the sources; part of the build key
# Errors, not warnings: a call without a prototype, a non-static function missing from
# parrot_ops.h, and pointer or integer mismatches at a call.  A definition that
# conflicts with its prototype in parrot_ops.h is always an error in C.
_STRICT = (
    "-Werror=implicit-function-declaration",
    "-Werror=missing-prototypes",
    "-Werror=incompatible-pointer-types",
    "-Werror=int-conversion",
)
_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-std=gnu11", *_STRICT)
_NATIVE_FLAGS = ("-march=native",)  # this CPU's instructions: AVX-512 and AMX where it has them
# The portable build: the compiler's default target (no -march; baseline x86-64 on the
# usual distributions), and -DPARROT_PORTABLE leaves out the intrinsics code even where
# that target would have it, so it is the C that other CPUs run.
_PORTABLE_FLAGS = ("-DPARROT_PORTABLE",)
# Generated C (c_boundary.layout_check_source) compiled with the sources: the build
# fails unless the ctypes Structures lay out parrot_ops.h's structs as the compiler does.
_LAYOUT_CHECK = "parrot_layout_check.c"

MODES = ("native", "portable", "off")  # the values of KernelOptions.cpu_kernel

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}  # build ("native" / "portable") -> loaded, None if failed
_statuses: dict[str, str] = {}  # build -> why it is or is not loaded
_mode = "native"  # the process's latest selected build (select): threads that made none
_cache: Path | None = None  # ... and its kernel cache folder (None: the default)
_thread = threading.local()  # .selection: (build, cache folder) this thread selected


def _cpu_signature() -> str:
    """What ``-march=native`` compiles for: the CPU's feature flags."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _cache_dir(cache_dir: str | Path | None) -> Path:
    folder = cache_dir if cache_dir is not None else _selection()[1]
    return Path(folder) if folder is not None else Path.home() / ".cache" / "parrot" / "kernels"


def _key(sources: dict[str, str], cc: str, flags: tuple[str, ...], link: tuple[str, ...]) -> str:
    """What a build depends on, hashed: sources, compiler, flags, link arguments, and the
    CPU for ``-march=native``."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60, check=True)
    parts = [t for pair in sorted(sources.items()) for t in pair]
    cpu = _cpu_signature() if "-march=native" in flags else ""
    return hashlib.sha256("\0".join((*parts, cc, version.stdout, *flags, *link, cpu)).encode()).hexdigest()


def _run(cmd: list[str], cwd: Path) -> None:
    """Run a compiler command; raises RuntimeError with its messages when it fails."""
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd)
    if run.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed: {run.stderr.strip()[-2000:]}")


def _objects(sources: dict[str, str], cc: str, flags: tuple[str, ...], tmp: Path) -> list[str]:
    """Write ``sources`` into ``tmp`` and compile each .c file there; the object files."""
    for name, text in sources.items():
        (tmp / name).write_text(text)
    c_files = [name for name in sources if name.endswith(".c")]
    _run([cc, *flags, "-c", *c_files], tmp)
    return [str(tmp / (name[:-2] + ".o")) for name in c_files]


def _link(cc: str, objects: list[str], out: Path, runtime: openmp_runtime.OpenMPRuntime) -> None:
    """Link the shared library against ``runtime``; if that fails, against the compiler's
    default OpenMP runtime (logged: the ops may then run on a second thread pool)."""
    try:
        _run([cc, "-shared", *objects, "-o", str(out), *runtime.link_args(), "-lm"], out.parent)
    except RuntimeError as exc:
        if runtime.path is None:
            raise
        log.warning(
            "linking Parrot's C ops against %s failed (%s); using -fopenmp's runtime", runtime.path, exc
        )
        _run([cc, "-shared", *objects, "-o", str(out), "-fopenmp", "-lm"], out.parent)


def _compile(
    sources: dict[str, str],
    cc: str,
    flags: tuple[str, ...],
    runtime: openmp_runtime.OpenMPRuntime,
    out_dir: Path,
) -> Path:
    """The shared library of ``sources`` (name -> text) linked against ``runtime``,
    built into ``out_dir`` unless an identical build is cached there."""
    target = out_dir / f"parrot-ops-{_key(sources, cc, flags, runtime.link_args())[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        built = Path(tmp) / "ops.so"
        _link(cc, _objects(sources, cc, flags, Path(tmp)), built, runtime)
        os.replace(built, target)  # atomic: concurrent builders leave one complete file
    return target


def compile_flags(*, portable: bool = False) -> tuple[str, ...]:
    """The compiler flags of the native build (``-march=native``) or the portable one
    (the compiler's default target, no intrinsics code); the strict ones in both."""
    return _FLAGS + (_PORTABLE_FLAGS if portable else _NATIVE_FLAGS)


def build(*, portable: bool = False, cache_dir: str | Path | None = None) -> ctypes.CDLL:
    """Compile (or take from the cache) and load the library; raises if that fails.
    ``portable``: the portable build (see :func:`compile_flags`), else the native one;
    ``cache_dir``: where builds are kept (default: the selected one, see :func:`select`)."""
    folder = resources.files(__package__).joinpath("csrc")
    sources = {name: folder.joinpath(name).read_text() for name in SOURCES + HEADERS}
    sources[_LAYOUT_CHECK] = c_boundary.layout_check_source()
    runtime = openmp_runtime.find()
    (log.info if runtime.path else log.warning)("OpenMP runtime for Parrot's C ops: %s", runtime.reason)
    before = openmp_runtime.loaded()
    cc = os.environ.get("CC") or "cc"  # the toolchain's own convention, like make's
    path = _compile(sources, cc, compile_flags(portable=portable), runtime, _cache_dir(cache_dir))
    lib = ctypes.CDLL(str(path))
    _check_one_runtime(before)
    return c_boundary.bind(lib)


def _check_one_runtime(before: list[str]) -> None:
    """Warn when loading the library brought another OpenMP runtime into a process that
    already had one (``before``): two thread pools would compete for the cores."""
    added = [p for p in openmp_runtime.loaded() if p not in before]
    if before and added:
        log.warning(
            "Parrot's C ops loaded the OpenMP runtime %s beside %s", ", ".join(added), ", ".join(before)
        )


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"cpu_kernel must be one of {', '.join(MODES)}, not {mode!r}")
    return mode


def select(mode: str, *, cache_dir: str | Path | None = None) -> None:
    """Make ``mode`` (one of :data:`MODES`) the build :func:`library` returns on this
    thread (and on threads that never selected one), with builds kept in ``cache_dir``
    (None: ``~/.cache/parrot/kernels``).  Called by the engine when it starts, on the
    thread that runs its steps, from its ``KernelOptions``."""
    global _mode, _cache
    selection = (_check_mode(mode), None if cache_dir is None else Path(cache_dir))
    _mode, _cache = selection
    _thread.selection = selection


def _selection() -> tuple[str, Path | None]:
    return getattr(_thread, "selection", None) or (_mode, _cache)


def selected() -> str:
    """The build :func:`library` returns on this thread (see :func:`select`)."""
    return _selection()[0]


@contextmanager
def using(mode: str, *, cache_dir: str | Path | None = None) -> Iterator[None]:
    """:func:`select` ``mode`` for the block, then restore the selections before it
    (this thread's and the process's)."""
    global _mode, _cache
    before, before_thread = (_mode, _cache), getattr(_thread, "selection", None)
    select(mode, cache_dir=cache_dir)
    try:
        yield
    finally:
        _mode, _cache = before
        if before_thread is None:
            del _thread.selection
        else:
            _thread.selection = before_thread


def library(mode: str | None = None) -> ctypes.CDLL | None:
    """The loaded library of build ``mode`` (default: the selected one), building it on
    the first call; None when unavailable or ``off`` (then :func:`status` gives the
    reason).  A failed build is not retried."""
    mode = _check_mode(selected() if mode is None else mode)
    if mode == "off":
        return None
    if mode in _libs:
        return _libs[mode]
    with _lock:
        if mode not in _libs:
            portable = mode == "portable"
            try:
                _libs[mode] = build(portable=portable)
                _statuses[mode] = "ready (portable build)" if portable else "ready"
            except Exception as exc:  # any build or load failure leaves the PyTorch paths
                _libs[mode] = None
                _statuses[mode] = f"unavailable: {exc}"
                log.warning("Parrot's C ops are %s; the engine uses its PyTorch paths", _statuses[mode])
    return _libs[mode]


def require(lib: ctypes.CDLL | None = None) -> ctypes.CDLL:
    """``lib`` if given, else the selected library; raises RuntimeError (with
    :func:`status`) when there is none.  For callers that only run once a
    ``supports``/``applies`` check said the C side is there."""
    lib = lib or library()
    if lib is None:
        raise RuntimeError(f"Parrot's C ops are {status()}")
    return lib


def status(mode: str | None = None) -> str:
    """'ready', 'ready (portable build)', 'not built yet', or why build ``mode``
    (default: the selected one) is not used."""
    mode = _check_mode(selected() if mode is None else mode)
    if mode == "off":
        return "switched off (cpu_kernel='off')"
    return _statuses.get(mode, "not built yet")
