"""bf16 linear layers at decode sizes on Intel AMX tiles (``csrc/amx_linear.c``).

A decode step's projections multiply a few dozen rows by each weight once, so
their time is the time to stream the weights.  oneDNN's AMX GEMM streams them at
roughly half this machine's memory bandwidth at those sizes; the C kernel reads
each weight from a layout packed for its tile loads (:func:`pack`) and gets close
to the bandwidth.  :class:`~parrot.engine.kernels.packed_linear.PackedLinear` uses it for
bf16 weights when a call has at most :data:`MAX_ROWS` rows (prefill keeps oneDNN).

The engine uses it only where Parrot's C ops are built with AMX-BF16
(``-march=native`` on a CPU that has it) and Linux grants the tile state
(:func:`available`); the engine's ``amx`` option
(:class:`~parrot.engine.kernels.options.KernelOptions`) turns it off (to compare).
Elsewhere :func:`linear` computes the same products in portable C (slower than
oneDNN; the tests run it on every CPU).
Results: x rounded to bf16, products accumulated in fp32, bias added in fp32,
written in x's dtype.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import Tensor

from parrot.engine.kernels import native
from parrot.engine.kernels.linear_args import linear_operands

__all__ = ["MAX_ROWS", "AmxWeight", "available", "linear", "pack"]

# Calls with more rows (prefill chunks) go to oneDNN, which is as fast there.
MAX_ROWS = 128


def available(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the AMX kernel can run here: ``lib`` (default: the selected library,
    :func:`parrot.engine.kernels.native.library`) is built with it and Linux grants the tiles."""
    lib = lib or native.library()
    return lib is not None and bool(lib.parrot_amx_ready())


@dataclass(frozen=True)
class AmxWeight:
    """A weight [out_features, in_features] packed for the kernel: ``data`` is int16
    (bf16 bits) in the block layout of ``csrc/amx_linear.c``, zero-padded."""

    data: Tensor
    out_features: int
    in_features: int


def pack(weight: Tensor, *, lib: ctypes.CDLL | None = None) -> AmxWeight:
    """The kernel's packed copy of ``weight`` [N, K], rounded to bf16.  ``lib``: a
    library from :func:`parrot.engine.kernels.native.build` (default: the loaded one)."""
    lib = native.require(lib)
    if weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"pack needs a 2-D CPU weight, got {tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    w = weight.detach().to(torch.bfloat16).contiguous()
    out = torch.empty(lib.parrot_amx_packed_size(n, k), dtype=torch.int16)
    lib.parrot_amx_pack(w.data_ptr(), n, k, out.data_ptr())
    return AmxWeight(out, n, k)


def linear(
    x: Tensor, weight: AmxWeight, bias: Tensor | None = None, *, lib: ctypes.CDLL | None = None
) -> Tensor:
    """``x @ W^T + bias`` for x [M, K] fp32 or bf16 and ``weight = pack(W)``; returns
    [M, N] in x's dtype.  ``bias``: fp32 [N] or None."""
    lib = native.require(lib)
    x, bias, y = linear_operands(
        x,
        weight,
        bias,
        x_dtypes=(torch.float32, torch.bfloat16),
        data_dtype=torch.int16,
        packed_size=lib.parrot_amx_packed_size,
    )
    (m, n), k, data = y.shape, weight.in_features, weight.data
    if m == 0:
        return y
    code = lib.parrot_amx_linear(
        x.data_ptr(),
        int(x.dtype == torch.bfloat16),
        m,
        k,
        data.data_ptr(),
        n,
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    if code != 0:
        raise MemoryError("amx_linear: could not allocate its scratch memory")
    return y
