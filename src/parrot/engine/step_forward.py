"""How the engine computes a step's hidden states: one strategy, chosen when it starts.

:func:`choose` looks at the model (packed or not, which C kernel copies its
projections have), the KV cache and the engine's kernels
(:class:`~parrot.engine.kernels.kernel_set.KernelSet`), once, and returns a
:class:`StepForward` with a name that the start-up log and the engine's stats
(``decode_path``) show:

* ``c-forward/f32``, ``c-forward/amx-bf16``, ``c-forward/avx512-bf16`` — a pure
  decode step within the kernels' row limit whose attention runs on the C kernels
  alone goes through one C call for all its layers
  (:mod:`parrot.engine.kernels.decode_forward`, with the fp32 projection kernel or the
  bf16 one on AMX tiles or AVX-512 BF16); every other step (prefill chunks, larger
  batches, attention the C side does not cover) takes the model's forward.  Both
  give the same bits;
* ``pytorch/fused`` — the model's forward with its elementwise steps in C
  (:mod:`parrot.engine.kernels.fused`) and oneDNN-packed projections;
* ``pytorch/packed`` — the model's forward with oneDNN-packed projections;
* ``pytorch`` — the model's plain forward (any device);
* ``cuda/triton`` — on CUDA: the model's plain forward (fp16/bf16 weights),
  prefill through PyTorch's ``scaled_dot_product_attention``
  (:func:`~parrot.engine.prefill_attention.sdpa_prefill_attention`) and decode
  attention through the Triton shared-prefix kernel
  (:mod:`parrot.engine.kernels.attention.triton_kernel`); ``cuda/pytorch`` when
  triton is not installed or ``decode_attention="torch"`` asks for PyTorch's;
* ``pytorch/triton`` — the same Triton decode path on CPU tensors, run by Triton's
  interpreter (``TRITON_INTERPRET=1``): how CI checks the CUDA strategy without a GPU.

``decode_attention`` (:class:`~parrot.engine.config.EngineConfig`) picks the decode
backend: ``auto`` (Triton on CUDA when installed, the CPU's own paths otherwise),
``torch`` or ``triton``.

Prompt chunks' attention is chosen with the strategy too: on the CPU with a bf16 KV
cache, a head dimension that is a multiple of 32 and the kernel set's ``bf16_prefill``
backend, every step's chunks attend on Parrot's C kernel
(:mod:`parrot.engine.kernels.prefill_bf16`: ``prefill_lib``, ``prefill_backend``);
otherwise through PyTorch's flash attention (:mod:`parrot.engine.prefill_attention`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
from torch import Tensor

from parrot.engine.core.contexts import ContextTable
from parrot.engine.core.step_planner import SeqSlice
from parrot.engine.kernels import decode_forward, fused
from parrot.engine.kernels.attention import triton_available
from parrot.engine.kernels.attention.triton_kernel import interpret_requested
from parrot.engine.kernels.kernel_set import KernelSet, for_options
from parrot.engine.kv_store import PagedKVCache
from parrot.engine.model import LlamaModel
from parrot.engine.paged import PagedStepAttention

__all__ = ["StepForward", "choose", "step_inputs"]


def step_inputs(
    slices: list[SeqSlice], contexts: ContextTable, device: str
) -> tuple[Tensor, Tensor, list[int]]:
    """A step's token ids and positions [T] on ``device``, and the KV cache rows
    (:meth:`ContextTable.slots`) their keys and values go to: slice after slice, each
    slice's ``n`` tokens from its ``start`` (their blocks already reserved)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for s in slices:
        ids.extend(s.ctx.tokens(s.start, s.start + s.n))
        positions.extend(range(s.start, s.start + s.n))
        slots.extend(contexts.slots(s.ctx, s.start, s.n))
    as_tensor = torch.tensor
    return (
        as_tensor(ids, dtype=torch.long, device=device),
        as_tensor(positions, dtype=torch.long, device=device),
        slots,
    )


