"""Prefill attention in bf16 dot products over the paged bf16 cache
(parrot.engine.kernels.prefill_bf16).

The oracle is float64 causal attention of the bf16-rounded queries over the chunk's
keys, gathered from its blocks.  Every backend that runs here is checked, in both
builds: the native one (AMX tiles where the CPU has them and Linux grants them,
AVX-512 BF16 where the CPU has it, and the portable C) and the portable one.  Chunk
layouts cross the kernel's 16-query blocks, 16- and 32-key steps and 64-column output
groups, with pasts, blocks out of order, block sizes that are not 16 and queries that
are a strided view (as the q/k/v GEMM's output is).  Then the engine: its step
strategy picks the kernel only where it applies, and an engine whose prompt attention
runs on it (either build) computes what PyTorch's flash attention computes, up to
bf16 rounding.
"""

from __future__ import annotations

import ctypes
import math
import random
from dataclasses import replace

import pytest
import torch

from parrot.engine.kernels import native, prefill_bf16
from parrot.engine.kernels.kernel_set import for_options
from parrot.engine.kernels.options import KernelOptions
from parrot.engine.kernels.prefill_bf16 import BACKENDS, ChunkSpec, PrefillPlan
from parrot.engine.loader import LoadedModel
from parrot.engine.model import LlamaModel, ModelConfig
from parrot.engine.runner import EngineRunner, Job
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.tokenizer import TINY_VOCAB_SIZE, TextTokenizer


@pytest.fixture(scope="module", params=["native", "portable"])
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    return native.build(portable=request.param == "portable")


