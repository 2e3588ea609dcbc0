"""``parrot serve --backend ...``: external OpenAI-compatible servers as the engines.

One engine per ``--backend-url`` (see :mod:`parrot.manager.backends.openai_backend`), set up
before the server starts (:func:`parrot.manager.backends.connect.connect_backend`);
``--backend`` replaces the embedded engine.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parrot.manager.backends.openai_backend import OpenAIBackend
    from parrot.manager.service import Manager

BACKEND_KINDS = ("vllm", "sglang", "openai")  # those of manager.backends.openai_backend, import-free


def add_backend_args(p: argparse.ArgumentParser) -> None:
    """The backend options of ``parrot serve`` (a list of declarations)."""
    p.add_argument(
        "--backend",
        choices=BACKEND_KINDS,
        default=None,
        help="drive external OpenAI-compatible completion servers as the engines instead of the "
        "embedded one: vllm and sglang get token-id prompts, openai text prompts",
    )
    p.add_argument(
        "--backend-url",
        action="append",
        default=[],
        help="base URL of one backend replica (e.g. http://10.0.0.5:8000); repeat for each",
    )
    p.add_argument("--backend-model", default=None, help="served model name (default: the only one served)")
    p.add_argument(
        "--backend-tokenizer",
        default=None,
        help="model folder with the tokenizer.json the backend uses, or 'tiny' (default: --model); "
        "also the tokenizer of backends registered later (POST /v1/engines) whose model no engine serves",
    )
    p.add_argument(
        "--backend-api-key-env",
        default=None,
        metavar="VAR",
        help="environment variable holding the backends' API key (sent as a bearer token)",
    )
    # DEFAULT_BACKEND_MAX_INFLIGHT (parrot.protocol.schemas), kept import-free here
    p.add_argument("--backend-max-inflight", type=int, default=64, help="requests in flight per replica")
    p.add_argument(
        "--backend-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for a connection or for any byte of an answer before the call is "
        "re-run on another replica",
    )
    p.add_argument(
        "--backend-max-seq-len", type=int, default=None, help="the model's context (default: as reported)"
    )
    p.add_argument(
        "--backend-warm-prefix",
        action="store_true",
        help="send each long prompt prefix with max_tokens=1 before its generation, to warm the "
        "backend's prefix cache (off by default: one more request per call)",
    )
    p.add_argument(
        "--backend-priority",
        action="store_true",
        help="vllm only, started with --scheduling-policy priority: send each call's place in the "
        "manager's order (app-FIFO) as its request priority, and dispatch latency calls up to the "
        "backend's capacity instead of holding them back under the latency cap",
    )


def register_backends(args: argparse.Namespace, manager: Manager) -> list[OpenAIBackend]:
    """Connect every ``--backend-url`` and register it; raises SystemExit with the
    reason when an option or a backend does not fit."""
    from parrot.manager.backends.connect import BackendSetupError, connect_backend, load_tokenizer
    from parrot.manager.backends.openai_backend import BackendOptions

    if not args.backend_url:
        raise SystemExit("parrot serve: --backend needs at least one --backend-url")
    api_key = None
    if args.backend_api_key_env:
        api_key = os.environ.get(args.backend_api_key_env)
        if not api_key:
            raise SystemExit(f"parrot serve: ${args.backend_api_key_env} is not set")
    engines = []
    try:
        tokenizer = load_tokenizer(args.backend_tokenizer or args.model)
        for url in args.backend_url:
            options = BackendOptions(
                kind=args.backend,
                model=args.backend_model,
                api_key=api_key,
                max_inflight=args.backend_max_inflight,
                timeout_s=args.backend_timeout,
                warm_prefix=args.backend_warm_prefix,
                send_priority=args.backend_priority,
            )
            engine = connect_backend(url, options, tokenizer, max_seq_len=args.backend_max_seq_len)
            manager.pool.register(engine, name=f"{args.backend}-{len(engines)}", url=engine.url, polled=True)
            engines.append(engine)
    except (BackendSetupError, ValueError) as exc:
        raise SystemExit(f"parrot serve: {exc}") from exc
    return engines
