"""A decode step's layers in one C call (parrot.engine.kernels.decode_forward).

The oracle is the Python path itself: the same engine workload run with the C
forward on and off must give bit-identical logits at every step, because the C
side makes the same kernel calls in the same order.  The model has head dim 64,
so the shared-prefix kernel takes the shared rows where the CPU has AVX-512.
"""

from __future__ import annotations

import random

import pytest
import torch

from parrot.engine import step_forward
from parrot.engine.core.step_planner import SeqSlice
from parrot.engine.kernels import bf16_linear, decode_forward, f32_linear, native
from parrot.engine.kernels.attention import cpu_kernel
from parrot.engine.kernels.kernel_set import for_options
from parrot.engine.kernels.options import KernelOptions
from parrot.engine.loader import LoadedModel
from parrot.engine.model import LlamaModel, ModelConfig
from parrot.engine.paged import PagedStepAttention
from parrot.engine.runner import EngineRunner, Job
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.tokenizer import TINY_VOCAB_SIZE, TextTokenizer
from tests.cpu_features import bf16_weights

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
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _loaded(seed: int = 0) -> LoadedModel:
    return LoadedModel("t64", CONFIG, LlamaModel.random_init(CONFIG, seed), TextTokenizer.byte_level_tiny())


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(n)]


def _workload(runner: EngineRunner, seed: int) -> None:
    """Two prefix groups, one nested, and a sequence sharing nothing, generating together."""
    rng = random.Random(seed)

    def drain() -> None:
        while runner.has_work():
            runner._step()

    runner._enqueue(Job(1, None, _tokens(rng, 70)))
    runner._enqueue(Job(2, None, _tokens(rng, 40)))
    drain()
    runner._enqueue(Job(3, 1, _tokens(rng, 33)))
    drain()
    for i, parent in enumerate([1, 1, 3, 3, 2, 2, None]):
        runner._enqueue(Job(10 + i, parent, _tokens(rng, 3 + i), sampling=GREEDY))
    drain()


def _spy_run(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each step's call of decode_forward.run took the C forward."""
    took: list[bool] = []
    real = decode_forward.run

    def spy(*args):
        out = real(*args)
        took.append(out is not None)
        return out

    monkeypatch.setattr(decode_forward, "run", spy)
    return took


def _logits_per_step(
    monkeypatch: pytest.MonkeyPatch, loaded: LoadedModel, c_forward: bool, seed: int = 1, **runner_options
):
    runner = EngineRunner(
        loaded, kv_cache_tokens=4096, kernels=KernelOptions(c_forward=c_forward), **runner_options
    )
    got: list[torch.Tensor] = []
    real_logits = loaded.model.compute_logits
    monkeypatch.setattr(loaded.model, "compute_logits", lambda h: got.append(real_logits(h)) or got[-1])
    took = _spy_run(monkeypatch)
    _workload(runner, seed)
    monkeypatch.undo()
    return got, took, runner.step_forward.name


def test_the_c_forward_gives_the_python_paths_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = _loaded()
    shared_rows: list[int] = []
    real_attention = decode_forward._attention

    def attention(plan, batch):
        shared_rows.append(len(plan.shared))
        return real_attention(plan, batch)

    monkeypatch.setattr(decode_forward, "_attention", attention)
    on, took, path = _logits_per_step(monkeypatch, loaded, True)
    off, took_off, path_off = _logits_per_step(monkeypatch, loaded, False)
    assert len(on) == len(off) > 20
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))
    assert not any(took_off) and not path_off.startswith("c-forward/")
    # the engine chose the C forward where its projection kernel is built ...
    assert path.startswith("c-forward/") == (f32_linear.available() and native.library() is not None)
    # ... and every decode step took it where its attention kernels are built too; prefill never
    built = f32_linear.available() and cpu_kernel.shared_built(CONFIG.head_dim)
    assert sum(took) >= (19 if built else 0) and (any(took) == built)
    assert not path.startswith("c-forward/") or len(took) - sum(took) >= 3  # three prefill steps in Python
    # the C forward's steps had the batch's shared rows: A's root, its nested fork, B
    assert not built or max(shared_rows) == 3


