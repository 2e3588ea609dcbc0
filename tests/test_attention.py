"""Paged decode attention with prefix-tree sharing (parrot.engine.kernels.attention).

Every case is a random prefix *tree* in a fragmented paged cache: several
groups, each with a shared root prefix, a nested second and third level for
some of its sequences, and private suffixes; plus sequences that share nothing.
Segments start mid-block, one child per node continues inside its parent's
last block, some segments are a single token.  Every cache row that no segment
covers is NaN, so reading a wrong row (or a row past a segment's end) shows up
as a NaN in the output.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import parrot.engine.kernels.attention.torch_impl as torch_impl
import parrot.engine.kernels.attention.torch_plan as torch_plan
import parrot.engine.kernels.attention.triton_kernel as triton_kernel
from parrot.engine.kernels import native
from parrot.engine.kernels.attention import (
    Segment,
    paged_decode_attention,
    plan_decode_attention,
    reference_decode_attention,
    validate_segments,
)
from parrot.engine.kernels.attention.triton_kernel import (
    TritonUnavailableError,
    triton_paged_decode_attention,
)

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


@dataclass
class Case:
    q: torch.Tensor  # [B, H, D]
    k: torch.Tensor  # [NB, BS, KVH, D]
    v: torch.Tensor
    segments: list[Segment]
    used: torch.Tensor  # bool [NB, BS]: rows read by some segment


@dataclass
class _Node:
    seqs: list[int]
    length: int
    parent: int | None


def _tree(rng: random.Random, groups: list[int], solo: int, max_len: int) -> tuple[int, list[_Node]]:
    """Segment specs in parent-before-child order; returns (batch, nodes)."""
    nodes: list[_Node] = []

    def length() -> int:
        return 1 if rng.random() < 0.2 else rng.randint(1, max_len)

    nxt = 0
    for n in groups:
        seqs = list(range(nxt, nxt + n))
        nxt += n
        deepest = {s: len(nodes) for s in seqs}
        nodes.append(_Node(seqs, length(), None))  # level 1: the group's system prompt
        lvl2 = seqs[: max(2, n // 2 + 1)] if n >= 2 else []
        if lvl2:  # level 2: a conversation shared by part of the group
            nodes.append(_Node(lvl2, length(), deepest[lvl2[0]]))
            deepest.update({s: len(nodes) - 1 for s in lvl2})
            lvl3 = lvl2[: max(1, len(lvl2) - 1)]
            nodes.append(_Node(lvl3, length(), deepest[lvl3[0]]))  # level 3
            deepest.update({s: len(nodes) - 1 for s in lvl3})
        for s in seqs:  # private suffixes (some sequences have none)
            if rng.random() < 0.8:
                nodes.append(_Node([s], length(), deepest[s]))
    for _ in range(solo):  # sequences sharing nothing; some stored as two runs
        nodes.append(_Node([nxt], length(), None))
        if rng.random() < 0.5:
            nodes.append(_Node([nxt], length(), len(nodes) - 1))
        nxt += 1
    return nxt, nodes


def make_case(
    seed: int,
    *,
    block_size: int = 16,
    kv_heads: int = 2,
    group: int = 2,
    dim: int = 16,
    groups: tuple[int, ...] = (3, 5),
    solo: int = 2,
    max_len: int = 40,
    dtype: torch.dtype = torch.float32,
) -> Case:
    rng = random.Random(seed)
    batch, nodes = _tree(rng, list(groups), solo, max_len)
    need = sum(-(-(block_size - 1 + nd.length) // block_size) for nd in nodes) + 5
    free = list(range(need))
    rng.shuffle(free)
    tails: dict[int, tuple[int, int]] = {}  # node -> (last block, first free row) if the block is not full
    segments: list[Segment] = []
    used = torch.zeros(need, block_size, dtype=torch.bool)
    for i, nd in enumerate(nodes):
        tail = tails.pop(nd.parent, None) if nd.parent is not None else None  # first child continues
        if tail is not None:
            blocks, start = [tail[0]], tail[1]
        else:
            blocks, start = [], rng.randrange(block_size) if rng.random() < 0.7 else 0
        nb = -(-(start + nd.length) // block_size)
        while len(blocks) < nb:
            blocks.append(free.pop())
        end = (start + nd.length) % block_size
        if end:
            tails[i] = (blocks[-1], end)
        for t in range(start, start + nd.length):
            used[blocks[t // block_size], t % block_size] = True
        segments.append(Segment(torch.tensor(blocks), start, nd.length, torch.tensor(sorted(nd.seqs))))
    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    k = torch.randn(need, block_size, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(need, block_size, kv_heads, dim, generator=gen).to(dtype)
    k[~used] = torch.nan
    v[~used] = torch.nan
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    return Case(q, k, v, segments, used)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b| (in float64)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max())


def check(case: Case, *, share: bool, backend: str = "torch", tol: float = TOL, **kw: object) -> torch.Tensor:
    ref = reference_decode_attention(case.q, case.k, case.v, case.segments)
    if backend == "triton_direct":
        scale = 1.0 / math.sqrt(case.q.shape[-1])
        args = (case.q, case.k, case.v, case.segments)
        out = triton_paged_decode_attention(*args, scale=scale, share=share, **kw)
    else:
        out = paged_decode_attention(case.q, case.k, case.v, case.segments, share=share, backend=backend)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < tol
    return out


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny ops on 2 shared cores: OpenMP barriers cost milliseconds when a neighbour
    holds the other core, so these tests run single-threaded (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["kernel", "portable", "torch"])
def cpu_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """The CPU paths for single-query rows: the C kernel of the native build (built
    here on first use), the portable build's C, and PyTorch's gather + fused attention
    (the C ops switched off).  Both C builds are "kernel" to the tests' expectations."""
    build = {"kernel": "native", "portable": "portable", "torch": "off"}[request.param]
    with native.using(build):
        if build != "off":
            assert native.library() is not None, native.status()
        yield "torch" if build == "off" else "kernel"


