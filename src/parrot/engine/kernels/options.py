"""Which kernels an engine may use: one :class:`KernelOptions`, part of the engine's
:class:`~parrot.engine.config.EngineConfig`, read once when the engine starts and
passed down to what packs its weights, allocates its KV cache and chooses its step
strategy.  No kernel reads the environment.

The environment variables below are only the defaults of ``parrot serve`` /
``parrot engine``'s flags (:meth:`KernelOptions.from_env`, the one place that reads
them); an engine built in Python gets the field defaults unless it passes options.

=========================  =========================  ===========================================
variable                   flag                       field
=========================  =========================  ===========================================
``PARROT_CPU_KERNEL``      ``--cpu-kernel``           ``cpu_kernel``: ``native`` (``1``, the
                                                      default: built with ``-march=native``),
                                                      ``portable`` (no AVX-512/AMX code) or
                                                      ``off`` (``0``: PyTorch paths only)
``PARROT_BF16_LINEAR``     ``--[no-]bf16-linear``     ``bf16_linear``: bf16 projections of
                                                      decode size on Parrot's C kernel (AMX
                                                      tiles, else AVX-512 BF16)
``PARROT_BF16_PREFILL``    ``--[no-]bf16-prefill``    ``bf16_prefill``: prompt attention over a
                                                      bf16 KV cache on Parrot's C kernel (AMX
                                                      tiles, else AVX-512 BF16)
``PARROT_AMX``             ``--[no-]amx``             ``amx``: AMX tiles for those two kernels
                                                      (else they run in AVX-512 BF16)
``PARROT_F32_LINEAR``      ``--[no-]f32-linear``      ``f32_linear``: the fp32 AVX-512 kernel
``PARROT_DECODE_FORWARD``  ``--[no-]c-forward``       ``c_forward``: decode steps in one C call
``PARROT_HUGEPAGES``       ``--[no-]hugepages``       ``hugepages``: weights and KV on 2 MiB pages
``PARROT_KERNEL_CACHE``    ``--kernel-cache``         ``kernel_cache``: where built libraries are
                                                      kept (default ``~/.cache/parrot/kernels``)
=========================  =========================  ===========================================

A boolean variable set to ``0`` turns its kernel off (to compare); any other value
leaves it on.  Turning a kernel off never changes what the engine computes beyond
rounding order: each choice falls back to the path the others use.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["CPU_KERNEL_MODES", "ENVIRONMENT", "KernelOptions", "add_kernel_arguments"]

CPU_KERNEL_MODES = ("native", "portable", "off")

# variable -> field (the table in the module docstring)
ENVIRONMENT = {
    "PARROT_CPU_KERNEL": "cpu_kernel",
    "PARROT_BF16_LINEAR": "bf16_linear",
    "PARROT_AMX": "amx",
    "PARROT_BF16_PREFILL": "bf16_prefill",
    "PARROT_F32_LINEAR": "f32_linear",
    "PARROT_DECODE_FORWARD": "c_forward",
    "PARROT_HUGEPAGES": "hugepages",
    "PARROT_KERNEL_CACHE": "kernel_cache",
}
_MODE_ALIASES = {"1": "native", "0": "off"}


@dataclass(frozen=True)
class KernelOptions:
    """``cpu_kernel`` — which build of Parrot's C ops the engine loads (one of
    :data:`CPU_KERNEL_MODES`); ``bf16_linear`` / ``f32_linear`` — whether packed
    projections keep the bf16 / fp32 C kernel's copy for decode-sized calls;
    ``bf16_prefill`` — whether prompt chunks over a bf16 KV cache attend on Parrot's C
    kernel; ``amx`` — whether those two bf16 kernels may run on AMX tiles (else in
    AVX-512 BF16 where the CPU has it); ``c_forward`` —
    whether decode steps may run all layers in one C call; ``hugepages`` — whether the
    fp32 kernel's weights and the KV cache ask for 2 MiB pages; ``kernel_cache`` — the
    folder for built libraries (None: ``~/.cache/parrot/kernels``)."""

    cpu_kernel: str = "native"
    amx: bool = True
    f32_linear: bool = True
    c_forward: bool = True
    hugepages: bool = True
    kernel_cache: str | None = None
    bf16_prefill: bool = True
    bf16_linear: bool = True

    def __post_init__(self) -> None:
        if self.cpu_kernel not in CPU_KERNEL_MODES:
            modes = ", ".join(CPU_KERNEL_MODES)
            raise ValueError(f"cpu_kernel must be one of {modes}, not {self.cpu_kernel!r}")

    def linear_key(self) -> tuple[str, bool, bool, bool, bool]:
        """The fields that decide how a projection is packed (its C kernel copies); two
        options with the same key pack alike, so a model packed under one need not be
        repacked for the other."""
        return (self.cpu_kernel, self.bf16_linear, self.amx, self.f32_linear, self.hugepages)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelOptions:
        """The options the ``PARROT_*`` variables of ``environ`` (default: this process's)
        ask for (see the module docstring); raises ValueError for an unknown
        ``PARROT_CPU_KERNEL``."""
        env = os.environ if environ is None else environ
        mode = env.get("PARROT_CPU_KERNEL", "native")
        return cls(
            cpu_kernel=_MODE_ALIASES.get(mode, mode),
            bf16_linear=env.get("PARROT_BF16_LINEAR", "1") != "0",
            amx=env.get("PARROT_AMX", "1") != "0",
            bf16_prefill=env.get("PARROT_BF16_PREFILL", "1") != "0",
            f32_linear=env.get("PARROT_F32_LINEAR", "1") != "0",
            c_forward=env.get("PARROT_DECODE_FORWARD", "1") != "0",
            hugepages=env.get("PARROT_HUGEPAGES", "1") != "0",
            kernel_cache=env.get("PARROT_KERNEL_CACHE") or None,
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> KernelOptions:
        """The options parsed by a parser given :func:`add_kernel_arguments`."""
        return cls(**{field: getattr(args, field) for field in ENVIRONMENT.values()})


# flag -> what it switches (each a --flag / --no-flag pair; the field is the flag with _)
_SWITCHES = {
    "bf16-linear": "bf16 projections of decode size on Parrot's C kernel ($PARROT_BF16_LINEAR)",
    "bf16-prefill": "prompt attention over a bf16 KV cache on Parrot's C kernel ($PARROT_BF16_PREFILL)",
    "amx": "AMX tiles for the bf16 projections' and prompt attention's kernels (else AVX-512 BF16) "
    "($PARROT_AMX)",
    "f32-linear": "fp32 projections on the AVX-512 kernel ($PARROT_F32_LINEAR)",
    "c-forward": "decode steps in one C call ($PARROT_DECODE_FORWARD)",
    "hugepages": "weights and KV cache on 2 MiB pages ($PARROT_HUGEPAGES)",
}


def add_kernel_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the table above on ``parser`` (``parrot serve`` / ``parrot engine``),
    their defaults from this process's environment; exits with a message when
    ``PARROT_CPU_KERNEL`` holds an unknown value."""
    try:
        env = KernelOptions.from_env()
    except ValueError as exc:
        raise SystemExit(f"parrot: PARROT_CPU_KERNEL: {exc}") from None
    group = parser.add_argument_group("kernels (defaults from PARROT_* environment variables)")
    group.add_argument(
        "--cpu-kernel",
        choices=CPU_KERNEL_MODES,
        default=env.cpu_kernel,
        help="build of Parrot's C ops: native (-march=native), portable (no AVX-512/AMX code) or off "
        "(PyTorch paths only); default %(default)s ($PARROT_CPU_KERNEL)",
    )
    for flag, what in _SWITCHES.items():
        default = getattr(env, flag.replace("-", "_"))
        group.add_argument(
            f"--{flag}",
            action=argparse.BooleanOptionalAction,
            default=default,
            help=f"{what}; on: %(default)s",
        )
    group.add_argument(
        "--kernel-cache",
        default=env.kernel_cache,
        help="folder for built C libraries (default ~/.cache/parrot/kernels; $PARROT_KERNEL_CACHE)",
    )
