"""The bf16 linear kernel (parrot.engine.kernels.bf16_linear, csrc/bf16_linear.c).

Results are checked against float64 products of the bf16-rounded operands; shapes
cross the AMX backend's 16-row tiles, 32-row groups and 256-row chunks, the AVX-512
BF16 backend's 12/8/4/2/1-row groups, and the 32-column / 32-deep weight blocks.
Every backend that runs here is checked, in both builds: the native one (AMX tiles
where the CPU has them and Linux grants them, AVX-512 BF16 where the CPU has it,
and the portable C) and the portable one (portable C only).
"""

from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest
import torch

from parrot.engine.kernels import bf16_linear, native
from parrot.engine.kernels.kernel_set import for_options
from parrot.engine.kernels.options import KernelOptions
from parrot.engine.kernels.packed_linear import PackedLinear
from tests.cpu_features import needs_bf16_packing


@pytest.fixture(scope="module", params=["native", "portable"])
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    return native.build(portable=request.param == "portable")


def _backends(lib: ctypes.CDLL) -> list[str]:
    """Every backend that runs with ``lib``."""
    return [b for b in bf16_linear.BACKENDS if bf16_linear.runs(b, lib)]


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.bfloat16().double() @ w.bfloat16().double().T
    return out if bias is None else out + bias.double()


def test_pack_layout_follows_the_documented_blocks(lib: ctypes.CDLL) -> None:
    n, k = 40, 50  # padded to 64 x 64: 2 x 2 blocks of 16 rows x 64
    w = torch.arange(n * k, dtype=torch.float32).view(n, k).bfloat16()
    packed = bf16_linear.pack(w, lib=lib).data.view(2, 2, 16, 64)
    flat = w.view(torch.int16)
    for nb, kb, r, c in [
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (0, 0, 3, 33),
        (1, 0, 2, 5),
        (0, 1, 8, 17),
        (1, 1, 0, 63),
    ]:
        col, kk = nb * 32 + (c // 32) * 16 + (c % 32) // 2, kb * 32 + 2 * r + c % 2
        want = int(flat[col, kk]) if col < n and kk < k else 0
        assert int(packed[nb, kb, r, c]) == want, (nb, kb, r, c)
    assert int(packed[1, 1, 15, 63]) == 0  # padding (column 63 >= 40) is zero


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 16, 32),
        (3, 40, 50),
        (16, 96, 64),
        (17, 960, 576),
        (27, 70, 40),  # AVX-512 BF16 groups 12 + 12 + 2 + 1
        (33, 33, 100),
        (300, 70, 64),
        (32, 576, 1536),
    ],
)
def test_every_backend_matches_float64_reference(
    lib: ctypes.CDLL, x_dtype: torch.dtype, m: int, n: int, k: int
) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen).to(x_dtype)
    bias = torch.randn(n, generator=gen)
    packed = bf16_linear.pack(w, lib=lib)
    for backend in _backends(lib):
        for b in (bias, None):
            y = bf16_linear.linear(x, packed, b, backend=backend, lib=lib)
            assert y.shape == (m, n) and y.dtype == x_dtype
            ref = _reference(x, w, b)
            tol = 1e-6 if x_dtype == torch.float32 else 8e-3  # bf16 output: one rounding
            assert float((y.double() - ref).abs().max() / ref.abs().max()) < tol, backend


def test_a_backend_that_cannot_run_here_is_refused_and_writes_nothing() -> None:
    portable = native.build(portable=True)
    packed = bf16_linear.pack(torch.randn(32, 64), lib=portable)
    for backend in ("avx512-bf16", "amx"):
        with pytest.raises(ValueError, match=f"the {backend} backend cannot run here"):
            bf16_linear.linear(torch.randn(2, 64), packed, backend=backend, lib=portable)
    y = torch.full((2, 32), 7.0)
    code = portable.parrot_bf16_linear(
        torch.randn(2, 64).data_ptr(), 0, 2, 64, packed.data.data_ptr(), 32, None, y.data_ptr(), 1, 1
    )
    assert code == 1 and bool((y == 7.0).all())
    with pytest.raises(ValueError, match="backend must be one of"):
        bf16_linear.linear(torch.randn(2, 64), packed, backend="avx2", lib=portable)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


def test_the_best_backend_follows_the_cpu() -> None:
    flags = _cpu_flags()
    assert bf16_linear.best(native.build(portable=True)) == "portable"
    best = bf16_linear.best(native.build())
    assert (best != "portable") == ("avx512_bf16" in flags)
    assert best != "amx" or "amx_tile" in flags


def test_no_rows_give_no_rows(lib: ctypes.CDLL) -> None:
    w = torch.randn(32, 64)
    for backend in _backends(lib):
        y = bf16_linear.linear(torch.randn(0, 64), bf16_linear.pack(w, lib=lib), backend=backend, lib=lib)
        assert y.shape == (0, 32)


