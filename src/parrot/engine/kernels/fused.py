"""A decoder layer's elementwise steps as single C calls (``csrc/layer_ops.c``).

Each function here replaces a short chain of eager PyTorch ops: the residual add
and the RMSNorm after it (and the cast of the normed rows to the next GEMM's
dtype), RoPE on q and k inside the fused q/k/v output, and SwiGLU's
``silu(gate) * up`` on the fused gate/up output.  They compute in
fp32 like the PyTorch chains (results differ only by rounding order) and take
only what :func:`applies` accepts: contiguous CPU tensors, with
:mod:`parrot.engine.kernels.native` built.  The model checks that once per forward and
otherwise runs its PyTorch code.  SiLU uses the vector ``exp`` of ``csrc/simd.h``
on AVX-512: a scalar ``expf`` would be slower than PyTorch's vectorised SiLU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from parrot.engine.kernels import native

__all__ = ["add_rms_norm", "applies", "rope_", "silu_mul"]

_DTYPES = (torch.float32, torch.bfloat16)


def applies(hidden: Tensor) -> bool:
    """Whether the fused ops run a forward whose residual stream is ``hidden``:
    fp32 on CPU, contiguous, outside autograd (the C side records no graph), with
    the C library available."""
    return (
        not hidden.requires_grad
        and hidden.device.type == "cpu"
        and hidden.dtype == torch.float32
        and hidden.is_contiguous()
        and native.library() is not None
    )


def add_rms_norm(
    h: Tensor, delta: Tensor | None, weight: Tensor, eps: float, out_dtype: torch.dtype = torch.float32
) -> Tensor:
    """``h += delta`` in place (if given), then RMSNorm of ``h`` times ``weight`` as a new
    ``out_dtype`` tensor.  h: fp32 [T, D] contiguous; delta: [T, D] fp32/bf16; weight: fp32 [D]."""
    rows, dim = h.shape
    if h.dtype != torch.float32 or not h.is_contiguous() or weight.dtype != torch.float32:
        raise ValueError("add_rms_norm needs a contiguous fp32 h and an fp32 weight")
    if any(t is not None and t.device.type != "cpu" for t in (h, delta, weight)):
        raise ValueError("add_rms_norm runs on CPU tensors only")
    if weight.shape != (dim,) or out_dtype not in _DTYPES:
        raise ValueError(f"add_rms_norm: weight must be [{dim}] and out fp32 or bf16")
    if delta is not None:
        if delta.shape != h.shape or delta.dtype not in _DTYPES:
            raise ValueError(f"add_rms_norm: delta must be fp32/bf16 {tuple(h.shape)}")
        delta = delta.contiguous()
    out = torch.empty(rows, dim, dtype=out_dtype)
    native.require().parrot_add_rms_norm(
        h.data_ptr(),
        None if delta is None else delta.data_ptr(),
        int(delta is not None and delta.dtype == torch.bfloat16),
        weight.contiguous().data_ptr(),
        float(eps),
        rows,
        dim,
        out.data_ptr(),
        int(out_dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out


def rope_(x: Tensor, heads: int, cos: Tensor, sin: Tensor) -> None:
    """Rotate the first ``heads`` head vectors of every row of ``x`` in place (x: fp32
    [T, W] contiguous, W >= heads * D; cos, sin: fp32 [T, D], halves repeated)."""
    rows, dim = cos.shape
    if x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2 or x.shape[0] != rows:
        raise ValueError("rope_ needs a contiguous fp32 [T, W] x with one row per cos row")
    if heads * dim > x.shape[1] or dim % 2 or sin.shape != cos.shape:
        raise ValueError(f"rope_: {heads} heads of {dim} do not fit rows of {x.shape[1]}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError("rope_: cos and sin must be fp32")
    if any(t.device.type != "cpu" for t in (x, cos, sin)):
        raise ValueError("rope_ runs on CPU tensors only")
    cos, sin = cos.contiguous(), sin.contiguous()
    native.require().parrot_rope(
        x.data_ptr(), rows, heads, dim, x.shape[1], cos.data_ptr(), sin.data_ptr(), torch.get_num_threads()
    )


def silu_mul(gu: Tensor) -> Tensor:
    """``silu(gu[:, :I]) * gu[:, I:]`` as a new [T, I] tensor of gu's dtype (gu: fp32 or
    bf16 [T, 2I] contiguous, the fused gate/up output; computed in fp32)."""
    if gu.dim() != 2 or gu.shape[1] % 2 or gu.dtype not in _DTYPES:
        raise ValueError(f"silu_mul needs an fp32/bf16 [T, 2I] input, got {tuple(gu.shape)} {gu.dtype}")
    if not gu.is_contiguous() or gu.device.type != "cpu":
        raise ValueError("silu_mul runs on contiguous CPU tensors only")
    rows, inter = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gu.dtype)
    bf16 = int(gu.dtype == torch.bfloat16)
    native.require().parrot_silu_mul(
        gu.data_ptr(), bf16, rows, inter, out.data_ptr(), bf16, torch.get_num_threads()
    )
    return out
