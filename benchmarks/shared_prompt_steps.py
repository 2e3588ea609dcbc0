"""Engine steps of forks under one shared prompt, in-process: where a shared-prompt run spends its time.

    python benchmarks/shared_prompt_steps.py [--model smollm2] [--forks 32] [--prefix-tokens 2000]
        [--question-tokens 20] [--max-tokens 64] [--repeats 3] [--threads 2] [--max-step-tokens 512]
        [--modes shared prefill-shared prefill-off unshared] [--time-kernels] [--dtype bfloat16]

One ``EngineRunner`` is stepped in a loop on this thread (no HTTP, no manager):
the prefix is filled as one context, then ``--forks`` generates fork it, each
with its own question, greedy, ``ignore_eos``.  Per run it prints tokens per
second, the time of the steps that prefill the questions, and the median decode
step.  Modes, interleaved within each repeat so that drift hits all alike:

* ``shared``: the engine as it ships (shared-prefix attention in decode and prefill);
* ``prefill-shared``: the same, but prefill chunks take the shared plan even where
  attending chunk by chunk would be faster (on the C prompt kernel: ``KERNEL_SHARING_BREAK_EVEN_ROWS``
  raised to infinity; on PyTorch's path over a bf16 cache:
  ``BF16_SHARING_BREAK_EVEN_KEYS_PER_ROW`` lowered to 0): the A/B of that choice;
* ``prefill-off``: the same, but prefill chunks attend to the prefix one chunk at a
  time (``plan_shared_prefill`` disabled) — the A/B of prefill sharing alone;
* ``unshared``: ``share_prefix=False`` (per-sequence attention everywhere).

``--time-kernels`` also times every call of the C attention kernels made from Python
(``cpu_kernel.shared_row`` / ``decode_rows``) and prints their mean per step.  Decode
steps that take the C forward (:mod:`parrot.engine.kernels.decode_forward`) call them from C
and are not counted: run with ``PARROT_DECODE_FORWARD=0`` (read as the engine's
``c_forward`` option, :class:`~parrot.engine.kernels.options.KernelOptions`) to time those too.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Callable

import torch

from parrot.engine import paged
from parrot.engine.kernels.attention import cpu_kernel
from parrot.engine.kernels.options import KernelOptions
from parrot.engine.loader import load_model
from parrot.engine.runner import EngineRunner, Job
from parrot.protocol.sampling import SamplingParams

KERNEL_SECONDS = [0.0]  # C attention kernel time, when --time-kernels wraps them


def time_kernels() -> None:
    for name in ("shared_row", "decode_rows"):
        real = getattr(cpu_kernel, name)

        def timed(*args, _real=real, **kwargs):
            t = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                KERNEL_SECONDS[0] += time.perf_counter() - t

        setattr(cpu_kernel, name, timed)


def run_once(runner: EngineRunner, args: argparse.Namespace, rng: random.Random, base: int) -> dict:
    vocab = runner.tokenizer.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    def drain() -> None:
        while runner.has_work():
            runner._step()

    runner._enqueue(Job(base, None, tokens(args.prefix_tokens)))
    drain()
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.forks):
        runner._enqueue(Job(base + 1 + i, base, tokens(args.question_tokens), sampling=sp))
    steps: list[float] = []  # seconds of each forward step
    forward = runner._forward

    def timed() -> tuple[list[Job], torch.Tensor | None]:
        before = runner.counters["steps"]
        t = time.perf_counter()
        out = forward()
        if runner.counters["steps"] > before:
            steps.append(time.perf_counter() - t)
        return out

    runner._forward = timed  # type: ignore[method-assign]
    KERNEL_SECONDS[0] = 0.0
    t0 = time.perf_counter()
    try:
        drain()
    finally:
        runner._forward = forward  # type: ignore[method-assign]
    wall = time.perf_counter() - t0
    for i in range(args.forks + 1):
        runner.contexts.free(base + i)
    # the steps that hold the questions' tokens (within max_step_tokens each)
    prefill_steps = -(-args.forks * args.question_tokens // runner.max_step_tokens)
    return {
        "tok_s": args.forks * args.max_tokens / wall,
        "prefill_s": sum(steps[:prefill_steps]),
        "decode_ms": 1e3 * statistics.median(steps[prefill_steps:]),
        "kernel_ms": 1e3 * KERNEL_SECONDS[0] / len(steps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--forks", type=int, default=32)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--question-tokens", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-step-tokens", type=int, default=512, help="the engine's per-step token budget")
    ap.add_argument("--time-kernels", action="store_true")
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the packed weights' and the KV cache's dtype (the suite's runs use bfloat16)",
    )
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["shared", "prefill-off"],
        choices=["shared", "prefill-shared", "prefill-off", "unshared"],
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    if args.time_kernels:
        time_kernels()
    loaded = load_model(args.model)
    dtype = getattr(torch, args.dtype)
    dtypes = {} if dtype == torch.float32 else {"weight_dtype": dtype, "kv_dtype": dtype}
    runners = {
        "shared": EngineRunner(
            loaded, max_step_tokens=args.max_step_tokens, kernels=KernelOptions.from_env(), **dtypes
        ),
        "unshared": (
            EngineRunner(
                loaded,
                share_prefix=False,
                max_step_tokens=args.max_step_tokens,
                kernels=KernelOptions.from_env(),
                **dtypes,
            )
            if "unshared" in args.modes
            else None
        ),
    }
    planner: Callable = paged.plan_shared_prefill
    break_even = paged.KERNEL_SHARING_BREAK_EVEN_ROWS
    bf16_break_even = paged.BF16_SHARING_BREAK_EVEN_KEYS_PER_ROW
    rng = random.Random(0)
    results: dict[str, list[dict]] = {m: [] for m in args.modes}
    base = 0
    for r in range(-1, args.repeats):  # repeat -1 warms up
        for mode in args.modes if r % 2 else reversed(args.modes):
            runner = runners["unshared" if mode == "unshared" else "shared"]
            off = mode == "prefill-off"
            paged.plan_shared_prefill = (lambda *a: None) if off else planner  # type: ignore[assignment]
            paged.KERNEL_SHARING_BREAK_EVEN_ROWS = math.inf if mode == "prefill-shared" else break_even
            paged.BF16_SHARING_BREAK_EVEN_KEYS_PER_ROW = 0.0 if mode == "prefill-shared" else bf16_break_even
            base += 10_000
            got = run_once(runner, args, rng, base)
            paged.plan_shared_prefill = planner
            paged.KERNEL_SHARING_BREAK_EVEN_ROWS = break_even
            paged.BF16_SHARING_BREAK_EVEN_KEYS_PER_ROW = bf16_break_even
            if r >= 0:
                results[mode].append(got)
                print(
                    f"{mode:12s} repeat {r}: {got['tok_s']:6.1f} tok/s, question prefill "
                    f"{got['prefill_s'] * 1e3:6.0f} ms, decode step median {got['decode_ms']:5.1f} ms"
                    + (
                        f", C attention kernels {got['kernel_ms']:4.1f} ms a step (mean)"
                        if args.time_kernels
                        else ""
                    ),
                    flush=True,
                )
    for mode, rows in results.items():
        print(
            f"{mode:12s} median: {statistics.median(g['tok_s'] for g in rows):6.1f} tok/s, question prefill "
            f"{statistics.median(g['prefill_s'] for g in rows) * 1e3:6.0f} ms, decode step "
            f"{statistics.median(g['decode_ms'] for g in rows):5.1f} ms"
        )


if __name__ == "__main__":
    main()
