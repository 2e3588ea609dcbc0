"""The C shared-prefix kernel (cpu_kernel.shared_row, csrc/shared_rows.c).

One run of keys at scattered cache rows (every other row NaN, so a wrong read
shows) read by m queries; outputs NaN-poisoned before each call.  Lane counts
cross the kernel's 16- and 32-lane chunks, key counts its 32-key tiles and the
splits of keys over threads; with up to two chunks of lanes and several kv heads
a task walks all kv heads per tile, with more lanes a task takes one kv head.  Both
builds run every case on every CPU: the native one (the AVX-512 kernel for head
dims that are multiples of 64 where the CPU has AVX-512, else the portable C) and
the portable one (portable C only).
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from parrot.engine.kernels import native
from parrot.engine.kernels.attention import (
    Segment,
    cpu_kernel,
    paged_decode_attention,
    reference_decode_attention,
)


@pytest.fixture(scope="module", params=["native", "portable"])
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    return native.build(portable=request.param == "portable")


def _built(lib: ctypes.CDLL, dim: int) -> bool:
    return bool(lib.parrot_shared_rows_supported(dim))


def _case(
    seed: int, *, m: int, n: int, kv_heads: int, group: int, dim: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n_cache = 2 * n + 5
    k = torch.full((n_cache, kv_heads, dim), torch.nan)
    v = torch.full((n_cache, kv_heads, dim), torch.nan)
    tok = torch.randperm(n_cache, generator=gen)[:n].contiguous()
    k[tok] = torch.randn(n, kv_heads, dim, generator=gen)
    v[tok] = torch.randn(n, kv_heads, dim, generator=gen)
    batch = m + 3
    return {
        "qs": torch.randn(batch, kv_heads * group, dim, generator=gen) / dim**0.5,
        "seqs": torch.randperm(batch, generator=gen)[:m].contiguous(),
        "kf": k.to(dtype),
        "vf": v.to(dtype),
        "tok": tok,
        "out": torch.full((m, kv_heads * group, dim), torch.nan),
        "lse": torch.full((m, kv_heads * group), torch.nan),
    }


def _reference(c: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of every query over the run: (out [m, H, D], lse [m, H])."""
    m, heads, dim = c["out"].shape
    kv_heads = c["kf"].shape[1]
    k, v = c["kf"][c["tok"]].double(), c["vf"][c["tok"]].double()  # [n, KVH, D]
    q = c["qs"][c["seqs"]].double().view(m, kv_heads, heads // kv_heads, dim)
    s = torch.einsum("mhgd,nhd->mhgn", q, k)
    out = torch.einsum("mhgn,nhd->mhgd", torch.softmax(s, -1), v).reshape(m, heads, dim)
    return out, torch.logsumexp(s, -1).reshape(m, heads)


def _run(c: dict[str, torch.Tensor], lib: ctypes.CDLL, threads: int | None = None) -> None:
    """Run the kernel (AVX-512 or portable C, whichever ``lib`` has for the head dim)
    on ``threads`` threads (default: torch's)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        cpu_kernel.shared_row(**c, lib=lib)
    finally:
        torch.set_num_threads(before)


def _check(c: dict[str, torch.Tensor]) -> None:
    ref_out, ref_lse = _reference(c)
    assert torch.isfinite(c["out"]).all() and torch.isfinite(c["lse"]).all()
    assert float((c["out"].double() - ref_out).abs().max() / ref_out.abs().max()) < 1e-5
    assert float((c["lse"].double() - ref_lse).abs().max()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "n", "kv_heads", "group", "dim"),
    [
        (1, 1, 1, 1, 64),  # one lane, one key
        (5, 31, 2, 3, 64),  # 15 lanes, part of one tile
        (6, 33, 3, 3, 64),  # 18 lanes: a second 16-lane vector; a second tile of one key
        (11, 200, 3, 3, 64),  # 33 lanes: a second chunk
        (32, 700, 2, 1, 128),  # 32 lanes, many tiles and splits
        (40, 130, 1, 2, 128),  # 80 lanes: chunks of 32, 32, 16
        (22, 150, 3, 3, 64),  # 66 lanes on 3 kv heads: one kv head per task (the others: all heads)
    ],
)
def test_matches_float64_reference(
    lib: ctypes.CDLL, dtype: torch.dtype, m: int, n: int, kv_heads: int, group: int, dim: int
) -> None:
    c = _case(m + n + dim, m=m, n=n, kv_heads=kv_heads, group=group, dim=dim, dtype=dtype)
    _run(c, lib)
    _check(c)


@pytest.mark.parametrize(("threads", "kv_heads", "n"), [(1, 1, 50), (2, 3, 1000), (3, 2, 300), (4, 1, 65)])
def test_keys_split_over_threads_merge_exactly(lib: ctypes.CDLL, threads: int, kv_heads: int, n: int) -> None:
    """Fewer kv heads than two per thread: the keys are split, each split's softmax
    state is merged by log-sum-exp; the result is the same attention."""
    c = _case(threads * 10 + kv_heads, m=7, n=n, kv_heads=kv_heads, group=2, dim=64)
    _run(c, lib, threads)
    _check(c)


def test_nan_reaches_exactly_the_lanes_that_read_it(lib: ctypes.CDLL) -> None:
    c = _case(11, m=6, n=90, kv_heads=2, group=3, dim=64)
    c["kf"][c["tok"][40], 0, 7] = torch.nan  # a key of kv head 0: every query's heads 0-2
    c["qs"][c["seqs"][4], 5, 0] = torch.nan  # query 4, head 5 (kv head 1)
    _run(c, lib)
    out = c["out"]
    assert torch.isnan(out[:, :3]).all()
    assert torch.isnan(out[4, 5]).all()
    finite = torch.ones(out.shape[:2], dtype=torch.bool)
    finite[:, :3] = False
    finite[4, 5] = False
    assert torch.isfinite(out[finite]).all()


def test_extreme_scores_stay_finite(lib: ctypes.CDLL) -> None:
    """Scores hundreds apart (most weights underflow), across tiles and splits."""
    c = _case(12, m=9, n=400, kv_heads=1, group=2, dim=64)
    c["qs"] *= 200.0
    _run(c, lib, 2)
    ref_out, ref_lse = _reference(c)
    assert torch.isfinite(c["out"]).all()
    assert float((c["out"].double() - ref_out).abs().max() / ref_out.abs().max()) < 1e-5
    assert float(((c["lse"].double() - ref_lse).abs() / ref_lse.abs()).max()) < 1e-5


def test_bad_inputs_are_refused_before_the_c_side(lib: ctypes.CDLL) -> None:
    c = _case(13, m=3, n=20, kv_heads=2, group=2, dim=64)
    bad = [
        ({"kf": c["kf"].transpose(1, 2).contiguous().transpose(1, 2)}, "contiguous"),
        ({"tok": c["tok"].int()}, "int64"),
        ({"seqs": c["seqs"].int()}, "int64"),
        ({"vf": c["vf"].to(torch.bfloat16)}, "mismatched"),
        ({"out": c["out"][:2]}, r"\[m, H, D\]"),
        ({"lse": c["lse"].double()}, "fp32"),
        ({"qs": c["qs"].double()}, "fp32"),
        ({"kf": c["kf"].half(), "vf": c["vf"].half()}, "fp32 or bf16"),
        ({"tok": c["tok"][:0]}, "at least one"),
        ({k: c[k][:, :3].contiguous() for k in ("qs", "out", "lse")}, "head counts"),  # 3 heads on 2 kv heads
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            cpu_kernel.shared_row(**{**c, **change}, lib=lib)
        assert c["out"].isnan().all() and c["lse"].isnan().all()  # nothing was written


@pytest.mark.parametrize("dim", [16, 48, 96])
def test_head_dims_without_the_avx512_kernel_run_the_portable_c(lib: ctypes.CDLL, dim: int) -> None:
    """Not a multiple of 64: no build offers the kernel to the engine for it, and the
    call computes in portable C."""
    c = _case(14, m=2, n=10, kv_heads=2, group=2, dim=dim)
    assert not _built(lib, dim)
    _run(c, lib)
    _check(c)


def test_the_portable_build_offers_no_shared_kernel_but_computes() -> None:
    portable = native.build(portable=True)
    assert not _built(portable, 64) and not _built(portable, 128)
    c = _case(15, m=2, n=10, kv_heads=1, group=1, dim=64)
    _run(c, portable)
    _check(c)


def _groups_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Segment]]:
    """Two prefix groups (3 and 2 sequences), a nested prefix under the first, private tails."""
    gen = torch.Generator().manual_seed(16)
    k = torch.randn(40, 16, 2, 64, generator=gen)
    v = torch.randn(40, 16, 2, 64, generator=gen)
    q = torch.randn(5, 6, 64, generator=gen)
    segments = [
        Segment(torch.tensor([3, 9, 4]), 0, 40, torch.tensor([0, 1, 2])),
        Segment(torch.tensor([17, 12]), 5, 20, torch.tensor([1, 2])),
        Segment(torch.tensor([30, 31]), 0, 19, torch.tensor([3, 4])),
        *(Segment(torch.tensor([20 + s]), 0, 3 + s, torch.tensor([s])) for s in range(5)),
    ]
    return q, k, v, segments


@pytest.mark.parametrize("build", ["native", "portable"])
def test_shared_rows_of_a_batch_run_in_the_kernel(monkeypatch: pytest.MonkeyPatch, build: str) -> None:
    """With the C ops on, every shared row of a plan goes through shared_row (3 here:
    two groups and a nested prefix) where the selected build has the AVX-512 kernel
    (none with the portable build: PyTorch's path), and the batch's attention is
    still exact."""
    q, k, v, segments = _groups_case()
    calls = []
    real = cpu_kernel.shared_row

    def spy(*args: object, **kwargs: object) -> None:
        calls.append(args[1])
        real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernel, "shared_row", spy)
    with native.using(build):
        out = paged_decode_attention(q, k, v, segments, share=True)
        expected = 3 if native.library() is not None and cpu_kernel.shared_built(64) else 0
    assert len(calls) == expected
    ref = reference_decode_attention(q.double(), k.double(), v.double(), segments)
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5


def test_without_the_c_ops_shared_rows_keep_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, segments = _groups_case()
    monkeypatch.setattr(cpu_kernel, "shared_row", lambda *a, **kw: pytest.fail("C kernel called"))
    with native.using("off"):
        out = paged_decode_attention(q, k, v, segments, share=True)
    ref = reference_decode_attention(q.double(), k.double(), v.double(), segments)
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5
