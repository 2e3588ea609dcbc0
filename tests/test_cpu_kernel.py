"""The C decode kernel (parrot.engine.kernels.attention.cpu_kernel) and the library
build (parrot.engine.kernels.native).

Both builds are checked on every machine: the native one (AVX-512 intrinsics for
head dims that are multiples of 16 where the CPU has AVX-512) and the portable C
one.  Keys sit at scattered cache rows and every other row is NaN, so reading a
wrong row shows up; outputs are NaN-poisoned before each call.
"""

from __future__ import annotations

import ctypes
import logging
import shutil
from pathlib import Path

import pytest
import torch

from parrot.engine.kernels import native
from parrot.engine.kernels.attention import (
    Segment,
    cpu_kernel,
    paged_decode_attention,
    plan_decode_attention,
    reference_decode_attention,
)
from parrot.engine.kernels.attention.merge import merge_partials


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _cpu_has_avx512() -> bool:
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.fixture(scope="module", params=["native", "portable"])
def build(request: pytest.FixtureRequest) -> tuple[str, ctypes.CDLL]:
    return str(request.param), native.build(portable=request.param == "portable")


def _case(
    seed: int, *, rows: int, kv_heads: int, group: int, dim: int, lengths: list[int], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    n_cache = rows * width * 2 + 7
    k = torch.full((n_cache, kv_heads, dim), torch.nan)
    v = torch.full((n_cache, kv_heads, dim), torch.nan)
    tok = torch.zeros(rows, width, dtype=torch.int64)
    perm = torch.randperm(n_cache, generator=gen)
    for r, n in enumerate(lengths):
        idx = perm[r * width : r * width + n]
        tok[r, :n] = idx
        tok[r, n:] = -(10**9)  # never read: past the row's length
        k[idx] = torch.randn(n, kv_heads, dim, generator=gen)
        v[idx] = torch.randn(n, kv_heads, dim, generator=gen)
    batch = rows + 2
    q = torch.randn(batch, kv_heads * group, dim, generator=gen) / dim**0.5
    seqs = torch.randperm(batch, generator=gen)[:rows]
    return {
        "qs": q,
        "seqs": seqs,
        "kf": k.to(dtype),
        "vf": v.to(dtype),
        "tok": tok,
        "lens": torch.tensor(lengths, dtype=torch.int64),
        "out": torch.full((rows, kv_heads * group, dim), torch.nan),
        "lse": torch.full((rows, kv_heads * group), torch.nan),
    }


def _reference(c: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of every row: (out [R, H, D], lse [R, H])."""
    rows, heads, dim = c["out"].shape
    kv_heads = c["kf"].shape[1]
    group = heads // kv_heads
    outs, lses = [], []
    for r in range(rows):
        idx = c["tok"][r, : int(c["lens"][r])]
        k, v = c["kf"][idx].double(), c["vf"][idx].double()  # [n, KVH, D]
        q = c["qs"][c["seqs"][r]].double().view(kv_heads, group, dim)
        s = torch.einsum("hgd,nhd->hgn", q, k)
        outs.append(torch.einsum("hgn,nhd->hgd", torch.softmax(s, -1), v).reshape(heads, dim))
        lses.append(torch.logsumexp(s, -1).reshape(heads))
    return torch.stack(outs), torch.stack(lses)


LENGTHS = [1, 15, 16, 17, 40, 100]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("kv_heads", "group", "dim"),
    # register kernels (dim 64: G 1-4, dim 128: G 1-2), the general AVX-512 task, portable C
    [(3, 3, 64), (1, 4, 64), (2, 1, 128), (2, 2, 128), (1, 5, 64), (2, 3, 128), (1, 4, 16), (2, 3, 24)],
)
def test_kernel_matches_float64_reference(
    build: tuple[str, ctypes.CDLL], dtype: torch.dtype, kv_heads: int, group: int, dim: int
) -> None:
    name, lib = build
    c = _case(dim + group, rows=6, kv_heads=kv_heads, group=group, dim=dim, lengths=LENGTHS, dtype=dtype)
    vector = cpu_kernel.decode_rows(**c, lib=lib)
    assert vector == (name == "native" and dim % 16 == 0 and _cpu_has_avx512())  # the path that ran
    ref_out, ref_lse = _reference(c)
    assert torch.isfinite(c["out"]).all() and torch.isfinite(c["lse"]).all()
    err = (c["out"].double() - ref_out).abs().max() / ref_out.abs().max()
    assert err < 1e-5
    assert (c["lse"].double() - ref_lse).abs().max() < 1e-5


@pytest.mark.parametrize(("rows", "kv_heads", "threads"), [(1, 3, 2), (1, 5, 2), (2, 4, 4), (3, 2, 1)])
def test_few_rows_split_their_heads_over_the_threads(
    build: tuple[str, ctypes.CDLL], rows: int, kv_heads: int, threads: int
) -> None:
    """Fewer rows than two per thread: tasks take part of a row's kv heads (uneven splits
    included); every head of every row is still written once, right."""
    _, lib = build
    c = _case(
        rows + kv_heads,
        rows=rows,
        kv_heads=kv_heads,
        group=2,
        dim=64,
        lengths=[33, 7, 16][:rows],
        dtype=torch.float32,
    )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_kernel.decode_rows(**c, lib=lib)
    finally:
        torch.set_num_threads(before)
    ref_out, ref_lse = _reference(c)
    assert rel_err(c["out"], ref_out) < 1e-5 and (c["lse"].double() - ref_lse).abs().max() < 1e-5


def test_nan_reaches_exactly_the_rows_that_read_it(build: tuple[str, ctypes.CDLL]) -> None:
    _, lib = build
    c = _case(5, rows=4, kv_heads=2, group=3, dim=64, lengths=[30, 30, 17, 50], dtype=torch.float32)
    c["kf"][c["tok"][1, 20], 0, 5] = torch.nan  # a key row 1 reads, kv head 0
    c["qs"][c["seqs"][3], 4, 0] = torch.nan  # row 3's query head 4 (kv head 1)
    cpu_kernel.decode_rows(**c, lib=lib)
    out = c["out"]
    assert torch.isnan(out[1, :3]).any(dim=-1).all()  # all of kv head 0's query heads
    assert torch.isfinite(out[1, 3:]).all()
    assert torch.isnan(out[3, 4]).all() and torch.isfinite(out[3, :3]).all()
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()


def test_extreme_scores_stay_finite(build: tuple[str, ctypes.CDLL]) -> None:
    """Scores hundreds apart (most weights underflow to zero) still normalise exactly."""
    _, lib = build
    c = _case(6, rows=2, kv_heads=1, group=2, dim=32, lengths=[40, 70], dtype=torch.float32)
    c["qs"] *= 200.0
    cpu_kernel.decode_rows(**c, lib=lib)
    ref_out, ref_lse = _reference(c)
    assert torch.isfinite(c["out"]).all()
    assert (c["out"].double() - ref_out).abs().max() / ref_out.abs().max() < 1e-5
    assert ((c["lse"].double() - ref_lse).abs() / ref_lse.abs()).max() < 1e-5


def test_layouts_are_checked_before_the_c_side_runs() -> None:
    c = _case(7, rows=2, kv_heads=2, group=2, dim=16, lengths=[3, 5], dtype=torch.float32)
    before = c["out"].clone()
    bad = [
        ({"kf": c["kf"].transpose(1, 2).contiguous().transpose(1, 2)}, "contiguous"),
        ({"tok": c["tok"].int()}, "int64"),
        ({"lens": c["lens"].int()}, "int64"),
        ({"vf": c["vf"].to(torch.bfloat16)}, "mismatched"),
        ({"out": c["out"][:1]}, "mismatched"),
        ({"lse": c["lse"].double()}, "fp32"),
        ({"qs": c["qs"].double()}, "queries must be fp32"),
        ({"kf": c["kf"].half(), "vf": c["vf"].half()}, "caches fp32 or bf16"),
        ({"seqs": c["seqs"][:1]}, "row counts"),
        ({k: c[k][:, :3].contiguous() for k in ("qs", "out", "lse")}, "head counts"),  # 3 heads on 2 kv heads
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            cpu_kernel.decode_rows(**{**c, **change})
        assert torch.equal(c["out"].isnan(), before.isnan())  # nothing was written


# Two sequences, one block each: the smallest batch a plan is made for.
SEGMENTS = [
    Segment(torch.tensor([0]), 0, 5, torch.tensor([0])),
    Segment(torch.tensor([1]), 0, 9, torch.tensor([1])),
]


def _small() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return tuple(torch.randn(shape, generator=gen) for shape in ((2, 4, 16), (2, 16, 2, 16), (2, 16, 2, 16)))


def test_the_engine_plans_use_the_kernel_when_it_is_built() -> None:
    q, k, v = _small()
    plan = plan_decode_attention(SEGMENTS, q, k)
    assert plan.kernel == (native.library() is not None)
    out = paged_decode_attention(q, k, v, plan)
    assert rel_err(out, reference_decode_attention(q, k, v, SEGMENTS)) < 1e-5
    with pytest.raises(ValueError, match="built for the CPU kernel"):
        paged_decode_attention(q.double(), k.double(), v.double(), plan)


def _partials(seed: int, owner: list[int], heads: int = 6, dim: int = 20):
    gen = torch.Generator().manual_seed(seed)
    slots = len(owner)
    return (
        torch.randn(slots, heads, dim, generator=gen),
        torch.randn(slots, heads, generator=gen) * 5,
        torch.tensor(owner, dtype=torch.int64),
    )


def _csr(owner: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.zeros(batch + 1, dtype=torch.int64)
    starts[1:] = torch.bincount(owner, minlength=batch).cumsum(0)
    return starts, torch.argsort(owner, stable=True)


def test_merge_lse_equals_the_pytorch_merge(build: tuple[str, ctypes.CDLL]) -> None:
    """Sequences with one to four partials, in any slot order."""
    _, lib = build
    out, lse, owner = _partials(21, [2, 0, 1, 2, 3, 2, 0, 4, 2])
    expected = merge_partials(out.clone(), lse, torch.ones_like(lse), owner, 5)
    result = torch.full((5, 6, 20), torch.nan)
    cpu_kernel.merge_lse(out, lse, *_csr(owner, 5), result, lib=lib)
    assert rel_err(result, expected) < 1e-6


def test_merge_lse_keeps_a_nan_in_its_sequence_and_head(build: tuple[str, ctypes.CDLL]) -> None:
    _, lib = build
    out, lse, owner = _partials(22, [0, 1, 1, 2])
    lse[2, 3] = torch.nan  # sequence 1, head 3
    out[3, 0, 5] = torch.nan  # sequence 2, head 0
    result = torch.zeros(3, 6, 20)
    cpu_kernel.merge_lse(out, lse, *_csr(owner, 3), result, lib=lib)
    bad = torch.isnan(result).any(-1)
    expected = torch.zeros(3, 6, dtype=torch.bool)
    expected[1, 3] = expected[2, 0] = True
    assert torch.equal(bad, expected)


def test_merge_lse_checks_layouts_before_the_c_side() -> None:
    out, lse, owner = _partials(23, [0, 1])
    starts, slots = _csr(owner, 2)
    result = torch.full((2, 6, 20), torch.nan)
    bad = [
        ({"out": out.double()}, "fp32"),
        ({"lse": lse[:, :5].contiguous()}, "do not match"),
        ({"result": torch.full((2, 6, 21), torch.nan)}, "do not match"),
        ({"starts": starts[:-1]}, r"\[B \+ 1\]"),
        ({"slots": slots.int()}, "int64"),
        ({"out": out.transpose(1, 2).contiguous().transpose(1, 2)}, "contiguous"),
    ]
    for change, match in bad:
        args = {"out": out, "lse": lse, "starts": starts, "slots": slots, "result": result, **change}
        with pytest.raises(ValueError, match=match):
            cpu_kernel.merge_lse(**args)
        assert result.isnan().all()  # nothing was written


def test_plans_with_sharing_merge_in_c_when_the_kernels_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three sequences under one shared 32-token run, each with a private tail: with
    the C kernels built for head dim 64 the partials merge in C, exactly."""
    gen = torch.Generator().manual_seed(24)
    q = torch.randn(3, 4, 64, generator=gen)
    k, v = torch.randn(8, 16, 2, 64, generator=gen), torch.randn(8, 16, 2, 64, generator=gen)
    segments = [Segment(torch.tensor([0, 1]), 0, 32, torch.tensor([0, 1, 2]))]
    segments += [Segment(torch.tensor([2 + s]), 0, 5 + s, torch.tensor([s])) for s in range(3)]
    plan = plan_decode_attention(segments, q, k)
    calls = []
    real = cpu_kernel.merge_lse
    monkeypatch.setattr(cpu_kernel, "merge_lse", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = paged_decode_attention(q, k, v, plan)
    assert rel_err(out, reference_decode_attention(q, k, v, segments)) < 1e-5
    c_merge = plan.kernel and plan.shared_kernel
    assert (plan.lse_merge is not None) == c_merge and len(calls) == int(c_merge)


def test_switched_off_by_the_cpu_kernel_option() -> None:
    q, k, _ = _small()
    with native.using("off"):
        assert native.library() is None and "cpu_kernel='off'" in native.status()
        assert not plan_decode_attention(SEGMENTS, q, k).kernel
    assert native.selected() == "native"  # restored after the block


def test_a_failed_build_falls_back_to_pytorch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No compiler: one warning naming the failure, and attention still right (PyTorch path)."""
    monkeypatch.setattr(native, "_libs", {})
    monkeypatch.setattr(native, "_statuses", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with (
        native.using("native", cache_dir=tmp_path / "cache"),
        caplog.at_level(logging.WARNING, logger="parrot.engine.kernels.native"),
    ):
        assert native.library() is None
        assert native.library() is None  # not retried
        assert native.status().startswith("unavailable") and "no-such-cc" in native.status()
    assert len([r for r in caplog.records if "PyTorch paths" in r.getMessage()]) == 1
    q, k, v = _small()
    plan = plan_decode_attention(SEGMENTS, q, k)
    assert not plan.kernel
    out = paged_decode_attention(q, k, v, plan)
    assert rel_err(out, reference_decode_attention(q, k, v, SEGMENTS)) < 1e-5


def test_builds_are_cached_per_source_and_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if shutil.which("cc") is None:
        pytest.fail("no C compiler ('cc') on this machine: the kernel cannot be built")
    native.build(cache_dir=tmp_path)
    native.build(portable=True, cache_dir=tmp_path)
    first = sorted(p.name for p in tmp_path.iterdir())
    assert len(first) == 2 and all(n.endswith(".so") for n in first)  # no temp files left
    native.build(cache_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == first  # reused, not rebuilt
