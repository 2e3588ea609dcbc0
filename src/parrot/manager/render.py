"""Turn a call whose inputs are materialised into engine steps.

A call's template becomes an alternation of *fill* steps (constant text and
input values, tokenized piece by piece so a constant prefix always yields the
same tokens whatever follows it) and *generate* steps (one per output, in
template order).  Everything runs in one engine context, so text after an
output is conditioned on what was generated.

With ``chat=True`` the model's chat format wraps the prompt: its opening text
goes before the template and the assistant-turn marker right before the
output, which must then be the template's last element; whitespace at the
edges of the user's text is dropped.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from parrot.manager.graph import Call, OutputSpec, Variable
from parrot.manager.prefix import prefix_keys, user_pieces
from parrot.protocol.errors import BadRequest, ContextTooLong
from parrot.protocol.template import Placeholder, Template, Text
from parrot.protocol.tokenizer import TextTokenizer


@dataclass
class FillStep:
    tokens: list[int]


@dataclass
class GenerateStep:
    output: OutputSpec


Step = FillStep | GenerateStep


def check_chat_shape(template: Template) -> None:
    """``chat=True`` needs exactly one output, at the end (trailing whitespace allowed)."""
    pieces = list(template.pieces)
    while pieces and isinstance(pieces[-1], Text) and not pieces[-1].text.strip():
        pieces.pop()
    outputs = [p for p in pieces if isinstance(p, Placeholder) and p.direction == "output"]
    if len(outputs) != 1 or pieces[-1] is not outputs[0]:
        raise BadRequest(
            "with chat=True the template must have exactly one output placeholder, as its last element",
            code="invalid_template",
        )


def check_starts_with_text(template: Template) -> None:
    """A call needs an output to generate, and a prompt before its first output."""
    if not any(p.direction == "output" for p in template.placeholders):
        raise BadRequest(
            "the template has no output placeholder: nothing to generate", code="invalid_template"
        )
    first = template.pieces[0] if template.pieces else None
    if isinstance(first, Placeholder) and first.direction == "output":
        raise BadRequest(
            "a template cannot start with an output: there is no prompt to generate from",
            code="invalid_template",
        )


def input_text(value: Variable | str) -> str:
    if isinstance(value, Variable):
        if value.value is None:
            raise RuntimeError(f"variable {value.var_id} is not materialised")
        return value.value
    return value


@dataclass
class Rendered:
    steps: list[Step]
    # (prefix key, tokens before that boundary) at each constant->variable
    # boundary before the first output, outermost first; keys as in
    # :func:`parrot.manager.prefix.prefix_keys`
    prefixes: list[tuple[str, int]]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.steps if isinstance(s, FillStep))


@functools.lru_cache(maxsize=256)
def _constant_tokens(tokenizer: TextTokenizer, text: str) -> tuple[int, ...]:
    """Token ids of a template's constant text.  Calls of one template repeat the same
    text (a long system prompt would be tokenized again for every call), so it is
    tokenized once per tokenizer and text; input values are not cached."""
    return tuple(tokenizer.encode(text))


def render(call: Call, tokenizer: TextTokenizer, max_seq_len: int) -> Rendered:
    """Engine steps for ``call``; raises ContextTooLong if the prompt cannot fit."""
    pieces = user_pieces(call)
    before = between = ""
    if call.chat:
        if tokenizer.chat is None:
            raise BadRequest("this model has no chat format; submit with chat=false", code="no_chat_format")
        before, between = tokenizer.chat.wrap()
    keys = iter(prefix_keys(call))
    prefixes: list[tuple[str, int]] = []
    steps: list[Step] = []
    pending: list[int] = []
    if tokenizer.add_bos and tokenizer.bos_token_id is not None:
        pending.append(tokenizer.bos_token_id)
    if before:
        pending.extend(_constant_tokens(tokenizer, before))
    total = 0
    seen_output = False
    for i, piece in enumerate(pieces):
        if isinstance(piece, Text):
            pending.extend(_constant_tokens(tokenizer, piece.text))
            if not seen_output and i + 1 < len(pieces) and isinstance(pieces[i + 1], Placeholder):
                prefixes.append((next(keys), total + len(pending)))
        elif piece.direction == "input":
            pending.extend(tokenizer.encode(input_text(call.inputs[piece.name])))
        else:
            seen_output = True
            if between:
                pending.extend(_constant_tokens(tokenizer, between))
            if pending:
                steps.append(FillStep(pending))
                total += len(pending)
                pending = []
            steps.append(GenerateStep(call.outputs[piece.name]))
    if pending:
        steps.append(FillStep(pending))
        total += len(pending)
    if total >= max_seq_len:
        raise ContextTooLong(
            f"the rendered prompt has {total} tokens; the model's context is {max_seq_len} "
            "(generation needs at least one more)",
            detail={"prompt_tokens": total, "max_seq_len": max_seq_len},
        )
    if steps and isinstance(steps[0], GenerateStep):
        raise BadRequest("the rendered prompt before the first output is empty", code="empty_prompt")
    return Rendered(steps, prefixes)
