"""A decode step's layers in one C call (``csrc/decode_forward.c``).

On the fused path a decode step is a few hundred calls of Parrot's C ops (four
projections, two norms, RoPE, SiLU and the attention kernels per layer), each
wrapped in Python and PyTorch glue: views, argument checks, output allocation, the
KV write, the partials' buffers.  At SmolLM2's size that glue is a sizeable share
of a step (``docs/engine.md``, "Why the kernels exist").  :func:`run` makes the
same calls from C in one go, with the step's attention plan converted once into
index arrays, and returns the same bits as the Python path
(every op is the same function with the same arguments, in the same order).

It applies to a step when all of these hold (else :func:`run` returns None and the
model runs as before): every new token is a decode token (no prefill chunk); the
KV cache is fp32 or bf16 on CPU; every projection of the model has the C kernel
copy the Python path would use for this many rows: Parrot's fp32 kernel
(:mod:`parrot.engine.kernels.f32_linear`, at most its ``MAX_ROWS`` tokens) or, for bf16
weights, the bf16 kernel on one backend for all (:mod:`parrot.engine.kernels.bf16_linear`,
at most its ``MAX_ROWS``), with fp32 norms; the attention plan runs on the C kernels only
(:class:`~parrot.engine.kernels.attention.torch_plan.TorchDecodePlan` with ``kernel``, and
``shared_kernel`` if it has shared rows).  Whether the engine tries it at all is its
``c_forward`` option (:mod:`parrot.engine.step_forward`).
"""

from __future__ import annotations

import ctypes
import itertools
import math

import torch
from torch import Tensor

from parrot.engine.kernels import bf16_linear, c_boundary, f32_linear, native
from parrot.engine.kernels.attention.torch_plan import TorchDecodePlan
from parrot.engine.kernels.packed_linear import PackedLinear
from parrot.engine.kv_store import PagedKVCache
from parrot.engine.model import LlamaModel, rope_cos_sin
from parrot.engine.paged import PagedStepAttention

__all__ = ["run"]

# The C structs, derived from csrc/parrot_ops.h (the fields are the header's).
_Layer = c_boundary.struct("ParrotDecodeLayer")
_Shape = c_boundary.struct("ParrotDecodeShape")
_Attention = c_boundary.struct("ParrotDecodeAttention")


class _Weights:
    """A model's layer table for the C side, valid while the model keeps these packed
    layers (``packed``: every PackedLinear it points into, held so the pointers stay
    valid and compared by identity to notice a re-pack).  ``bf16``: the backend the
    layers run on in the bf16 kernel (bf16 weights), or None: the fp32 kernel."""

    def __init__(self, model: LlamaModel, packed: list[PackedLinear], bf16: str | None):
        self.packed = packed
        self.bf16 = bf16
        self.max_rows = f32_linear.MAX_ROWS if bf16 is None else bf16_linear.MAX_ROWS
        self.keep: list[Tensor] = []
        layers = model.model.layers
        self.table = (_Layer * len(layers))()
        for entry, layer, (qkv, o, gate_up, down) in zip(
            self.table, layers, zip(*[iter(packed)] * 4, strict=True), strict=True
        ):
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            in_w, post_w = (self._hold(n.weight.detach().contiguous()) for n in norms)
            entry.in_norm, entry.post_norm = in_w, post_w
            entry.in_eps, entry.post_eps = norms[0].eps, norms[1].eps
            entry.qkv, entry.o, entry.gate_up, entry.down = (
                _kernel_copy(p, bf16 is not None).data_ptr() for p in (qkv, o, gate_up, down)
            )
            bias = qkv.bias if bf16 is None else qkv.bf16_bias  # what each kernel gets from Python
            entry.qkv_bias = None if bias is None else self._hold(bias.contiguous())
        final = model.model.norm
        self.final_norm, self.final_eps = self._hold(final.weight.detach().contiguous()), final.eps

    def _hold(self, t: Tensor) -> int:
        self.keep.append(t)
        return t.data_ptr()


