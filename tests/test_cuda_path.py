"""The CUDA engine's code paths, checked on the CPU (CI has no GPU).

What the CUDA engine runs that is not CPU-specific runs here on CPU tensors:
the plain forward without packing or C kernels, prefill attention through
``scaled_dot_product_attention`` (:func:`sdpa_prefill_attention`), decode
attention through the Triton kernel and its per-step plan (Triton's
interpreter, ``TRITON_INTERPRET=1``, set by conftest), the model in a 16-bit
dtype, the device options and their errors.  Greedy tokens of the default CPU
engine are the oracle.  The GPU itself is checked by tests/test_gpu.py.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import subprocess
import sys

import pytest
import torch

from parrot import cli
from parrot.engine import prefill_attention as pa
from parrot.engine.config import EngineConfig
from parrot.engine.device import CUDA_KERNELS, place_model, placement, resolve_device
from parrot.engine.kernels.attention import paged_decode_attention, reference_decode_attention
from parrot.engine.kernels.attention import triton_kernel as tk
from parrot.engine.kv_store import causal_mask, grouped_attention
from parrot.engine.latency_probe import step_seconds
from parrot.engine.loader import load_model
from parrot.engine.local import LocalEngine
from parrot.engine.model import ContiguousKVAttention, ContiguousKVCache
from parrot.engine.runner import EngineRunner
from parrot.protocol.sampling import SamplingParams
from tests.test_attention import make_case, rel_err

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
_ids = itertools.count(70_000)


def _prompts(vocab: int) -> list[list[int]]:
    """A long prompt, a fork sharing its first 40 tokens and a short one."""
    base = [(7 * i + 3) % vocab for i in range(40)]
    return [[*base, 5, 6, 7, 8], [*base, 9, 10], [(11 * i + 1) % vocab for i in range(9)]]


async def _greedy(engine: LocalEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Fill every prompt (the second forks from the first's context: a chunk with a past
    and shared decode blocks), then generate all at once."""
    ids = [next(_ids) for _ in prompts]
    await engine.fill(prompts[0], ids[0])
    await engine.fill(prompts[1][len(prompts[0]) - 4 :], ids[1], ids[0])
    await engine.fill(prompts[2], ids[2])

    async def gen(ctx: int) -> list[int]:
        out: list[int] = []
        async for chunk in engine.generate(GREEDY, ctx):
            out.extend(chunk.token_ids)
        return out

    outs = await asyncio.gather(*(gen(c) for c in ids))
    for c in ids:
        await engine.free_context(c)
    return list(outs)


def _run(prompts: list[list[int]], **options: object) -> tuple[list[list[int]], str]:
    """Greedy outputs of a fresh tiny engine (its own model: nothing packed before) and
    the step strategy its stats show."""
    engine = LocalEngine(load_model("tiny"), max_step_tokens=32, latency_cap=4096, **options)
    try:
        outs = asyncio.run(_greedy(engine, prompts))
        return outs, asyncio.run(engine.stats()).decode_path
    finally:
        engine.close()


# The CUDA engine's configuration, on the CPU: no packing, no C kernels.
CUDA_LIKE = {"prepack": False, "kernels": CUDA_KERNELS}


