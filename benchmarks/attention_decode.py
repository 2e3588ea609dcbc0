"""Benchmark: shared-prefix (share=True) vs per-sequence (share=False) paged decode attention.

LLaMA-7B head layout (32 heads x 128 dims, MHA), block_size 16, one decode step of
one layer.  Each group shares a ``--prefix``-token prompt; every sequence has its
own ``--suffix``-token tail.  Physical blocks are a random permutation of the
cache (a fragmented paged cache, so every gather is a real gather).

Both variants run in the same process, interleaved inside every repeat (the order
alternates between repeats) so that load from other processes hits both alike;
the speed-up is computed per repeat and reported as median [min, max]; "min/min"
is the ratio of the two variants' fastest repeats (the least disturbed ones).

    python benchmarks/attention_decode.py                 # the table in docs/attention.md
    python benchmarks/attention_decode.py --threads 1     # one core: far less noise from neighbours
    python benchmarks/attention_decode.py --threads 1 --profile 32   # per-op breakdown at batch 32
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from parrot.engine.kernels import native
from parrot.engine.kernels.attention import Segment, paged_decode_attention
from parrot.engine.kernels.options import add_kernel_arguments

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 32, 128, 16


def build_case(
    groups: list[int], prefix: int, suffix: int, seed: int = 0, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Segment]]:
    """groups[i] sequences share prefix i; returns q [B, H, D], caches and segments."""
    gen = torch.Generator().manual_seed(seed)
    nb_prefix = -(-prefix // BLOCK_SIZE)
    nb_suffix = -(-suffix // BLOCK_SIZE)
    batch = sum(groups)
    num_blocks = len(groups) * nb_prefix + batch * nb_suffix + 8
    perm = torch.randperm(num_blocks, generator=gen)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    segments: list[Segment] = []
    nxt, seq0 = 0, 0
    for n in groups:
        segments.append(Segment(perm[nxt : nxt + nb_prefix], 0, prefix, torch.arange(seq0, seq0 + n)))
        nxt += nb_prefix
        for s in range(seq0, seq0 + n):
            segments.append(Segment(perm[nxt : nxt + nb_suffix], 0, suffix, torch.tensor([s])))
            nxt += nb_suffix
        seq0 += n
    return q.to(device), k_cache.to(device), v_cache.to(device), segments


def _time(fn: Callable[[], torch.Tensor]) -> float:
    t0 = time.perf_counter()
    out = fn()
    if out.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


@dataclass
class Result:
    shared: list[float]  # seconds per repeat
    plain: list[float]
    rel: float  # max |shared - plain| / max |plain|

    @property
    def ratios(self) -> list[float]:
        return [p / s for p, s in zip(self.plain, self.shared, strict=True)]


def run_case(groups: list[int], args: argparse.Namespace) -> Result:
    q, k, v, segs = build_case(groups, args.prefix, args.suffix, device=args.device)

    def shared() -> torch.Tensor:
        return paged_decode_attention(q, k, v, segs, share=True, backend=args.backend, validate=False)

    def plain() -> torch.Tensor:
        return paged_decode_attention(q, k, v, segs, share=False, backend=args.backend, validate=False)

    a, b = shared(), plain()  # warm-up, and a cross-check of the two paths
    res = Result([], [], float((a - b).abs().max() / b.abs().max()))
    for r in range(args.repeats):  # interleaved; the order alternates
        if r % 2 == 0:
            res.shared.append(_time(shared))
            res.plain.append(_time(plain))
        else:
            res.plain.append(_time(plain))
            res.shared.append(_time(shared))
    return res


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f} [{min(xs) * 1e3:.1f}, {max(xs) * 1e3:.1f}]"


def _row(groups: list[int], res: Result) -> str:
    r = res.ratios
    return (
        f"| {sum(groups)} | {len(groups)} x {groups[0]} | {_ms(res.shared)} | {_ms(res.plain)} "
        f"| {statistics.median(r):.1f}x [{min(r):.1f}, {max(r):.1f}] "
        f"| {min(res.plain) / min(res.shared):.1f}x | {res.rel:.1e} |"
    )


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def machine() -> str:
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{model}, {os.cpu_count()} cores visible, torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads, Python {platform.python_version()}"
    )


def profile(batch: int, args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    q, k, v, segs = build_case([batch], args.prefix, args.suffix, device=args.device)
    for share in (True, False):
        paged_decode_attention(q, k, v, segs, share=share, backend=args.backend, validate=False)
        with tprofile(activities=[ProfilerActivity.CPU]) as prof:
            paged_decode_attention(q, k, v, segs, share=share, backend=args.backend, validate=False)
        print(f"\n### share={share}, batch {batch}\n")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="8,16,32,64")
    ap.add_argument("--prefix", type=int, default=6000)
    ap.add_argument("--suffix", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="e.g. cuda (with --backend triton on a GPU)")
    ap.add_argument("--backend", default="torch", choices=["torch", "triton", "auto"])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--profile", type=int, default=0, help="only profile one call of each variant at batch N")
    add_kernel_arguments(ap)  # --cpu-kernel (default $PARROT_CPU_KERNEL): the C kernels or not
    args = ap.parse_args(argv)
    native.select(args.cpu_kernel, cache_dir=args.kernel_cache)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {machine()}")
    print(f"load average (1, 5, 15 min) before: {_load()}")
    if args.profile:
        profile(args.profile, args)
        return
    print(
        f"layout: H={HEADS}, KVH={KV_HEADS}, D={HEAD_DIM}, block_size={BLOCK_SIZE}, fp32, "
        f"device {args.device}, backend {args.backend}, "
        f"prefix {args.prefix}, suffix {args.suffix}; {args.repeats} repeats after 1 warm-up\n"
    )
    cases = [[int(b)] for b in args.batches.split(",")] + [[16, 16]]
    print("| batch | prefix groups | shared ms, median [min, max] | per-seq ms, median [min, max] "
          "| speed-up, median [min, max] | min/min | max rel diff |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for groups in cases:
        print(_row(groups, run_case(groups, args)), flush=True)
    print(f"\nload average (1, 5, 15 min) after: {_load()}")


if __name__ == "__main__":
    main()
