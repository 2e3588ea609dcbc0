"""Parrot: serve LLM applications, not single requests.

``import parrot as P`` gives everything an application needs::

    @P.semantic_function(chat=True)
    def write_code(task: P.Input, code: P.Output(max_tokens=200, transform=P.transforms.strip())):
        \"\"\"Write python code of {{task}}. Code: {{code}}\"\"\"

    with P.connect("http://127.0.0.1:9000"):
        print(write_code("a sort function").get())

Importing this package is light: it never imports torch, fastapi or uvicorn
(the manager and the engine live in their own subpackages).
"""

from parrot.frontend import (
    LATENCY,
    THROUGHPUT,
    AsyncSession,
    ConnectionFailed,
    Input,
    NoSession,
    Output,
    SemanticFunction,
    SemanticVariable,
    Session,
    aconnect,
    connect,
    current_session,
    semantic_function,
    template_function,
)
from parrot.protocol import transforms
from parrot.protocol.errors import (
    BadRequest,
    BindingError,
    CallFailed,
    Conflict,
    ContextTooLong,
    CycleError,
    EngineError,
    Forbidden,
    InvalidConstraint,
    InvalidSampling,
    InvalidTemplate,
    InvalidTransform,
    NoEngine,
    NotFound,
    ParrotError,
    PayloadTooLarge,
    Timeout,
    Unauthorized,
)
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.transforms import TransformChain, TransformFailed

__version__ = "0.1.0"

__all__ = [
    "LATENCY",
    "THROUGHPUT",
    "AsyncSession",
    "BadRequest",
    "BindingError",
    "CallFailed",
    "Conflict",
    "ConnectionFailed",
    "ContextTooLong",
    "CycleError",
    "EngineError",
    "Forbidden",
    "Input",
    "InvalidConstraint",
    "InvalidSampling",
    "InvalidTemplate",
    "InvalidTransform",
    "NoEngine",
    "NoSession",
    "NotFound",
    "Output",
    "ParrotError",
    "PayloadTooLarge",
    "SamplingParams",
    "SemanticFunction",
    "SemanticVariable",
    "Session",
    "Timeout",
    "TransformChain",
    "TransformFailed",
    "Unauthorized",
    "__version__",
    "aconnect",
    "connect",
    "current_session",
    "semantic_function",
    "template_function",
    "transforms",
]
