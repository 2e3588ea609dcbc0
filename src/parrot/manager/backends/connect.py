"""Setting up an external OpenAI-compatible backend as an engine.

:func:`connect_backend` asks the backend's ``GET /v1/models`` for the model's name and
context length (``max_model_len``, as vLLM and Parrot report it), loads the tokenizer
the manager renders prompts with (:func:`load_tokenizer`: a local model folder, or the
built-in ``tiny`` one), and, where the backend has vLLM's ``POST /tokenize``, checks
that both tokenize probe texts alike — prompts sent as token ids must mean to the
backend what they mean to the manager.  It runs synchronously (``parrot serve`` calls
it before its event loop starts) and raises :class:`BackendSetupError` with a message
naming the backend for anything that does not fit.  :func:`connect_backend_off_loop`
does the same from a running manager (a backend an operator registers with
``POST /v1/engines``), in a worker thread, within a deadline.

The manager needs the whole tokenizer locally: it renders and counts prompts on its
own event loop, where a request to the backend per text would stall every session.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from parrot.manager.backends.openai_backend import BackendOptions, OpenAIBackend
from parrot.protocol.tokenizer import TextTokenizer

PROBE_TEXTS = ("Hello, world! Parrot serves LLM applications.", "  spaces\tand\nlines 12345 ünïcödé")
"""Texts both tokenizers must encode alike (words, numbers, whitespace, non-ASCII)."""


class BackendSetupError(RuntimeError):
    """The backend cannot be driven as an engine (the message says which and why)."""


def load_tokenizer(spec: str) -> TextTokenizer:
    """The tokenizer of ``spec``: ``tiny``/``tiny:SEED`` (Parrot's byte-level test
    tokenizer) or a Hugging Face model folder with a ``tokenizer.json``."""
    if spec == "tiny" or spec.startswith("tiny:"):
        return TextTokenizer.byte_level_tiny()
    path = Path(spec).expanduser()
    if (path / "tokenizer.json").is_file():
        try:
            return TextTokenizer.from_hf_dir(path)
        except (OSError, ValueError) as exc:
            raise BackendSetupError(f"tokenizer folder {path}: {exc}") from exc
    raise BackendSetupError(
        f"no tokenizer at {spec!r}: give --backend-tokenizer a model folder with a tokenizer.json "
        "(the one the backend serves) or 'tiny'"
    )


def connect_backend(
    url: str, options: BackendOptions, tokenizer: TextTokenizer, *, max_seq_len: int | None = None
) -> OpenAIBackend:
    """An engine for the backend at ``url`` (see the module docstring).  ``max_seq_len``
    overrides what the backend reports (needed when it reports none)."""
    if not url.startswith(("http://", "https://")):
        raise BackendSetupError(f"backend url must start with http:// or https://, got {url!r}")
    try:
        with httpx.Client(base_url=url, timeout=options.timeout_s, headers=options.headers()) as client:
            model, reported = _describe(client, url, options.model)
            _check_tokenizer(client, url, model, tokenizer)
    except httpx.HTTPError as exc:
        raise BackendSetupError(f"backend {url} cannot be reached: {exc!r}") from exc
    length = max_seq_len or reported
    if not length:
        raise BackendSetupError(f"backend {url} does not report max_model_len; give --backend-max-seq-len")
    options.model = model
    return OpenAIBackend(url, options, model, length, tokenizer)


async def connect_backend_off_loop(
    url: str,
    options: BackendOptions,
    tokenizer: TextTokenizer,
    *,
    max_seq_len: int | None = None,
    deadline_s: float,
) -> OpenAIBackend:
    """:func:`connect_backend` in a worker thread (its HTTP requests, and the tokenizer's
    pass over its vocabulary, stay off the event loop); raises
    :class:`BackendSetupError` past ``deadline_s`` seconds too."""

    def connect() -> OpenAIBackend:
        _ = tokenizer.max_token_bytes  # computed once, here rather than on the loop
        return connect_backend(url, options, tokenizer, max_seq_len=max_seq_len)

    try:
        return await asyncio.wait_for(asyncio.to_thread(connect), deadline_s)
    except TimeoutError:
        raise BackendSetupError(f"backend {url} did not describe itself within {deadline_s:g} s") from None


def _describe(client: httpx.Client, url: str, wanted: str | None) -> tuple[str, int | None]:
    """(model name, its context length or None) from ``GET /v1/models``."""
    resp = client.get("/v1/models")
    if resp.status_code >= 400:
        raise BackendSetupError(
            f"backend {url} answered GET /v1/models with {resp.status_code}: {resp.text[:200]}"
        )
    try:
        entries = {str(m["id"]): m for m in resp.json()["data"]}
    except (ValueError, KeyError, TypeError) as exc:
        raise BackendSetupError(f"backend {url} answered GET /v1/models without a list of models") from exc
    if wanted is None:
        if len(entries) != 1:
            raise BackendSetupError(f"backend {url} serves {sorted(entries)}; name one with --backend-model")
        wanted = next(iter(entries))
    if wanted not in entries:
        raise BackendSetupError(f"backend {url} does not serve {wanted!r}; it serves {sorted(entries)}")
    length = entries[wanted].get("max_model_len")
    return wanted, length if isinstance(length, int) and length > 0 else None


def _check_tokenizer(client: httpx.Client, url: str, model: str, tokenizer: TextTokenizer) -> None:
    """Compare the local tokenizer with the backend's ``POST /tokenize`` where it has one."""
    for text in PROBE_TEXTS:
        resp = client.post("/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
        if resp.status_code in (404, 405):
            return  # no tokenize endpoint (SGLang, plain OpenAI servers, Parrot): nothing to compare
        try:
            theirs = resp.json()["tokens"]
        except (ValueError, KeyError, TypeError):
            return
        ours = tokenizer.encode(text)
        if theirs != ours:
            raise BackendSetupError(
                f"backend {url} tokenizes {text!r} as {theirs[:12]}..., the local tokenizer as "
                f"{ours[:12]}...: give --backend-tokenizer the folder of the model the backend serves"
            )
