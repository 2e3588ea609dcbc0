"""fp32 linear layers that stream their weights while computing (``csrc/f32_linear.c``).

A decode step multiplies a few dozen rows by every weight once: the weights come
from memory as they are used.  oneDNN's fp32 GEMM reads and computes one after the
other at those sizes; the C kernel reads each weight from a panel layout packed
for it (:func:`pack`) and prefetches the next panel while it computes, so the two
overlap.  :class:`~parrot.engine.kernels.packed_linear.PackedLinear` keeps this copy
beside oneDNN's and sends fp32 calls of at most :data:`MAX_ROWS` rows here
(it is faster than oneDNN up to about that many rows and no faster beyond, so
prefill chunks keep oneDNN: ``docs/engine.md``, "Why the kernels exist").  Its
packed weights sit on 2 MiB pages (:mod:`parrot.engine.hugepages`).

The engine uses it where Parrot's C ops are built with AVX-512F (``-march=native``
on a CPU that has it: :func:`available`); the engine's ``f32_linear`` option
(:class:`~parrot.engine.kernels.options.KernelOptions`) turns it off (to compare).
Every other build computes the same bits in portable C (slower than oneDNN, so the
engine keeps oneDNN there; the tests run it on every CPU).  Each output is one
fp32 sum over the input features in order plus the bias, the same whatever the
number of rows or threads.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import Tensor

from parrot.engine import hugepages
from parrot.engine.kernels import native
from parrot.engine.kernels.linear_args import linear_operands

__all__ = ["MAX_ROWS", "F32Weight", "available", "linear", "pack"]

# Calls with more rows (prefill chunks) go to oneDNN, which is as fast or faster there
# (``benchmarks/linear_step.py``).
MAX_ROWS = 256


def available(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the kernel can run here: ``lib`` (default: the selected library,
    :func:`parrot.engine.kernels.native.library`) is built for AVX-512."""
    lib = lib or native.library()
    return lib is not None and bool(lib.parrot_f32_linear_supported())


@dataclass(frozen=True)
class F32Weight:
    """A weight [out_features, in_features] packed for the kernel: ``data`` is fp32 in
    the panel layout of ``csrc/f32_linear.c``, zero-padded to whole panels."""

    data: Tensor
    out_features: int
    in_features: int


def pack(weight: Tensor, *, lib: ctypes.CDLL | None = None, huge_pages: bool = True) -> F32Weight:
    """The kernel's packed copy of ``weight`` [N, K] (converted to fp32).  ``lib``: a
    library from :func:`parrot.engine.kernels.native.build` (default: the selected one);
    ``huge_pages``: carve it from :func:`parrot.engine.hugepages.empty`'s chunks (else
    plain memory)."""
    lib = native.require(lib)
    if weight.dim() != 2 or weight.device.type != "cpu" or not weight.is_floating_point():
        raise ValueError(f"pack needs a 2-D float CPU weight, got {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    if n < 1 or k < 1:
        raise ValueError(f"pack needs a non-empty weight, got {tuple(weight.shape)}")
    w = weight.detach().to(torch.float32).contiguous()
    size = lib.parrot_f32_packed_size(n, k)
    out = hugepages.empty(size) if huge_pages else torch.empty(size)  # streamed every step: 2 MiB pages
    lib.parrot_f32_pack(w.data_ptr(), n, k, out.data_ptr())
    return F32Weight(out, n, k)


def linear(
    x: Tensor, weight: F32Weight, bias: Tensor | None = None, *, lib: ctypes.CDLL | None = None
) -> Tensor:
    """``x @ W^T + bias`` for x [M, K] fp32 and ``weight = pack(W)``; returns [M, N]
    fp32.  ``bias``: fp32 [N] or None."""
    lib = native.require(lib)
    x, bias, y = linear_operands(
        x,
        weight,
        bias,
        x_dtypes=(torch.float32,),
        data_dtype=torch.float32,
        packed_size=lib.parrot_f32_packed_size,
    )
    (m, n), k, data = y.shape, weight.in_features, weight.data
    if m == 0:
        return y
    code = lib.parrot_f32_linear(
        x.data_ptr(),
        m,
        k,
        data.data_ptr(),
        n,
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    if code != 0:  # every build computes (portable C without AVX-512): a broken library
        raise RuntimeError(f"parrot_f32_linear returned {code}")
    return y
