"""The Python API of Parrot: semantic functions, semantic variables, sessions.

Imports only :mod:`parrot.protocol` (plus ``httpx`` and ``pydantic``), never
the manager, the engine or torch.
"""

from parrot.frontend.client import (
    DEFAULT_TIMEOUT,
    AsyncSession,
    ConnectionFailed,
    NoSession,
    Session,
    aconnect,
    connect,
    current_session,
)
from parrot.frontend.function import Input, Output, SemanticFunction, semantic_function, template_function
from parrot.frontend.variable import LATENCY, THROUGHPUT, SemanticVariable

__all__ = [
    "DEFAULT_TIMEOUT",
    "LATENCY",
    "THROUGHPUT",
    "AsyncSession",
    "ConnectionFailed",
    "Input",
    "NoSession",
    "Output",
    "SemanticFunction",
    "SemanticVariable",
    "Session",
    "aconnect",
    "connect",
    "current_session",
    "semantic_function",
    "template_function",
]