def _kernel_copy(p: PackedLinear, bf16: bool) -> Tensor:
    """The packed weight the C kernel of this mode reads (checked present)."""
    copy = p.bf16 if bf16 else p.f32
    assert copy is not None  # _packed_layers chose the mode every layer has
    return copy.data


def _packed_layers(model: LlamaModel) -> tuple[list[PackedLinear], str | None] | None:
    """The model's projections in layer order (q/k/v, o, gate/up, down) and their bf16
    kernel backend (None: fp32), if every one has the C kernel copy of one mode (the
    fp32 kernel, or the bf16 kernel on one backend) and the norms are fp32; else None."""
    out: list[PackedLinear] = []
    modes: set[str | None] = set()
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = (
            attn.qkv,
            attn.o_proj.packed,
            mlp.gate_up,
            mlp.down_proj.packed,
        )
        for p in parts:
            if not isinstance(p, PackedLinear) or (p.f32 is None) == (p.bf16 is None):
                return None
            modes.add(p.bf16_backend if p.bf16 is not None else None)
        if layer.input_layernorm.weight.dtype != torch.float32:
            return None
        out.extend(parts)  # type: ignore[arg-type]
    if len(modes) != 1:
        return None
    return out, modes.pop()


def _weights(model: LlamaModel) -> _Weights | None:
    """The model's cached layer table, rebuilt when its packed layers changed."""
    found = _packed_layers(model)
    if found is None or model.model.norm.weight.dtype != torch.float32:
        return None
    packed, bf16 = found
    cached = model.decode_tables if isinstance(model.decode_tables, _Weights) else None
    if (
        cached is None
        or len(cached.packed) != len(packed)
        or any(a is not b for a, b in zip(cached.packed, packed, strict=True))
    ):
        cached = _Weights(model, packed, bf16)
        model.decode_tables = cached
    return cached


def _attention(plan: TorchDecodePlan, batch: int) -> tuple[_Attention, list[Tensor]] | None:
    """The plan as the C side's index arrays (and the tensors they point into), or None
    when it does not run on the C kernels alone."""
    if not plan.kernel or plan.looped or (plan.shared and not plan.shared_kernel):
        return None
    if not plan.direct and plan.lse_merge is None:
        return None
    keep: list[Tensor] = []
    a = _Attention()
    pad = plan.padded
    if pad is not None:
        keep += [pad.seqs, pad.tok, pad.lengths]
        a.rows, a.width = pad.rows, pad.width
        a.row_seqs, a.row_tok, a.row_lens = (t.data_ptr() for t in keep[-3:])
    if plan.shared:
        seqs = torch.cat([r.seqs for r in plan.shared]).to(torch.int64).contiguous()
        tok = torch.cat([r.tok for r in plan.shared]).to(torch.int64).contiguous()
        seq_off = torch.tensor([0, *itertools.accumulate(r.m for r in plan.shared)])
        tok_off = torch.tensor([0, *itertools.accumulate(r.tok.numel() for r in plan.shared)])
        keep += [seqs, tok, seq_off, tok_off]
        a.shared = len(plan.shared)
        a.seqs, a.tok, a.seq_off, a.tok_off = (
            seqs.data_ptr(),
            tok.data_ptr(),
            seq_off.data_ptr(),
            tok_off.data_ptr(),
        )
    a.slots = plan.slots
    if plan.lse_merge is not None:
        starts, order = plan.lse_merge
        keep += [starts, order]
        a.merge_starts, a.merge_slots = starts.data_ptr(), order.data_ptr()
    elif plan.slots != batch:  # direct means one slot per sequence
        return None
    return a, keep


