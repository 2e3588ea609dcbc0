"""oneDNN-prepacked linear layers for CPU inference.

``F.linear`` on CPU hands an fp32 weight to MKL in its plain ``[out, in]``
layout on every call.  oneDNN can instead reorder a weight once into the
blocked layout its GEMM kernels read directly, which is several times faster at
decode and prefill sizes (``docs/engine.md``, "Why the kernels exist"), with
fp32 accuracy (results differ from the plain path only by rounding order).

:func:`prepack_linears` packs every :class:`Projection` (the ``nn.Linear`` the
model is built of) in place: each keeps its ``weight`` (checkpoints, other
devices and tests still see the plain tensor) and gets a packed copy that its
``forward`` uses.  Packing is idempotent and is skipped (returns 0) where it
cannot apply: oneDNN missing, a non-CPU weight, or a dtype other than fp32 / bf16.
The packed copy doubles the weights' memory (adds half as much as bf16).

``dtype=torch.bfloat16`` packs bf16 copies of fp32 weights: the GEMMs then read
half the bytes and use the CPU's bf16 dot products, with inputs rounded to bf16
and fp32 accumulation; the residual stream, norms, attention and KV cache stay fp32.
That is a precision choice (greedy outputs can differ from fp32's), so it is opt-in:
``parrot serve --weight-dtype bfloat16``.
Where Parrot's bf16 kernel runs (:mod:`parrot.engine.kernels.bf16_linear`: AMX tiles or
AVX-512 BF16), a bf16 layer also keeps the kernel's packed copy and sends calls of at
most ``bf16_linear.MAX_ROWS`` rows (decode steps) there; likewise an fp32 layer where
Parrot's fp32 kernel runs (:mod:`parrot.engine.kernels.f32_linear`, AVX-512), for calls of
at most ``f32_linear.MAX_ROWS`` rows.  Which of them a layer may use, and from which
build of the C ops, is the engine's
:class:`~parrot.engine.kernels.kernel_set.KernelSet`, given when it is packed.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parrot.engine.kernels import bf16_linear, f32_linear
from parrot.engine.kernels.kernel_set import KernelSet, for_options

__all__ = [
    "PackedLinear",
    "Projection",
    "bf16_packing_supported",
    "packed_linear_available",
    "prepack_linears",
]

# The batch size oneDNN tunes the packed layout for; measured on this machine, a
# hint of 16 is as fast as the exact size from 4 to 512 rows (1 row: the same).
_BATCH_HINT = 16


def _onednn_linear_ops() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


@functools.cache
def bf16_packing_supported() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU.  Its bf16 reorder needs AVX-512
    (BW, VL, DQ) or AVX-NE-CONVERT and raises RuntimeError on a CPU without them (an
    AVX2-only AMD EPYC Milan, say), so it is tried once on a small weight."""
    if not _onednn_linear_ops():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), _BATCH_HINT)
    except RuntimeError:
        return False
    return True


def packed_linear_available(weight: Tensor, dtype: torch.dtype | None = None) -> bool:
    """True when ``weight`` can be prepacked here as ``dtype`` (default: its own): CPU,
    fp32/bf16, oneDNN ops present, and for bf16 a CPU whose oneDNN packs bf16."""
    want = weight.dtype if dtype is None else dtype
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and want in (torch.float32, torch.bfloat16)
        and weight.dim() == 2
        and _onednn_linear_ops()
        and (want != torch.bfloat16 or bf16_packing_supported())
    )