def test_it_declines_steps_it_does_not_cover(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = _loaded(2)
    runner = EngineRunner(loaded, kv_cache_tokens=1024)
    rng = random.Random(3)
    runner._enqueue(Job(1, None, _tokens(rng, 20)))
    while runner.has_work():
        runner._step()
    ctx = runner.contexts.get(1)
    ctx.own_tokens.append(5)  # one pending decode token, as a generate leaves it
    runner.contexts.reserve(ctx, 1)
    slots = runner.contexts.slots(ctx, ctx.computed_len, 1)
    ids, pos = torch.tensor([5]), torch.tensor([ctx.computed_len])

    def step(**kw) -> PagedStepAttention:
        return PagedStepAttention(runner.cache, [SeqSlice(ctx, ctx.computed_len, 1)], slots, **kw)

    with torch.inference_mode():
        if not (f32_linear.available() and native.library() is not None):
            assert decode_forward.run(loaded.model, ids, pos, step(), runner.cache) is None
            pytest.skip("no AVX-512 fp32 kernel here: the C forward declines every step (checked)")
        assert decode_forward.run(loaded.model, ids, pos, step(), runner.cache) is not None
        assert step_forward.choose(loaded.model, runner.cache).c_forward
        assert not step_forward.choose(
            loaded.model, runner.cache, for_options(KernelOptions(c_forward=False))
        ).c_forward
        chunk = PagedStepAttention(runner.cache, [SeqSlice(ctx, 0, ctx.computed_len + 1)], list(range(21)))
        every = torch.arange(21)
        assert decode_forward.run(loaded.model, every, every, chunk, runner.cache) is None
        with pytest.raises(ValueError, match="token id out of range"):
            decode_forward.run(loaded.model, torch.tensor([TINY_VOCAB_SIZE]), pos, step(), runner.cache)
        # re-packed as bf16: the bf16 kernel's copies where it runs (AMX or AVX-512 BF16), else none
        assert loaded.model.prepack(torch.bfloat16)
        bf16 = decode_forward.run(loaded.model, ids, pos, step(), runner.cache)
        assert (bf16 is not None) == (bf16_linear.best() != "portable")
        assert loaded.model.prepack(torch.float32)  # back: a new layer table is built
        assert decode_forward.run(loaded.model, ids, pos, step(), runner.cache) is not None


@pytest.mark.parametrize(
    ("weight_dtype", "kv_dtype"),
    [(None, torch.bfloat16), bf16_weights(None), bf16_weights(torch.bfloat16)],
)
def test_bf16_weights_and_caches_give_the_python_paths_bits(
    monkeypatch: pytest.MonkeyPatch, weight_dtype: torch.dtype | None, kv_dtype: torch.dtype | None
) -> None:
    """bf16 weights run on the bf16 kernel's best backend here (the MLP in bf16 from its
    norm to the residual add), a bf16 cache gets its new rows rounded to nearest even:
    as in Python."""
    loaded = _loaded(4)
    options = {"weight_dtype": weight_dtype, "kv_dtype": kv_dtype}
    on, took, path = _logits_per_step(monkeypatch, loaded, True, 5, **options)
    off, _, _ = _logits_per_step(monkeypatch, loaded, False, 5, **options)
    assert len(on) == len(off) > 20
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))
    best = bf16_linear.best()
    kernels = best != "portable" if weight_dtype == torch.bfloat16 else f32_linear.available()
    assert any(took) == (kernels and cpu_kernel.shared_built(CONFIG.head_dim))
    expected = {"amx": "c-forward/amx-bf16", "avx512-bf16": "c-forward/avx512-bf16"}.get(best)
    if weight_dtype != torch.bfloat16:
        expected = "c-forward/f32"
    assert (path == expected) == (kernels and native.library() is not None)
