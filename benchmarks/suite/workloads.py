"""Seeded workload generators, one per figure of the Parrot paper's section 5.

Every generator has the signature ``(scale: float = 1.0, seed: int = 0) ->
list[Workload]`` and returns one :class:`~benchmarks.suite.spec.Workload` per
x-axis point of its figure.  Use :func:`generate` (validates its arguments) or
:func:`all_workloads`.

Invariants:

* deterministic: the same ``(figure, scale, seed)`` gives equal workloads
  (text is drawn from ``random.Random`` instances seeded with strings, which
  Python hashes with SHA-512, independent of ``PYTHONHASHSEED``); another seed
  gives other text;
* every app passes :func:`~benchmarks.suite.spec.check_app`; workload names and
  app ids are unique across the whole suite;
* arrivals (``AppSpec.arrival_s``) are sorted within a workload's apps;
* at ``scale=1`` every call's estimated prompt plus output is under 2,048 SmolLM2
  tokens; at any scale it stays under :data:`CONTEXT_TOKENS` or the generator
  raises ``ValueError`` (only fig14's reduce prompt grows with the scale);
* ``params`` is JSON-able and always has ``"sweep"`` (the name of the x-axis)
  and ``"x"`` (its value), which :mod:`benchmarks.suite.report` plots against;
  fig17 and fig19 also carry ``"app_output_tokens"`` (``{app_id: tokens}`` of the
  single-call apps whose per-token latency is reported), for systems that do
  not report output token counts.

Scale.  ``scale`` multiplies *counts* (chunks per document, concurrent apps,
batch sizes, files, the length of Poisson arrival windows), rounded, at least 1.
Per-call lengths (chunk sizes, output lengths, system prompts) are x-axis values
or fixed, because they are bounded by SmolLM2's context and by what a 2-core CPU
decodes.  ``scale=1`` is sized for about ten minutes of wall time per system
on a 2-core CPU with SmolLM2-135M, i.e. about half an hour for Parrot and two
baselines: in all ~530,000 prompt tokens (without prefix sharing; ~3 min at
~3,000 tokens/s), ~35,000 decoded tokens (~4 min at ~150 tokens/s batched,
more where calls run one at a time), ~680 calls (each paying the emulated
200-300 ms network delay on the baselines) and ~4 min of Poisson arrival
windows.  ``python -m benchmarks.suite.workloads [--scale S]`` prints the
per-workload counts.  The paper (LLaMA 7B/13B on A100/A6000 GPUs) corresponds
roughly to the scales noted per figure below, with longer prompts than ours.

Per figure (paper -> ours at ``scale=1``):

* fig11, chain summary of one document: paper Arxiv documents of > 20,000
  tokens, output lengths of roughly 25-100 and chunk sizes of roughly
  512-2,048 tokens (the summary we work from gives no axis values; these are
  recalled from the original figure, treat them as approximate).  Ours: one
  3,072-token document (scale multiplies its length; paper ~ scale 7), outputs
  25/50/100 at chunk 512 (6 calls), chunks 256/512/1,024 at output 50 (12/6/3 calls).
* fig12a, the same chain with background chat: paper ShareGPT chat arriving at
  several rates.  Ours: a 6-call chain (chunk 512, output 50) arriving at 3 s,
  background chat at 0/0.5/1/1.5 req/s over a 30 s window (scale multiplies
  document length and window), lengths from :func:`sharegpt_lengths`.
* fig12b, concurrent chains: paper 25 apps on 25 documents.  Ours: 4 and 8
  apps (paper ~ scale 3), each a 4-call chain (chunk 512, output 50) on its own
  document, arriving within 0.5 s.
* fig14, map-reduce summary: paper > 20,000-token documents, varying output
  length and chunk size.  Ours: a 4,096-token document, outputs 25/50/100 at
  chunk 512 (8 maps) and chunks 256/512/1,024 at output 50 (16/8/4 maps).
  Scale multiplies the document; above about 4.4 the reduce prompt outgrows
  the context and generation raises ValueError.
* fig15_16, shared system prompt (Bing Copilot): paper ~6,000-token system
  prompt, batches 8-64.  Ours: 1,500-token system prompt, 50-100-token queries,
  batches 8/16/32 (scale multiplies them) x outputs 32/64, all submitted at once.
* fig17, GPTs on several engines: paper four applications, four engines,
  Poisson arrivals.  Ours: four applications with 600-1,200-token system
  prompts, ``engines=2``, rates 0.5/1/2/4 req/s over a 20 s window (scale
  multiplies the window), outputs 24-48 tokens.
* fig18, multi-agent programming (MetaGPT): paper architect + coders +
  reviewers, three review rounds, up to 16 files.  Ours: the same DAG with
  2/4/8 files (scale multiplies them; paper ~ scale 2), a 400-token shared
  system prompt and 100-token task, plan 96, code 64 and review 48 tokens.
* fig19, chat + map-reduce on several engines: paper chat at 1 req/s next to
  map-reduce analytics, four engines.  Ours: chat at 1 req/s over 30 s plus two
  map-reduce apps (2,048-token documents, 8 maps of chunk 256, output 50,
  ``criteria="throughput"``), ``engines=2`` (scale multiplies window and apps).
"""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.suite import textgen
from benchmarks.suite.spec import AppSpec, CallSpec, Criteria, Workload, check_app

