"""The Triton kernels of :mod:`parrot.engine.kernels.attention.triton_kernel`, as JIT
functions at module level (a kernel's helpers are found through the module's globals,
compiled or interpreted alike).

Never imported as a package module: :func:`~parrot.engine.kernels.attention.triton_kernel._kernels`
executes this file as a module of its own once per interpreter mode (triton decides
compiled or interpreted when a function is decorated, so each mode needs its own
definitions), the first time a kernel is used, so that importing the package never
imports triton.

:func:`segment_partials`: one program per (work item, kv head) loads every K/V tile of
its piece once and keeps an online softmax for all its rows, its steps the helpers
:func:`piece_queries`, :func:`kv_tile` and :func:`store_partials` (inlined);
:func:`merge`: one program per (sequence, head) walks the sequence's slots with an
online log-sum-exp and writes its output in q's dtype.  The plan and the numerics:
the triton_kernel module docstring.
"""

import triton
import triton.language as tl


@triton.jit
def piece_queries(
    q_ptr, sqb, sqh, sqd, seqs_cat, q_off, m, row0, kvh, dim,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rows ``row0 + [0, BLOCK_M)`` of the piece's m queries x GROUP heads of kv head
    ``kvh``: their queries [BLOCK_M, BLOCK_D] (0 on padded rows), which rows are real,
    and each row's member index and head."""
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < m * GROUP
    j = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    seq = tl.load(seqs_cat + q_off + j, mask=row_ok, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < dim
    q = tl.load(
        q_ptr + seq[:, None] * sqb + head[:, None] * sqh + d[None, :] * sqd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    return q, row_ok, j, head


@triton.jit
def kv_tile(ptr, sb, st, sh, sd, blk, off, kvh, d, mask):
    """The K or V rows at blocks ``blk``, offsets ``off`` of kv head ``kvh`` (0 where masked)."""
    return tl.load(
        ptr + blk[:, None] * sb + off[:, None] * st + kvh * sh + d[None, :] * sd, mask=mask, other=0.0
    )


@triton.jit
def store_partials(
    part_out, part_lse, acc, m_i, l_i, slot0, j, head, row_ok, heads, dim, BLOCK_D: tl.constexpr
):
    """Member j's partial (out, lse) of each real row, at slot ``slot0 + j``."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < dim
    out = acc / l_i[:, None]
    lse = m_i + tl.log(l_i)
    slot = (slot0 + j).to(tl.int64)
    tl.store(
        part_out + (slot[:, None] * heads + head[:, None]) * dim + d[None, :],
        out,
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(part_lse + slot * heads + head, lse, mask=row_ok)


@triton.jit
def segment_partials(
    q_ptr, sqb, sqh, sqd,
    k_ptr, skb, skt, skh, skd,
    v_ptr, svb, svt, svh, svd,
    block_table, seqs_cat,
    p_bt_off, p_start, p_len, p_q_off, p_m, p_slot0,
    w_piece, w_row0,
    part_out, part_lse,
    scale, heads, dim,
    GROUP: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    wid = tl.program_id(0)
    kvh = tl.program_id(1)
    p = tl.load(w_piece + wid)
    bt_off = tl.load(p_bt_off + p)
    start = tl.load(p_start + p)
    length = tl.load(p_len + p)
    q, row_ok, j, head = piece_queries(
        q_ptr, sqb, sqh, sqd, seqs_cat, tl.load(p_q_off + p), tl.load(p_m + p), tl.load(w_row0 + wid),
        kvh, dim, GROUP, BLOCK_M, BLOCK_D,
    )  # fmt: skip
    d = tl.arange(0, BLOCK_D)
    d_ok = d < dim
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for n0 in range(0, length, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        t_ok = t < length
        pos = start + t
        blk = tl.load(block_table + bt_off + pos // BS, mask=t_ok, other=0).to(tl.int64)
        off = (pos % BS).to(tl.int64)
        kv_ok = t_ok[:, None] & d_ok[None, :]
        k = kv_tile(k_ptr, skb, skt, skh, skd, blk, off, kvh, d, kv_ok)
        v = kv_tile(v_ptr, svb, svt, svh, svd, blk, off, kvh, d, kv_ok)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = tl.where(t_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        pr = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    store_partials(
        part_out, part_lse, acc, m_i, l_i, tl.load(p_slot0 + p), j, head, row_ok, heads, dim, BLOCK_D
    )


@triton.jit
def merge(
    part_out, part_lse, seq_ptr, seq_slots,
    o_ptr, sob, soh, sod,
    heads, dim,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    beg = tl.load(seq_ptr + b)
    end = tl.load(seq_ptr + b + 1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < dim
    # Running max / denominator kept per lane (all lanes equal): plain [BLOCK_D]
    # vectors keep loop-carried types simple for the compiler.
    m = tl.full((BLOCK_D,), float("-inf"), dtype=tl.float32)
    den = tl.zeros((BLOCK_D,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for i in range(beg, end):
        s = tl.load(seq_slots + i).to(tl.int64)
        lse = tl.load(part_lse + s * heads + h)
        o = tl.load(part_out + (s * heads + h) * dim + d, mask=d_ok, other=0.0)
        m_new = tl.maximum(m, lse)
        a = tl.exp(m - m_new)
        w = tl.exp(lse - m_new)
        acc = acc * a + w * o
        den = den * a + w
        m = m_new
    res = acc / den
    tl.store(o_ptr + b * sob + h * soh + d * sod, res.to(o_ptr.dtype.element_ty), mask=d_ok)
