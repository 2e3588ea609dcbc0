"""Prefill chunks under shared prefixes (parrot.engine.prefill_sharing).

The oracle is float64 causal attention of each chunk over its own sequence's
keys, read through its block table.  The cache is NaN wherever no sequence
wrote, so a read outside a chunk's keys shows.  Block tables are built the way
the engine builds them: a child shares its parent's full blocks and copies the
partial tail block on its first write.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from parrot.engine import prefill_attention as pa
from parrot.engine import prefill_sharing as ps
from parrot.engine.kernels.attention import cpu_kernel

BS = 16


class _Forest:
    """Block tables of forked sequences, allocating physical blocks in order."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def grow(self, table: list[int], length: int, n: int) -> tuple[list[int], int]:
        table = list(table)
        if length % BS and n:
            table[-1] = next(self._next)  # copy-on-write of the shared partial block
        while len(table) * BS < length + n:
            table.append(next(self._next))
        return table, length + n


def _chunks(forest: _Forest) -> list[tuple[list[int], int, int]]:
    """(table, start, total) of chunks in two prefix groups, one nested, plus
    chunks that share nothing: a fresh sequence and one with a private past."""
    root_a, len_a = forest.grow([], 0, 48)  # 3 full blocks
    mid, len_mid = forest.grow(root_a, len_a, 37)  # forks A, ends inside a block
    root_b, len_b = forest.grow([], 0, 70)
    chunks = []
    for parent, plen, extra, n in [
        (root_a, len_a, 0, 20),  # starts at a block boundary, right after A
        (root_a, len_a, 5, 1),  # a one-token chunk after 5 tokens of its own
        (mid, len_mid, 0, 30),
        (mid, len_mid, 11, 17),
        (root_b, len_b, 0, 9),
        (root_b, len_b, 3, 40),
        ([], 0, 0, 25),  # a fresh sequence
        ([], 0, 33, 12),  # a private past only
    ]:
        table, total = forest.grow(parent, plen, extra + n)
        chunks.append((table, total - n, total))
    return chunks


