"""The kernels one engine uses, chosen once (see :mod:`parrot.engine.kernels`)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

from parrot.engine.kernels import bf16_linear, f32_linear, native, prefill_bf16
from parrot.engine.kernels.options import KernelOptions

__all__ = ["KernelSet", "for_options"]


@dataclass(frozen=True)
class KernelSet:
    """``options`` — what the engine allowed; ``lib`` — the loaded build of the C ops
    (None: ``cpu_kernel='off'`` or the build failed); ``f32_linear`` — fp32
    projections of decode size run on Parrot's fp32 kernel (AVX-512 build);
    ``bf16_linear`` — the backend bf16 ones run on in Parrot's bf16 kernel (``amx``:
    AMX build, tiles granted, ``amx`` allowed; else ``avx512-bf16``: a build with
    AVX512-BF16), or None (oneDNN);
    ``bf16_prefill`` — the backend prompt chunks over a bf16 KV cache attend on
    (:mod:`parrot.engine.kernels.prefill_bf16`: ``amx`` or ``avx512-bf16`` as for the
    projections), or None (PyTorch's flash attention);
    ``c_attention`` — decode attention may run on the C kernels (else PyTorch);
    ``c_forward`` — decode steps may run all layers in one C call.  Invariant: every
    kernel it names is allowed by ``options`` and present in ``lib``."""

    options: KernelOptions
    lib: ctypes.CDLL | None = field(compare=False, repr=False)
    f32_linear: bool
    bf16_linear: str | None
    bf16_prefill: str | None
    c_attention: bool
    c_forward: bool

    def linear_key(self) -> tuple[str, bool, bool, bool, bool]:
        """What decides how a projection is packed (see ``KernelOptions.linear_key``)."""
        return self.options.linear_key()

    def select(self) -> None:
        """Make this set's build the one the model's forward finds (attention, fused
        ops; :func:`parrot.engine.kernels.native.select`): the engine calls it when it
        starts."""
        native.select(self.options.cpu_kernel, cache_dir=self.options.kernel_cache)

    def describe(self) -> str:
        """One line for the start-up log: the build and the kernels in use."""
        used = [
            name
            for name, on in (
                ("f32-linear", self.f32_linear),
                (f"bf16-linear/{self.bf16_linear}", self.bf16_linear is not None),
                (f"bf16-prefill/{self.bf16_prefill}", self.bf16_prefill is not None),
                ("c-attention", self.c_attention),
                ("c-forward", self.c_forward),
            )
            if on
        ]
        build = (
            self.options.cpu_kernel
            if self.lib is not None
            else f"none ({native.status(self.options.cpu_kernel)})"
        )
        return f"C ops build {build}; kernels: {', '.join(used) or 'PyTorch only'}"


def for_options(options: KernelOptions | None = None) -> KernelSet:
    """The set ``options`` (default: every kernel allowed, the native build) gives on
    this CPU, loading (building on first use) the C ops' build it names."""
    options = KernelOptions() if options is None else options
    lib = native.library(options.cpu_kernel)
    return KernelSet(
        options=options,
        lib=lib,
        f32_linear=options.f32_linear and lib is not None and f32_linear.available(lib),
        bf16_linear=_bf16_backend(options, lib),
        bf16_prefill=_prefill_backend(options, lib),
        c_attention=lib is not None,
        c_forward=options.c_forward and lib is not None,
    )


def _narrowed(best: str, amx: bool) -> str | None:
    """A bf16 kernel's backend from the fastest that runs (``best``, of ``portable``,
    ``avx512-bf16``, ``amx``): not AMX unless ``amx`` (every CPU with AMX has AVX-512
    BF16); None for portable C only, which oneDNN and PyTorch beat."""
    if best == "amx" and not amx:
        best = "avx512-bf16"
    return None if best == "portable" else best


def _bf16_backend(options: KernelOptions, lib: ctypes.CDLL | None) -> str | None:
    """The backend of the bf16 projections' kernel that ``options`` allow with ``lib``."""
    if not options.bf16_linear or lib is None:
        return None
    return _narrowed(bf16_linear.best(lib), options.amx)


def _prefill_backend(options: KernelOptions, lib: ctypes.CDLL | None) -> str | None:
    """The backend of the prompt attention kernel that ``options`` allow with ``lib`` (for
    head dims that are multiples of 32, which the step strategy checks)."""
    if not options.bf16_prefill or lib is None:
        return None
    return _narrowed(prefill_bf16.best(32, lib), options.amx)
