"""Prefill speed and decode step time against batch size, in-process.

    python benchmarks/batch_steps.py [--model smollm2] [--context 250] [--batches 1 4 8 16 32 64]
        [--max-tokens 32] [--dtype float32|bfloat16] [--threads 2]

One ``EngineRunner`` is stepped in a loop on this thread (no HTTP, no manager,
prefix cache off so every prompt is computed).  For each batch size B it fills B
distinct random prompts of ``--context`` tokens, then generates ``--max-tokens``
greedy tokens for all of them together, and prints the prompt tokens per second
of the prefill steps and the median decode step (its time is every running
request's time per output token) with the decode tokens per second it gives.
Batch 1 runs twice; the first is a warm-up.

These are the proportions the evaluation suite's workloads are sized from
(``benchmarks/suite/workloads.py``): how many prompt tokens one decode step costs,
and how cheaply decode steps batch.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from parrot.engine.kernels.options import KernelOptions
from parrot.engine.loader import load_model
from parrot.engine.runner import EngineRunner, Job
from parrot.protocol.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=250, help="prompt tokens of each sequence")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else None
    runner = EngineRunner(
        load_model(args.model),
        weight_dtype=dtype,
        kv_dtype=dtype,
        prefix_cache=False,
        kernels=KernelOptions.from_env(),
    )
    rng = random.Random(0)
    vocab = runner.tokenizer.vocab_size
    steps: list[tuple[int, float]] = []  # (tokens in the step, seconds)
    forward = runner._forward

    def timed():
        t = time.perf_counter()
        out = forward()
        steps.append((runner.counters["steps"], time.perf_counter() - t))
        return out

    runner._forward = timed  # type: ignore[method-assign]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    base = 0
    for b in [args.batches[0], *args.batches]:
        base += 10_000
        for i in range(b):
            runner._enqueue(Job(base + i, None, [rng.randrange(100, vocab) for _ in range(args.context)]))
            runner._enqueue(Job(base + i, None, sampling=sp))
        steps.clear()
        while runner.has_work():
            runner._step()
        prefill_steps = -(-b * args.context // runner.max_step_tokens)
        prefill_s = sum(s for _, s in steps[:prefill_steps])
        decode_s = statistics.median(s for _, s in steps[prefill_steps + 1 :])
        print(
            f"{args.dtype} batch {b:3d} x {args.context} tokens: prefill {b * args.context / prefill_s:6.0f} "
            f"tok/s, decode step {decode_s * 1e3:6.1f} ms -> {b / decode_s:7.1f} tok/s",
            flush=True,
        )
        for i in range(b):
            runner.contexts.free(base + i)


if __name__ == "__main__":
    main()
