"""Where an engine runs: the ``--device`` / ``--dtype`` options, their resolution and
the model's placement.

* ``cpu`` (the default): the model stays fp32 on the CPU, with oneDNN-packed
  projections and Parrot's C kernels where they apply;
* ``cuda``: the model is copied to the GPU in ``--dtype`` (bfloat16 by default,
  or float16 / float32), the paged KV cache is allocated there, the C kernels and
  weight packing are off, prefill attention runs through PyTorch's fused
  ``scaled_dot_product_attention`` and decode attention through the Triton
  shared-prefix kernel (the ``cuda/triton`` step strategy,
  :mod:`parrot.engine.step_forward`);
* ``auto``: ``cuda`` when ``torch.cuda.is_available()``, else ``cpu``.

Asking for ``cuda`` where PyTorch sees no CUDA device is an error at start-up,
never a silent fall-back to the CPU.  This module imports torch only inside its
functions, so the CLI can declare its options without importing torch.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parrot.engine.kernels.options import KernelOptions  # torch-free

if TYPE_CHECKING:
    import torch

    from parrot.engine.config import EngineConfig
    from parrot.engine.model import LlamaModel

__all__ = [
    "DEVICES",
    "DTYPES",
    "Placement",
    "add_device_arguments",
    "model_dtype",
    "place_model",
    "placement",
    "resolve_device",
]

DEVICES = ("cpu", "cuda", "auto")
DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_CUDA_DTYPE = "bfloat16"


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype`` (shared by ``parrot serve`` and ``parrot engine``)."""
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where the engine runs: cpu (default), cuda (the model, KV cache and attention on the "
        "GPU; an error without a CUDA device) or auto (cuda when available, else cpu)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help=f"the model's dtype on a CUDA device (default {DEFAULT_CUDA_DTYPE}); on the CPU the "
        "model is float32 (see --weight-dtype for bf16 projections there)",
    )


def resolve_device(device: str) -> str:
    """``"cpu"`` or ``"cuda"`` for a configured ``device`` (one of :data:`DEVICES`).

    Raises ValueError for an unknown name, and for ``"cuda"`` when PyTorch sees no
    CUDA device (with the reason, so the operator sees why at start-up)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, not {device!r}")
    if device == "cpu":
        return "cpu"
    import torch

    available = torch.cuda.is_available()
    if device == "auto":
        return "cuda" if available else "cpu"
    if not available:
        build = "a CPU-only PyTorch build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise ValueError(
            f"--device cuda: no CUDA device is available (torch.cuda.is_available() is False; "
            f"PyTorch {torch.__version__} is {build}); use --device cpu or auto"
        )
    return "cuda"


def model_dtype(device: str, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the model computes in on resolved ``device``: ``dtype``, or float32 on
    the CPU and :data:`DEFAULT_CUDA_DTYPE` on CUDA.  On the CPU only float32 is
    accepted (the CPU engine's bf16 is its packed weights', ``weight_dtype``)."""
    import torch

    if dtype is None:
        return torch.float32 if device == "cpu" else getattr(torch, DEFAULT_CUDA_DTYPE)
    allowed = {getattr(torch, name) for name in DTYPES}
    if dtype not in allowed:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype}")
    if device == "cpu" and dtype != torch.float32:
        raise ValueError(f"dtype {dtype} needs --device cuda; on the CPU use --weight-dtype bfloat16")
    return dtype


# On CUDA: none of the CPU's C kernels, no 2 MiB page advice (PyTorch paths and Triton only).
CUDA_KERNELS = KernelOptions(cpu_kernel="off", amx=False, f32_linear=False, c_forward=False, hugepages=False)


@dataclass(frozen=True)
class Placement:
    """An engine's resolved device (``cpu`` or ``cuda``), its model's dtype there, the
    kernels it may use and whether it packs its projections (CPU only)."""

    device: str
    dtype: torch.dtype
    kernels: KernelOptions
    prepack: bool


def placement(config: EngineConfig) -> Placement:
    """Resolve ``config``'s device and check the options that only mean something on
    the CPU (ValueError naming the option)."""
    device = resolve_device(config.device)
    dtype = model_dtype(device, config.dtype)
    if device == "cpu":
        _check_cpu_weight_dtype(config.weight_dtype)
        return Placement(device, dtype, config.kernels, config.prepack)
    if config.weight_dtype is not None:
        raise ValueError("weight_dtype packs CPU projections; on CUDA set the model's dtype instead")
    if config.kv_dtype is not None and config.kv_dtype != dtype:
        raise ValueError(f"on CUDA the KV cache is in the model's dtype ({dtype}), not {config.kv_dtype}")
    return Placement(device, dtype, CUDA_KERNELS, prepack=False)


def _check_cpu_weight_dtype(weight_dtype: torch.dtype | None) -> None:
    """ValueError before any model loads when this CPU cannot pack ``weight_dtype``."""
    import torch

    from parrot.engine.kernels.packed_linear import bf16_packing_supported

    if weight_dtype == torch.bfloat16 and not bf16_packing_supported():
        raise ValueError(
            "--weight-dtype bfloat16 needs a CPU on which oneDNN packs bf16 weights (AVX-512 BW/VL/DQ "
            f"or AVX-NE-CONVERT); this one offers {torch.backends.cpu.get_cpu_capability()}: "
            "leave --weight-dtype out to run fp32 weights"
        )


def place_model(model: LlamaModel, device: str, dtype: torch.dtype) -> LlamaModel:
    """``model`` itself when it already is ``dtype`` on ``device``; else a copy of its
    checkpoint weights there (the original, which other engines may share, is left
    untouched; packed copies are not carried over).  The copy is in eval mode without
    gradients, like every loaded model."""
    import torch

    from parrot.engine.model import LlamaModel

    weight = model.model.embed_tokens.weight
    if weight.device.type == device and weight.dtype == dtype:
        return model
    with torch.device("meta"):
        placed = LlamaModel(model.config)
    names = {name for name, _ in placed.named_parameters()}
    state = {k: v.to(device=device, dtype=dtype) for k, v in model.state_dict().items() if k in names}
    placed.load_state_dict(state, strict=True, assign=True)
    placed._inv_freq = placed._inv_freq.to(device)  # RoPE's fp32 frequencies: no copy per step
    placed.requires_grad_(False)
    return placed.eval()
