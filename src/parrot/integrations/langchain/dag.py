"""Run an LCEL pipeline as one Parrot DAG, submitted in one batch request.

:func:`submit_as_dag` walks the pipeline once, on the client, with the caller's
inputs.  Each Parrot model step becomes a semantic-function call recorded in one
``session.batch()``; what it returns to the rest of the pipeline is a *marker*
standing for the call's output variable (:mod:`.placeholders`), so prompt templates
and text-joining code downstream run as usual and the next call's prompt names the
variable.  When the walk ends the batch is sent as one ``POST
/v1/sessions/{sid}/batch``; the server runs every call as soon as its inputs exist,
and only the values in the pipeline's final output are ever fetched.

A model call's prompt becomes a template: constant text stays text (text with braces
becomes a constant input, since templates have no escape for ``{{``), each marker an
input bound to its variable, then one output placeholder with the model's sampling
settings.  The server tokenizes the rendered prompt as a whole, as
``POST /v1/completions`` does, so with greedy sampling a :class:`ParrotLLM` step gives
the same text as the request-level call.  A :class:`ParrotChatModel` step takes one
human message and runs as a ``chat=True`` call (the model's chat markup around it, as
semantic functions do), which may render differently from the model's full chat
template behind ``/v1/chat/completions``.

Supported runnables: ``RunnableSequence`` (``a | b``), ``RunnableParallel`` (and dict
literals), ``RunnableEach`` (``.map()``), ``RunnablePassthrough`` (plain and
``.assign``), ``RunnablePick``, prompt templates, ``StrOutputParser``, the two Parrot
models, and ``RunnableLambda`` functions that only move or format text (they run once,
here, on marker text: code that cuts or changes a model's output text, or returns
something other than text, raises).  Anything else raises :class:`UnsupportedRunnable`
naming it, before anything is sent.  Code that branches on a model's output cannot be
traced: the output does not exist yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompt_values import ChatPromptValue, StringPromptValue
from langchain_core.prompts import BasePromptTemplate
from langchain_core.runnables import Runnable, RunnableLambda, RunnableParallel, RunnableSequence
from langchain_core.runnables.base import RunnableEachBase, coerce_to_runnable
from langchain_core.runnables.passthrough import RunnableAssign, RunnablePassthrough, RunnablePick

import parrot as P
from parrot.frontend.sync_session import Session
from parrot.frontend.variable import SemanticVariable
from parrot.integrations.langchain.models import ParrotChatModel, ParrotLLM, ParrotParams
from parrot.integrations.langchain.placeholders import OPEN, MarkerDamaged, Markers, check_input, map_text

__all__ = ["PendingResult", "UnsupportedRunnable", "batch_as_dag", "invoke_as_dag", "submit_as_dag"]

SUPPORTED = (
    "RunnableSequence, RunnableParallel (dict literals), .map(), RunnablePassthrough (.assign), "
    "RunnablePick, prompt templates, ParrotLLM, ParrotChatModel, StrOutputParser, text-only lambdas"
)
_TEXT = (str, dict, list, tuple, StringPromptValue, ChatPromptValue, BaseMessage)


class UnsupportedRunnable(TypeError):
    """A pipeline step cannot become part of a Parrot DAG; the message names the step."""

    def __init__(self, runnable: Any, why: str):
        name = runnable.get_name() if isinstance(runnable, Runnable) else repr(runnable)
        super().__init__(
            f"{name} ({type(runnable).__name__}) cannot run inside a Parrot DAG: {why}. "
            f"Supported: {SUPPORTED}."
        )
        self.runnable = runnable


class PendingResult:
    """The pipeline's outputs, one per input, with model outputs still on the server.

    :meth:`result` fetches the variables the outputs hold (once each) and returns the
    outputs with their text in place; ``calls`` is the number of model calls submitted."""

    def __init__(self, outputs: list[Any], markers: Markers, calls: int):
        self.outputs = outputs
        self.calls = calls
        self._markers = markers
        self._values: dict[int, str] = {}

    def _fetch(self, var: SemanticVariable) -> str:
        if id(var) not in self._values:
            self._values[id(var)] = var.get()
        return self._values[id(var)]

    def result(self) -> list[Any]:
        return [self._markers.resolve(out, self._fetch) for out in self.outputs]


def submit_as_dag(runnable: Any, inputs: Sequence[Any], session: Session) -> PendingResult:
    """Record ``runnable`` applied to every input as calls of ``session``, sent as one
    batch; nothing is sent if any step is unsupported (the error names it)."""
    for value in inputs:
        check_input(value)
    tracer = _Tracer()
    chain = coerce_to_runnable(runnable)
    with session.batch():
        outputs = [tracer.run(chain, value) for value in inputs]
    return PendingResult(outputs, tracer.markers, tracer.calls)


def batch_as_dag(
    runnable: Any, inputs: Sequence[Any], *, url: str | None = None, api_key: str | None = None
) -> list[Any]:
    """``runnable.batch(inputs)``, as one Parrot DAG in one session (every input's calls
    in one batch request).  ``url``: the server (default: the pipeline's Parrot model's
    ``base_url``); ``api_key`` likewise."""
    model = None if url is not None else _first_model(runnable)
    with P.connect(url or model.base_url, api_key=api_key or getattr(model, "api_key", None)) as session:
        return submit_as_dag(runnable, list(inputs), session).result()


def invoke_as_dag(runnable: Any, value: Any, *, url: str | None = None, api_key: str | None = None) -> Any:
    """``runnable.invoke(value)``, as one Parrot DAG (see :func:`batch_as_dag`)."""
    return batch_as_dag(runnable, [value], url=url, api_key=api_key)[0]


def _first_model(runnable: Any) -> ParrotParams:
    graph = coerce_to_runnable(runnable).get_graph()
    for node in graph.nodes.values():
        if isinstance(node.data, ParrotParams):
            return node.data
    raise ValueError("the pipeline has no Parrot model to take the server URL from: pass url=")


class _Tracer:
    """Walks a pipeline with marker text, recording model calls in the current session."""

    def __init__(self) -> None:
        self.markers = Markers()
        self.calls = 0

    def run(self, r: Runnable, value: Any) -> Any:
        if isinstance(r, RunnableSequence):
            for step in r.steps:
                value = self.run(step, value)
            return value
        if isinstance(r, RunnableParallel):
            return {key: self.run(step, value) for key, step in r.steps__.items()}
        if isinstance(r, RunnableEachBase):
            if not isinstance(value, list | tuple):
                raise UnsupportedRunnable(r, f"it maps over a list, got {type(value).__name__}")
            return [self.run(r.bound, v) for v in value]
        if isinstance(r, RunnableAssign):
            if not isinstance(value, dict):
                raise UnsupportedRunnable(r, f"it assigns into a dict, got {type(value).__name__}")
            return {**value, **self.run(r.mapper, value)}
        if isinstance(r, RunnablePick | BasePromptTemplate):
            return self._checked(r, r.invoke(value))
        if isinstance(r, RunnablePassthrough):
            if r.func is not None or r.afunc is not None:
                raise UnsupportedRunnable(r, "a passthrough with a side-effect function")
            return value
        if isinstance(r, ParrotLLM | ParrotChatModel):
            return self._model_call(r, value)
        if type(r) is StrOutputParser:
            return self._parse_str(r, value)
        if isinstance(r, RunnableLambda):
            return self._lambda(r, value)
        raise UnsupportedRunnable(r, "it is not one of the supported steps")

    def _checked(self, r: Runnable, out: Any) -> Any:
        try:
            self.markers.check(out)
        except MarkerDamaged as exc:
            why = f"{exc}; steps may move and format a model's text, not change it"
            raise UnsupportedRunnable(r, why) from exc
        return out

    def _lambda(self, r: RunnableLambda, value: Any) -> Any:
        func = getattr(r, "func", None)
        if func is None:
            raise UnsupportedRunnable(r, "an async-only lambda")
        out = func(value)
        if isinstance(out, Runnable):
            return self.run(out, value)
        if _has_marker(value) and not _text_only(out):
            raise UnsupportedRunnable(
                r, "it made a non-text value from a model's output, which is not known until the DAG runs"
            )
        return self._checked(r, out)

    def _parse_str(self, r: Runnable, value: Any) -> str:
        if isinstance(value, str):
            return value
        if isinstance(value, BaseMessage) and isinstance(value.content, str):
            return value.content
        raise UnsupportedRunnable(r, f"it parses a model's text, got {type(value).__name__}")

    def _model_call(self, model: ParrotLLM | ParrotChatModel, value: Any) -> Any:
        chat = isinstance(model, ParrotChatModel)
        prompt = _prompt_text(model, value, chat)
        template, inputs = self._template(model, prompt)
        output = P.Output(**_output_settings(model))
        fn = P.template_function(template, name=model.get_name(), model=model.model, chat=chat, text=output)
        var = fn(**inputs)
        self.calls += 1
        text = self.markers.mark(var)
        return AIMessage(content=text) if chat else text

    def _template(self, model: Runnable, prompt: str) -> tuple[str, dict[str, Any]]:
        try:
            pieces = self.markers.split(prompt)
        except MarkerDamaged as exc:
            raise UnsupportedRunnable(model, str(exc)) from exc
        parts: list[str] = []
        inputs: dict[str, Any] = {}
        for piece in pieces:
            if isinstance(piece, str) and "{" not in piece and "}" not in piece:
                parts.append(piece)
                continue
            name = f"x{len(inputs)}"
            inputs[name] = piece
            parts.append(f"{{{{input:{name}}}}}")
        parts.append("{{output:text}}")
        return "".join(parts), inputs


def _prompt_text(model: Runnable, value: Any, chat: bool) -> str:
    """The text a model step is prompted with (for a chat model: its one human message)."""
    if isinstance(value, str):
        return value
    if isinstance(value, StringPromptValue):
        return value.text
    if isinstance(value, ChatPromptValue):
        if not chat:
            return value.to_string()  # what LangChain sends a text LLM
        messages = value.messages
        if len(messages) == 1 and messages[0].type == "human" and isinstance(messages[0].content, str):
            return messages[0].content
        kinds = [m.type for m in messages]
        raise UnsupportedRunnable(model, f"in a DAG a chat model takes one human message, got {kinds}")
    raise UnsupportedRunnable(model, f"its input must be a prompt or text, got {type(value).__name__}")


def _output_settings(model: ParrotParams) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "max_tokens": model.max_tokens,
        "temperature": model.temperature,
        "top_p": model.top_p,
        "seed": model.seed,
        "stop": tuple(model.stop or ()),
    }
    if model.top_k is not None:
        settings["top_k"] = model.top_k
    return settings


def _has_marker(value: Any) -> bool:
    found = False

    def look(text: str) -> str:
        nonlocal found
        found = found or OPEN in text
        return text

    map_text(value, look)
    return found


def _text_only(value: Any) -> bool:
    if isinstance(value, dict):
        return all(_text_only(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(_text_only(v) for v in value)
    return isinstance(value, _TEXT)