__all__ = [
    "CONTEXT_TOKENS",
    "FIGURES",
    "Cost",
    "agents_app",
    "all_workloads",
    "app_cost",
    "call_prompt_tokens",
    "chain_app",
    "chat_app",
    "generate",
    "map_reduce_app",
    "poisson_arrivals",
    "shared_prompt_app",
    "sharegpt_lengths",
    "workload_cost",
]

#: Upper bound on estimated prompt + output tokens of any call (vLLM is started with max-model-len 4096).
CONTEXT_TOKENS = 4096
_CONTEXT_MARGIN = 0.95  # token estimates are ~2% high or low; keep a margin

_PLACEHOLDER = re.compile(r"\{\{(?:input|output):[A-Za-z_][A-Za-z0-9_]*\}\}")

# ShareGPT lengths (vLLM paper, Kwon et al., SOSP 2023, Fig. 11a: ShareGPT mean input 161.31 and mean
# output 337.99 tokens).  The paper shows histograms, not a fit: we model both as log-normal with the
# published means and our own, assumed shape parameters (sigma), then shrink and cap them so chat
# stays feasible next to the measured app on a 2-core CPU.
SHAREGPT_MEAN_PROMPT = 161.31
SHAREGPT_MEAN_OUTPUT = 337.99
SHAREGPT_SIGMA_PROMPT = 1.0
SHAREGPT_SIGMA_OUTPUT = 0.8
CHAT_OUTPUT_DIVISOR = 4.0  # output mean 338 -> 84.5 tokens
CHAT_PROMPT_RANGE = (16, 512)
CHAT_OUTPUT_RANGE = (8, 128)


# --------------------------------------------------------------------------- helpers


def _out(name: str) -> str:
    return "{{output:" + name + "}}"


def _inp(name: str) -> str:
    return "{{input:" + name + "}}"


def _rng(seed: int, *parts: object) -> random.Random:
    """A generator private to ``(seed, *parts)``; string seeds are hashed deterministically."""
    return random.Random("/".join(map(str, (seed, *parts))))


def _count(base: int, scale: float) -> int:
    """``base * scale`` rounded, at least 1 (non-decreasing in ``scale``)."""
    return max(1, round(base * scale))


def _name(figure: str, **params: object) -> str:
    return f"{figure}/" + ",".join(f"{k}={v}" for k, v in params.items())


def poisson_arrivals(rng: random.Random, rate: float, duration_s: float, start_s: float = 0.0) -> list[float]:
    """Arrival times of a Poisson process of ``rate`` per second in ``[start_s, start_s + duration_s)``.

    Sorted, rounded to milliseconds; empty for ``rate == 0``.
    """
    if rate < 0 or duration_s < 0:
        raise ValueError(f"rate and duration must be >= 0, got {rate}, {duration_s}")
    times: list[float] = []
    if rate == 0:
        return times
    t = rng.expovariate(rate)
    while t < duration_s:
        times.append(round(start_s + t, 3))
        t += rng.expovariate(rate)
    return times


