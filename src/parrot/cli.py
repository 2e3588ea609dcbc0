"""Command line: ``parrot serve`` (manager + embedded engine) and
``parrot engine --manager URL`` (a separate engine process).

This module runs the commands: it checks the parsed options against each other
(raising SystemExit with the command's name), builds the manager's and the
engine's configurations and serves them.  The options themselves are declared in
:mod:`parrot.cli_args` (the backend options in :mod:`parrot.cli_backend`, the
kernel options in :mod:`parrot.engine.kernels.options`).

Invariants: :func:`_parser` is :func:`parrot.cli_args.build_parser`, so
``parrot --help`` shows the same text it always did; importing this module
imports neither torch nor the manager's service (the commands import them when
they run); every bad combination of options ends in SystemExit before a model
loads or a socket is bound.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parrot.engine.local import LocalEngine
    from parrot.manager.service import ManagerConfig

from parrot.cli_args import DEFAULT_MODEL, build_parser
from parrot.cli_backend import register_backends
from parrot.engine.kernels.options import KernelOptions  # torch-free
from parrot.protocol.cluster import CLUSTER_SECRET_ENV, client_tls, generate_secret, resolve_secret

__all__ = ["DEFAULT_MODEL", "main", "manager_config", "run_engine", "serve"]


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
    """The command line (declared in :mod:`parrot.cli_args`)."""
    return build_parser()


def _load_engine(args: argparse.Namespace) -> LocalEngine:
    """The engine the options describe; its model loads on the engine's own thread
    (SystemExit at once if the placement, e.g. ``--device cuda``, is impossible)."""
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