def test_nan_stays_in_its_row(lib: ctypes.CDLL) -> None:
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(64, 96, generator=gen), torch.randn(20, 96, generator=gen)
    x[7, 3] = torch.nan
    for backend in _backends(lib):
        y = bf16_linear.linear(x, bf16_linear.pack(w, lib=lib), backend=backend, lib=lib)
        assert torch.isnan(y[7]).all(), backend
        assert torch.isfinite(torch.cat([y[:7], y[8:]])).all(), backend


def test_bad_inputs_are_refused(lib: ctypes.CDLL) -> None:
    w = torch.randn(32, 64)
    packed = bf16_linear.pack(w, lib=lib)
    x = torch.randn(4, 64)
    bad = [
        ({"x": x.view(2, 2, 64)}, "2-D"),
        ({"x": x.half()}, "fp32/bf16"),
        ({"x": torch.randn(4, 63)}, "takes 64"),  # pads to the same blocks: must still be refused
        ({"weight": replace(packed, data=packed.data[:-1])}, "does not hold"),
        ({"weight": replace(packed, data=packed.data.float())}, "does not hold"),
        ({"weight": replace(packed, out_features=33)}, "does not hold"),
        ({"bias": torch.randn(32).double()}, "bias"),
        ({"bias": torch.randn(31)}, "bias"),
    ]
    for change, match in bad:
        args = {"x": x, "weight": packed, "bias": None, **change}
        with pytest.raises(ValueError, match=match):
            bf16_linear.linear(**args, lib=lib)
    with pytest.raises(ValueError, match="2-D CPU weight"):
        bf16_linear.pack(w.view(-1), lib=lib)


def test_the_portable_build_computes_but_is_not_offered_to_the_engine() -> None:
    """The portable C reads the same packed blocks; the engine keeps oneDNN there."""
    portable, fast = native.build(portable=True), native.build()
    assert bf16_linear.best(portable) == "portable"
    assert for_options(KernelOptions(cpu_kernel="portable")).bf16_linear is None
    gen = torch.Generator().manual_seed(9)
    w, x = torch.randn(40, 100, generator=gen), torch.randn(5, 100, generator=gen).bfloat16()
    got = bf16_linear.linear(x, bf16_linear.pack(w, lib=portable), lib=portable)
    want = bf16_linear.linear(x, bf16_linear.pack(w, lib=fast), lib=fast)
    assert (
        got.dtype == torch.bfloat16
        and float((got.double() - want.double()).abs().max()) <= float(want.double().abs().max()) * 2**-7
    )  # the two differ at most by bf16 output rounding of their fp32 sums


@needs_bf16_packing
def test_packed_linear_sends_decode_sizes_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 PackedLinear: calls of at most MAX_ROWS rows go to the bf16 kernel on the
    kernel set's backend, larger ones to oneDNN; both give the bf16 product."""
    gen = torch.Generator().manual_seed(6)
    w, bias = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    layer = PackedLinear(w, bias, dtype=torch.bfloat16)
    best = bf16_linear.best()
    assert layer.bf16_backend == (None if best == "portable" else best)
    assert (layer.bf16 is not None) == (best != "portable")
    calls = []
    real = bf16_linear.linear

    def spy(*a, **kw):
        calls.append((a[0].shape[0], kw["backend"]))
        return real(*a, **kw)

    monkeypatch.setattr(bf16_linear, "linear", spy)
    small = torch.randn(bf16_linear.MAX_ROWS, 64, generator=gen)
    large = torch.randn(bf16_linear.MAX_ROWS + 1, 64, generator=gen)
    for x in (small, large):
        y = layer(x)
        ref = _reference(x, w, bias.bfloat16())  # oneDNN adds a bf16 bias; the kernel an fp32 one
        assert float((y.double() - ref).abs().max() / ref.abs().max()) < 1e-2
    assert calls == ([(bf16_linear.MAX_ROWS, best)] if layer.bf16 is not None else [])


@needs_bf16_packing
def test_the_options_narrow_the_backend() -> None:
    """``bf16_linear=False`` keeps bf16 projections on oneDNN; ``amx=False`` keeps the
    kernel off the AMX tiles (AVX-512 BF16 where the CPU has it)."""
    w = torch.randn(32, 64)
    off = PackedLinear(w, dtype=torch.bfloat16, kernels=for_options(KernelOptions(bf16_linear=False)))
    assert off.bf16 is None and off.bf16_backend is None
    no_amx = for_options(KernelOptions(amx=False)).bf16_linear
    assert no_amx == ("avx512-bf16" if bf16_linear.runs("avx512-bf16") else None)
    assert (
        PackedLinear(w, dtype=torch.bfloat16, kernels=for_options(KernelOptions(amx=False))).bf16_backend
        == no_amx
    )