class PackedLinear:
    """``x @ weight.T + bias`` through a oneDNN-packed copy of ``weight`` (x: [..., in]).

    ``dtype``: the packed copy's dtype (default: the weight's).  With a bf16 copy of
    an fp32 weight, inputs are rounded to bf16, the GEMM accumulates in fp32 and the
    output comes back in the input's dtype: bf16 weights and products, an fp32
    residual stream.  ``kernels``: which C kernel copies it keeps (its ``f32_linear``
    / ``bf16_linear``, from its library, on huge pages as its options say; default:
    :func:`~parrot.engine.kernels.kernel_set.for_options` of the defaults).
    """

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None = None,
        *,
        dtype: torch.dtype | None = None,
        kernels: KernelSet | None = None,
    ):
        kernels = for_options() if kernels is None else kernels
        self.key = kernels.linear_key()  # what decided its kernel copies (prepack compares it)
        self.dtype = weight.dtype if dtype is None else dtype
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"packed weights are float32 or bfloat16, not {self.dtype}")
        with torch.no_grad():
            w = weight.detach().to(self.dtype)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, _BATCH_HINT)
        self.bias = None if bias is None else bias.detach().to(self.dtype)
        self.out_features, self.in_features = weight.shape
        # The C kernels' own copies, for calls of few rows (chosen here, once: this
        # layer keeps its choice): fp32 weights on AVX-512, bf16 on AMX or AVX-512 BF16.
        lib = kernels.lib
        self.f32: f32_linear.F32Weight | None = None
        self._f32_lib = lib if kernels.f32_linear and self.dtype == torch.float32 else None
        if self._f32_lib is not None:
            self.f32 = f32_linear.pack(weight, lib=self._f32_lib, huge_pages=kernels.options.hugepages)
        self.bf16: bf16_linear.Bf16Weight | None = None  # the bf16 kernel's copy (bf16 only)
        self.bf16_bias: Tensor | None = None  # the bias as the bf16 kernel takes it (fp32)
        self.bf16_backend = kernels.bf16_linear if self.dtype == torch.bfloat16 else None
        self._bf16_lib = lib if self.bf16_backend is not None else None
        if self._bf16_lib is not None:
            self.bf16 = bf16_linear.pack(weight, lib=self._bf16_lib)
            self.bf16_bias = None if bias is None else bias.detach().float()

    def __call__(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected last dim {self.in_features}, got {tuple(x.shape)}")
        few = x.dim() == 2 and x.device.type == "cpu"  # and then: rows within a kernel's MAX_ROWS
        if self.f32 is not None and few and x.shape[0] <= f32_linear.MAX_ROWS and x.dtype == torch.float32:
            return f32_linear.linear(x, self.f32, self.bias, lib=self._f32_lib)
        if (
            self.bf16 is not None
            and few
            and x.shape[0] <= bf16_linear.MAX_ROWS
            and x.dtype in (torch.float32, torch.bfloat16)
        ):
            return bf16_linear.linear(
                x, self.bf16, self.bf16_bias, backend=self.bf16_backend, lib=self._bf16_lib
            )
        if x.dtype == self.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        y = torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, self.bias, "none", [], "")
        return y.to(x.dtype)


class Projection(nn.Linear):
    """An ``nn.Linear`` that runs through its packed copy when it has one (``packed``,
    set by :func:`prepack_linears`).  Its parameters, and so its checkpoint entries, are
    ``nn.Linear``'s: the packed copy is derived from them and never saved."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed: PackedLinear | None = None

    def forward(self, x: Tensor) -> Tensor:
        packed = self.packed
        return F.linear(x, self.weight, self.bias) if packed is None else packed(x)


def prepack_linears(
    model: nn.Module,
    dtype: torch.dtype | None = None,
    *,
    exclude: Iterable[nn.Module] = (),
    kernels: KernelSet | None = None,
) -> int:
    """Pack every :class:`Projection` in ``model`` whose weight allows it, as ``dtype``
    (default: the weight's) with the C kernel copies of ``kernels`` (see
    :class:`PackedLinear`); returns how many now run packed.  Safe to call again: a
    projection already packed as ``dtype`` with these kernels is kept, one packed
    otherwise is repacked.
    Projections in ``exclude`` (e.g. ones the caller packs fused) are left unpacked,
    and a packed copy they had is dropped.  Plain ``nn.Linear`` modules are left as
    they are."""
    kernels = for_options() if kernels is None else kernels
    skip = {id(m) for m in exclude}
    count = 0
    for module in model.modules():
        if not isinstance(module, Projection):
            continue
        if id(module) in skip:
            module.packed = None
            continue
        want = module.weight.dtype if dtype is None else dtype
        if not packed_linear_available(module.weight, want):
            continue
        current = module.packed
        if current is None or current.dtype != want or current.key != kernels.linear_key():
            module.packed = PackedLinear(module.weight, module.bias, dtype=want, kernels=kernels)
        count += 1
    return count
