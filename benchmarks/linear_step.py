"""One forward step's projections, Parrot's C kernel against oneDNN, side by side.

    python benchmarks/linear_step.py [--model smollm2] [--dtype float32|bfloat16]
        [--rows 1 16 32 64 128 512] [--repeats 7] [--threads 2]

Builds every projection of the model's layers (q/k/v and gate/up fused, o, down)
plus the logits, with seeded random weights of the model's shapes, twice: as
``PackedLinear`` with Parrot's kernel for the dtype (fp32:
:mod:`parrot.engine.kernels.f32_linear`; bf16: :mod:`parrot.engine.kernels.bf16_linear` on
its best backend here, AMX tiles or AVX-512 BF16) and with that kernel switched off
(oneDNN's packed GEMM).  Each step calls all of them once with ``rows`` input rows, so
every weight comes from memory as in a real step (the model's weights do not fit in
cache).  The two variants alternate within each repeat; prints the median step time
of each and their ratio per row count.  Rows above a kernel's ``MAX_ROWS`` go to
oneDNN in both variants.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from parrot.engine.kernels import bf16_linear, f32_linear
from parrot.engine.kernels.kernel_set import for_options
from parrot.engine.kernels.options import KernelOptions
from parrot.engine.kernels.packed_linear import PackedLinear
from parrot.engine.loader import load_model


def layer_shapes(model: str) -> list[tuple[int, int]]:
    c = load_model(model).config
    per_layer = [
        (c.q_size + 2 * c.kv_size, c.hidden_size),
        (c.hidden_size, c.q_size),
        (2 * c.intermediate_size, c.hidden_size),
        (c.hidden_size, c.intermediate_size),
    ]
    return per_layer * c.num_layers + [(c.vocab_size, c.hidden_size)]


def build(shapes: list[tuple[int, int]], dtype: torch.dtype, kernel: bool) -> list[PackedLinear]:
    gen = torch.Generator().manual_seed(0)
    switch = "f32_linear" if dtype == torch.float32 else "bf16_linear"
    kernels = for_options(dataclasses.replace(KernelOptions.from_env(), **{switch: kernel}))
    return [
        PackedLinear(torch.randn(n, k, generator=gen) * 0.02, dtype=dtype, kernels=kernels) for n, k in shapes
    ]


def has_kernel(layer: PackedLinear) -> bool:
    return (layer.f32 if layer.dtype == torch.float32 else layer.bf16) is not None


def step_seconds(layers: list[PackedLinear], inputs: dict[int, torch.Tensor]) -> float:
    t = time.perf_counter()
    for lin in layers:
        lin(inputs[lin.in_features])
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64, 128, 512])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if dtype == torch.float32 and not f32_linear.available():
        raise SystemExit("Parrot's fp32 kernel is not available here (needs AVX-512 and the C ops)")
    if dtype == torch.bfloat16 and bf16_linear.best() == "portable":
        raise SystemExit("Parrot's bf16 kernel is not available here (needs AVX512-BF16 or AMX, and C ops)")
    shapes = layer_shapes(args.model)
    mine, onednn = build(shapes, dtype, True), build(shapes, dtype, False)
    assert has_kernel(mine[0]) and not has_kernel(onednn[0])
    mb = sum(n * k for n, k in shapes) * dtype.itemsize / 2**20
    which = "" if dtype == torch.float32 else f", bf16 kernel on {mine[0].bf16_backend}"
    print(
        f"# {args.model}: {len(shapes)} projections, {mb:.0f} MiB of {args.dtype} weights, "
        f"{args.threads} threads{which}"
    )
    for rows in args.rows:
        gen = torch.Generator().manual_seed(rows)
        inputs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in shapes}}
        times: dict[str, list[float]] = {"kernel": [], "onednn": []}
        step_seconds(mine, inputs), step_seconds(onednn, inputs)  # warm-up
        for r in range(args.repeats):
            for name in ("kernel", "onednn") if r % 2 == 0 else ("onednn", "kernel"):
                times[name].append(step_seconds(mine if name == "kernel" else onednn, inputs))
        ratios = [o / k for k, o in zip(times["kernel"], times["onednn"], strict=True)]
        print(
            f"rows {rows:4d}: kernel {statistics.median(times['kernel']) * 1e3:7.1f} ms, "
            f"oneDNN {statistics.median(times['onednn']) * 1e3:7.1f} ms, "
            f"oneDNN / kernel {statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]",
            flush=True,
        )


if __name__ == "__main__":
    main()
