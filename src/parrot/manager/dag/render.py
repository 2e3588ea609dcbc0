"""Turn a call whose inputs are materialised into engine steps.

A call's template becomes an alternation of *fill* steps and *generate* steps
(one per output, in template order); everything runs in one engine context, so
text after an output is conditioned on what was generated.

What the model sees is what a request-level client would send: the text
before the first output (constant text and input values, with the chat markup
of ``chat=True``) is rendered into one string and tokenized *as a whole*, so
the first fill holds exactly the tokens of ``POST /v1/completions`` with that
string as its prompt (BOS first where the model wants one).  Text between two
outputs is likewise one string, tokenized on its own: it follows generated
tokens, which a string cannot reproduce.  Shared prefixes need no special
cutting: the engine's prefix cache reuses whole KV blocks by their tokens.

With ``chat=True`` the model's chat format wraps the prompt: its opening text
goes before the template and the assistant-turn marker right before the
output, which must then be the template's last element; whitespace at the
edges of the user's text is dropped.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from parrot.manager.dag.graph import Call, OutputSpec, Variable
from parrot.manager.dag.prefix import leading_text_key, user_pieces
from parrot.manager.dag.tokens import NeedsTokenizing, TokenSource, utf8_len
from parrot.protocol.errors import BadRequest, ContextTooLong
from parrot.protocol.template import Piece, Placeholder, Template, Text
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
    # (prefix key, its tokens) of the leading constant text (a system prompt), when the
    # template starts with one: the part of the prompt that calls of the same template
    # share whatever their inputs; key: parrot.manager.dag.prefix.leading_text_key
    constant_prefix: tuple[str, int] | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.steps if isinstance(s, FillStep))

    @property
    def first_fill_tokens(self) -> int:
        """Tokens of the prompt before the first output."""
        first = self.steps[0] if self.steps else None
        return len(first.tokens) if isinstance(first, FillStep) else 0


_CONSTANT_TOKENS: OrderedDict[tuple[TextTokenizer, bytes], int] = OrderedDict()
_CONSTANT_TOKENS_ENTRIES = 256


def _constant_tokens(tokenizer: TextTokenizer, text: str, tokens: TokenSource | None = None) -> int | None:
    """How many tokens a template's leading constant text has (calls of one template
    repeat it: a long system prompt is tokenized once per tokenizer, not per call);
    None when ``tokens`` deferred it (long text, tokenized off the loop; without
    ``tokens``, everything is tokenized here).

    The cache keeps a 16-byte digest of the text, not the text, so its memory is bounded
    in bytes (a few hundred bytes per entry, :data:`_CONSTANT_TOKENS_ENTRIES` entries)
    however long the templates are; least recently used entries go first."""
    key = (tokenizer, hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest())
    count = _CONSTANT_TOKENS.get(key)
    if count is None:
        got = (tokens or TokenSource(None)).get(tokenizer, text, keep_ids=0)
        if got is None:
            return None
        count = got.count
        _CONSTANT_TOKENS[key] = count
        if len(_CONSTANT_TOKENS) > _CONSTANT_TOKENS_ENTRIES:
            _CONSTANT_TOKENS.popitem(last=False)
    else:
        _CONSTANT_TOKENS.move_to_end(key)
    return count


def render(
    call: Call, tokenizer: TextTokenizer, max_seq_len: int, tokens: TokenSource | None = None
) -> Rendered:
    """Engine steps for ``call``; raises ContextTooLong if the prompt cannot fit.

    ``tokens`` says where long text is tokenized (:mod:`parrot.manager.dag.tokens`): with
    a deferring source, text it has not tokenized yet raises NeedsTokenizing (every
    such text of the call recorded at once); without one, everything is tokenized
    here.  A prompt that has more UTF-8 bytes than ``max_seq_len`` tokens can hold is
    rejected before anything is tokenized."""
    if call.prompt_ids is not None:
        return _render_ids(call, call.prompt_ids, tokenizer, max_seq_len)
    source = tokens if tokens is not None else TokenSource(None)
    pieces = user_pieces(call)
    before = between = ""
    if call.chat:
        if tokenizer.chat is None:
            raise BadRequest("this model has no chat format; submit with chat=false", code="no_chat_format")
        before, between = tokenizer.chat.wrap()
    fills = _fill_texts(call, pieces, before, between)
    bos = tokenizer.bos_token_id if tokenizer.add_bos else None
    _check_fits(fills, tokenizer, max_seq_len, bos is not None)
    got = [source.get(tokenizer, text, keep_ids=max_seq_len) for text, _ in fills]
    constant = _leading_constant(call, pieces, before, tokenizer, source)  # after: records it too
    if any(g is None for g in got):
        raise NeedsTokenizing(f"call {call.call_id}: its prompt is being tokenized")
    steps: list[Step] = []
    total = 0
    for i, ((_, output), tokenized) in enumerate(zip(fills, got, strict=True)):
        assert tokenized is not None
        ids = [] if tokenized.ids is None else list(tokenized.ids)
        count = tokenized.count
        if i == 0 and bos is not None:
            ids.insert(0, bos)
            count += 1
        if count:
            steps.append(FillStep(ids))
            total += count
        steps.append(GenerateStep(output))
    if total >= max_seq_len:
        raise ContextTooLong(
            f"the rendered prompt has {total} tokens; the model's context is {max_seq_len} "
            "(generation needs at least one more)",
            detail={"prompt_tokens": total, "max_seq_len": max_seq_len},
        )
    if steps and isinstance(steps[0], GenerateStep):
        raise BadRequest("the rendered prompt before the first output is empty", code="empty_prompt")
    return Rendered(steps, constant)


def _render_ids(call: Call, ids: tuple[int, ...], tokenizer: TextTokenizer, max_seq_len: int) -> Rendered:
    """The steps of a token-id prompt: its ids filled as given (no BOS added, as OpenAI
    and vLLM take them), then the call's one output.  Raises BadRequest for an id outside
    the vocabulary or an empty prompt, ContextTooLong when no token fits after it."""
    if not ids:
        raise BadRequest("the token-id prompt is empty", code="empty_prompt")
    bad = next((t for t in ids if not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise BadRequest(
            f"token id {bad} is outside the model's vocabulary [0, {tokenizer.vocab_size})",
            code="invalid_token_id",
        )
    if len(ids) >= max_seq_len:
        raise ContextTooLong(
            f"the prompt has {len(ids)} tokens; the model's context is {max_seq_len} "
            "(generation needs at least one more)",
            detail={"prompt_tokens": len(ids), "max_seq_len": max_seq_len},
        )
    (output,) = call.outputs.values()
    return Rendered([FillStep(list(ids)), GenerateStep(output)])


def _fill_texts(call: Call, pieces: list[Piece], before: str, between: str) -> list[tuple[str, OutputSpec]]:
    """The string of each fill, with the output generated right after it, in order.
    Text after the last output is never filled: nothing reads it."""
    fills: list[tuple[str, OutputSpec]] = []
    text: list[str] = [before]  # the string of the fill being assembled
    for piece in pieces:
        if isinstance(piece, Text):
            text.append(piece.text)
        elif piece.direction == "input":
            text.append(input_text(call.inputs[piece.name]))
        else:
            text.append(between)
            fills.append(("".join(text), call.outputs[piece.name]))
            text.clear()
    return fills


def _check_fits(
    fills: list[tuple[str, OutputSpec]], tokenizer: TextTokenizer, max_seq_len: int, bos: bool
) -> None:
    """Reject, without tokenizing, a prompt whose bytes alone make more tokens than
    the context holds (:meth:`TextTokenizer.min_tokens`)."""
    if tokenizer.max_token_bytes is None:
        return
    at_least = int(bos) + sum(tokenizer.min_tokens(text) for text, _ in fills)
    if at_least >= max_seq_len:
        n_bytes = sum(utf8_len(text) for text, _ in fills)
        raise ContextTooLong(
            f"the rendered prompt has at least {at_least} tokens ({n_bytes} bytes, at most "
            f"{tokenizer.max_token_bytes} per token); the model's context is {max_seq_len} "
            "(generation needs at least one more)",
            detail={"min_prompt_tokens": at_least, "prompt_bytes": n_bytes, "max_seq_len": max_seq_len},
        )


def _leading_constant(
    call: Call, pieces: list[Piece], before: str, tokenizer: TextTokenizer, tokens: TokenSource
) -> tuple[str, int] | None:
    """(key, tokens) of the template's leading constant text, if it starts with one;
    raises NeedsTokenizing when ``tokens`` deferred its tokenization."""
    key = leading_text_key(call)
    first = pieces[0] if pieces else None
    if key is None or not isinstance(first, Text):
        return None
    count = _constant_tokens(tokenizer, before + first.text, tokens)
    if count is None:
        raise NeedsTokenizing(f"call {call.call_id}: its system prompt is being tokenized")
    return key, count