def _lognormal(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so that E[X] == mean
    return min(hi, max(lo, round(rng.lognormvariate(mu, sigma))))


def sharegpt_lengths(rng: random.Random) -> tuple[int, int]:
    """One chat request's ``(prompt_tokens, output_tokens)``, modelled on ShareGPT (see constants)."""
    prompt = _lognormal(rng, SHAREGPT_MEAN_PROMPT, SHAREGPT_SIGMA_PROMPT, *CHAT_PROMPT_RANGE)
    output = _lognormal(
        rng, SHAREGPT_MEAN_OUTPUT / CHAT_OUTPUT_DIVISOR, SHAREGPT_SIGMA_OUTPUT, *CHAT_OUTPUT_RANGE
    )
    return prompt, output


def _chunks(text: str, chunk_tokens: int) -> list[str]:
    """``text`` split into ``round(words / words_for_tokens(chunk_tokens))`` (at least 1) consecutive
    pieces of equal word counts (to within one word), so each is about ``chunk_tokens`` tokens."""
    words = text.split()
    n = max(1, round(len(words) / textgen.words_for_tokens(chunk_tokens)))
    bounds = [i * len(words) // n for i in range(n + 1)]
    return [" ".join(words[lo:hi]) for lo, hi in itertools.pairwise(bounds)]


# --------------------------------------------------------------------------- cost estimates


@dataclass(frozen=True)
class Cost:
    """Estimated work of an app or workload, in SmolLM2 tokens."""

    calls: int
    prefill_tokens: int  # every call's whole prompt, as a system without prefix sharing computes it
    decode_tokens: int
    max_call_tokens: int  # the largest prompt + output of one call

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            self.calls + other.calls,
            self.prefill_tokens + other.prefill_tokens,
            self.decode_tokens + other.decode_tokens,
            max(self.max_call_tokens, other.max_call_tokens),
        )


def call_prompt_tokens(call: CallSpec, produced: Mapping[str, int]) -> int:
    """Estimated prompt tokens of ``call``; ``produced`` maps earlier call names to their max_tokens."""
    literal = textgen.estimate_tokens(_PLACEHOLDER.sub(" ", call.template))
    consts = sum(textgen.estimate_tokens(v) for v in call.consts.values())
    deps = sum(produced[d] for d in call.deps.values())
    return literal + consts + deps


def app_cost(app: AppSpec) -> Cost:
    """Estimated :class:`Cost` of one app (every call decodes exactly its ``max_tokens``)."""
    produced: dict[str, int] = {}
    total = Cost(0, 0, 0, 0)
    for call in app.calls:
        prompt = call_prompt_tokens(call, produced)
        produced[call.name] = call.max_tokens
        total = total + Cost(1, prompt, call.max_tokens, prompt + call.max_tokens)
    return total


def workload_cost(workload: Workload) -> Cost:
    """Sum of :func:`app_cost` over the workload's apps."""
    total = Cost(0, 0, 0, 0)
    for app in workload.apps:
        total = total + app_cost(app)
    return total


def _output_tokens(apps: Iterable[AppSpec]) -> dict[str, int]:
    """``{app_id: max_tokens of its outputs}``, for per-token latencies when a system reports no counts."""
    return {app.app_id: sum(c.max_tokens for c in app.calls if c.name in app.outputs) for app in apps}


def _finish(
    figure: str, name: str, params: dict[str, Any], apps: Sequence[AppSpec], engines: int = 1
) -> Workload:
    """Check every app and the context budget, sort by arrival, and wrap into a Workload."""
    ordered = tuple(sorted(apps, key=lambda a: a.arrival_s))
    limit = int(CONTEXT_TOKENS * _CONTEXT_MARGIN)
    for app in ordered:
        check_app(app)
        cost = app_cost(app)
        if cost.max_call_tokens > limit:
            raise ValueError(
                f"{app.app_id}: a call needs ~{cost.max_call_tokens} tokens (prompt + output), over the "
                f"context budget of {limit}; use a smaller scale"
            )
    return Workload(figure=figure, name=name, params=params, apps=ordered, engines=engines)


# --------------------------------------------------------------------------- app builders


_DOC_INTRO = "You are summarising a long document, one part at a time.\n\n"


def chain_app(app_id: str, chunks: Sequence[str], output_tokens: int, *, arrival_s: float = 0.0) -> AppSpec:
    """Chain summary: call ``i`` reads the summary from call ``i-1`` (if any) and chunk ``i``.

    Invariant: call ``i > 0`` has exactly one dependency, on call ``i-1``; only
    the last call is an output.
    """
    if not chunks:
        raise ValueError(f"{app_id}: a chain needs at least one chunk")
    calls: list[CallSpec] = []
    for i, chunk in enumerate(chunks):
        name = f"sum{i:03d}"
        if i == 0:
            head, deps = _DOC_INTRO, {}
        else:
            head = _DOC_INTRO + "Summary of the document so far:\n" + _inp("summary") + "\n\n"
            deps = {"summary": calls[-1].name}
        template = (
            head
            + "Next part of the document:\n"
            + _inp("chunk")
            + "\n\nWrite a concise summary of the document so far, including this part.\nSummary: "
            + _out(name)
        )
        calls.append(CallSpec(name, template, output_tokens, consts={"chunk": chunk}, deps=deps))
    return AppSpec(app_id, "chain", tuple(calls), (calls[-1].name,), arrival_s=arrival_s)


def map_reduce_app(
    app_id: str,
    chunks: Sequence[str],
    output_tokens: int,
    *,
    arrival_s: float = 0.0,
    criteria: Criteria = "latency",
) -> AppSpec:
    """Map-reduce summary: one independent map call per chunk, then a reduce call on all map outputs."""
    if not chunks:
        raise ValueError(f"{app_id}: map-reduce needs at least one chunk")
    maps = [
        CallSpec(
            f"map{i:03d}",
            "Summarise this part of a document.\n\nDocument part:\n"
            + _inp("chunk")
            + "\n\nSummary: "
            + _out(f"map{i:03d}"),
            output_tokens,
            consts={"chunk": chunk},
        )
        for i, chunk in enumerate(chunks)
    ]
    parts = "".join(f"Part {i + 1}: " + _inp(f"part{i:03d}") + "\n" for i in range(len(maps)))
    reduce = CallSpec(
        "reduce",
        "Summaries of the parts of a document:\n"
        + parts
        + "\nCombine them into one concise summary of the whole document.\nSummary: "
        + _out("reduce"),
        output_tokens,
        deps={f"part{i:03d}": m.name for i, m in enumerate(maps)},
    )
    return AppSpec(app_id, "map_reduce", (*maps, reduce), ("reduce",), arrival_s=arrival_s, criteria=criteria)


def chat_app(app_id: str, rng: random.Random, *, arrival_s: float) -> AppSpec:
    """One single-call chat request with ShareGPT-like lengths."""
    prompt_tokens, output_tokens = sharegpt_lengths(rng)
    call = CallSpec(
        "reply",
        "User: " + _inp("message") + "\nAssistant: " + _out("reply"),
        output_tokens,
        consts={"message": textgen.filler(rng, prompt_tokens)},
    )
    return AppSpec(app_id, "chat", (call,), ("reply",), arrival_s=arrival_s)


def shared_prompt_app(
    app_id: str, system_text: str, query: str, output_tokens: int, *, arrival_s: float = 0.0
) -> AppSpec:
    """One request: ``system_text`` literally at the start of the template, then the user query.

    Invariant: the template starts with ``system_text`` verbatim, so every app built
    with the same ``system_text`` has the same constant prefix up to the first variable.
    """
    template = system_text + "\n\nUser: " + _inp("query") + "\n\nAssistant: " + _out("answer")
    call = CallSpec("answer", template, output_tokens, consts={"query": query})
    return AppSpec(app_id, "shared_prompt", (call,), ("answer",), arrival_s=arrival_s)


def _system_prompt(rng: random.Random, n_tokens: int, role: str) -> str:
    return f"You are {role}. Follow the instructions and the reference text below.\n\n" + textgen.filler(
        rng, n_tokens
    )


def agents_app(
    app_id: str,
    system_text: str,
    task: str,
    n_files: int,
    *,
    rounds: int = 3,
    plan_tokens: int = 96,
    code_tokens: int = 64,
    review_tokens: int = 48,
) -> AppSpec:
    """Multi-agent programming (MetaGPT-like): architect plan, then per file code and ``rounds`` reviews.

    Every prompt starts with the literal ``system_text`` and ``task``; every coder
    and reviewer prompt continues with the plan placeholder, then that file's
    history (code, review, revised code, ...).  Outputs: the last code of every file.
    """
    shared = system_text + "\n\nProject task: " + task + "\n\n"
    plan = CallSpec(
        "plan",
        shared
        + "Architect: write the design plan, listing the files and their interfaces.\nPlan: "
        + _out("plan"),
        plan_tokens,
    )
    calls = [plan]
    finals: list[str] = []
    for f in range(n_files):
        history = shared + "Design plan:\n" + _inp("plan") + "\n\n" + f"File {f + 1} of {n_files}.\n"
        deps = {"plan": "plan"}
        code = f"f{f:02d}_code0"
        prompt = history + "Coder: write this file.\nCode v0: " + _out(code)
        calls.append(CallSpec(code, prompt, code_tokens, deps=dict(deps)))
        history += "Code v0: " + _inp("code0") + "\n"
        deps["code0"] = code
        for r in range(1, rounds + 1):
            review = f"f{f:02d}_review{r}"
            calls.append(
                CallSpec(
                    review,
                    history + f"Reviewer: review code v{r - 1}.\nReview {r}: " + _out(review),
                    review_tokens,
                    deps=dict(deps),
                )
            )
            history += f"Review {r}: " + _inp(f"review{r}") + "\n"
            deps[f"review{r}"] = review
            code = f"f{f:02d}_code{r}"
            calls.append(
                CallSpec(
                    code,
                    history + f"Coder: revise the code after review {r}.\nCode v{r}: " + _out(code),
                    code_tokens,
                    deps=dict(deps),
                )
            )
            history += f"Code v{r}: " + _inp(f"code{r}") + "\n"
            deps[f"code{r}"] = code
        finals.append(code)
    return AppSpec(app_id, "agents", tuple(calls), tuple(finals))


# --------------------------------------------------------------------------- figures

#: fig11 and fig14 points: (sweep, output tokens, chunk tokens).
_SUMMARY_POINTS = (
    *(("output", out, 512) for out in (25, 50, 100)),
    *(("chunk", 50, chunk) for chunk in (256, 512, 1024)),
)


def _summary_sweep(
    figure: str,
    doc_tokens: int,
    seed: int,
    count_key: str,
    make_app: Callable[[str, list[str], int], AppSpec],
) -> list[Workload]:
    """One workload per :data:`_SUMMARY_POINTS` point: ``make_app(app_id, chunks, out)`` on
    the chunks of one seeded ``doc_tokens``-token document (``params[count_key]``: calls)."""
    doc = textgen.filler(_rng(seed, figure, "doc"), doc_tokens)
    workloads = []
    for sweep, out, chunk in _SUMMARY_POINTS:
        x = out if sweep == "output" else chunk
        name = _name(figure, sweep=sweep, out=out, chunk=chunk)
        chunks = _chunks(doc, chunk)
        params = {"sweep": sweep, "x": x, "output_tokens": out, "chunk_tokens": chunk, count_key: len(chunks)}
        workloads.append(_finish(figure, name, params, [make_app(name, chunks, out)]))
    return workloads


def fig11(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """Chain summary of one document; sweeps output length (chunk 512) and chunk size (output 50)."""
    return _summary_sweep(
        "fig11",
        _count(3072, scale),
        seed,
        "calls",
        lambda name, chunks, out: chain_app(f"{name}/chain0", chunks, out),
    )


def fig12a(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """A chain (arriving at 3 s) amid Poisson background chat at several rates."""
    chunks = _chunks(textgen.filler(_rng(seed, "fig12a", "doc"), _count(3072, scale)), 512)
    window = 30.0 * scale
    workloads = []
    for rate in (0.0, 0.5, 1.0, 1.5):
        name = _name("fig12a", chat_rate=rate)
        rng = _rng(seed, name)
        apps = [chain_app(f"{name}/chain0", chunks, 50, arrival_s=3.0)]
        for i, t in enumerate(poisson_arrivals(_rng(seed, "fig12a", "arrivals"), rate, window)):
            apps.append(chat_app(f"{name}/chat{i:04d}", rng, arrival_s=t))
        params = {"sweep": "chat_rate", "x": rate, "window_s": window, "chat_apps": len(apps) - 1}
        workloads.append(_finish("fig12a", name, params, apps))
    return workloads


def fig12b(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """Several chain apps (4-call chains, each on its own document) submitted within 0.5 s."""
    workloads = []
    for n_apps in sorted({_count(4, scale), _count(8, scale)}):
        name = _name("fig12b", apps=n_apps)
        rng = _rng(seed, name)
        arrivals = sorted(round(rng.uniform(0.0, 0.5), 3) for _ in range(n_apps))
        apps = [
            chain_app(f"{name}/chain{i:03d}", _chunks(textgen.filler(rng, 4 * 512), 512), 50, arrival_s=t)
            for i, t in enumerate(arrivals)
        ]
        workloads.append(_finish("fig12b", name, {"sweep": "apps", "x": n_apps, "apps": n_apps}, apps))
    return workloads


def fig14(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """Map-reduce summary of one document; sweeps output length (chunk 512) and chunk size (output 50)."""
    return _summary_sweep(
        "fig14",
        _count(4096, scale),
        seed,
        "maps",
        lambda name, chunks, out: map_reduce_app(f"{name}/mr0", chunks, out),
    )


def fig15_16(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """A batch of requests sharing one 1,500-token system prompt, all submitted at time 0."""
    system = _system_prompt(_rng(seed, "fig15_16", "system"), 1500, "a helpful search assistant")
    workloads = []
    for batch in sorted({_count(b, scale) for b in (8, 16, 32)}):
        for out in (32, 64):
            name = _name("fig15_16", batch=batch, out=out)
            rng = _rng(seed, name)
            queries = [textgen.filler(rng, rng.randint(50, 100)) for _ in range(batch)]
            apps = [shared_prompt_app(f"{name}/req{i:03d}", system, q, out) for i, q in enumerate(queries)]
            params = {"sweep": "batch", "x": batch, "output_tokens": out, "system_tokens": 1500}
            workloads.append(_finish("fig15_16", name, params, apps))
    return workloads


_GPTS = (
    ("productivity", "an assistant that plans and organises work", 600),
    ("programming", "an expert programming assistant", 800),
    ("image", "an assistant that writes prompts for image generation", 1000),
    ("data", "a data analysis assistant", 1200),
)


def fig17(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """Four GPTs-like apps with their own system prompts; Poisson requests at several rates, 2 engines."""
    systems = [_system_prompt(_rng(seed, "fig17", g), n, role) for g, role, n in _GPTS]
    window = 20.0 * scale
    workloads = []
    for rate in (0.5, 1.0, 2.0, 4.0):
        name = _name("fig17", rate=rate)
        rng = _rng(seed, name)
        apps = []
        for i, t in enumerate(poisson_arrivals(_rng(seed, "fig17", "arrivals"), rate, window)):
            g = rng.randrange(len(_GPTS))
            query = textgen.filler(rng, rng.randint(30, 80))
            app_id = f"{name}/{_GPTS[g][0]}{i:04d}"
            apps.append(shared_prompt_app(app_id, systems[g], query, rng.randint(24, 48), arrival_s=t))
        params = {"sweep": "rate", "x": rate, "window_s": window, "requests": len(apps), "gpts": len(_GPTS)}
        params["app_output_tokens"] = _output_tokens(apps)
        workloads.append(_finish("fig17", name, params, apps, engines=2))
    return workloads


def fig18(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """Multi-agent programming with F files (architect, coders, reviewers, three review rounds)."""
    rng = _rng(seed, "fig18", "system")
    system = _system_prompt(rng, 400, "one member of a software team: architect, coder or reviewer")
    task = textgen.filler(rng, 100)
    workloads = []
    for files in sorted({_count(f, scale) for f in (2, 4, 8)}):
        name = _name("fig18", files=files)
        app = agents_app(f"{name}/agents0", system, task, files)
        params = {"sweep": "files", "x": files, "files": files, "rounds": 3, "calls": len(app.calls)}
        workloads.append(_finish("fig18", name, params, [app]))
    return workloads


def fig19(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """Chat at 1 req/s next to map-reduce apps (criteria throughput), 2 engines."""
    name = _name("fig19", chat_rate=1.0)
    rng = _rng(seed, name)
    window = 30.0 * scale
    n_mr = _count(2, scale)
    apps = [
        map_reduce_app(
            f"{name}/mr{i:03d}",
            _chunks(textgen.filler(rng, 2048), 256),
            50,
            arrival_s=round(i * window / n_mr, 3),
            criteria="throughput",
        )
        for i in range(n_mr)
    ]
    for i, t in enumerate(poisson_arrivals(rng, 1.0, window)):
        apps.append(chat_app(f"{name}/chat{i:04d}", rng, arrival_s=t))
    params = {"sweep": "mixed", "x": 1.0, "window_s": window, "map_reduce_apps": n_mr}
    params["chat_apps"] = len(apps) - n_mr
    params["app_output_tokens"] = _output_tokens(a for a in apps if a.kind == "chat")
    return [_finish("fig19", name, params, apps, engines=2)]


FIGURES: dict[str, Callable[..., list[Workload]]] = {
    "fig11": fig11,
    "fig12a": fig12a,
    "fig12b": fig12b,
    "fig14": fig14,
    "fig15_16": fig15_16,
    "fig17": fig17,
    "fig18": fig18,
    "fig19": fig19,
}


def _check_args(scale: float, seed: int) -> None:
    is_number = isinstance(scale, int | float) and not isinstance(scale, bool)
    if not is_number or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")


def generate(figure: str, scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """The workloads of ``figure`` (a key of :data:`FIGURES`)."""
    if figure not in FIGURES:
        raise ValueError(f"unknown figure {figure!r}; expected one of {', '.join(FIGURES)}")
    _check_args(scale, seed)
    return FIGURES[figure](scale=scale, seed=seed)


def all_workloads(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """Every figure's workloads, in :data:`FIGURES` order."""
    _check_args(scale, seed)
    return [w for fig in FIGURES for w in generate(fig, scale, seed)]


def _main() -> None:  # pragma: no cover - a printing helper
    """Print a table of the suite's workloads and their estimated token counts."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    total = Cost(0, 0, 0, 0)
    print(f"{'workload':45} {'apps':>5} {'calls':>6} {'prefill':>8} {'decode':>7} {'max call':>8}")
    for w in all_workloads(args.scale, args.seed):
        c = workload_cost(w)
        total = total + c
        counts = f"{c.calls:6} {c.prefill_tokens:8} {c.decode_tokens:7} {c.max_call_tokens:8}"
        print(f"{w.name:45} {len(w.apps):5} {counts}")
    print(f"{'total':45} {'':5} {total.calls:6} {total.prefill_tokens:8} {total.decode_tokens:7}")


if __name__ == "__main__":  # pragma: no cover
    _main()
