"""The fused decoder-layer ops in C (parrot.engine.kernels.fused) against their PyTorch chains,
and a model forward with them against the plain forward."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from parrot.engine.kernels import fused, native
from parrot.engine.model import LlamaModel, ModelConfig, apply_rope, random_init, rope_cos_sin, rope_inv_freq
from parrot.protocol.tokenizer import TINY_VOCAB_SIZE
from tests.cpu_features import bf16_weights


@pytest.fixture(autouse=True, params=["native", "portable"])
def _built(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test on both builds of the C ops: the native one (AVX-512 where the CPU
    has it) and the portable C, selected as an engine with ``cpu_kernel`` does."""
    with native.using(request.param):
        assert native.library() is not None, native.status()
        yield


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_add_then_the_norm(
    delta_dtype: torch.dtype | None, out_dtype: torch.dtype
) -> None:
    h = torch.randn(7, 96, generator=_gen(1)) * 3
    w = torch.rand(96, generator=_gen(2)) + 0.5
    delta = None if delta_dtype is None else torch.randn(7, 96, generator=_gen(3)).to(delta_dtype)
    want_h = h if delta is None else h + delta.float()
    want = F.rms_norm(want_h, (96,), w, 1e-5).to(out_dtype)
    got = fused.add_rms_norm(h, delta, w, 1e-5, out_dtype)
    assert torch.equal(h, want_h)  # the residual stream was updated in place, exactly
    assert got.dtype == out_dtype and got.shape == (7, 96)
    tol = 1e-6 if out_dtype == torch.float32 else 8e-3  # bf16: one rounding of the same value
    assert rel_err(got, want) < tol


def test_add_rms_norm_keeps_a_nan_in_its_row() -> None:
    h = torch.randn(3, 32, generator=_gen(4))
    h[1, 5] = torch.nan
    out = fused.add_rms_norm(h, None, torch.ones(32), 1e-6)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()


def test_rope_rotates_only_the_first_heads_in_place() -> None:
    t, heads, dim, width = 5, 3, 16, 5 * 16
    x = torch.randn(t, width, generator=_gen(5))
    before = x.clone()
    cfg = ModelConfig.tiny()
    inv = rope_inv_freq(ModelConfig(**{**cfg.__dict__, "head_dim": dim}))
    cos, sin = rope_cos_sin(inv, torch.tensor([0, 1, 7, 100, 2047]))
    fused.rope_(x, heads, cos, sin)
    want = apply_rope(before[:, : heads * dim].view(t, heads, dim), cos, sin).reshape(t, heads * dim)
    assert rel_err(x[:, : heads * dim], want) < 1e-6
    assert torch.equal(x[:, heads * dim :], before[:, heads * dim :])  # other heads untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "inter"), [(1, 16), (3, 40), (5, 1536), (2, 7)]
)  # vector body, tails, scalar only
def test_silu_mul_is_silu_of_gate_times_up(dtype: torch.dtype, rows: int, inter: int) -> None:
    gu = (torch.randn(rows, 2 * inter, generator=_gen(rows + inter)) * 4).to(dtype)
    gu[0, 0], gu[0, 1] = 100.0, -100.0  # sigmoid's saturated ends
    want = F.silu(gu[:, :inter].double()) * gu[:, inter:].double()
    got = fused.silu_mul(gu)
    assert got.shape == (rows, inter) and got.dtype == dtype
    assert rel_err(got, want) < (1e-6 if dtype == torch.float32 else 4e-3)  # bf16: one rounding of the result


def test_silu_mul_keeps_a_nan_in_its_element() -> None:
    gu = torch.randn(3, 64, generator=_gen(9))
    gu[1, 5] = torch.nan  # gate element 5 of row 1
    gu[2, 32 + 20] = torch.nan  # up element 20 of row 2
    got = fused.silu_mul(gu)
    nan = torch.zeros(3, 32, dtype=torch.bool)
    nan[1, 5] = nan[2, 20] = True
    assert torch.equal(got.isnan(), nan)


def test_bad_inputs_are_refused_before_the_c_side_runs() -> None:
    h, w = torch.randn(2, 8), torch.ones(8)
    kept = h.clone()
    cases = [
        (lambda: fused.add_rms_norm(h.t().contiguous().t(), None, w, 1e-5), "contiguous"),
        (lambda: fused.add_rms_norm(h, None, torch.ones(9), 1e-5), r"weight must be \[8\]"),
        (lambda: fused.add_rms_norm(h, torch.ones(2, 9), w, 1e-5), "delta must be"),
        (lambda: fused.add_rms_norm(h, None, w, 1e-5, torch.float64), "fp32 or bf16"),
        (lambda: fused.rope_(h, 2, torch.ones(2, 8), torch.ones(2, 8)), "do not fit"),
        (lambda: fused.rope_(h, 1, torch.ones(3, 8), torch.ones(3, 8)), "one row per cos row"),
        (lambda: fused.silu_mul(torch.ones(2, 7)), r"\[T, 2I\]"),
        (lambda: fused.silu_mul(torch.ones(2, 8).double()), "fp32/bf16"),
        (lambda: fused.silu_mul(torch.ones(8, 2).t()), "contiguous"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
        assert torch.equal(h, kept)


class _Causal:
    """Plain causal attention over the tokens of one call (no cache)."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t, h, d = q.shape
        group = h // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), -math.inf)
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("weight_dtype", [None, bf16_weights()])
def test_a_packed_model_forward_with_fused_ops_equals_the_plain_one(
    weight_dtype: torch.dtype | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model: LlamaModel = random_init(ModelConfig.tiny(), seed=3)
    assert model.prepack(weight_dtype)
    ids = torch.randint(0, TINY_VOCAB_SIZE, (37,), generator=_gen(7))
    with torch.inference_mode():
        used = []
        real = model._forward_fused
        monkeypatch.setattr(model, "_forward_fused", lambda *a: used.append(1) or real(*a))
        got = model(ids, torch.arange(37), _Causal())
        assert used  # the fused path ran
        with native.using("off"):
            want = model(ids, torch.arange(37), _Causal())
        assert len(used) == 1  # and not with the C ops switched off
    assert rel_err(got, want) < (1e-5 if weight_dtype is None else 2e-2)


def test_fused_ops_apply_only_where_the_c_side_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fused.applies(torch.randn(3, 8))
    assert not fused.applies(torch.randn(3, 8, requires_grad=True))  # autograd keeps PyTorch
    assert not fused.applies(torch.randn(3, 8).double())
    assert not fused.applies(torch.randn(8, 3).t())
    with native.using("off"):
        assert not fused.applies(torch.randn(3, 8))
