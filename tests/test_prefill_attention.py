"""Prefill-chunk attention: the fused two-part path equals plain masked attention."""

from __future__ import annotations

import pytest
import torch

from parrot.engine import prefill_attention as pa
from parrot.engine.kv_store import causal_mask, grouped_attention


@pytest.mark.parametrize(("start", "n"), [(0, 1), (0, 37), (5, 1), (64, 20), (300, 128)])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (4, 1)])
def test_chunk_attention_matches_masked_attention(start: int, n: int, heads: int, kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(start * 31 + n)
    q = torch.randn(n, heads, 16, generator=gen)
    k = torch.randn(start + n, kv_heads, 16, generator=gen)
    v = torch.randn(start + n, kv_heads, 16, generator=gen)
    expected = grouped_attention(q.double(), k.double(), v.double(), causal_mask(start, n, "cpu"))
    got = pa.prefill_attention(q, k, v, start)
    assert pa.fused_prefill_available(q)  # the fused path is the one under test here
    assert got.shape == q.shape and torch.isfinite(got).all()
    assert (got.double() - expected).abs().max() < 1e-5


def test_falls_back_to_masked_attention_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(9, 4, 8, generator=gen), torch.randn(30, 2, 8, generator=gen), torch.randn(30, 2, 8)
    fused = pa.prefill_attention(q, k, v, 21)
    monkeypatch.setattr(pa, "_flash_op", lambda: None)
    assert not pa.fused_prefill_available(q)
    assert torch.allclose(pa.prefill_attention(q, k, v, 21), fused, atol=1e-5)


def test_keys_must_end_with_the_chunk() -> None:
    q, k = torch.randn(4, 2, 8), torch.randn(10, 2, 8)
    with pytest.raises(ValueError, match=r"keys must cover positions \[0, start \+ n\): 10 != 5 \+ 4"):
        pa.prefill_attention(q, k, k, 5)


@pytest.mark.parametrize(("start", "n"), [(0, 37), (64, 20), (300, 128)])
def test_bf16_inputs_run_in_bf16_and_merge_in_fp32(start: int, n: int) -> None:
    """With a bf16 cache the engine runs prefill attention in bf16: the result is the
    attention of the bf16-rounded inputs (only the kernel's own bf16 steps differ) and
    comes back as bf16; the past/chunk merge is done in fp32."""
    gen = torch.Generator().manual_seed(start + n)
    q = torch.randn(n, 6, 64, generator=gen).bfloat16()
    k = torch.randn(start + n, 2, 64, generator=gen).bfloat16()
    v = torch.randn(start + n, 2, 64, generator=gen).bfloat16()
    expected = grouped_attention(q.double(), k.double(), v.double(), causal_mask(start, n, "cpu"))
    got = pa.prefill_attention(q, k, v, start)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert float((got.double() - expected).abs().max() / expected.abs().max()) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_without_a_past_is_the_kernels_output_as_it_is(dtype: torch.dtype) -> None:
    """A fresh sequence takes one causal call and no fp32 round trip: bit for bit what
    the two-part path (which widens to fp32 for its merge) gives, in q's dtype."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(23, h, 16, generator=gen).to(dtype) for h in (6, 2, 2))
    got = pa.prefill_attention(q, k, v, 0)
    assert got.dtype == dtype and torch.equal(got, pa._fused(q, k, v, 0)[0].to(dtype))
    assert torch.equal(pa.prefill_partial(q, k, v, 0)[0].to(dtype), got)