@pytest.fixture
def tiny_pieces(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Force the torch path to split every row into pieces of a few keys."""
    monkeypatch.setattr(torch_plan, "KV_BUDGET", 1)
    monkeypatch.setattr(torch_plan, "SCORE_BUDGET", 1)
    monkeypatch.setattr(torch_plan, "PAD_BUDGET", 1)  # no row is batched or fused: all take the loop
    with native.using("off"):  # the kernel has no pieces
        yield


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# ---------------------------------------------------------------- torch backend

LAYOUTS = [(2, 1), (2, 3), (1, 4)]  # (KVH, G): MHA, GQA, MQA


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize(("kv_heads", "group"), LAYOUTS)
@pytest.mark.parametrize("seed", range(3))
def test_torch_matches_reference(
    cpu_path: str, seed: int, kv_heads: int, group: int, block_size: int, share: bool
) -> None:
    case = make_case(seed, block_size=block_size, kv_heads=kv_heads, group=group, dim=16 if seed else 24)
    check(case, share=share)


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize(("kv_heads", "group"), LAYOUTS)
def test_torch_split_into_pieces(tiny_pieces: None, kv_heads: int, group: int, share: bool) -> None:
    """Pieces of one key each: exercises the running rescale and the multi-slot merge."""
    case = make_case(7, block_size=4, kv_heads=kv_heads, group=group, groups=(4, 6), max_len=30)
    check(case, share=share)


def test_share_and_baseline_agree_on_long_prefix(cpu_path: str) -> None:
    case = make_case(3, block_size=16, kv_heads=4, group=2, dim=32, groups=(12, 9), solo=3, max_len=700)
    a = check(case, share=True)
    b = check(case, share=False)
    assert rel_err(a, b) < TOL


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    seed=st.integers(0, 10_000),
    block_size=st.sampled_from([1, 2, 5, 16]),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    dim=st.sampled_from([4, 16, 24]),
    groups=st.lists(st.integers(1, 7), min_size=0, max_size=3),
    solo=st.integers(0, 3),
    share=st.booleans(),
    split=st.booleans(),
    pad_budget=st.sampled_from([0, 300, 1 << 22]),
    kernel=st.booleans(),
)
def test_torch_random_trees(
    seed: int,
    block_size: int,
    kv_heads: int,
    group: int,
    dim: int,
    groups: list[int],
    solo: int,
    share: bool,
    split: bool,
    pad_budget: int,
    kernel: bool,
) -> None:
    """pad_budget: 0 puts every single-query row on the piece loop, 300 batches only the
    shortest, 4 Mi batches all of them (the padded path); ``kernel``: single-query rows
    in the C kernel instead (budgets then apply to shared rows only)."""
    if not groups and not solo:
        solo = 1
    case = make_case(
        seed, block_size=block_size, kv_heads=kv_heads, group=group, dim=dim, groups=tuple(groups), solo=solo
    )
    budget = kv_heads * dim * 2 if split else torch_plan.KV_BUDGET
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch_plan, "KV_BUDGET", budget)
        mp.setattr(torch_plan, "PAD_BUDGET", pad_budget)
        with native.using(native.selected() if kernel else "off"):
            check(case, share=share)


def test_shared_rows_run_fused_on_cpu_within_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    fused: list[int] = []
    real = torch_impl._run_shared_fused

    def spy(row, *args):  # type: ignore[no-untyped-def]
        fused.append(row.m)
        return real(row, *args)

    monkeypatch.setattr(torch_impl, "_run_shared_fused", spy)
    check(make_case(3, kv_heads=2, group=3, groups=(4, 2), solo=1), share=True)
    assert fused and max(fused) >= 4  # the 4-sequence group's prefix went through the fused kernel
    fused.clear()
    monkeypatch.setattr(torch_plan, "PAD_BUDGET", 1)  # too long to gather whole: the piece loop
    check(make_case(3, kv_heads=2, group=3, groups=(4, 2), solo=1), share=True)
    assert not fused


@pytest.mark.parametrize("share", [True, False])
def test_padded_rows_without_the_fused_kernel(share: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched matmul path that replaces the fused CPU kernel elsewhere (e.g. CUDA)."""
    monkeypatch.setattr(torch_impl, "_flash_op", lambda: None)
    with native.using("off"):
        for seed in range(3):
            check(make_case(seed, kv_heads=2, group=3, groups=(4, 2), solo=3), share=share)


def test_a_fork_that_shares_nothing_in_its_batch_needs_no_merge() -> None:
    """Each sequence reads its parent's run and its own tail, but no run is read by two
    sequences: with sharing on, each sequence is still one row, in batch order (direct)."""
    gen = torch.Generator().manual_seed(21)
    k = torch.randn(8, 4, 2, 16, generator=gen)
    v = torch.randn(8, 4, 2, 16, generator=gen)
    q = torch.randn(2, 4, 16, generator=gen)
    one = torch.tensor([0])
    segs = [
        Segment(torch.tensor([0, 1]), 0, 7, one),  # sequence 0: parent's run, then its tail
        Segment(torch.tensor([1, 2]), 3, 4, one),
        Segment(torch.tensor([4]), 0, 3, torch.tensor([1])),  # sequence 1: one run
    ]
    plan = plan_decode_attention(segs, q, k, share=True)
    assert plan.direct and plan.padded is not None and plan.padded.rows == 2
    out = paged_decode_attention(q, k, v, plan)
    assert rel_err(out, reference_decode_attention(q, k, v, segs)) < TOL


@pytest.mark.parametrize("share", [True, False])
def test_a_plan_serves_every_layer_like_the_segments_do(cpu_path: str, share: bool) -> None:
    """One plan, several layers (different q and caches of the same shapes): each result
    equals the plain call's; on the torch path the padded rows mix with the piece loop,
    in the kernel every single-query row is batched."""
    case = make_case(4, kv_heads=2, group=3, dim=16, groups=(5, 3), solo=3, max_len=60)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch_plan, "PAD_BUDGET", 2 * 40 * 2 * 16)  # some rows padded, the rest looped
        plan = plan_decode_attention(case.segments, case.q, case.k, share=share)
        assert plan.padded is not None and plan.kernel == (cpu_path == "kernel")
        assert not plan.looped if plan.kernel else (plan.looped or share)
        gen = torch.Generator().manual_seed(9)
        for layer in range(3):
            q = torch.randn(case.q.shape, generator=gen) if layer else case.q
            k = torch.where(case.k.isnan(), case.k, torch.randn(case.k.shape, generator=gen))
            v = torch.where(case.v.isnan(), case.v, torch.randn(case.v.shape, generator=gen))
            layer_case = Case(q, k, v, case.segments, case.used)
            with_plan = paged_decode_attention(q, k, v, plan)
            assert torch.equal(with_plan, paged_decode_attention(q, k, v, case.segments, share=share))
            assert rel_err(with_plan, reference_decode_attention(q, k, v, layer_case.segments)) < TOL


