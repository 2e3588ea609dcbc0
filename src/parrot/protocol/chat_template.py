"""Chat messages rendered into the prompt text a model was trained on.

:func:`render_chat` renders a conversation with the model's own chat template
(the Jinja template in its tokenizer files, as transformers and vLLM render it)
in Jinja's *immutable sandbox*: a template can read the messages and call the
few helpers below, but not reach Python attributes, modules or files, nor
change the objects it is given.  A model without a template but with a known
:class:`~parrot.protocol.tokenizer.ChatFormat` gets that markup, turn after turn.

Rendering costs time linear in the conversation's length; the caller runs it off
the event loop when the messages are long.  Errors a template raises on purpose
(``raise_exception``, e.g. roles out of order) and errors it meets are
:class:`~parrot.protocol.errors.BadRequest` (400, ``invalid_messages``).
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from parrot.protocol.errors import BadRequest
from parrot.protocol.tokenizer import ChatFormat, TextTokenizer

__all__ = ["ROLES", "ChatMessage", "render_chat"]

ROLES = ("system", "developer", "user", "assistant", "tool")
"""Message roles a conversation may use (``developer`` is OpenAI's newer name for ``system``)."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class _TemplateError(Exception):
    """Raised by a template's ``raise_exception``."""


def _raise_exception(message: str) -> None:
    raise _TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _token_text(tokenizer: TextTokenizer, token_id: int | None) -> str:
    return "" if token_id is None else tokenizer.decode([token_id], skip_special_tokens=False)


def render_chat(
    tokenizer: TextTokenizer, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True
) -> str:
    """The prompt text of ``messages`` for ``tokenizer``'s model, ending with the
    assistant's turn opened (``add_generation_prompt``).  Without the BOS token when
    the tokenizer adds one to every prompt (a template that writes it would
    otherwise give the model two)."""
    if not messages:
        raise BadRequest("messages must hold at least one message", code="invalid_messages")
    for m in messages:
        if m.role not in ROLES:
            raise BadRequest(f"unknown message role {m.role!r}; one of {ROLES}", code="invalid_messages")
    if tokenizer.chat_template:
        return _render_template(tokenizer, messages, add_generation_prompt)
    if tokenizer.chat is not None:
        return _render_format(tokenizer.chat, messages, add_generation_prompt)
    raise BadRequest("this model has no chat format; use /v1/completions", code="no_chat_format")


def _render_template(
    tokenizer: TextTokenizer, messages: Sequence[ChatMessage], add_generation_prompt: bool
) -> str:
    from jinja2 import TemplateError

    assert tokenizer.chat_template is not None
    eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    bos = _token_text(tokenizer, tokenizer.bos_token_id)
    try:
        text = _compiled(tokenizer.chat_template).render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos,
            eos_token=_token_text(tokenizer, eos),
        )
    except _TemplateError as exc:
        raise BadRequest(
            f"the model's chat template refused the messages: {exc}", code="invalid_messages"
        ) from None
    except (TemplateError, TypeError, ValueError) as exc:
        raise BadRequest(
            f"the model's chat template failed on the messages: {exc}", code="invalid_messages"
        ) from None
    if tokenizer.add_bos and bos and text.startswith(bos):
        text = text[len(bos) :]  # the engine puts the BOS token in front of every prompt itself
    return text


def _render_format(fmt: ChatFormat, messages: Sequence[ChatMessage], add_generation_prompt: bool) -> str:
    """Turns in ``fmt``'s markup: a system turn (the conversation's own, else the format's
    default), then each message in its role's markup."""
    parts: list[str] = []
    if messages[0].role not in ("system", "developer") and fmt.default_system:
        parts.append(fmt.system_prefix + fmt.default_system + fmt.turn_end)
    prefixes = {"system": fmt.system_prefix, "developer": fmt.system_prefix, "user": fmt.user_prefix}
    for m in messages:
        prefix = prefixes.get(m.role, fmt.assistant_prefix if m.role == "assistant" else fmt.user_prefix)
        parts.append(prefix + m.content + fmt.turn_end)
    if add_generation_prompt:
        parts.append(fmt.assistant_prefix)
    return "".join(parts)
