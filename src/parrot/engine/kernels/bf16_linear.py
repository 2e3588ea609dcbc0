"""bf16 linear layers at decode sizes (``csrc/bf16_linear.c``), on AMX tiles or AVX-512 BF16.

A decode step's projections multiply a few dozen rows by each weight once, so
their time is the time to stream the weights.  oneDNN's bf16 GEMM streams them at
roughly half the memory bandwidth at those sizes; the C kernel reads each weight
from a layout packed for its dot products (:func:`pack`) and gets close to the
bandwidth.  One packed layout serves every backend (:data:`BACKENDS`):

* ``amx`` — Intel AMX tiles (Sapphire Rapids and later), where the build targets
  AMX-BF16 and Linux grants the tile state;
* ``avx512-bf16`` — AVX-512 BF16 dot products (``vdpbf16ps``: AMD Zen 4 and later,
  Intel Cooper Lake and later), where the build targets AVX512-BF16;
* ``portable`` — plain C, on every CPU (slower than oneDNN: the tests run it, the
  engine does not).

:class:`~parrot.engine.kernels.packed_linear.PackedLinear` uses the kernel for bf16
weights when a call has at most :data:`MAX_ROWS` rows (prefill keeps oneDNN), on
the backend the engine's :class:`~parrot.engine.kernels.kernel_set.KernelSet` names
(its ``bf16_linear`` and ``amx`` options can narrow it, to compare).
Results: x rounded to bf16, products accumulated in fp32 (each backend in its own
order), bias added in fp32, written in x's dtype.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import Tensor

from parrot.engine.kernels import native
from parrot.engine.kernels.linear_args import linear_operands

__all__ = ["BACKENDS", "MAX_ROWS", "Bf16Weight", "best", "linear", "pack", "runs"]

# Calls with more rows (prefill chunks) go to oneDNN, which is as fast there.
MAX_ROWS = 128

# By the number the C side gives each (parrot_bf16_linear_best): slowest first.
BACKENDS = ("portable", "avx512-bf16", "amx")


def best(lib: ctypes.CDLL | None = None) -> str:
    """The fastest backend that may run here with ``lib`` (default: the selected library,
    :func:`parrot.engine.kernels.native.library`); ``portable`` without a library."""
    lib = lib or native.library()
    return "portable" if lib is None else BACKENDS[lib.parrot_bf16_linear_best()]


def runs(backend: str, lib: ctypes.CDLL | None = None) -> bool:
    """Whether ``backend`` may run here with ``lib`` (every backend up to :func:`best`)."""
    return BACKENDS.index(backend) <= BACKENDS.index(best(lib))


@dataclass(frozen=True)
class Bf16Weight:
    """A weight [out_features, in_features] packed for the kernel: ``data`` is int16
    (bf16 bits) in the block layout of ``csrc/bf16_linear.c``, zero-padded."""

    data: Tensor
    out_features: int
    in_features: int


def pack(weight: Tensor, *, lib: ctypes.CDLL | None = None) -> Bf16Weight:
    """The kernel's packed copy of ``weight`` [N, K], rounded to bf16.  ``lib``: a
    library from :func:`parrot.engine.kernels.native.build` (default: the loaded one)."""
    lib = native.require(lib)
    if weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"pack needs a 2-D CPU weight, got {tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    w = weight.detach().to(torch.bfloat16).contiguous()
    out = torch.empty(lib.parrot_bf16_packed_size(n, k), dtype=torch.int16)
    lib.parrot_bf16_pack(w.data_ptr(), n, k, out.data_ptr())
    return Bf16Weight(out, n, k)


def linear(
    x: Tensor,
    weight: Bf16Weight,
    bias: Tensor | None = None,
    *,
    backend: str | None = None,
    lib: ctypes.CDLL | None = None,
) -> Tensor:
    """``x @ W^T + bias`` for x [M, K] fp32 or bf16 and ``weight = pack(W)``; returns
    [M, N] in x's dtype.  ``bias``: fp32 [N] or None.  ``backend``: one of
    :data:`BACKENDS` (default: :func:`best`); ValueError when it cannot run here."""
    lib = native.require(lib)
    backend = best(lib) if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    x, bias, y = linear_operands(
        x,
        weight,
        bias,
        x_dtypes=(torch.float32, torch.bfloat16),
        data_dtype=torch.int16,
        packed_size=lib.parrot_bf16_packed_size,
    )
    (m, n), k, data = y.shape, weight.in_features, weight.data
    if m == 0:
        return y
    code = lib.parrot_bf16_linear(
        x.data_ptr(),
        int(x.dtype == torch.bfloat16),
        m,
        k,
        data.data_ptr(),
        n,
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        BACKENDS.index(backend),
        torch.get_num_threads(),
    )
    if code == 1:
        raise ValueError(f"the {backend} backend cannot run here (best: {best(lib)})")
    if code != 0:
        raise MemoryError("bf16_linear: could not allocate its scratch memory")
    return y