def test_a_plan_for_another_batch_is_refused() -> None:
    case = make_case(4)
    plan = plan_decode_attention(case.segments, case.q, case.k)
    with pytest.raises(ValueError, match="another batch"):
        paged_decode_attention(case.q[:-1], case.k, case.v, plan)
    with pytest.raises(ValueError, match=r"seq index \d+ outside \[0, batch_size=2\)"):
        plan_decode_attention(case.segments, case.q[:2], case.k)  # validated when planned


def test_custom_scale_and_low_precision(cpu_path: str) -> None:
    case = make_case(11, kv_heads=2, group=2)
    ref = reference_decode_attention(case.q, case.k, case.v, case.segments, scale=0.3)
    for share in (True, False):
        out = paged_decode_attention(case.q, case.k, case.v, case.segments, scale=0.3, share=share)
        assert rel_err(out, ref) < TOL
    for dtype in (torch.bfloat16, torch.float16):
        low = Case(case.q.to(dtype), case.k.to(dtype), case.v.to(dtype), case.segments, case.used)
        ref = reference_decode_attention(low.q, low.k, low.v, low.segments)
        for share in (True, False):
            out = paged_decode_attention(low.q, low.k, low.v, low.segments, share=share)
            assert out.dtype == dtype and torch.isfinite(out).all()
            assert rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("share", [True, False])