@dataclass(frozen=True)
class StepForward:
    """``name``: what the stats show; ``c_forward``: try the C forward first, with
    ``lib`` (the engine's build of the C ops); ``decode_backend``: the backend of the
    step's decode attention (``auto``, ``torch`` or ``triton``); ``prefill_lib``: the
    build whose C kernel computes prompt chunks' attention (None: PyTorch's), on
    ``prefill_backend`` (None: the fastest it has)."""

    name: str
    c_forward: bool
    lib: ctypes.CDLL | None = field(default=None, compare=False, repr=False)
    decode_backend: str = "auto"
    prefill_lib: ctypes.CDLL | None = field(default=None, compare=False, repr=False)
    prefill_backend: str | None = None

    def attention(
        self, cache: PagedKVCache, slices: list[SeqSlice], slots: list[int], *, share_prefix: bool
    ) -> PagedStepAttention:
        """The attention backend of one step over ``slices`` (see :class:`PagedStepAttention`)."""
        return PagedStepAttention(
            cache,
            slices,
            slots,
            share_prefix=share_prefix,
            decode_backend=self.decode_backend,
            prefill_lib=self.prefill_lib,
            prefill_backend=self.prefill_backend,
        )

    def __call__(
        self,
        model: LlamaModel,
        input_ids: Tensor,
        positions: Tensor,
        attn: PagedStepAttention,
        cache: PagedKVCache,
    ) -> Tensor:
        """The step's final hidden states [T, D]."""
        if self.c_forward:
            hidden = decode_forward.run(model, input_ids, positions, attn, cache, self.lib)
            if hidden is not None:
                return hidden
        return model(input_ids, positions, attn)


def choose(
    model: LlamaModel, cache: PagedKVCache, kernels: KernelSet | None = None, decode_attention: str = "auto"
) -> StepForward:
    """The strategy for this model and cache on ``kernels`` (default: every kernel
    allowed) with ``decode_attention`` (see the module docstring).  ValueError when
    ``triton`` is asked for where it cannot run."""
    on_cuda = cache.k.device.type == "cuda"
    if decode_attention == "triton":
        if not triton_available():
            raise ValueError("decode_attention='triton' needs the 'triton' package (pip install triton)")
        if not on_cuda and not interpret_requested():
            raise ValueError("decode_attention='triton' needs a CUDA device (or TRITON_INTERPRET=1 on CPU)")
        return StepForward(
            "cuda/triton" if on_cuda else "pytorch/triton", c_forward=False, decode_backend="triton"
        )
    if on_cuda:
        triton = decode_attention == "auto" and triton_available()
        backend = "triton" if triton else "torch"
        return StepForward(
            f"cuda/{'triton' if triton else 'pytorch'}", c_forward=False, decode_backend=backend
        )
    kernels = for_options() if kernels is None else kernels
    lib = kernels.lib
    kernel_prefill = cache.k.dtype == torch.bfloat16 and model.config.head_dim % 32 == 0
    prefill = kernels.bf16_prefill if kernel_prefill else None
    prefill_lib = lib if prefill is not None else None
    c_forward = kernels.c_forward and decode_attention == "auto"  # its attention is the C kernels'
    mode = decode_forward.c_forward_mode(model, cache, lib) if c_forward else None
    if mode is not None:
        return StepForward(
            f"c-forward/{mode}", c_forward=True, lib=lib, prefill_lib=prefill_lib, prefill_backend=prefill
        )
    packed = len(model.model.layers) > 0 and model.model.layers[0].self_attn.qkv is not None
    residual = model.model.embed_tokens.weight  # the residual stream has its dtype and device
    if packed and fused.applies(
        torch.empty(1, model.config.hidden_size, dtype=residual.dtype, device=residual.device)
    ):
        name = "pytorch/fused"
    else:
        name = "pytorch/packed" if packed else "pytorch"
    return StepForward(
        name,
        c_forward=False,
        decode_backend=decode_attention,
        prefill_lib=prefill_lib,
        prefill_backend=prefill,
    )
