"""PyTorch paged decode attention (CPU-fast; also runs on CUDA): the three row kinds
that a :class:`~parrot.engine.kernels.attention.torch_plan.TorchDecodePlan` dispatches
to, their buffers and partial-result layout.

Both modes reduce the batch to *rows*: a row is a run of keys (flat token
indices into the cache viewed as ``[num_blocks * block_size, KVH, D]``) and the
queries that read all of it.

* ``share=True``: one row per segment — a shared prefix is one row whose M
  dimension holds all its queries × the G query heads of each kv head, so its
  K/V are gathered once and used by one GEMM per kv head.
* ``share=False`` (baseline): one row per sequence, holding the concatenation of
  its segments' keys — plain per-sequence paged attention.

Each row is split into pieces of at most ``piece`` keys (sized so the gathered
K/V and the scores stay within a few MiB, i.e. in cache).  Per piece: gather K/V
rows into buffers reused across pieces (no fresh allocations or page faults per
piece), one batched matmul over kv heads for ``Q K^T`` ([KVH, M, D] x [KVH, D, T],
the gathered ``[T, KVH, D]`` read through strides, no transposing copy), a
stable in-place softmax, one batched matmul for ``P V``.  Only the piece's own
tokens are gathered, so cache rows outside every segment are never read.

On CPU a shared row short enough to gather whole (within ``torch_plan.PAD_BUDGET``) skips
the piece loop: one call of PyTorch's fused flash kernel takes its m x G query
rows per kv head against the row's keys and returns normalised rows with their
log-sum-exp.

Short single-query rows (every sequence's private tail; with ``share=False``
every sequence) are batched instead: their token indices are padded to one
width and all of them run as one gather and two batched matmuls, with padding
masked out.  Long rows keep the piece loop above (their padded K/V would not
stay in cache).  Which rows go where depends only on the batch, not on the
layer, so a :class:`TorchDecodePlan` computes it once per step and every layer
reuses it (:mod:`parrot.engine.paged`).

Every piece produces per-query unnormalised partials (out, max, den) that are
merged exactly by :func:`merge_partials`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from parrot.engine.kernels.attention import cpu_kernel
from parrot.engine.kernels.attention.merge import merge_partials
from parrot.engine.kernels.attention.segments import Segment
from parrot.engine.kernels.attention.torch_plan import Padded, Row, TorchDecodePlan, fits_whole, piece_tokens

__all__ = ["TorchDecodePlan", "compute_dtype", "cpu_flash_attention", "torch_paged_decode_attention"]


class _Buffers:
    """Per-call scratch buffers, grown on demand and reused across pieces and rows."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype = dtype
        self.device = device
        self._bufs: dict[str, Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> Tensor:
        numel = 1
        for s in shape:
            numel *= s
        dtype = self.dtype if dtype is None else dtype
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            self._bufs[name] = buf
        return buf[:numel].view(shape)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype decode attention computes in for queries of ``dtype`` (16-bit: fp32)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _Partials:
    """Slot-indexed unnormalised partials (see :mod:`merge`): out [S, H, D], max [S, H], den [S, H]."""

    def __init__(self, slots: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device):
        self.out = torch.empty(slots, heads, dim, dtype=dtype, device=device)
        self.max = torch.empty(slots, heads, dtype=dtype, device=device)
        self.den = torch.empty(slots, heads, dtype=dtype, device=device)
        self.next = 0

    def take(self, seqs: Tensor) -> slice:
        """Reserve len(seqs) consecutive slots (owned by ``seqs``, as the plan's ``owner`` says)."""
        sl = slice(self.next, self.next + seqs.numel())
        self.next = sl.stop
        return sl


def _gather(kf: Tensor, vf: Tensor, tok: Tensor, bufs: _Buffers, cdt: torch.dtype) -> tuple[Tensor, Tensor]:
    """K/V rows of ``tok`` into reused buffers: ([T, KVH, D], [T, KVH, D]) in the compute dtype."""
    shape = (tok.numel(), *kf.shape[1:])
    k = torch.index_select(kf, 0, tok, out=bufs.get("k", shape, kf.dtype))
    v = torch.index_select(vf, 0, tok, out=bufs.get("v", shape, vf.dtype))
    return k.to(cdt), v.to(cdt)


def _run_single(row: Row, qs: Tensor, kf: Tensor, vf: Tensor, bufs: _Buffers, parts: _Partials) -> None:
    """A single-query row: each piece writes max/den/out straight into its own slot
    (a slot's [H, ...] layout is [KVH, G, ...]), so no copies and no rescaling."""
    _, kv_heads, dim = kf.shape
    group = qs.shape[1] // kv_heads
    qg = qs.index_select(0, row.seqs).view(kv_heads, group, dim)
    piece = piece_tokens(kv_heads, dim, group)
    for a in range(0, row.tok.numel(), piece):
        k, v = _gather(kf, vf, row.tok[a : a + piece], bufs, qs.dtype)  # [T, KVH, D]
        s = torch.matmul(qg, k.permute(1, 2, 0), out=bufs.get("s", (kv_heads, group, k.shape[0]), qs.dtype))
        i = parts.take(row.seqs).start
        mx = torch.amax(s, dim=-1, keepdim=True, out=parts.max[i].view(kv_heads, group, 1))
        s.sub_(mx).exp_()  # every exponent <= 0; the max itself gives exp(0) = 1
        torch.sum(s, dim=-1, out=parts.den[i].view(kv_heads, group))
        torch.matmul(s, v.permute(1, 0, 2), out=parts.out[i].view(kv_heads, group, dim))


def _run_shared(row: Row, qs: Tensor, kf: Tensor, vf: Tensor, bufs: _Buffers, parts: _Partials) -> None:
    """A multi-query row: the GEMM M dim is its m queries x the G heads of a kv head.

    Pieces are folded into one running (max, den, out) per query row, flash-style:
    with ``new = max(run_max, piece_max)`` the piece's scores are exponentiated
    as ``exp(s - new)`` and the running sums are rescaled by ``exp(run_max - new)``
    (<= 1), so the row fills only m slots however long it is.
    """
    _, kv_heads, dim = kf.shape
    m, group = row.m, qs.shape[1] // kv_heads
    big_m = m * group
    cdt = qs.dtype
    # [m, H, D] -> [KVH, m * G, D]; row r of kv head k is (query r // G, head k * G + r % G).
    qg = qs.index_select(0, row.seqs).view(m, kv_heads, group, dim).transpose(0, 1)
    qg = qg.reshape(kv_heads, big_m, dim)
    if _fused_shared_row(row, qs, kv_heads, dim):
        _run_shared_fused(row, qg, kf, vf, bufs, parts)
        return
    piece = piece_tokens(kv_heads, dim, big_m)
    run_max = run_den = run_out = None
    for a in range(0, row.tok.numel(), piece):
        k, v = _gather(kf, vf, row.tok[a : a + piece], bufs, cdt)  # [T, KVH, D]
        s = torch.matmul(qg, k.permute(1, 2, 0), out=bufs.get("s", (kv_heads, big_m, k.shape[0]), cdt))
        mx = s.amax(dim=-1, keepdim=True)  # [KVH, M, 1]
        if run_max is None:
            s.sub_(mx).exp_()
            run_max, run_den = mx, s.sum(dim=-1, keepdim=True)
            run_out = torch.matmul(s, v.permute(1, 0, 2))  # [KVH, M, D]
            continue
        new = torch.maximum(run_max, mx)
        alpha = run_max.sub_(new).exp_()  # rescales the running sums; in (0, 1]
        s.sub_(new).exp_()
        run_den.mul_(alpha).add_(s.sum(dim=-1, keepdim=True))
        run_out.mul_(alpha).baddbmm_(s, v.permute(1, 0, 2))
        run_max = new
    if run_max is None or run_den is None or run_out is None:  # rows always have >= 1 key
        raise RuntimeError("empty row")
    sl = parts.take(row.seqs)
    parts.out[sl].view(m, kv_heads, group, dim).copy_(run_out.view(kv_heads, m, group, dim).transpose(0, 1))
    parts.max[sl].view(m, kv_heads, group).copy_(run_max.view(kv_heads, m, group).transpose(0, 1))
    parts.den[sl].view(m, kv_heads, group).copy_(run_den.view(kv_heads, m, group).transpose(0, 1))


def _fused_shared_row(row: Row, qs: Tensor, kv_heads: int, dim: int) -> bool:
    """Whether a multi-query row runs as one call of the fused CPU kernel: on CPU, in
    fp32/bf16, with the kernel present, and the row's gathered K within ``torch_plan.PAD_BUDGET``
    (longer rows keep the piece loop, whose gathers stay in cache)."""
    return (
        qs.device.type == "cpu"
        and qs.dtype in (torch.float32, torch.bfloat16)
        and fits_whole(row, kv_heads, dim)
        and _flash_op() is not None
    )


def _run_shared_fused(row: Row, qg: Tensor, kf: Tensor, vf: Tensor, bufs: _Buffers, parts: _Partials) -> None:
    """A multi-query row as one fused attention call: per kv head, its m * G query
    rows against the row's keys, read once (no mask: every query reads every key).
    The kernel returns normalised rows and their log-sum-exp: partials with
    ``max = lse`` and ``den = 1``."""
    kv_heads, big_m, dim = qg.shape
    m, group = row.m, big_m // row.m
    k, v = _gather(kf, vf, row.tok, bufs, qg.dtype)  # [L, KVH, D]
    out, lse = _flash_op()(
        qg.unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), 0.0, False, scale=1.0
    )  # [1, KVH, m * G, D], [1, KVH, m * G]
    sl = parts.take(row.seqs)
    parts.out[sl].view(m, kv_heads, group, dim).copy_(out[0].reshape(kv_heads, m, group, dim).transpose(0, 1))
    parts.max[sl].view(m, kv_heads, group).copy_(lse[0].reshape(kv_heads, m, group).transpose(0, 1))
    parts.den[sl].fill_(1.0)