def _cache(chunks, kv_heads: int, dim: int, seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    blocks = 1 + max(b for table, _, _ in chunks for b in table) + 3
    k = torch.full((blocks * BS, kv_heads, dim), torch.nan)
    v = torch.full((blocks * BS, kv_heads, dim), torch.nan)
    for table, _, total in chunks:
        for p in range(total):
            row = table[p // BS] * BS + p % BS
            if torch.isnan(k[row]).any():
                k[row] = torch.randn(kv_heads, dim, generator=gen)
                v[row] = torch.randn(kv_heads, dim, generator=gen)
    shape = (blocks, BS, kv_heads, dim)
    return k.to(dtype).view(shape), v.to(dtype).view(shape)


def _reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunks) -> torch.Tensor:
    _, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    kf = k_cache.reshape(-1, kv_heads, dim).double()
    vf = v_cache.reshape(-1, kv_heads, dim).double()
    outs, row = [], 0
    for table, start, total in chunks:
        n = total - start
        idx = torch.tensor([table[p // BS] * BS + p % BS for p in range(total)])
        keys = kf[idx].repeat_interleave(heads // kv_heads, 1)  # [total, H, D]
        vals = vf[idx].repeat_interleave(heads // kv_heads, 1)
        qc = q[row : row + n].double()
        s = torch.einsum("nhd,thd->hnt", qc, keys) / math.sqrt(dim)
        mask = torch.arange(total)[None, :] <= torch.arange(start, total)[:, None]  # [n, total]
        s = s.masked_fill(~mask, -torch.inf)
        outs.append(torch.einsum("hnt,thd->nhd", torch.softmax(s, -1), vals))
        row += n
    return torch.cat(outs)


def _plan(chunks, q: torch.Tensor) -> ps.SharedPrefill | None:
    tables, starts, totals = zip(*chunks, strict=True)
    return ps.plan_shared_prefill(tables, starts, totals, BS, q)


def _queries(chunks, heads: int, dim: int, seed: int) -> torch.Tensor:
    rows = sum(total - start for _, start, total in chunks)
    return torch.randn(rows, heads, dim, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("force_flash", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 64), (4, 4, 64), (8, 2, 16)])
def test_shared_prefill_matches_per_sequence_causal_attention(
    force_flash, heads, kv_heads, dim, monkeypatch
) -> None:
    """Shared runs go to the C kernel where it is built for the head dim (AVX-512,
    dim % 64 == 0), else (or forced) through PyTorch's fused kernel."""
    if force_flash:
        monkeypatch.setattr(cpu_kernel, "shared_built", lambda dim: False)
    kernel_calls = []
    real = cpu_kernel.shared_row
    monkeypatch.setattr(cpu_kernel, "shared_row", lambda *a, **kw: kernel_calls.append(1) or real(*a, **kw))
    chunks = _chunks(_Forest())
    k, v = _cache(chunks, kv_heads, dim, seed=dim + heads, dtype=torch.float32)
    q = _queries(chunks, heads, dim, seed=heads)
    plan = _plan(chunks, q)
    assert plan is not None
    # group A's 3 blocks are read once by its 4 chunks (51 query rows); the nested run
    # below it (mid's 2 full blocks of its own) by mid's 2 chunks (47 rows); group B's 4
    # full blocks by its 2 chunks (49 rows); the last two chunks share nothing
    assert sorted(r.rows.numel() for r in plan.runs) == [47, 49, 68]
    got = plan.attend(q, k, v)
    expected = _reference(q, k, v, chunks)
    assert got.shape == q.shape and got.dtype == torch.float32 and torch.isfinite(got).all()
    rel = float((got.double() - expected).abs().max() / expected.abs().max())
    assert rel < 1e-5
    assert len(kernel_calls) == (0 if force_flash or not cpu_kernel.shared_built(dim) else 3)


def test_bf16_cache_prefills_in_bf16_and_merges_in_fp32() -> None:
    chunks = _chunks(_Forest())
    k, v = _cache(chunks, 2, 64, seed=3, dtype=torch.bfloat16)
    q = _queries(chunks, 6, 64, seed=4)
    plan = _plan(chunks, q)
    assert plan is not None
    got = plan.attend(q, k, v)
    expected = _reference(q, k, v, chunks)  # the attention of the bf16-rounded keys and values
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert float((got.double() - expected).abs().max() / expected.abs().max()) < 2e-2


def test_a_nan_key_in_a_shared_run_reaches_exactly_the_chunks_under_it() -> None:
    chunks = _chunks(_Forest())
    k, v = _cache(chunks, 2, 64, seed=5, dtype=torch.float32)
    root_b_block = chunks[4][0][0]  # group B's first block: read by chunks 4 and 5 only
    k[root_b_block, 3, 1] = torch.nan
    q = _queries(chunks, 6, 64, seed=6)
    got = _plan(chunks, q).attend(q, k, v)
    bad = torch.isnan(got).any(-1).any(-1)  # [rows]
    lengths = [total - start for _, start, total in chunks]
    owner = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(lengths))
    assert bad.tolist() == [int(c) in (4, 5) for c in owner]


def test_no_plan_without_two_chunks_sharing_a_block() -> None:
    forest = _Forest()
    lone = forest.grow([], 0, 40)
    other = forest.grow([], 0, 50)
    q = torch.randn(8, 4, 16)
    assert ps.plan_shared_prefill([lone[0]], [30], [40], BS, q) is None  # one chunk
    assert ps.plan_shared_prefill([lone[0], other[0]], [30, 42], [40, 50], BS, q) is None  # nothing shared


def test_no_plan_when_a_shared_block_holds_a_chunks_own_tokens() -> None:
    """Two chunks writing into the same blocks (never the engine's tables: it writes
    only blocks a context alone holds) are declined, not attended wrongly."""
    q = torch.randn(40, 4, 16)
    assert ps.plan_shared_prefill([[0, 1], [0, 1]], [0, 10], [20, 30], BS, q) is None


def test_no_plan_without_the_fused_cpu_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = _chunks(_Forest())
    q = _queries(chunks, 4, 16, seed=7)
    assert _plan(chunks, q) is not None
    monkeypatch.setattr(pa, "_flash_op", lambda: None)
    assert _plan(chunks, q) is None
    with pytest.raises(ValueError, match="needs PyTorch's fused CPU attention kernel"):
        pa.prefill_partial(q[:4], torch.randn(4, 4, 16), torch.randn(4, 4, 16), 0)