def c_forward_mode(model: LlamaModel, cache: PagedKVCache, lib: ctypes.CDLL | None) -> str | None:
    """The kernels the C forward would run this model's decode steps on over ``cache``
    with library ``lib`` (``"f32"``: Parrot's fp32 kernel; ``"amx-bf16"`` /
    ``"avx512-bf16"``: the bf16 kernel on AMX tiles / AVX-512 BF16), or None when it
    cannot run them at all (no library, weights or cache it does not take)."""
    if lib is None:
        return None
    if cache.k.dtype not in (torch.float32, torch.bfloat16) or cache.k.device.type != "cpu":
        return None
    weights = _weights(model)
    if weights is None:
        return None
    if weights.bf16 is None:
        return "f32"
    return "amx-bf16" if weights.bf16 == "amx" else weights.bf16


def _step_weights(
    model: LlamaModel,
    input_ids: Tensor,
    attn: PagedStepAttention,
    cache: PagedKVCache,
    lib: ctypes.CDLL | None,
) -> tuple[_Weights, ctypes.CDLL] | None:
    """The model's layer table and the library to run the step on, when the step is one the
    C forward takes (decode tokens only, within the kernels' row limit, a contiguous fp32
    or bf16 cache on CPU, no autograd; see the module docstring); else None."""
    if attn.chunks or not attn.num_decode or input_ids.numel() != attn.num_decode:
        return None
    k, v = cache.k, cache.v
    if k.dtype not in (torch.float32, torch.bfloat16) or k.device.type != "cpu":
        return None
    if not (k.is_contiguous() and v.is_contiguous()) or input_ids.requires_grad:
        return None
    weights = _weights(model)
    lib = lib or native.library()
    if weights is None or lib is None or input_ids.numel() > weights.max_rows:
        return None
    return weights, lib


def _shape(model: LlamaModel, weights: _Weights, tokens: int, kv_dtype: torch.dtype) -> _Shape:
    """The C side's description of the step: the model's sizes, its final norm, the
    weights' kernel (fp32 or the bf16 backend) and the KV cache's dtype."""
    c = model.config
    return _Shape(
        tokens=tokens,
        hidden=c.hidden_size,
        heads=c.num_heads,
        kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        inter=c.intermediate_size,
        scale=1.0 / math.sqrt(c.head_dim),
        final_eps=weights.final_eps,
        final_norm=weights.final_norm,
        weights_bf16=int(weights.bf16 is not None),
        bf16_backend=0 if weights.bf16 is None else bf16_linear.BACKENDS.index(weights.bf16),
        kv_bf16=int(kv_dtype == torch.bfloat16),
    )


def run(
    model: LlamaModel,
    input_ids: Tensor,
    positions: Tensor,
    attn: PagedStepAttention,
    cache: PagedKVCache,
    lib: ctypes.CDLL | None = None,
) -> Tensor | None:
    """The step's final hidden states [T, D] through the C forward of ``lib`` (default:
    the selected library), or None when it does not apply (see the module docstring);
    ``attn`` is the step's attention backend and ``cache`` its KV cache."""
    found = _step_weights(model, input_ids, attn, cache, lib)
    if found is None:
        return None
    weights, lib = found
    c, t, k, v = model.config, input_ids.numel(), cache.k, cache.v
    model.check_inputs(input_ids, positions)
    plan = attn.decode_plan(torch.empty(t, c.num_heads, c.head_dim))
    if not isinstance(plan, TorchDecodePlan):
        return None
    converted = _attention(plan, t)
    if converted is None:
        return None
    table, _keep = converted
    cos, sin = (x.contiguous() for x in rope_cos_sin(model._inv_freq, positions))  # [T, Dh] each
    h = model.model.embed_tokens(input_ids).contiguous()  # [T, D], the residual stream
    out = torch.empty(t, c.hidden_size)
    shape = _shape(model, weights, t, k.dtype)
    code = lib.parrot_decode_forward(
        weights.table,
        len(weights.table),
        ctypes.byref(shape),
        h.data_ptr(),
        out.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        k[0].numel(),  # the stride between layers
        attn.slots.data_ptr(),
        ctypes.byref(table),
        torch.get_num_threads(),
    )
    if code == 2:
        raise MemoryError("decode_forward: could not allocate its scratch memory")
    if code != 0:
        return None  # a kernel it needs is not built here: nothing was written
    return out