def test_a_bf16_cache_under_fp32_queries_is_read_exactly(cpu_path: str, share: bool) -> None:
    """K/V stored in bf16, widened as read: fp32 accuracy against the widened cache, and
    the same result as passing that fp32 cache."""
    case = make_case(12, kv_heads=2, group=3)
    k16, v16 = case.k.to(torch.bfloat16), case.v.to(torch.bfloat16)
    ref = reference_decode_attention(case.q, k16.float(), v16.float(), case.segments)
    out = paged_decode_attention(case.q, k16, v16, case.segments, share=share)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL
    wide = paged_decode_attention(case.q, k16.float(), v16.float(), case.segments, share=share)
    assert rel_err(out, wide) < TOL
    with pytest.raises(ValueError, match="share one float dtype"):  # bf16 queries, fp32 cache
        paged_decode_attention(case.q.to(torch.bfloat16), case.k, case.v, case.segments, share=share)


def test_the_triton_backend_refuses_a_cache_narrower_than_q(interpret: None) -> None:
    case = make_case(13)
    k16, v16 = case.k.to(torch.bfloat16), case.v.to(torch.bfloat16)
    with pytest.raises(ValueError, match="triton backend needs q in the caches' dtype"):
        paged_decode_attention(case.q, k16, v16, case.segments, backend="triton")


def test_auto_backend_on_cpu_is_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("triton must not be used for CPU tensors")

    monkeypatch.setattr("parrot.engine.kernels.attention.api.triton_paged_decode_attention", boom)
    check(make_case(1), share=True, backend="auto")


# ---------------------------------------------------------------- NaN guards


