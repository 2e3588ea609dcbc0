"""LangChain models over Parrot's OpenAI API: :class:`ParrotLLM` (``POST
/v1/completions``) and :class:`ParrotChatModel` (``POST /v1/chat/completions``).

Each model call is one HTTP request (a streamed one with ``stream=True``), so these
classes behave like any request-level LangChain model; to run a whole pipeline as one
Parrot DAG, hand it to :func:`parrot.integrations.langchain.invoke_as_dag`, which
reads the same fields (``model``, sampling) from these objects.

Defaults differ from OpenAI's on purpose: ``temperature`` is 0.0 (greedy, as
``P.Output``'s) and ``max_tokens`` 256, so a pipeline gives the same text whether it
runs request by request or as a DAG.  A non-2xx answer raises the Parrot error class
the server names (:func:`parrot.protocol.errors.error_from_body`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.llms import LLM
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult, GenerationChunk
from pydantic import BaseModel, Field

from parrot.protocol.errors import error_from_body
from parrot.protocol.tls import tls_context

DEFAULT_URL = "http://127.0.0.1:9000"
_ROLES = {"human": "user", "ai": "assistant", "system": "system"}


class ParrotParams(BaseModel):
    """The fields both models share: where the server is and how to sample."""

    base_url: str = Field(default=DEFAULT_URL, description="The Parrot server's root URL (no /v1).")
    model: str | None = Field(default=None, description="Served model id; any live engine's if None.")
    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = None
    api_key: str | None = Field(default=None, repr=False)
    timeout: float = Field(default=600.0, gt=0.0)

    def sampling(self, stop: list[str] | None = None) -> dict[str, Any]:
        """The OpenAI body fields for sampling; ``stop`` (from a call) overrides the field."""
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature}
        body["top_p"] = self.top_p
        for key in ("model", "top_k", "seed"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        stops = stop if stop is not None else self.stop
        if stops:
            body["stop"] = list(stops)
        return body

    def _client(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(
            base_url=self.base_url.rstrip("/"), timeout=self.timeout, headers=headers, verify=tls_context()
        )

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        with self._client() as http:
            response = http.post(path, json=body)
        if not response.is_success:
            raise _error(response)
        return response.json()

    def _stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The decoded ``data:`` events of a streamed answer, up to ``[DONE]``."""
        with self._client() as http, http.stream("POST", path, json={**body, "stream": True}) as response:
            if not response.is_success:
                response.read()
                raise _error(response)
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise error_from_body(500, event)
                yield event


def _error(response: httpx.Response) -> Exception:
    try:
        body = response.json()
    except ValueError:
        body = {"error": {"message": response.text, "code": "http_error"}}
    return error_from_body(response.status_code, body)


class ParrotLLM(ParrotParams, LLM):
    """A LangChain text-completion LLM served by Parrot (``POST /v1/completions``)."""

    @property
    def _llm_type(self) -> str:
        return "parrot"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"base_url": self.base_url, **self.sampling()}

    def _call(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        data = self._post("/v1/completions", {"prompt": prompt, **self.sampling(stop), **kwargs})
        return data["choices"][0]["text"]

    def _stream(  # type: ignore[override]
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        body = {"prompt": prompt, **self.sampling(stop), **kwargs}
        for event in ParrotParams._stream(self, "/v1/completions", body):
            for choice in event.get("choices") or ():
                text = choice.get("text") or ""
                if text:
                    chunk = GenerationChunk(text=text)
                    if run_manager is not None:
                        run_manager.on_llm_new_token(text, chunk=chunk)
                    yield chunk


def message_dicts(messages: list[BaseMessage]) -> list[dict[str, str]]:
    """OpenAI chat messages for LangChain ones (text content only)."""
    out = []
    for m in messages:
        role = _ROLES.get(m.type)
        if role is None:
            raise ValueError(f"ParrotChatModel cannot send a {m.type!r} message (only system, human, ai)")
        out.append({"role": role, "content": m.content if isinstance(m.content, str) else str(m.text)})
    return out


class ParrotChatModel(ParrotParams, BaseChatModel):
    """A LangChain chat model served by Parrot (``POST /v1/chat/completions``: the
    model's own chat template renders the conversation)."""

    @property
    def _llm_type(self) -> str:
        return "parrot-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"base_url": self.base_url, **self.sampling()}

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        body = {"messages": message_dicts(messages), **self.sampling(stop), **kwargs}
        data = self._post("/v1/chat/completions", body)
        text = data["choices"][0]["message"]["content"] or ""
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=text))])

    def _stream(  # type: ignore[override]
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        body = {"messages": message_dicts(messages), **self.sampling(stop), **kwargs}
        for event in ParrotParams._stream(self, "/v1/chat/completions", body):
            for choice in event.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") or ""
                if text:
                    chunk = ChatGenerationChunk(message=AIMessageChunk(content=text))
                    if run_manager is not None:
                        run_manager.on_llm_new_token(text, chunk=chunk)
                    yield chunk
