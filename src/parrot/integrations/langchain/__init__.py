"""LangChain on Parrot (``pip install 'parrot-serve[langchain]'``).

Two things:

- :class:`ParrotLLM` and :class:`ParrotChatModel`: LangChain models over Parrot's
  OpenAI API (``POST /v1/completions`` and ``POST /v1/chat/completions``), with
  streaming.  Drop-in for any LangChain code, one HTTP request per model call.
- :func:`invoke_as_dag` / :func:`batch_as_dag` / :func:`submit_as_dag`: run an LCEL
  pipeline (prompts, these models, ``StrOutputParser``, sequences,
  ``RunnableParallel``, ``.map()``, passthroughs, text-only lambdas) as *one* Parrot
  DAG submitted in one batch request, so intermediate outputs stay on the server
  and the manager sees the whole application.  See :mod:`.dag` for what is
  supported; anything else raises :class:`UnsupportedRunnable` naming it.
"""

from __future__ import annotations

try:
    import langchain_core  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "parrot.integrations.langchain needs langchain-core: pip install 'parrot-serve[langchain]'"
    ) from exc

from parrot.integrations.langchain.dag import (
    PendingResult,
    UnsupportedRunnable,
    batch_as_dag,
    invoke_as_dag,
    submit_as_dag,
)
from parrot.integrations.langchain.models import ParrotChatModel, ParrotLLM

__all__ = [
    "ParrotChatModel",
    "ParrotLLM",
    "PendingResult",
    "UnsupportedRunnable",
    "batch_as_dag",
    "invoke_as_dag",
    "submit_as_dag",
]
