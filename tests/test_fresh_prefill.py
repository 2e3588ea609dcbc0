"""Fresh prefill chunks batched into padded flash calls (parrot.engine.fresh_prefill).

The oracle is float64 causal attention of each chunk over its own keys.  Rows of
the step that are not fresh chunks hold NaN in ``out`` and must keep it.
"""

from __future__ import annotations

import math

import pytest
import torch

from parrot.engine import fresh_prefill as fp
from parrot.engine.prefill_attention import prefill_attention

H, KVH, D = 6, 2, 16


def _oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one chunk, float64, GQA by repeating kv heads."""
    n, group = q.shape[0], q.shape[1] // k.shape[1]
    kk, vv = (x.double().repeat_interleave(group, 1) for x in (k, v))
    scores = torch.einsum("ihd,jhd->hij", q.double(), kk) / math.sqrt(q.shape[2])
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hij,jhd->ihd", scores.softmax(-1), vv)


def _step(lengths: list[int], other: int, dtype: torch.dtype) -> tuple[list[slice], torch.Tensor, ...]:
    """A step of ``other`` non-fresh rows first, then fresh chunks of ``lengths``."""
    gen = torch.Generator().manual_seed(sum(lengths) + other)
    total = other + sum(lengths)
    q, k, v = (torch.randn(total, h, D, generator=gen).to(dtype) for h in (H, KVH, KVH))
    rows, row = [], other
    for n in lengths:
        rows.append(slice(row, row + n))
        row += n
    return rows, q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_fresh_chunks_equal_causal_attention_of_each_chunk_alone(dtype):
    lengths = [37, 2, 40, 33, 100, 5, 90, 3, 81]  # several groups, some padded
    rows, q, k, v = _step(lengths, other=4, dtype=dtype)
    groups = fp.plan_fresh_chunks(rows, "cpu")
    assert 1 < len(groups) < len(lengths)
    out = torch.full((q.shape[0], H, D), float("nan"))
    for g in groups:
        g.attend(q, k, v, out)
    assert out[:4].isnan().all()  # rows of other slices untouched
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for r in rows:
        expected = _oracle(q[r], k[r], v[r])
        assert torch.allclose(out[r].double(), expected, atol=tol), (
            r,
            (out[r].double() - expected).abs().max(),
        )
        alone = prefill_attention(q[r], k[r], v[r], 0).float()  # the per-chunk path
        assert torch.allclose(out[r], alone, atol=tol)


def test_groups_pad_at_most_to_their_fill_bound_and_cover_every_row_once():
    lengths = [10, 11, 12, 50, 49, 2, 200, 161, 160, 7]
    rows, *_ = _step(lengths, other=0, dtype=torch.float32)
    groups = fp.plan_fresh_chunks(rows, "cpu")
    dest = torch.cat([g.dest for g in groups]).tolist()
    assert sorted(dest) == list(range(sum(lengths)))  # every real row exactly once
    for g in groups:
        assert g.gather.numel() == g.batch * g.width
        assert g.valid.numel() * 1.0 >= fp.MIN_FILL * g.gather.numel() - 1e-9
        assert g.valid.numel() == g.dest.numel()
    # 200 with 161 and 160 (161 >= 0.8 * 200), but 50 and 12 apart
    widths = sorted((g.width, g.batch) for g in groups)
    assert (200, 3) in widths and (12, 3) in widths


def test_padding_repeats_a_chunks_own_last_row():
    rows = [slice(3, 5), slice(5, 10)]  # lengths 2 and 5: 2 < 0.8 * 5, two groups
    groups = fp.plan_fresh_chunks(rows, "cpu")
    assert [g.gather.tolist() for g in groups] == [[3, 4], [5, 6, 7, 8, 9]]
    rows = [slice(0, 4), slice(4, 9)]  # 4 >= 0.8 * 5: one group, the first padded with row 3
    (g,) = fp.plan_fresh_chunks(rows, "cpu")
    assert g.gather.tolist() == [0, 1, 2, 3, 3, 4, 5, 6, 7, 8]
    assert g.valid.tolist() == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert g.dest.tolist() == list(range(9))


def test_not_available_off_cpu_dtypes():
    assert fp.fresh_batching_available(torch.zeros(1, H, D))
    assert not fp.fresh_batching_available(torch.zeros(1, H, D, dtype=torch.float64))