def cpu_flash_attention() -> Any:
    """PyTorch's fused CPU attention kernel (the one behind ``F.scaled_dot_product_attention``),
    which also returns each row's log-sum-exp; None in a PyTorch without it."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


_flash_op = cpu_flash_attention  # looked up at call time (tests replace it)


def _run_padded(pad: Padded, qs: Tensor, kf: Tensor, vf: Tensor, parts: _Partials) -> None:
    """All batched single-query rows at once: one gather, then attention as a batch of
    R sequences with KVH heads and G queries each (the G query heads sharing a kv head).

    On CPU that attention is one call of PyTorch's fused flash kernel with the padding
    as an additive -inf mask; it returns normalised rows and their log-sum-exp, i.e.
    partials with ``max = lse`` and ``den = 1`` (the merge is indifferent to the split).
    Elsewhere: two batched matmuls and an explicit softmax.
    """
    _, kv_heads, dim = kf.shape
    group = qs.shape[1] // kv_heads
    cdt = qs.dtype
    q = qs.index_select(0, pad.seqs).view(pad.rows, kv_heads, group, dim)
    k = kf.index_select(0, pad.tok).view(pad.rows, pad.width, kv_heads, dim).to(cdt)
    v = vf.index_select(0, pad.tok).view(pad.rows, pad.width, kv_heads, dim).to(cdt)
    sl = parts.take(pad.seqs)
    out = parts.out[sl].view(pad.rows, kv_heads, group, dim)
    flash = _flash_op()
    if flash is not None and q.device.type == "cpu" and cdt in (torch.float32, torch.bfloat16):
        mask = None if pad.pad is None else pad.additive(cdt)
        o, lse = flash(q, k.transpose(1, 2), v.transpose(1, 2), 0.0, False, attn_mask=mask, scale=1.0)
        out.copy_(o)
        parts.max[sl].view(pad.rows, kv_heads, group).copy_(lse)
        parts.den[sl].fill_(1.0)
        return
    s = torch.matmul(q, k.permute(0, 2, 3, 1))  # [R, KVH, G, W]
    if pad.pad is not None:
        s.masked_fill_(pad.pad, -torch.inf)
    mx = torch.amax(s, dim=-1, keepdim=True)  # finite: every row has >= 1 real key
    parts.max[sl].view(pad.rows, kv_heads, group).copy_(mx.squeeze(-1))
    s.sub_(mx).exp_()  # padding: exp(-inf) = 0
    parts.den[sl].view(pad.rows, kv_heads, group).copy_(s.sum(dim=-1))
    torch.matmul(s, v.transpose(1, 2), out=out)


def _run_padded_kernel(pad: Padded, qs: Tensor, kf: Tensor, vf: Tensor, parts: _Partials) -> None:
    """All single-query rows in one call of the C kernel, which reads each row's keys
    in place (no gather, padding never read); like the flash call it returns
    normalised rows and their log-sum-exp (``max = lse``, ``den = 1``)."""
    sl = parts.take(pad.seqs)
    tok = pad.tok.view(pad.rows, pad.width)
    cpu_kernel.decode_rows(qs, pad.seqs, kf, vf, tok, pad.lengths, parts.out[sl], parts.max[sl])
    parts.den[sl].fill_(1.0)


def _run_shared_kernel(
    row: Row, qs: Tensor, kf: Tensor, vf: Tensor, bufs: _Buffers, parts: _Partials
) -> None:
    """A multi-query row in one call of the C shared-prefix kernel, which reads each
    key and value row once per kv head in place (no gather); it returns normalised
    rows and their log-sum-exp (``max = lse``, ``den = 1``)."""
    sl = parts.take(row.seqs)
    cpu_kernel.shared_row(qs, row.seqs.contiguous(), kf, vf, row.tok, parts.out[sl], parts.max[sl])
    parts.den[sl].fill_(1.0)


def torch_paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    segments: Sequence[Segment] | TorchDecodePlan,
    *,
    scale: float,
    share: bool,
) -> Tensor:
    """See :func:`parrot.engine.kernels.attention.paged_decode_attention`; inputs are already checked.

    q: [B, H, D]; k_cache, v_cache: [NB, BS, KVH, D] with token dims mergeable.
    ``segments`` may be a :class:`TorchDecodePlan` built for this batch and layout
    (then ``share`` is the plan's).  Returns [B, H, D] in q's dtype.
    """
    batch, heads, dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    device = q.device
    cdt = compute_dtype(q.dtype)
    if isinstance(segments, TorchDecodePlan):
        plan = segments
        if plan.batch != batch or plan.shape != (kv_heads, dim, group):
            raise ValueError("the decode plan was built for another batch or head layout")
        if plan.kernel and not (cpu_kernel.supports(cdt, k_cache) and v_cache.is_contiguous()):
            raise ValueError("the decode plan was built for the CPU kernel, which cannot take these tensors")
    else:
        plan = TorchDecodePlan(
            segments,
            batch=batch,
            block_size=block_size,
            kv_heads=kv_heads,
            dim=dim,
            group=group,
            share=share,
            device=device,
            kernel=cpu_kernel.supports(cdt, k_cache) and v_cache.is_contiguous(),
        )
    kf = k_cache.view(num_blocks * block_size, kv_heads, dim)
    vf = v_cache.view(num_blocks * block_size, kv_heads, dim)
    qs = q.to(cdt) * scale  # [B, H, D]

    parts = _Partials(plan.slots, heads, dim, cdt, device)
    bufs = _Buffers(cdt, device)
    if plan.padded is not None:
        (_run_padded_kernel if plan.kernel else _run_padded)(plan.padded, qs, kf, vf, parts)
    for r in plan.looped:
        _run_single(r, qs, kf, vf, bufs, parts)
    for r in plan.shared:
        (_run_shared_kernel if plan.shared_kernel else _run_shared)(r, qs, kf, vf, bufs, parts)
    if parts.next != plan.slots:  # internal invariant, not input validation
        raise RuntimeError(f"partial slot accounting mismatch: {parts.next} != {plan.slots}")
    if plan.direct:
        return parts.out.div_(parts.den.unsqueeze(-1)).to(q.dtype)
    if plan.lse_merge is not None:
        merged = torch.empty(batch, heads, dim, dtype=cdt, device=device)
        cpu_kernel.merge_lse(parts.out, parts.max, *plan.lse_merge, merged)
        return merged.to(q.dtype)
    return merge_partials(parts.out, parts.max, parts.den, plan.owner, batch).to(q.dtype)
