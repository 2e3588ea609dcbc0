"""A C kernel for single-query decode rows on CPU, built on first use with the system C compiler.

PyTorch has no paged attention op on CPU, so the PyTorch path gathers every
row's keys and values out of the cache (a copy as large as what attention then
reads) before one fused attention call.  ``csrc/decode_rows.c`` reads the cache
rows in place instead: one pass over each sequence's K and V per layer, with an
online softmax, parallel over (row, kv head) on PyTorch's own OpenMP threads.

Build: ``$CC`` (default ``cc``) with ``-O3 -march=native -fopenmp``, once per
source / compiler / CPU, into ``$PARROT_KERNEL_CACHE`` (default
``~/.cache/parrot/kernels``), then loaded with :mod:`ctypes` (no PyTorch headers,
so it compiles in about a second).  Where that fails (no compiler, another OS) or
``PARROT_CPU_KERNEL=0`` is set, :func:`kernel` returns None, :func:`status`
says why, and attention keeps the PyTorch path: the kernel is never required.

The shared library links ``libgomp.so.1``, the soname of the OpenMP runtime
PyTorch's CPU wheels load first, so both use one thread pool.
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
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["build", "decode_rows", "kernel", "status", "supports"]

log = logging.getLogger(__name__)

_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
# -DPARROT_PORTABLE builds only the portable C path (tests check it on AVX-512 machines too).
_PORTABLE_FLAGS = ("-DPARROT_PORTABLE",)
_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None
_status = "not built yet"
_tried = False


def _cpu_signature() -> str:
    """What ``-march=native`` compiles for: the CPU model and feature flags."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _cache_dir() -> Path:
    env = os.environ.get("PARROT_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "parrot" / "kernels"


def _compile(source: str, cc: str, flags: tuple[str, ...]) -> Path:
    """The shared library for ``source``, compiled unless an identical build is cached."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60, check=True)
    key = hashlib.sha256("\0".join((source, cc, version.stdout, *flags, _cpu_signature())).encode())
    out_dir = _cache_dir()
    target = out_dir / f"decode_rows-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = Path(tmp) / "decode_rows.c"
        src.write_text(source)
        built = Path(tmp) / "decode_rows.so"
        run = subprocess.run(
            [cc, *flags, str(src), "-o", str(built), "-lm"], capture_output=True, text=True, timeout=300
        )
        if run.returncode != 0:
            raise RuntimeError(f"{cc} failed: {run.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: concurrent builders leave one complete file
    return target


def build(*, portable: bool = False) -> ctypes.CDLL:
    """Compile (or take from the cache) and load the kernel; raises if that fails.
    ``portable``: without the AVX-512 path (what non-AVX-512 CPUs and odd head dims run)."""
    source = resources.files(__package__).joinpath("csrc/decode_rows.c").read_text()
    flags = _FLAGS + (_PORTABLE_FLAGS if portable else ())
    lib = ctypes.CDLL(str(_compile(source, os.environ.get("CC") or "cc", flags)))
    fn = lib.parrot_decode_rows
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    c_int = ctypes.c_int
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, c_int, ptr, ptr, i64, i64, i64, i64, i64, ptr, ptr, c_int]
    fn.restype = ctypes.c_int
    return lib


def kernel() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on the first call; None when unavailable
    (then :func:`status` gives the reason, logged once as a warning)."""
    global _loaded, _status, _tried
    if os.environ.get("PARROT_CPU_KERNEL", "1") == "0":
        _status = "disabled by PARROT_CPU_KERNEL=0"
        return None
    if _tried:
        return _loaded
    with _lock:
        if not _tried:
            try:
                _loaded = build()
                _status = "ready"
            except Exception as exc:  # any build or load failure leaves the PyTorch path
                _status = f"unavailable: {exc}"
                log.warning("CPU decode kernel %s; decode attention uses the PyTorch path", _status)
            _tried = True
    return _loaded


def status() -> str:
    """'ready', 'not built yet', or why the kernel is not used."""
    return _status


def supports(compute_dtype: torch.dtype, cache: Tensor) -> bool:
    """Whether :func:`decode_rows` runs attention computed in ``compute_dtype`` over
    ``cache`` (fp32 compute; a contiguous fp32 or bf16 cache on CPU) and the kernel
    is available."""
    return (
        compute_dtype == torch.float32
        and cache.device.type == "cpu"
        and cache.dtype in (torch.float32, torch.bfloat16)
        and cache.is_contiguous()
        and kernel() is not None
    )


def decode_rows(
    qs: Tensor,
    seqs: Tensor,
    kf: Tensor,
    vf: Tensor,
    tok: Tensor,
    lens: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    lib: ctypes.CDLL | None = None,
) -> bool:
    """Attention of ``R`` single-query rows, written into ``out`` [R, H, D] and ``lse`` [R, H].

    qs: [B, H, D] fp32, scaled; seqs: int64 [R], the q row of each row; kf, vf:
    [N, KVH, D] fp32/bf16 caches; tok: int64 [R, W], row r's key rows in its
    first ``lens[r]`` (>= 1) entries.  The caller checks shapes and index ranges
    (:class:`~parrot.engine.attention.torch_impl.TorchDecodePlan` builds them);
    this checks layouts, because the C side trusts them.  ``lib``: a library from
    :func:`build` (default: :func:`kernel`'s).  Returns whether the AVX-512 path ran.
    """
    lib = lib or kernel()
    if lib is None:
        raise RuntimeError(f"CPU decode kernel {status()}")
    _, heads, dim = qs.shape
    _, kv_heads, _ = kf.shape
    rows, width = tok.shape
    tensors = (qs, seqs, kf, vf, tok, lens, out, lse)
    if not all(t.is_contiguous() and t.device.type == "cpu" for t in tensors):
        raise ValueError("decode_rows needs contiguous CPU tensors")
    if vf.shape != kf.shape or vf.dtype != kf.dtype or out.shape != (rows, heads, dim):
        raise ValueError("decode_rows: mismatched cache or output shapes")
    if lse.shape != (rows, heads) or out.dtype != torch.float32 or lse.dtype != torch.float32:
        raise ValueError("decode_rows: out and lse must be fp32 [R, H, D] and [R, H]")
    if seqs.dtype != torch.int64 or tok.dtype != torch.int64 or lens.dtype != torch.int64:
        raise ValueError("decode_rows: seqs, tok and lens must be int64")
    vector = lib.parrot_decode_rows(
        qs.data_ptr(),
        heads * dim,
        seqs.data_ptr(),
        kf.data_ptr(),
        vf.data_ptr(),
        int(kf.dtype == torch.bfloat16),
        tok.data_ptr(),
        lens.data_ptr(),
        rows,
        width,
        kv_heads,
        heads // kv_heads,
        dim,
        out.data_ptr(),
        lse.data_ptr(),
        torch.get_num_threads(),
    )
    return bool(vector)