@pytest.mark.parametrize("share", [True, False])
def test_poisoned_row_that_is_read_shows_up(cpu_path: str, share: bool) -> None:
    """The harness would catch reading a wrong block: NaN in a row that *is* read reaches
    exactly the sequences reading it."""
    case = make_case(5, groups=(4, 3), solo=2)
    seg = case.segments[0]  # the first group's root prefix
    t = seg.length - 1
    block = int(seg.block_ids[(seg.start + t) // 16])
    case.k[block, (seg.start + t) % 16, 0, 0] = torch.nan
    out = paged_decode_attention(case.q, case.k, case.v, case.segments, share=share)
    bad = torch.zeros(out.shape[0], dtype=torch.bool)
    bad[seg.seqs] = True
    assert torch.isnan(out[bad]).any(dim=(1, 2)).all()
    assert torch.isfinite(out[~bad]).all()


def test_unused_rows_are_poisoned_in_every_case() -> None:
    case = make_case(2)
    assert (~case.used).any()
    assert torch.isnan(case.k[~case.used]).all() and torch.isfinite(case.k[case.used]).all()


# ---------------------------------------------------------------- validation


def _ok() -> tuple[list[Segment], int, int, int]:
    segs = [
        Segment(torch.tensor([3, 1]), 14, 3, torch.tensor([0, 1, 2])),
        Segment(torch.tensor([0]), 0, 16, torch.tensor([1])),
        Segment(torch.tensor([2]), 5, 1, torch.tensor([2, 3])),
    ]
    return segs, 4, 5, 16


def _bad(i: int, **changes: object) -> list[Segment]:
    segs, *_ = _ok()
    fields = {"block_ids": segs[i].block_ids, "start": segs[i].start, "length": segs[i].length}
    fields["seqs"] = segs[i].seqs
    fields.update(changes)
    segs[i] = Segment(**fields)  # type: ignore[arg-type]
    return segs


def test_validate_accepts_good_segments() -> None:
    segs, batch, nb, bs = _ok()
    validate_segments(segs, batch, nb, bs)


@pytest.mark.parametrize(
    ("segs", "match"),
    [
        (_bad(0, block_ids=torch.tensor([3, 5])), "block id 5 outside"),
        (_bad(0, block_ids=torch.tensor([-1, 1])), "block id -1 outside"),
        (_bad(0, block_ids=torch.tensor([3.0, 1.0])), "1-D integer tensor"),
        (_bad(0, block_ids=torch.tensor([[3, 1]])), "1-D integer tensor"),
        (_bad(0, start=16), "start=16 outside"),
        (_bad(0, start=-1), "start=-1 outside"),
        (_bad(0, start=True), "must be ints"),
        (_bad(0, length=0), "length=0"),
        (_bad(0, length=2.0), "must be ints"),
        (_bad(0, block_ids=torch.tensor([3])), "needs exactly 2 blocks, got 1"),
        (_bad(1, block_ids=torch.tensor([0, 4])), "needs exactly 1 blocks, got 2"),
        (_bad(0, seqs=torch.tensor([], dtype=torch.long)), "seqs is empty"),
        (_bad(0, seqs=torch.tensor([0, 2, 1])), "segment 0: seqs must be sorted and unique"),
        (_bad(2, seqs=torch.tensor([3, 3])), "segment 2: seqs must be sorted and unique"),
        (_bad(2, seqs=torch.tensor([2, 4])), "seq index 4 outside"),
        (_bad(2, seqs=torch.tensor([2])), "sequence 3 is not listed"),
        (_bad(1, seqs=torch.tensor([True])), "1-D integer tensor"),
        ([*_ok()[0], "nope"], "expected Segment"),
        ([], "no segments for a batch of 4"),
    ],
)
def test_validate_rejects(segs: list[Segment], match: str) -> None:
    _, batch, nb, bs = _ok()
    with pytest.raises(ValueError, match=match):
        validate_segments(segs, batch, nb, bs)
    q = torch.zeros(batch, 2, 4)
    cache = torch.zeros(nb, bs, 1, 4)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(q, cache, cache, segs)


def test_validate_rejects_bad_sizes() -> None:
    segs, *_ = _ok()
    with pytest.raises(ValueError, match="batch_size must be an int"):
        validate_segments(segs, 4.0, 5, 16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size >= 1"):
        validate_segments(segs, 4, 5, 0)


def test_input_checks() -> None:
    segs, batch, nb, bs = _ok()
    q = torch.zeros(batch, 4, 8)
    cache = torch.zeros(nb, bs, 2, 8)
    bad_inputs = [
        ((q[0], cache, cache), {}, "q must be"),
        ((q, cache, cache[:, :, :1]), {}, "k_cache and v_cache"),
        ((q, cache[..., :4], cache[..., :4]), {}, "head dim mismatch"),
        ((torch.zeros(batch, 3, 8), cache, cache), {}, "not a multiple"),
        ((q.double(), cache, cache), {}, "share one float dtype"),
        ((q.long(), cache.long(), cache.long()), {}, "share one float dtype"),
        ((q, cache, cache), {"backend": "cuda"}, "backend must be"),
        ((q, cache, cache), {"scale": math.nan}, "scale must be a finite"),
        ((q, cache, cache), {"share": 1}, "must be bools"),
    ]
    for args, kw, match in bad_inputs:
        with pytest.raises(ValueError, match=match):
            paged_decode_attention(*args, segs, **kw)  # type: ignore[arg-type]
    strided = torch.zeros(bs, nb, 2, 8).transpose(0, 1)  # [NB, BS, ...] whose token dims do not merge
    with pytest.raises(ValueError, match="mergeable"):
        paged_decode_attention(q, strided, strided, segs)


def test_validate_can_be_skipped() -> None:
    segs, batch, nb, bs = _ok()
    q = torch.randn(batch, 2, 4)
    cache = torch.randn(nb, bs, 1, 4)
    a = paged_decode_attention(q, cache, cache, segs, validate=False)
    b = paged_decode_attention(q, cache, cache, segs)
    assert torch.equal(a, b)


# ---------------------------------------------------------------- triton (interpreter on CPU)


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize(("kv_heads", "group", "block_size"), [(2, 1, 16), (2, 3, 16), (1, 4, 1)])
def test_triton_interpreter_matches_reference(
    interpret: None, kv_heads: int, group: int, block_size: int, share: bool
) -> None:
    case = make_case(21, block_size=block_size, kv_heads=kv_heads, group=group, groups=(3, 4), max_len=45)
    check(case, share=share, backend="triton")


def test_triton_interpreter_pieces_and_row_tiles(interpret: None) -> None:
    """Pieces of 7 keys (split-K) and a group whose 40 queries x 2 heads need two 64-row tiles."""
    case = make_case(4, block_size=16, kv_heads=1, group=2, groups=(40, 3), solo=1, max_len=20)
    check(case, share=True, backend="triton_direct", piece_tokens=7)


def test_triton_interpreter_low_precision_and_nan(interpret: None) -> None:
    case = make_case(8, kv_heads=2, group=2, groups=(3,), solo=1, dtype=torch.float16)
    check(case, share=True, backend="triton", tol=2e-2)
    seg = case.segments[0]
    case.v[int(seg.block_ids[0]), seg.start, 1, 3] = torch.nan
    out = paged_decode_attention(case.q, case.k, case.v, case.segments, backend="triton")
    assert torch.isnan(out[seg.seqs]).any()


def test_triton_backend_needs_cuda_or_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = make_case(0)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        paged_decode_attention(case.q, case.k, case.v, case.segments, backend="triton")


def test_triton_missing_raises_import_error(interpret: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_kernel, "_KERNELS", {})
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    monkeypatch.setitem(sys.modules, "triton.language", None)
    case = make_case(0)
    with pytest.raises(TritonUnavailableError, match="pip install triton") as info:
        paged_decode_attention(case.q, case.k, case.v, case.segments, backend="triton")
    assert isinstance(info.value, ImportError)


def test_import_does_not_import_triton() -> None:
    code = (
        "import sys, parrot.engine.kernels.attention; assert 'triton' not in sys.modules, 'triton imported'"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# ---------------------------------------------------------------- benchmark script stays runnable


def test_benchmark_script_runs() -> None:
    cmd = [sys.executable, "benchmarks/attention_decode.py", "--batches", "2", "--prefix", "40"]
    cmd += ["--suffix", "5", "--repeats", "1", "--threads", "1"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert "| 2 | 1 x 2 |" in res.stdout and "speed-up" in res.stdout
