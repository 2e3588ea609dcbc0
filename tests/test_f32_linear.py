"""The fp32 linear kernel (parrot.engine.kernels.f32_linear, csrc/f32_linear.c).

Results are checked against float64 products; shapes cross the kernel's 32-column
panels (and their 16-column halves), its row groups of 12, 8, 4, 2 and 1 and its
256-row chunks.  Both builds are checked on every CPU: the native one (AVX-512
where the CPU has it, else the portable C) and the portable one, which must give
the native one's bits.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest
import torch

from parrot.engine.kernels import f32_linear, native
from parrot.engine.kernels.kernel_set import for_options
from parrot.engine.kernels.options import KernelOptions
from parrot.engine.kernels.packed_linear import PackedLinear


@pytest.fixture(scope="module", params=["native", "portable"])
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    return native.build(portable=request.param == "portable")


def _built(lib: ctypes.CDLL) -> bool:
    return bool(lib.parrot_f32_linear_supported())


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out if bias is None else out + bias.double()


def test_pack_layout_follows_the_documented_panels(lib: ctypes.CDLL) -> None:
    n, k = 40, 7  # two panels of 32 columns; the second holds 8 real ones
    w = torch.arange(n * k, dtype=torch.float32).view(n, k)
    packed = f32_linear.pack(w, lib=lib).data.view(2, k, 32)
    for p, kk, c in [(0, 0, 0), (0, 0, 1), (0, 6, 31), (1, 3, 0), (1, 5, 7)]:
        assert float(packed[p, kk, c]) == float(w[p * 32 + c, kk]), (p, kk, c)
    assert (packed[1, :, 8:] == 0).all()  # padding columns are zero


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 1, 1),
        (3, 17, 5),  # a panel of 17 columns: one full half and one column of the second
        (12, 32, 64),  # one group of 12
        (13, 40, 50),  # 12 + 1
        (23, 96, 33),  # 12 + 8 + 2 + 1
        (31, 960, 576),  # 12 + 12 + 4 + 2 + 1, SmolLM2's q/k/v
        (32, 576, 1536),  # SmolLM2's down projection
        (300, 70, 64),  # two chunks of rows (256 + 44)
    ],
)
def test_matches_float64_reference(lib: ctypes.CDLL, m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    packed = f32_linear.pack(w, lib=lib)
    for b in (bias, None):
        y = f32_linear.linear(x, packed, b, lib=lib)
        assert y.shape == (m, n) and y.dtype == torch.float32
        ref = _reference(x, w, b)
        assert float((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5


def test_rows_are_computed_alike_in_any_batch(lib: ctypes.CDLL) -> None:
    """Each output is one sum over k in order: a row gives the same bits alone, in a
    batch of any size (any row group) and with any thread count."""
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(100, 96, generator=gen), torch.randn(45, 96, generator=gen)
    packed = f32_linear.pack(w, lib=lib)
    full = f32_linear.linear(x, packed, lib=lib)
    for rows in (slice(0, 1), slice(7, 20), slice(30, 45)):
        assert torch.equal(f32_linear.linear(x[rows], packed, lib=lib), full[rows])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(f32_linear.linear(x, packed, lib=lib), full)
    finally:
        torch.set_num_threads(before)


def test_no_rows_give_no_rows(lib: ctypes.CDLL) -> None:
    y = f32_linear.linear(torch.randn(0, 64), f32_linear.pack(torch.randn(32, 64), lib=lib), lib=lib)
    assert y.shape == (0, 32)


def test_nan_stays_in_its_row(lib: ctypes.CDLL) -> None:
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(64, 96, generator=gen), torch.randn(20, 96, generator=gen)
    x[7, 3] = torch.nan
    y = f32_linear.linear(x, f32_linear.pack(w, lib=lib), lib=lib)
    assert torch.isnan(y[7]).all()
    assert torch.isfinite(torch.cat([y[:7], y[8:]])).all()


def test_bad_inputs_are_refused(lib: ctypes.CDLL) -> None:
    w = torch.randn(32, 64)
    packed = f32_linear.pack(w, lib=lib)
    x = torch.randn(4, 64)
    bad = [
        ({"x": x.view(2, 2, 64)}, "2-D fp32"),
        ({"x": x.bfloat16()}, "2-D fp32"),
        ({"x": torch.randn(4, 63)}, "takes 64"),
        ({"weight": replace(packed, data=packed.data[:-1])}, "does not hold"),
        ({"weight": replace(packed, data=packed.data.double())}, "does not hold"),
        ({"weight": replace(packed, out_features=33)}, "does not hold"),
        ({"bias": torch.randn(32).double()}, "bias"),
        ({"bias": torch.randn(31)}, "bias"),
    ]
    for change, match in bad:
        args = {"x": x, "weight": packed, "bias": None, **change}
        with pytest.raises(ValueError, match=match):
            f32_linear.linear(**args, lib=lib)
    for weight in (w.view(-1), torch.zeros(0, 64), torch.ones(3, 4, dtype=torch.int64)):
        with pytest.raises(ValueError, match="pack needs"):
            f32_linear.pack(weight, lib=lib)


def test_the_portable_build_gives_the_native_bits_and_the_engine_keeps_onednn() -> None:
    """The portable C makes the same fused multiply-adds in the same order, so both
    builds agree to the bit; only the AVX-512 build is offered to the engine."""
    portable, fast = native.build(portable=True), native.build()
    assert not _built(portable) and not f32_linear.available(portable)
    gen = torch.Generator().manual_seed(11)
    w, x, bias = torch.randn(70, 96, generator=gen), torch.randn(13, 96, generator=gen), torch.randn(70)
    got = f32_linear.linear(x, f32_linear.pack(w, lib=portable), bias, lib=portable)
    assert torch.equal(got, f32_linear.linear(x, f32_linear.pack(w, lib=fast), bias, lib=fast))


def test_packed_linear_sends_up_to_max_rows_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 PackedLinear: 2-D fp32 calls of at most MAX_ROWS rows go to the kernel,
    larger ones (and other shapes) to oneDNN; all give the fp32 product."""
    gen = torch.Generator().manual_seed(6)
    w, bias = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    layer = PackedLinear(w, bias)
    assert (layer.f32 is not None) == f32_linear.available()
    calls = []
    real = f32_linear.linear
    monkeypatch.setattr(f32_linear, "linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    small = torch.randn(f32_linear.MAX_ROWS, 64, generator=gen)
    large = torch.randn(f32_linear.MAX_ROWS + 1, 64, generator=gen)
    batched = torch.randn(2, 3, 64, generator=gen)
    for x in (small, large, batched):
        y = layer(x)
        ref = _reference(x.reshape(-1, 64), w, bias).view(*x.shape[:-1], 48)
        assert y.shape == ref.shape and float((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    assert calls == ([f32_linear.MAX_ROWS] if layer.f32 is not None else [])


def test_the_f32_linear_option_turns_the_kernel_off() -> None:
    w = torch.randn(32, 64)
    assert (PackedLinear(w).f32 is not None) == f32_linear.available()
    assert PackedLinear(w, kernels=for_options(KernelOptions(f32_linear=False))).f32 is None
