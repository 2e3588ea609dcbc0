"""One TLS context for every HTTP client a process opens towards Parrot."""

from __future__ import annotations

import functools
import ssl

import httpx

__all__ = ["tls_context"]


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The certificate-verifying TLS context the SDK's and the integrations' HTTP clients
    use, built once per process with httpx's defaults (certifi's CA bundle, or
    ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``).

    httpx builds one per client otherwise, loading the whole CA bundle each time, even for
    plain-HTTP URLs, and the SDK opens a client per session: an application opening a
    session per request paid that CPU on every request (``benchmarks/sdk_tls_ab.py``).
    An ``SSLContext`` may be shared by any number of clients and threads."""
    return httpx.create_ssl_context()
