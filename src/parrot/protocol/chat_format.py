"""Chat markup a model was trained with, as plain prefixes (:class:`ChatFormat`), and
its detection from a vocabulary and a Jinja chat template (:func:`detect_chat_format`).

Semantic functions with ``chat=True`` wrap their prompt in one user turn of this
markup; whole conversations are rendered with the model's own template
(:mod:`parrot.protocol.chat_template`)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["ChatFormat", "detect_chat_format"]


@dataclass(frozen=True)
class ChatFormat:
    """Chat markup of a model, enough to wrap one user prompt into one turn.

    The text given to the model is ``before + prompt + between`` and the model's
    answer follows.  ``before`` is ``[system_prefix + default_system + turn_end]
    + user_prefix`` (the system turn only when ``default_system`` is set) and
    ``between`` is ``turn_end + assistant_prefix``.
    """

    system_prefix: str
    user_prefix: str
    assistant_prefix: str
    turn_end: str
    default_system: str | None = None

    def __post_init__(self) -> None:
        for name in ("system_prefix", "user_prefix", "assistant_prefix", "turn_end"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"ChatFormat.{name} must be a string")
        if self.default_system is not None and not isinstance(self.default_system, str):
            raise ValueError("ChatFormat.default_system must be a string or None")

    def wrap(self, prompt_before_output: str = "") -> tuple[str, str]:
        """Return ``(before, between)`` for a user prompt.

        ``before`` goes in front of ``prompt_before_output`` and ``between``
        between it and the generated output.  The wrapping does not depend on
        the prompt's content, so the argument may be omitted.
        """
        if not isinstance(prompt_before_output, str):
            raise ValueError("wrap() takes the prompt text")
        before = self.user_prefix
        if self.default_system:
            before = self.system_prefix + self.default_system + self.turn_end + before
        return before, self.turn_end + self.assistant_prefix

    @classmethod
    def chatml(cls, default_system: str | None = None) -> ChatFormat:
        return cls(
            system_prefix="<|im_start|>system\n",
            user_prefix="<|im_start|>user\n",
            assistant_prefix="<|im_start|>assistant\n",
            turn_end="<|im_end|>\n",
            default_system=default_system,
        )

    @classmethod
    def llama3(cls, default_system: str | None = None) -> ChatFormat:
        return cls(
            system_prefix="<|start_header_id|>system<|end_header_id|>\n\n",
            user_prefix="<|start_header_id|>user<|end_header_id|>\n\n",
            assistant_prefix="<|start_header_id|>assistant<|end_header_id|>\n\n",
            turn_end="<|eot_id|>",
            default_system=default_system,
        )

    @classmethod
    def inst(cls) -> ChatFormat:
        """LLaMA-2 / Mistral ``[INST] prompt [/INST]`` (no system turn)."""
        return cls(system_prefix="", user_prefix="[INST] ", assistant_prefix="", turn_end=" [/INST]")


_CHATML_SYSTEM = re.compile(r"<\|im_start\|>system(?:\n|\\n)([^{}'\"+<>]+?)<\|im_end\|>")
_LLAMA3_SYSTEM = re.compile(
    r"<\|start_header_id\|>system<\|end_header_id\|>(?:\n|\\n){2}([^{}'\"+<>]+?)<\|eot_id\|>"
)


def detect_chat_format(vocab: Iterable[str], chat_template: str | None = None) -> ChatFormat | None:
    """Pick the chat markup from the vocabulary (and the Jinja template, if any).

    A literal default system prompt in the template (SmolLM2, Qwen2) becomes
    ``default_system``.
    """
    vocab = set(vocab)
    template = chat_template or ""
    if "<|im_start|>" in vocab:
        m = _CHATML_SYSTEM.search(template)
        return ChatFormat.chatml(m.group(1) if m else None)
    if "<|start_header_id|>" in vocab:
        m = _LLAMA3_SYSTEM.search(template)
        return ChatFormat.llama3(m.group(1) if m else None)
    if "[INST]" in vocab or "[INST]" in template:
        return ChatFormat.inst()
    return None
