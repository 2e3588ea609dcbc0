"""Tensors on transparent huge pages (parrot.engine.hugepages)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

from parrot.engine import hugepages
from parrot.engine.kernels.kernel_set import for_options
from parrot.engine.kernels.options import KernelOptions
from parrot.engine.kernels.packed_linear import PackedLinear
from parrot.engine.kv_store import PagedKVCache


def test_huge_page_tensors_are_disjoint_aligned_and_outlive_their_chunk() -> None:
    small = [hugepages.empty(n) for n in (1, 1000, 17, 300_000)]
    big = hugepages.empty(3 << 20)  # 12 MiB: a chunk of its own
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in [*small, big])
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    assert all(t.data_ptr() % 64 == 0 and t.dtype == torch.float32 for t in [*small, big])
    assert big.data_ptr() % hugepages.HUGE == 0
    for i, t in enumerate(small):
        t.fill_(float(i))
    for _ in range(20):  # new chunks after the current one fills: earlier tensors untouched
        hugepages.empty(2 << 20)
    assert all(bool((t == float(i)).all()) for i, t in enumerate(small))
    assert hugepages.empty(0, torch.bfloat16).shape == (0,)
    with pytest.raises(ValueError, match="numel must be >= 0"):
        hugepages.empty(-1)


def test_advise_covers_whole_huge_pages_only() -> None:
    assert hugepages.advise(torch.empty(10)) == 0  # no whole 2 MiB page inside
    big = hugepages.empty(4 << 20)  # 16 MiB starting on a huge page
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()  # Linux with huge pages built in
    assert hugepages.advise(big) == (16 << 20 if sys.platform.startswith("linux") and thp else 0)


@pytest.mark.parametrize("huge_pages", [True, False])
def test_the_hugepages_option_reaches_the_kv_cache_and_the_f32_weights(
    monkeypatch: pytest.MonkeyPatch, huge_pages: bool
) -> None:
    """The engine's ``hugepages`` option off: neither the KV cache nor the fp32 kernel's
    packed weights ask for huge pages (plain memory, to compare)."""
    advised: list[int] = []
    carved: list[int] = []
    real_advise, real_empty = hugepages.advise, hugepages.empty
    monkeypatch.setattr(hugepages, "advise", lambda t: advised.append(t.numel()) or real_advise(t))
    monkeypatch.setattr(hugepages, "empty", lambda n, *a: carved.append(n) or real_empty(n, *a))
    PagedKVCache(1, 4, 16, 1, 8, torch.float32, "cpu", huge_pages=huge_pages)
    assert advised == ([4 * 16 * 8] * 2 if huge_pages else [])
    w, x = torch.randn(32, 64), torch.randn(3, 64)
    packed = PackedLinear(w, kernels=for_options(KernelOptions(hugepages=huge_pages)))
    assert bool(carved) == (huge_pages and packed.f32 is not None)
    assert torch.allclose(packed(x), x @ w.T, rtol=1e-4, atol=1e-4)  # in plain memory the same
