"""PyTorch paged decode attention (CPU-fast; also runs on CUDA).  One module over 500
lines on purpose: the plan built once per step and the three row kinds it
dispatches to share their buffers and partial-result layout.

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

On CPU a shared row short enough to gather whole (within ``PAD_BUDGET``) skips
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

Length (just over 500 lines): the PyTorch decode attention's pieces and the plan
they share per step, kept together because the plan's layout is what the pieces read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from parrot.engine.kernels.attention import cpu_kernel
from parrot.engine.kernels.attention.merge import merge_partials
from parrot.engine.kernels.attention.segments import Segment, segment_token_index

__all__ = ["TorchDecodePlan", "compute_dtype", "cpu_flash_attention", "torch_paged_decode_attention"]

# Budgets, in elements, for the gathered K (and V) of one piece and for its score
# matrix.  1 Mi fp32 elements = 4 MiB (256 tokens of 32 x 128 heads): the gathered
# K and V of a piece stay in L3 while its GEMMs / GEMVs read them (the best of the
# powers of two from 2^18 to 2^23 in benchmarks/attention_decode.py).
KV_BUDGET = 1 << 20
SCORE_BUDGET = 1 << 20
# Budget, in elements, for the padded K (and V) of all batched single-query rows
# (rows x padded width x KVH x D); rows beyond it take the piece loop.  4 Mi fp32
# elements = 16 MiB: 32 rows of 680 tokens of SmolLM2's 3 x 64 kv heads.
PAD_BUDGET = 1 << 22


@dataclass(frozen=True)
class _Row:
    seqs: Tensor  # LongTensor [m] on the compute device
    m: int
    tok: Tensor  # LongTensor [L] flat token indices on the compute device


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


def _rows_for_segments(segments: Sequence[Segment], block_size: int, device: torch.device) -> list[_Row]:
    """One row per segment read by several sequences; the segments only one sequence
    reads (its private tail, and its ancestors' runs that nothing else in the batch
    shares) are joined into one row for that sequence, so a batch without sharing
    takes the direct (no-merge) path."""
    rows = []
    alone: dict[int, list[Tensor]] = {}
    for seg in segments:
        tok = segment_token_index(seg, block_size, device)
        if seg.seqs.numel() == 1:
            alone.setdefault(int(seg.seqs[0]), []).append(tok)
            continue
        seqs = seg.seqs.to(device=device, dtype=torch.int64)
        rows.append(_Row(seqs, seqs.numel(), tok))
    for seq, toks in alone.items():
        tok = toks[0] if len(toks) == 1 else torch.cat(toks)
        rows.append(_Row(torch.tensor([seq], device=device), 1, tok))
    return rows


def _rows_per_sequence(
    segments: Sequence[Segment], batch: int, block_size: int, device: torch.device
) -> list[_Row]:
    parts: list[list[Tensor]] = [[] for _ in range(batch)]
    for seg in segments:
        tok = segment_token_index(seg, block_size, device)
        for s in seg.seqs.tolist():
            parts[s].append(tok)
    rows = []
    for b, toks in enumerate(parts):
        if not toks:
            raise ValueError(f"sequence {b} is not listed by any segment")
        tok = toks[0] if len(toks) == 1 else torch.cat(toks)
        rows.append(_Row(torch.tensor([b], device=device), 1, tok))
    return rows


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


def _piece_tokens(kv_heads: int, dim: int, big_m: int) -> int:
    """Keys per piece of a row: gathered K (and V) and the [KVH, M, T] scores within budget."""
    return max(1, min(KV_BUDGET // (kv_heads * dim), SCORE_BUDGET // (kv_heads * big_m)))


def _row_slots(row: _Row, kv_heads: int, dim: int, group: int) -> int:
    """Partial slots a row fills: one per piece for single-query rows, m for multi-query rows."""
    if row.m == 1:
        return -(-row.tok.numel() // _piece_tokens(kv_heads, dim, group))
    return row.m


def _gather(kf: Tensor, vf: Tensor, tok: Tensor, bufs: _Buffers, cdt: torch.dtype) -> tuple[Tensor, Tensor]:
    """K/V rows of ``tok`` into reused buffers: ([T, KVH, D], [T, KVH, D]) in the compute dtype."""
    shape = (tok.numel(), *kf.shape[1:])
    k = torch.index_select(kf, 0, tok, out=bufs.get("k", shape, kf.dtype))
    v = torch.index_select(vf, 0, tok, out=bufs.get("v", shape, vf.dtype))
    return k.to(cdt), v.to(cdt)


def _run_single(row: _Row, qs: Tensor, kf: Tensor, vf: Tensor, bufs: _Buffers, parts: _Partials) -> None:
    """A single-query row: each piece writes max/den/out straight into its own slot
    (a slot's [H, ...] layout is [KVH, G, ...]), so no copies and no rescaling."""
    _, kv_heads, dim = kf.shape
    group = qs.shape[1] // kv_heads
    qg = qs.index_select(0, row.seqs).view(kv_heads, group, dim)
    piece = _piece_tokens(kv_heads, dim, group)
    for a in range(0, row.tok.numel(), piece):
        k, v = _gather(kf, vf, row.tok[a : a + piece], bufs, qs.dtype)  # [T, KVH, D]
        s = torch.matmul(qg, k.permute(1, 2, 0), out=bufs.get("s", (kv_heads, group, k.shape[0]), qs.dtype))
        i = parts.take(row.seqs).start
        mx = torch.amax(s, dim=-1, keepdim=True, out=parts.max[i].view(kv_heads, group, 1))
        s.sub_(mx).exp_()  # every exponent <= 0; the max itself gives exp(0) = 1
        torch.sum(s, dim=-1, out=parts.den[i].view(kv_heads, group))
        torch.matmul(s, v.permute(1, 0, 2), out=parts.out[i].view(kv_heads, group, dim))


def _run_shared(row: _Row, qs: Tensor, kf: Tensor, vf: Tensor, bufs: _Buffers, parts: _Partials) -> None:
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
    piece = _piece_tokens(kv_heads, dim, big_m)
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


def _fused_shared_row(row: _Row, qs: Tensor, kv_heads: int, dim: int) -> bool:
    """Whether a multi-query row runs as one call of the fused CPU kernel: on CPU, in
    fp32/bf16, with the kernel present, and the row's gathered K within PAD_BUDGET
    (longer rows keep the piece loop, whose gathers stay in cache)."""
    return (
        qs.device.type == "cpu"
        and qs.dtype in (torch.float32, torch.bfloat16)
        and row.tok.numel() * kv_heads * dim <= PAD_BUDGET
        and _flash_op() is not None
    )


def _run_shared_fused(
    row: _Row, qg: Tensor, kf: Tensor, vf: Tensor, bufs: _Buffers, parts: _Partials
) -> None:
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


@dataclass
class _Padded:
    """Single-query rows batched: row r reads ``tok.view(rows, width)[r, :lengths[r]]``.

    Padding repeats the row's own first token (a real key of that row, so padding
    never reads another sequence's or an unwritten cache row) and ``pad`` masks it.
    """

    seqs: Tensor  # LongTensor [rows]
    tok: Tensor  # LongTensor [rows * width]
    pad: Tensor | None  # bool [rows, 1, 1, width], True at padding; None if no row is padded
    lengths: Tensor  # LongTensor [rows]: keys of each row
    rows: int
    width: int
    _additive: dict[torch.dtype, Tensor] = field(default_factory=dict)

    def additive(self, dtype: torch.dtype) -> Tensor:
        """``pad`` as an additive mask (0 / -inf) of ``dtype``, built once per dtype."""
        got = self._additive.get(dtype)
        if got is None:
            assert self.pad is not None
            got = torch.zeros(self.pad.shape, dtype=dtype, device=self.pad.device).masked_fill_(
                self.pad, -torch.inf
            )
            self._additive[dtype] = got
        return got


def _pad_rows(rows: list[_Row], device: torch.device) -> _Padded:
    width = max(r.tok.numel() for r in rows)
    tok = torch.empty(len(rows), width, dtype=torch.int64, device=device)
    lengths = []
    for i, r in enumerate(rows):
        n = r.tok.numel()
        tok[i, :n] = r.tok
        tok[i, n:] = r.tok[0]
        lengths.append(n)
    pad = None
    lens = torch.tensor(lengths, device=device)
    if min(lengths) < width:
        pad = (torch.arange(width, device=device) >= lens.unsqueeze(1)).view(len(rows), 1, 1, width)
    seqs = torch.cat([r.seqs for r in rows])
    return _Padded(seqs, tok.view(-1), pad, lens, len(rows), width)


def _split_singles(singles: list[_Row], kv_heads: int, dim: int) -> tuple[list[_Row], list[_Row]]:
    """(batched, looped): the shortest rows whose padded K fits PAD_BUDGET are batched."""
    order = sorted(singles, key=lambda r: r.tok.numel())
    fit = 0
    for i, r in enumerate(order):
        if (i + 1) * r.tok.numel() * kv_heads * dim > PAD_BUDGET:
            break
        fit = i + 1
    return order[:fit], order[fit:]


class TorchDecodePlan:
    """The layer-independent part of one decode batch's attention (built once per step).

    ``kernel``: single-query rows run in the C kernel (:mod:`cpu_kernel`), which
    reads the cache in place, so all of them are batched whatever their length;
    ``shared_kernel``: with ``kernel``, shared rows run in the C shared kernel
    where it is built for the head dim.

    Invariants: every partial slot has an owner; slots are filled in the order
    batched rows, looped single rows (one slot per piece), shared rows (one slot per
    query); with ``kernel`` nothing is looped; ``direct`` is True exactly when each
    sequence has one slot and slot i belongs to sequence i, so outputs need no merge;
    ``lse_merge`` (starts [B + 1], slots [S]: each sequence's slots, CSR) is set when
    every partial comes from a C kernel (normalised, with its log-sum-exp) and a merge
    is needed, which then runs in :func:`cpu_kernel.merge_lse`.
    """

    def __init__(
        self,
        segments: Sequence[Segment],
        *,
        batch: int,
        block_size: int,
        kv_heads: int,
        dim: int,
        group: int,
        share: bool,
        device: torch.device,
        kernel: bool = False,
    ):
        self.segments = segments
        self.batch = batch
        self.share = share
        self.kernel = kernel
        self.shape = (kv_heads, dim, group)
        if share:
            rows = _rows_for_segments(segments, block_size, device)
        else:
            rows = _rows_per_sequence(segments, batch, block_size, device)
        singles = [r for r in rows if r.m == 1]
        self.shared = [r for r in rows if r.m > 1]
        self.shared_kernel = kernel and bool(self.shared) and cpu_kernel.shared_built(dim)
        batched, self.looped = (singles, []) if kernel else _split_singles(singles, kv_heads, dim)
        batched.sort(key=lambda r: int(r.seqs[0]))  # in batch order: the common case needs no merge
        self.padded = _pad_rows(batched, device) if batched else None
        owners = [] if self.padded is None else [self.padded.seqs]
        for r in self.looped:
            owners.append(r.seqs.expand(_row_slots(r, kv_heads, dim, group)))
        owners.extend(r.seqs for r in self.shared)
        self.owner = torch.cat(owners) if owners else torch.empty(0, dtype=torch.int64, device=device)
        self.slots = self.owner.numel()
        self.direct = (
            not self.looped
            and not self.shared
            and self.padded is not None
            and self.padded.rows == batch
            and bool((self.padded.seqs == torch.arange(batch, device=device)).all())
        )
        # With the C kernels every partial is normalised with its log-sum-exp: they
        # merge in one C pass, sequence by sequence (each one's slots, in slot order).
        self.lse_merge: tuple[Tensor, Tensor] | None = None
        if kernel and not self.direct and (self.shared_kernel or not self.shared):
            starts = torch.zeros(batch + 1, dtype=torch.int64, device=device)
            starts[1:] = torch.bincount(self.owner, minlength=batch).cumsum(0)
            self.lse_merge = (starts, torch.argsort(self.owner, stable=True))


def cpu_flash_attention() -> Any:
    """PyTorch's fused CPU attention kernel (the one behind ``F.scaled_dot_product_attention``),
    which also returns each row's log-sum-exp; None in a PyTorch without it."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


_flash_op = cpu_flash_attention  # looked up at call time (tests replace it)


def _run_padded(pad: _Padded, qs: Tensor, kf: Tensor, vf: Tensor, parts: _Partials) -> None:
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


def _run_padded_kernel(pad: _Padded, qs: Tensor, kf: Tensor, vf: Tensor, parts: _Partials) -> None:
    """All single-query rows in one call of the C kernel, which reads each row's keys
    in place (no gather, padding never read); like the flash call it returns
    normalised rows and their log-sum-exp (``max = lse``, ``den = 1``)."""
    sl = parts.take(pad.seqs)
    tok = pad.tok.view(pad.rows, pad.width)
    cpu_kernel.decode_rows(qs, pad.seqs, kf, vf, tok, pad.lengths, parts.out[sl], parts.max[sl])
    parts.den[sl].fill_(1.0)


def _run_shared_kernel(
    row: _Row, qs: Tensor, kf: Tensor, vf: Tensor, bufs: _Buffers, parts: _Partials
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
