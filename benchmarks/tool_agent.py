"""An agent that calls a tool between its LLM steps: what early prefill targets.

    python -m benchmarks.tool_agent --repeats 5 --dtype bfloat16

Each step ``k`` of the agent starts with instructions of its own (``--instruction-tokens``
tokens, constant: written when the agent was), then reads the tool's observation, then
generates an action (``--action-tokens``, greedy).  The tool runs on the client for
``--tool-s`` seconds after each action (and before the first step).  Three systems on
Parrot's engines, one engine of every core each, started side by side:

* ``parrot``: the whole agent submitted at the start, every step reading an observation
  variable the client sets when its tool returns; the manager fills each waiting step's
  instructions early (:mod:`parrot.manager.early_prefill`);
* ``parrot-no-early-prefill``: the same, with early prefill off (the ablation);
* ``parrot-baseline-throughput-apc``: a request-level client that renders step ``k``'s
  prompt when the observation is back and sends it to ``/v1/completions`` (the engine's
  prefix cache on).

No emulated network delay: every request goes over loopback.  Each repeat draws new
instructions (so no system finds a previous repeat's in its prefix cache), the systems'
order rotated per repeat.  Prints each system's mean agent latency with its min-max over
repeats, the latency less the tool time, and the ratios to ``parrot``.  Servers are
stopped on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from benchmarks.suite import textgen
from benchmarks.suite.systems import SystemHandle, start_system
from benchmarks.suite.workloads import seeded_rng

import parrot as P

SYSTEMS = ("parrot", "parrot-no-early-prefill", "parrot-baseline-throughput-apc")


def instructions(repeat: int, steps: int, tokens: int) -> list[str]:
    rng = seeded_rng(repeat, "tool_agent")
    return [
        f"You are step {k + 1} of a research agent. Read the rules below, then the tool's "
        f"observation, and answer with the next action.\n\n" + textgen.filler(rng, tokens)
        for k in range(steps)
    ]


def observation(k: int) -> str:
    return f"The tool returned {k * 7 + 3} results; the first says the answer is near page {k + 11}."


def template(instruction: str) -> str:
    return instruction + "\n\nObservation: {{input:obs}}\n\nAction:{{output:act}}"


def run_parrot(url: str, texts: list[str], args: argparse.Namespace) -> float:
    """The agent through Parrot's client: every step submitted up front."""
    out = P.Output(max_tokens=args.action_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    with P.connect(url, timeout=600) as s:
        obs = [s.variable(name=f"obs{k}") for k in range(len(texts))]
        acts = [
            s.call(P.template_function(template(t), name=f"step{k}", act=out), obs=obs[k])
            for k, t in enumerate(texts)
        ]
        for k, act in enumerate(acts):
            time.sleep(args.tool_s)  # the tool runs
            obs[k].set(observation(k))
            act.get(P.LATENCY)
    return time.perf_counter() - t0


def run_baseline(handle: SystemHandle, texts: list[str], args: argparse.Namespace) -> float:
    """The agent as a request-level client: each prompt rendered and sent when its
    observation is back."""
    t0 = time.perf_counter()
    with httpx.Client(timeout=600) as client:
        for k, text in enumerate(texts):
            time.sleep(args.tool_s)
            prompt = text + "\n\nObservation: " + observation(k) + "\n\nAction:"
            body = {
                "model": handle.model,
                "prompt": prompt,
                "max_tokens": args.action_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            answer = client.post(f"{handle.base_url}/v1/completions", json=body)
            answer.raise_for_status()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tool_agent", description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--instruction-tokens", type=int, default=800)
    parser.add_argument("--action-tokens", type=int, default=16)
    parser.add_argument("--tool-s", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=None, help="write the per-run latencies here (JSON)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or args.instruction_tokens < 1 or args.tool_s < 0:
        parser.error("--steps, --repeats and --instruction-tokens must be >= 1, --tool-s >= 0")
    runs: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds the stack: servers stopped
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tool-agent-")))
        handles = {
            name: stack.enter_context(start_system(name, log_dir=logs, dtype=args.dtype)) for name in SYSTEMS
        }
        warm = instructions(10_000, 1, 32)  # one untimed agent each: the engines warm
        for name, handle in handles.items():
            _runner(name)(handle, warm, args)
        for r in range(args.repeats):
            order = SYSTEMS[r % len(SYSTEMS) :] + SYSTEMS[: r % len(SYSTEMS)]
            texts = instructions(r, args.steps, args.instruction_tokens)
            for name in order:
                runs[name].append(_runner(name)(handles[name], texts, args))
                print(f"repeat {r} {name}: {runs[name][-1]:.2f} s", flush=True)
    tool = args.tool_s * args.steps
    mean = {name: statistics.fmean(v) for name, v in runs.items()}
    print(f"\n{args.steps} steps, {args.instruction_tokens}-token instructions, tool {args.tool_s:g} s")
    print(f"{'system':34} {'mean s':>8} {'min-max':>13} {'less tool':>10} {'x parrot':>9}")
    for name, values in runs.items():
        ratio = (mean[name] - tool) / (mean["parrot"] - tool)
        print(
            f"{name:34} {mean[name]:8.2f} {min(values):6.2f}-{max(values):<6.2f} "
            f"{mean[name] - tool:10.2f} {ratio:8.2f}x"
        )
    if args.out is not None:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": runs}, indent=1))
    return 0


def _runner(system: str) -> Callable[[SystemHandle, list[str], argparse.Namespace], float]:
    """How the agent is driven on ``system``: request by request, or through Parrot's client."""
    if system.startswith("parrot-baseline"):
        return run_baseline
    return lambda handle, texts, args: run_parrot(handle.base_url, texts, args)


if __name__ == "__main__":
    sys.exit(main())