def answer_like_cuda(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the CPU-only prefill paths report themselves unavailable, as they do for
    CUDA tensors, so every prefill chunk takes :func:`sdpa_prefill_attention`; returns
    the list the ``start`` of every call it serves is appended to."""
    monkeypatch.setattr(pa, "_flash_op", lambda: None)  # no CPU flash: no two-call merge, no sharing
    starts: list[int] = []
    real = pa.sdpa_prefill_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        starts.append(start)
        return real(q, k, v, start)

    monkeypatch.setattr(pa, "sdpa_prefill_attention", spy)
    return starts


# ------------------------------------------------------------------ (a) the engine


def test_the_device_agnostic_path_generates_what_the_default_cpu_engine_does(monkeypatch):
    prompts = _prompts(load_model("tiny").config.vocab_size)
    default, default_path = _run(prompts)
    assert default_path != "pytorch"  # the CPU's own fast path is the oracle
    starts = answer_like_cuda(monkeypatch)
    plain, path = _run(prompts, decode_attention="torch", **CUDA_LIKE)
    assert plain == default
    assert path == "pytorch"
    assert 0 in starts and any(s > 0 for s in starts)  # SDPA ran chunks with and without a past


# ------------------------------------------------------------------ (c) Triton through the strategy


def test_the_triton_strategy_generates_what_the_default_cpu_engine_does(monkeypatch):
    assert tk.interpret_requested()  # conftest: Triton's CPU interpreter
    prompts = _prompts(load_model("tiny").config.vocab_size)
    default, _ = _run(prompts)
    answer_like_cuda(monkeypatch)
    plans: list[tk.TritonDecodePlan] = []
    real = tk.triton_paged_decode_attention

    def spy(q, k, v, segments, **kw):
        assert isinstance(segments, tk.TritonDecodePlan)  # planned once per step, not per layer
        plans.append(segments)
        return real(q, k, v, segments, **kw)

    monkeypatch.setattr("parrot.engine.kernels.attention.api.triton_paged_decode_attention", spy)
    got, path = _run(prompts, decode_attention="triton", **CUDA_LIKE)
    assert got == default
    assert path == "pytorch/triton"
    layers = load_model("tiny").config.num_layers
    assert len(plans) >= layers * (GREEDY.max_tokens - 1)  # a decode step per token after the first
    assert len({id(p) for p in plans}) * layers == len(plans)  # every plan served each layer once
    assert max(p.plan.m[0] for p in plans) >= 2  # the fork's shared blocks were read once for both


def test_triton_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="decode_attention='triton' needs a CUDA device"):
        EngineRunner(load_model("tiny"), decode_attention="triton", latency_cap=64, **CUDA_LIKE)
    with pytest.raises(ValueError, match="decode_attention must be one of auto, torch, triton"):
        EngineConfig(decode_attention="flash")


def test_a_triton_plan_is_checked_against_the_batch_it_serves():
    case = make_case(3, kv_heads=2, group=2, block_size=8, groups=(3,), solo=1)
    batch = case.q.shape[0]
    plan = tk.plan_triton_decode(
        case.segments, batch=batch, block_size=8, group=2, share=True, device=case.q.device
    )
    ref = reference_decode_attention(case.q, case.k, case.v, case.segments)
    out = paged_decode_attention(case.q, case.k, case.v, plan, backend="triton")
    assert rel_err(out, ref) < 1e-5
    with pytest.raises(ValueError, match="Triton decode plan is for batch"):
        paged_decode_attention(case.q[:-1], case.k, case.v, plan, backend="triton")
    with pytest.raises(ValueError, match="a Triton decode plan needs the triton backend"):
        paged_decode_attention(case.q, case.k, case.v, plan, backend="torch")


# ------------------------------------------------------------------ (b) SDPA prefill


@pytest.mark.parametrize("start", [0, 1, 13, 40])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (3, 1)])
def test_sdpa_prefill_equals_the_float64_oracle_and_the_cpu_prefill(start, heads, kv_heads):
    gen = torch.Generator().manual_seed(start * 10 + heads)
    n, dim = 7, 16
    q = torch.randn(n, heads, dim, generator=gen)
    k = torch.randn(start + n, kv_heads, dim, generator=gen)
    v = torch.randn(start + n, kv_heads, dim, generator=gen)
    oracle = grouped_attention(q.double(), k.double(), v.double(), causal_mask(start, n, "cpu"))
    got = pa.sdpa_prefill_attention(q, k, v, start)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert rel_err(got, oracle) < 1e-5
    assert rel_err(pa.prefill_attention(q, k, v, start), got) < 1e-5  # the CPU's two-call merge
    half = pa.sdpa_prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), start)
    assert half.dtype == torch.bfloat16 and rel_err(half, oracle) < 3e-2


def test_sdpa_prefill_checks_its_keys():
    q, k = torch.zeros(3, 2, 8), torch.zeros(5, 2, 8)
    with pytest.raises(ValueError, match="keys must cover positions"):
        pa.sdpa_prefill_attention(q, k, k, 1)


# ------------------------------------------------------------------ the model in 16 bits


def test_a_bf16_copy_of_the_model_computes_in_bf16_close_to_fp32():
    loaded = load_model("tiny")
    model = loaded.model
    placed = place_model(model, "cpu", torch.bfloat16)
    assert placed is not model and model.model.embed_tokens.weight.dtype == torch.float32  # original kept
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in placed.parameters())
    assert place_model(model, "cpu", torch.float32) is model
    ids = torch.tensor([(5 * i + 2) % loaded.config.vocab_size for i in range(12)])
    pos = torch.arange(12)
    logits = []
    for m in (model, placed):
        attn = ContiguousKVAttention(ContiguousKVCache(loaded.config.num_layers), ["s"], [12])
        hidden = m(ids, pos, attn)
        assert hidden.dtype == m.model.embed_tokens.weight.dtype  # no fp32 promotion inside
        logits.append(m.compute_logits(hidden))
    assert rel_err(logits[1], logits[0]) < 5e-2


# ------------------------------------------------------------------ (d) the device options


def test_auto_picks_the_cpu_here_and_cuda_is_refused_with_its_reason():
    assert not torch.cuda.is_available()  # this test describes a machine without CUDA
    assert resolve_device("auto") == "cpu"
    runner = EngineRunner(load_model("tiny"), device="auto", latency_cap=64)
    assert runner.placement.device == "cpu" and runner.cache.device == "cpu"
    assert runner.stats().decode_path != "cuda/triton"
    with pytest.raises(ValueError, match=r"--device cuda: no CUDA device is available"):
        EngineRunner(load_model("tiny"), device="cuda")
    with pytest.raises(ValueError, match="device must be one of cpu, cuda, auto"):
        EngineConfig(device="gpu")
    with pytest.raises(ValueError, match="needs --device cuda"):
        EngineRunner(load_model("tiny"), dtype=torch.float16)


def test_cuda_only_options_are_checked_before_anything_is_placed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # only the option checks run
    place = placement(EngineConfig(device="cuda", dtype=torch.float16))
    assert (place.device, place.dtype, place.prepack, place.kernels) == (
        "cuda",
        torch.float16,
        False,
        CUDA_KERNELS,
    )
    assert placement(EngineConfig(device="auto")).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="weight_dtype packs CPU projections"):
        placement(EngineConfig(device="cuda", weight_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="KV cache is in the model's dtype"):
        placement(EngineConfig(device="cuda", kv_dtype=torch.float32))


@pytest.mark.parametrize("command", ["serve", "engine"])
def test_the_cli_refuses_device_cuda_without_cuda(command):
    args = [sys.executable, "-m", "parrot.cli", command, "--model", "tiny", "--device", "cuda", "--port", "0"]
    if command == "engine":
        args += ["--manager", "http://127.0.0.1:9", "--cluster-secret", "s" * 32]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, env=os.environ)
    assert done.returncode == 1
    assert f"parrot {command}: --device cuda: no CUDA device is available" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_cli_builds_a_cpu_engine_for_device_auto_here():
    args = cli._parser().parse_args(
        ["engine", "--manager", "http://x", "--model", "tiny", "--device", "auto"]
    )
    assert (args.device, args.dtype) == ("auto", None)
    engine = cli._load_engine(args)
    try:
        assert engine.runner.placement.device == "cpu"
        assert engine.runner.config.device == "auto"
        assert not asyncio.run(engine.stats()).decode_path.startswith("cuda")
    finally:
        engine.close()


# ------------------------------------------------------------------ timing


def test_step_timing_synchronises_a_cuda_device_and_only_it(monkeypatch):
    synced: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    assert step_seconds(0.0, "cpu") > 0 and synced == []
    assert step_seconds(0.0, "cuda:0") > 0 and synced == ["cuda:0"]
    assert math.isfinite(step_seconds(0.0, "cuda"))