def _backends(lib: ctypes.CDLL, dim: int) -> list[str]:
    """Every backend that runs heads of ``dim`` with ``lib``."""
    best = BACKENDS.index(prefill_bf16.best(dim, lib))
    return list(BACKENDS[: best + 1])


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: ChunkSpec) -> torch.Tensor:
    """[n, H, D] float64: chunk's queries (rounded to bf16) over its keys, causal."""
    bs, kv_heads, dim = k.shape[1], k.shape[2], k.shape[3]
    total = chunk.start + chunk.n
    rows = torch.tensor([b * bs + p for b in chunk.blocks for p in range(bs)][:total])
    keys = k.reshape(-1, kv_heads, dim)[rows].double()
    values = v.reshape(-1, kv_heads, dim)[rows].double()
    qq = q[chunk.row : chunk.row + chunk.n].bfloat16().double()
    group = q.shape[1] // kv_heads
    out = torch.empty(chunk.n, q.shape[1], dim, dtype=torch.float64)
    hidden = torch.arange(total)[None, :] > (chunk.start + torch.arange(chunk.n))[:, None]
    for h in range(q.shape[1]):
        scores = qq[:, h] @ keys[:, h // group].T / math.sqrt(dim)
        out[:, h] = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ values[:, h // group]
    return out


def _case(seed: int, heads: int, kv_heads: int, dim: int, bs: int, shapes: list[tuple[int, int]]):
    """A cache of random bf16 keys and values, chunks (n, start) placed on shuffled
    blocks, and queries as a view with gaps between rows (first row 3, 2 rows after)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = sum(-(-(start + n) // bs) for n, start in shapes)
    k = torch.randn(need + 3, bs, kv_heads, dim, generator=gen).bfloat16()
    v = torch.randn(need + 3, bs, kv_heads, dim, generator=gen).bfloat16()
    free = list(range(need + 3))
    rng.shuffle(free)
    chunks, row = [], 3
    for n, start in shapes:
        blocks = [free.pop() for _ in range(-(-(start + n) // bs))]
        chunks.append(ChunkSpec(row, n, start, blocks))
        row += n
    wide = torch.randn(row + 2, heads * dim + 40, generator=gen)  # rows 40 floats apart
    q = wide[:, : heads * dim].view(row + 2, heads, dim)
    return k, v, chunks, q


CASES = [
    (9, 3, 64, 16, [(1, 0), (17, 0), (5, 40), (100, 0), (33, 300), (16, 15)]),
    (4, 4, 32, 16, [(31, 0), (32, 1), (2, 64)]),
    (8, 2, 128, 16, [(48, 0), (7, 93)]),
    (6, 3, 96, 8, [(50, 0), (9, 31)]),
]


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "bs", "shapes"), CASES)
def test_every_chunk_row_is_causal_attention_over_its_blocks(
    lib: ctypes.CDLL, heads: int, kv_heads: int, dim: int, bs: int, shapes: list[tuple[int, int]]
) -> None:
    k, v, chunks, q = _case(len(shapes), heads, kv_heads, dim, bs, shapes)
    for backend in _backends(lib, dim):
        out = torch.full(q.shape, 7.0)
        PrefillPlan(chunks, bs, lib, backend).attend(q, k, v, out)
        for c in chunks:
            got = out[c.row : c.row + c.n].double()
            # bf16 probabilities weight the values: about 3 significant digits
            assert (got - _reference(q, k, v, c)).abs().max().item() < 2e-2, (backend, c)
        first, end = chunks[0].row, chunks[-1].row + chunks[-1].n
        assert (out[:first] == 7).all() and (out[end:] == 7).all()  # rows of no chunk stay as they were


def test_every_backend_agrees_with_the_portable_build(lib: ctypes.CDLL) -> None:
    k, v, chunks, q = _case(5, 9, 3, 64, 16, [(70, 0), (20, 130)])
    portable = torch.zeros(q.shape)
    PrefillPlan(chunks, 16, native.build(portable=True)).attend(q, k, v, portable)
    for backend in _backends(lib, 64):
        mine = torch.zeros(q.shape)
        PrefillPlan(chunks, 16, lib, backend).attend(q, k, v, mine)
        assert (mine - portable).abs().max().item() < 1e-2, backend


def test_a_backend_that_cannot_run_is_refused_and_writes_nothing() -> None:
    portable = native.build(portable=True)
    k, v, chunks, q = _case(2, 4, 2, 32, 16, [(20, 0)])
    out = torch.zeros(q.shape)
    for backend in ("avx512-bf16", "amx"):
        with pytest.raises(ValueError, match=f"the {backend} backend cannot run heads of 32 here"):
            PrefillPlan(chunks, 16, portable, backend).attend(q, k, v, out)
    k48, v48, chunks48, q48 = _case(2, 4, 2, 48, 16, [(20, 0)])  # the fast backends take multiples of 32
    assert prefill_bf16.best(48, native.build()) == "portable"
    with pytest.raises(ValueError, match="cannot run heads of 48"):
        PrefillPlan(chunks48, 16, native.build(), "avx512-bf16").attend(q48, k48, v48, torch.zeros(q48.shape))
    with pytest.raises(ValueError, match="backend must be one of"):
        PrefillPlan(chunks, 16, portable, "avx2")
    assert (out == 0).all()


def test_the_best_backend_follows_the_cpu() -> None:
    with open("/proc/cpuinfo") as f:
        flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    best = prefill_bf16.best(64, native.build())
    assert (best != "portable") == ("avx512_bf16" in flags)
    assert best != "amx" or "amx_tile" in flags
    assert prefill_bf16.best(64, native.build(portable=True)) == "portable"


def test_bad_plans_and_operands_are_refused_before_the_kernel_runs(lib: ctypes.CDLL) -> None:
    k, v, chunks, q = _case(1, 4, 2, 32, 16, [(20, 0)])
    out = torch.zeros(q.shape)
    with pytest.raises(ValueError, match="at least one chunk"):
        PrefillPlan([], 16, lib)
    with pytest.raises(ValueError, match="too few blocks"):
        PrefillPlan([ChunkSpec(0, 20, 0, [0])], 16, lib)
    with pytest.raises(ValueError, match="bad chunk"):
        PrefillPlan([ChunkSpec(0, 0, 0, [0])], 16, lib)
    with pytest.raises(ValueError, match="negative"):
        PrefillPlan([ChunkSpec(0, 4, 0, [-1])], 16, lib)
    plan = PrefillPlan(chunks, 16, lib)
    with pytest.raises(ValueError, match="bf16 cache"):
        plan.attend(q, k.float(), v.float(), out)
    with pytest.raises(ValueError, match="fp32 queries"):
        plan.attend(q.bfloat16(), k, v, out)
    with pytest.raises(ValueError, match="outside the cache"):
        PrefillPlan([ChunkSpec(3, 20, 0, [0, k.shape[0]])], 16, lib).attend(q, k, v, out)
    with pytest.raises(ValueError, match="layout does not match"):
        PrefillPlan([replace(chunks[0], blocks=[*chunks[0].blocks] * 2)], 8, lib).attend(q, k, v, out)
    with pytest.raises(ValueError, match="contiguous heads"):
        plan.attend(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, out)
    with pytest.raises(ValueError, match="T >="):
        plan.attend(q[:10], k, v, out[:10])
    assert (out == 0).all()  # nothing was written


# ---------------------------------------------------------------- the engine

CONFIG = ModelConfig(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    max_seq_len=2048,
)


def _loaded() -> LoadedModel:
    return LoadedModel("t64", CONFIG, LlamaModel.random_init(CONFIG, 3), TextTokenizer.byte_level_tiny())


def _runner(**kwargs: object) -> EngineRunner:
    return EngineRunner(_loaded(), kv_cache_tokens=512, latency_probe=False, **kwargs)


def test_the_strategy_takes_the_kernel_only_for_a_bf16_cache_with_it_allowed() -> None:
    here = for_options().bf16_prefill
    assert here == {"portable": None}.get(prefill_bf16.best(64), prefill_bf16.best(64))
    bf16 = _runner(kv_dtype=torch.bfloat16)
    assert (bf16.step_forward.prefill_lib is not None) == (here is not None)
    assert bf16.step_forward.prefill_backend == here
    assert _runner().step_forward.prefill_lib is None  # an fp32 cache
    off = _runner(kv_dtype=torch.bfloat16, kernels=KernelOptions(bf16_prefill=False))
    assert off.step_forward.prefill_lib is None
    no_tiles = _runner(kv_dtype=torch.bfloat16, kernels=KernelOptions(amx=False))
    assert no_tiles.step_forward.prefill_backend == (None if here is None else "avx512-bf16")
    tiny = replace(CONFIG, head_dim=48, hidden_size=96)  # not a multiple of 32
    model = LoadedModel("t48", tiny, LlamaModel.random_init(tiny, 0), TextTokenizer.byte_level_tiny())
    r48 = EngineRunner(model, kv_dtype=torch.bfloat16, kv_cache_tokens=512, latency_probe=False)
    assert r48.step_forward.prefill_lib is None


def _first_logits(prefill_lib: ctypes.CDLL | None) -> tuple[torch.Tensor, list[list[int]]]:
    """Logits of every generate's first token and the greedy tokens, for prompts
    filled in 32-token steps (several chunks a step, chunks with a past), two forked
    from one parent (chunks over blocks they share), with prompt attention on
    ``prefill_lib``'s kernel or (None) PyTorch's."""
    runner = EngineRunner(
        _loaded(), kv_dtype=torch.bfloat16, kv_cache_tokens=2048, max_step_tokens=32, latency_probe=False
    )
    runner.step_forward = replace(runner.step_forward, prefill_lib=prefill_lib, prefill_backend=None)
    rng = random.Random(0)
    firsts: list[torch.Tensor] = []
    real = runner._sample

    def spy(jobs: list[Job], logits: torch.Tensor) -> None:
        for job, row in zip(jobs, logits, strict=True):
            if job.generated == 0:
                firsts.append(row.clone())
        real(jobs, logits)

    runner._sample = spy  # type: ignore[method-assign]
    outs: dict[int, list[int]] = {}
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def on_chunk(ctx: int):
        return lambda chunk: outs.setdefault(ctx, []).extend(chunk.token_ids)

    def drain() -> None:
        while runner.has_work():
            runner._step()

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(n)]

    runner._enqueue(Job(1, None, tokens(70)))
    drain()
    prompts = [(10, None, 9), (11, None, 11), (12, None, 7), (13, 1, 45), (14, None, 100), (15, 1, 3)]
    for ctx, parent, n in prompts:  # fills: fresh ones share steps, forks have a past
        runner._enqueue(Job(ctx, parent, tokens(n)))
    drain()
    for ctx, _, _ in prompts:
        runner._enqueue(Job(ctx, None, sampling=greedy, on_chunk=on_chunk(ctx)))
    drain()
    return torch.stack(firsts), [outs[c] for c in sorted(outs)]


def test_an_engine_on_the_kernel_computes_what_pytorch_flash_attention_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reference, _ = _first_logits(None)
    calls: list[int] = []
    real = PrefillPlan.attend

    def counted(self: PrefillPlan, *args: torch.Tensor) -> None:
        calls.append(self.chunks)
        real(self, *args)

    monkeypatch.setattr(PrefillPlan, "attend", counted)
    for portable in (False, True):
        lib = native.build(portable=portable)
        calls.clear()
        logits, _tokens = _first_logits(lib)
        assert len(calls) >= CONFIG.num_layers and max(calls) >= 2  # steps of several chunks ran on it
        assert logits.shape == reference.shape
        assert (logits - reference).abs().max().item() < 0.01 * reference.abs().max().item()
        # a different greedy pick only at a near tie of the reference's logits
        picked = reference.gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
        assert (reference.max(-1).values - picked).max().item() < 0.01 * reference.abs().max().item()


def _fork_prefill_paths(
    question_tokens: int,
    monkeypatch: pytest.MonkeyPatch,
    *,
    kernel: bool = True,
    kv_dtype: torch.dtype = torch.bfloat16,
) -> tuple[int, int]:
    """(layers that attended on the kernel, layers that took the shared prefill) while four
    forks of one 64-token parent prefill ``question_tokens`` each, in one step: with
    ``kernel`` on the native build's prompt kernel (its fastest backend), else without it
    (PyTorch's per-chunk path)."""
    from parrot.engine.prefill_sharing import SharedPrefill

    runner = EngineRunner(
        _loaded(), kv_dtype=kv_dtype, kv_cache_tokens=2048, max_step_tokens=1024, latency_probe=False
    )
    runner.step_forward = replace(
        runner.step_forward, prefill_lib=native.build() if kernel else None, prefill_backend=None
    )
    rng = random.Random(1)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(n)]

    def drain() -> None:
        while runner.has_work():
            runner._step()

    runner._enqueue(Job(1, None, tokens(64)))
    drain()
    counts = {"kernel": 0, "shared": 0}
    kernel, shared = PrefillPlan.attend, SharedPrefill.attend

    def on_kernel(self: PrefillPlan, *args: torch.Tensor) -> None:
        counts["kernel"] += 1
        kernel(self, *args)

    def on_shared(self: SharedPrefill, *args: torch.Tensor) -> torch.Tensor:
        counts["shared"] += 1
        return shared(self, *args)

    monkeypatch.setattr(PrefillPlan, "attend", on_kernel)
    monkeypatch.setattr(SharedPrefill, "attend", on_shared)
    for ctx in range(10, 14):
        runner._enqueue(Job(ctx, 1, tokens(question_tokens)))
    drain()
    monkeypatch.undo()
    return counts["kernel"], counts["shared"]


def test_forks_with_long_prompts_attend_on_the_kernel_and_short_ones_share_their_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from parrot.engine.paged import KERNEL_SHARING_BREAK_EVEN_ROWS

    long_rows = int(KERNEL_SHARING_BREAK_EVEN_ROWS) + 8  # 40 rows a chunk: past the break-even
    short_rows = int(KERNEL_SHARING_BREAK_EVEN_ROWS) // 4  # 8: under it
    assert _fork_prefill_paths(long_rows, monkeypatch) == (CONFIG.num_layers, 0)
    assert _fork_prefill_paths(short_rows, monkeypatch) == (0, CONFIG.num_layers)


def test_without_the_kernel_a_bf16_cache_shares_only_a_prefix_long_against_the_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from parrot.engine.paged import BF16_SHARING_BREAK_EVEN_KEYS_PER_ROW

    # the parent's 64 tokens are four whole shared blocks; a chunk of q rows reads 64 / q per row
    long_rows = int(64 / BF16_SHARING_BREAK_EVEN_KEYS_PER_ROW) + 8  # 33 rows: 1.9 keys a row
    short_rows = 8  # 8 keys a row
    assert 64 / long_rows < BF16_SHARING_BREAK_EVEN_KEYS_PER_ROW <= 64 / short_rows
    assert _fork_prefill_paths(long_rows, monkeypatch, kernel=False) == (0, 0)
    assert _fork_prefill_paths(short_rows, monkeypatch, kernel=False) == (0, CONFIG.num_layers)
    # an fp32 cache keeps the shared plan first: there it costs no more than chunk by chunk
    fp32 = _fork_prefill_paths(long_rows, monkeypatch, kernel=False, kv_dtype=torch.float32)
    assert fp32 == (0, CONFIG.num_layers)
