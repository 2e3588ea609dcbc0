"""The cluster secret: what a manager and its engine processes prove to each other.

Engine traffic (registration, heartbeats, every engine endpoint but
``/healthz``) and the operator's view of the pool carry the secret in the
``X-Parrot-Cluster-Secret`` header.  It comes from ``--cluster-secret`` or the
``PARROT_CLUSTER_SECRET`` environment variable; a manager started without one
generates one (:func:`generate_secret`).  Comparison is constant-time, so the
time of a refusal tells nothing about how much of a guess was right.
"""

from __future__ import annotations

import hmac
import os
import secrets
import ssl

CLUSTER_SECRET_ENV = "PARROT_CLUSTER_SECRET"
CLUSTER_SECRET_HEADER = "X-Parrot-Cluster-Secret"
MIN_SECRET_CHARS = 16


def resolve_secret(flag_value: str | None) -> str | None:
    """The secret from the command line, else from the environment, else None.

    Raises ValueError for a secret shorter than :data:`MIN_SECRET_CHARS` or with
    characters an HTTP header cannot carry."""
    secret = flag_value if flag_value is not None else os.environ.get(CLUSTER_SECRET_ENV)
    if secret is None:
        return None
    secret = secret.strip()
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the cluster secret must be at least {MIN_SECRET_CHARS} characters")
    if not all(33 <= ord(ch) <= 126 for ch in secret):
        raise ValueError("the cluster secret must be printable ASCII without spaces")
    return secret


def generate_secret() -> str:
    """A fresh secret: 32 random bytes, URL-safe base64."""
    return secrets.token_urlsafe(32)


def secret_matches(expected: str, given: str | None) -> bool:
    """Whether ``given`` (a header's value, or None when absent) is ``expected``; constant-time."""
    if given is None:
        return False
    return hmac.compare_digest(expected.encode(), given.strip().encode("utf-8", "replace"))


def cluster_headers(secret: str | None) -> dict[str, str]:
    """The headers that present ``secret`` (none for None)."""
    return {} if secret is None else {CLUSTER_SECRET_HEADER: secret}


def client_tls(ca_file: str | None) -> ssl.SSLContext | bool:
    """What an HTTP client of the cluster verifies servers with: the CA bundle ``ca_file``
    (for certificates of a private CA), else the system's trust store (True)."""
    return True if ca_file is None else ssl.create_default_context(cafile=ca_file)
