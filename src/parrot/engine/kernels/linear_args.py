"""The argument checks and output allocation the C linear kernels share
(:mod:`~parrot.engine.kernels.f32_linear`, :mod:`~parrot.engine.kernels.bf16_linear`): the C
side trusts shapes, dtypes and layouts, so they are checked in Python before every call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["PackedWeight", "linear_operands"]

_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16"}


class PackedWeight(Protocol):
    data: Tensor
    out_features: int
    in_features: int


def linear_operands(
    x: Tensor,
    weight: PackedWeight,
    bias: Tensor | None,
    *,
    x_dtypes: tuple[torch.dtype, ...],
    data_dtype: torch.dtype,
    packed_size: Callable[[int, int], int],
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Raise ValueError unless x is a 2-D CPU tensor of ``x_dtypes`` with the weight's
    in_features, ``weight.data`` a contiguous ``data_dtype`` tensor of
    ``packed_size(out_features, in_features)`` elements, and ``bias`` None or fp32
    [out_features].  Returns x and bias contiguous (the tensors the C side must read, held
    by the caller for the call) and the output y, uninitialised [M, out_features] in x's
    dtype."""
    if x.dim() != 2 or x.dtype not in x_dtypes or x.device.type != "cpu":
        names = "/".join(_SHORT.get(d, str(d)) for d in x_dtypes)
        raise ValueError(
            f"linear needs a 2-D {names} CPU input, got {tuple(x.shape)} {x.dtype} on {x.device}"
        )
    k, n, data = x.shape[1], weight.out_features, weight.data
    if k != weight.in_features:
        raise ValueError(f"x has {k} features; the weight takes {weight.in_features}")
    if data.dtype != data_dtype or not data.is_contiguous() or data.numel() != packed_size(n, k):
        raise ValueError(f"packed data does not hold a [{n}, {k}] weight")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,)):
        raise ValueError(f"bias must be fp32 [{n}]")
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    return x.contiguous(), None if bias is None else bias.contiguous(), y
