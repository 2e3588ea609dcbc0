"""CPU tensors on transparent huge pages, for memory the engine streams through.

A decode step reads every weight once (hundreds of MiB) and the KV cache at
scattered rows; with 4 KiB pages each few KiB of that is a TLB miss and a page
walk.  Linux's transparent huge pages are commonly in ``madvise`` mode: memory gets
2 MiB pages only when asked with ``madvise(MADV_HUGEPAGE)`` before it is first
touched.  The chunks below also keep many weights contiguous: weights allocated
one by one land wherever the allocator puts them, and the fp32 kernel's speed
then varied from run to run; carved from chunks it is steady, with or without
huge pages (measurements: ``docs/engine.md``, "Why the kernels exist").

* :func:`advise` asks for the 2 MiB-aligned interior of a tensor not yet touched
  (e.g. the KV cache right after ``torch.empty``);
* :func:`empty` hands out 1-D tensors carved from shared, advised 32 MiB chunks
  (larger requests get chunks of their own), so that many weights of a few MiB
  each are all on huge pages without padding each one to 2 MiB.

Elsewhere (no Linux ``madvise``, a non-CPU tensor) both fall back to plain memory;
with the engine's ``hugepages`` option off (to compare) its callers use plain memory:
huge pages are an optimisation, never required.  Invariant: a tensor from
:func:`empty` never overlaps another one; a chunk is freed when the last tensor
carved from it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["advise", "empty"]

HUGE = 2 << 20  # bytes in a huge page
CHUNK = 32 << 20  # bytes in a shared chunk
_MADV_HUGEPAGE = 14
_ALIGN = 64  # bytes: every tensor handed out starts on a cache line


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise_fn = _madvise()


def advise(t: Tensor) -> int:
    """Ask for huge pages under ``t``'s memory (its whole 2 MiB pages); returns the
    bytes advised (0 when nothing could be: too small, not CPU, not Linux, refused).
    Only memory not yet touched gets huge pages, so call it right after allocating."""
    if _madvise_fn is None or t.device.type != "cpu":
        return 0
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo, hi = -(-start // HUGE) * HUGE, end // HUGE * HUGE
    if hi <= lo or _madvise_fn(lo, hi - lo, _MADV_HUGEPAGE) != 0:
        return 0
    return hi - lo


class _Arena:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: Tensor | None = None  # uint8, 2 MiB-aligned, advised
        self._used = 0

    @staticmethod
    def _aligned_chunk(nbytes: int) -> Tensor:
        """An advised uint8 tensor of ``nbytes`` (a multiple of HUGE) starting on a huge page."""
        raw = torch.empty(nbytes + HUGE, dtype=torch.uint8)
        offset = -raw.data_ptr() % HUGE
        chunk = raw[offset : offset + nbytes]
        advise(chunk)
        return chunk

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > CHUNK // 4:  # a large tensor: a chunk of its own, whole huge pages
            return self._aligned_chunk(-(-nbytes // HUGE) * HUGE)[:nbytes].view(dtype)
        with self._lock:
            if self._chunk is None or self._used + nbytes > CHUNK:
                self._chunk, self._used = self._aligned_chunk(CHUNK), 0
            out = self._chunk[self._used : self._used + nbytes]
            self._used += -(-nbytes // _ALIGN) * _ALIGN
        return out.view(dtype)


_arena = _Arena()


def empty(numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """An uninitialised 1-D CPU tensor of ``numel`` elements on huge pages where the
    system grants them (see the module docstring)."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return _arena.take(numel, dtype)
