"""Validating what a client sends before anything changes: a call's template and
bindings, built into a :class:`StagedCall` (unlinked, outside its session), and the
lengths of values and prompts, whose long text is tokenized off the event loop
(:meth:`CallStaging.run_tokenized`, :mod:`parrot.manager.dag.tokens`).

:class:`CallStaging` is one part of :class:`~parrot.manager.service.Manager` (which
inherits it).  Invariant: nothing here changes a session, a variable or the graph; an
operation that put off a check for text not tokenized yet stops at
:meth:`CallStaging.settle_tokens`, before its first change, and runs again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from parrot.manager.backends.pool import EngineHandle, EnginePool
from parrot.manager.config import ManagerConfig
from parrot.manager.dag.graph import (
    Call,
    Criteria,
    OutputSpec,
    PreRendered,
    Session,
    Variable,
    add_forks,
    new_id,
)
from parrot.manager.dag.render import check_chat_shape, check_starts_with_text, render
from parrot.manager.dag.tokens import NeedsTokenizing, TokenSource, utf8_len
from parrot.manager.tenants import cache_salt
from parrot.protocol.errors import BindingError, ContextTooLong, ParrotError
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import PlaceholderBinding, SubmitCall
from parrot.protocol.template import Template, parse_template
from parrot.protocol.transforms import parse_transforms

__all__ = ["CallStaging", "StagedCall", "VarLookup", "inline_bytes", "value_bytes"]

log = logging.getLogger(__name__)

MAX_TOKENIZING_PASSES = 16
"""Passes of :meth:`Manager.run_tokenized` before it gives up deferring (never reached:
each pass defers only text not tokenized yet, and a request holds finitely many)."""

T = TypeVar("T")

VarLookup = Callable[[PlaceholderBinding], Variable | None]
"""The variable a binding names (raises if it names an unknown one), or None if it names none."""


@dataclass
class StagedCall:
    """A validated call not yet linked into the graph nor added to its session."""

    call: Call
    new_vars: list[Variable]  # its outputs' fresh variables, not in the session yet
    criteria: dict[str, Criteria]  # output name -> criteria to put on its variable when added


class CallStaging:
    """The validating part of :class:`~parrot.manager.service.Manager` (see the module
    docstring); it reads the manager's ``config``, ``pool`` and token source."""

    config: ManagerConfig
    pool: EnginePool
    _tokens: TokenSource | None  # that of the operation run_tokenized is running (None: at once)

    # ------------------------------------------------------ tokenization
    async def run_tokenized(self, op: Callable[[], T]) -> T:
        """Run the synchronous operation ``op`` without tokenizing long text on the
        event loop, and return what it returns.

        ``op`` runs in passes, each synchronous from its first check to its last
        change.  In a pass, long text not tokenized yet is recorded and its check
        put off (a value's length, a prompt rendered at submit); the operation then
        stops at :meth:`settle_tokens`, before it changes anything, or at an error.
        Between passes the recorded text is tokenized in worker threads, and the
        next pass finds it.  The pass that records nothing is the one whose outcome
        (result or error) counts, so callers see the errors, in the order, of an
        operation that tokenized everything itself.  ``op`` must take everything
        it uses from the manager's state afresh (authorize the session in it):
        other requests run between passes."""
        source = TokenSource(self.config.inline_tokenize_bytes)
        for _ in range(MAX_TOKENIZING_PASSES):
            source.start_pass()
            self._tokens = source
            try:
                return op()
            except (NeedsTokenizing, ParrotError):
                if not source.pending:
                    raise
            finally:
                self._tokens = None
            await source.resolve()
        log.warning("an operation still deferred tokenization after %d passes", MAX_TOKENIZING_PASSES)
        return op()

    def settle_tokens(self) -> None:
        """Every operation calls this after validating and before changing anything:
        if a check was put off (its text is to be tokenized off the loop), the
        operation stops here, unchanged, and :meth:`run_tokenized` runs it again."""
        if self._tokens is not None and self._tokens.pending:
            raise NeedsTokenizing("the request's text is being tokenized")

    def _check_value_length(self, value: str, longest: EngineHandle | None = None) -> None:
        """Reject a value no engine could hold (``longest``: the live engine with
        the longest context, if the caller already looked it up).

        A value over ``max_seq_len * max_token_bytes`` bytes is rejected without
        being tokenized; a long one is counted off the loop (the check is put off,
        see :meth:`run_tokenized`)."""
        longest = longest or self.pool.longest_context(None)
        if longest is None:
            return
        n_bytes = utf8_len(value)
        if n_bytes <= longest.max_seq_len:  # every token spans at least one UTF-8 byte
            return
        tokenizer = longest.api.tokenizer
        at_least = tokenizer.min_tokens(value)
        if at_least > longest.max_seq_len:
            raise ContextTooLong(
                f"value has at least {at_least} tokens ({n_bytes} bytes, at most "
                f"{tokenizer.max_token_bytes} per token); the longest model context is {longest.max_seq_len}",
                detail={"min_tokens": at_least, "bytes": n_bytes, "max_seq_len": longest.max_seq_len},
            )
        got = (self._tokens or TokenSource(None)).get(tokenizer, value, keep_ids=longest.max_seq_len)
        if got is None:
            return  # put off until it is tokenized (settle_tokens stops the operation)
        if got.count > longest.max_seq_len:
            raise ContextTooLong(
                f"value has {got.count} tokens; the longest model context is {longest.max_seq_len}",
                detail={"tokens": got.count, "max_seq_len": longest.max_seq_len},
            )

    def stage_call(
        self,
        session: Session,
        req: SubmitCall,
        lookup: VarLookup,
        *,
        prompt_ids: tuple[int, ...] | None = None,
        samples: int = 1,
    ) -> StagedCall:
        """Validate ``req`` and build its call, unlinked: the session and every
        variable in it are left untouched (outputs that need a fresh variable get
        one in ``StagedCall.new_vars``, outside the session).  ``prompt_ids``: the
        prompt as token ids, filled in place of the template's text; ``samples``: how
        many samples of its last output (:func:`~parrot.manager.dag.graph.add_forks`)."""
        template, bindings = _bound_template(req)
        names = template.names
        check_starts_with_text(template)
        if req.chat:
            check_chat_shape(template)

        longest = self.pool.longest_context(req.model)  # what the prompt must fit
        inputs: dict[str, Variable | str] = {}
        outputs: dict[str, OutputSpec] = {}
        new_vars: list[Variable] = []
        for name in names:
            b = bindings[name]
            if template.direction_of(name) == "input":
                inputs[name] = self._bind_input(b, lookup, longest)
            else:
                outputs[name] = self._bind_output(session, b, lookup, new_vars)

        call = Call(
            new_id("c"),
            session.session_id,
            req.name,
            template,
            inputs,
            outputs,
            model=req.model,
            chat=req.chat,
            tenant=session.tenant,
            cache_salt=cache_salt(session.tenant, self.config.prefix_sharing),
            prompt_ids=prompt_ids,
        )
        if samples > 1:
            new_vars.extend(add_forks(call, samples))
        self._check_rendered_length(call, longest)
        criteria = {n: c for n in outputs if (c := bindings[n].criteria) is not None}
        return StagedCall(call, new_vars, criteria)

    def _bind_input(
        self, b: PlaceholderBinding, lookup: VarLookup, longest: EngineHandle | None
    ) -> Variable | str:
        var = lookup(b)
        if (var is None) == (b.value is None):
            raise BindingError(
                f"input {b.name!r} needs exactly one of 'var_id' (or a batch 'ref') or 'value'"
            )
        if b.sampling is not None or b.transform is not None or b.criteria is not None:
            raise BindingError(f"input {b.name!r} cannot carry sampling, transform or criteria")
        if b.value is not None:
            self._check_value_length(b.value, longest)
            return b.value
        return var  # type: ignore[return-value]

    def _bind_output(
        self, session: Session, b: PlaceholderBinding, lookup: VarLookup, new_vars: list[Variable]
    ) -> OutputSpec:
        if b.value is not None:
            raise BindingError(f"output {b.name!r} cannot have a value")
        sampling = SamplingParams.from_dict(b.sampling)
        transform = parse_transforms(b.transform)
        var = lookup(b)
        if var is None:
            var = Variable(new_id("v"), session.session_id, name=b.name)
            new_vars.append(var)
        return OutputSpec(b.name, var, sampling, transform)

    def _check_rendered_length(self, call: Call, longest: EngineHandle | None) -> None:
        """Reject at submit a prompt that can never fit, when all inputs are known."""
        if not all(v.state == "ready" for v in call.input_vars()):
            return
        if longest is None:
            return
        try:
            rendered = render(call, longest.api.tokenizer, longest.max_seq_len, self._tokens)
        except NeedsTokenizing:
            return  # put off until it is tokenized (settle_tokens stops the operation)
        call.rendered = PreRendered(longest.model, rendered, longest.max_seq_len)


def value_bytes(value: str | None) -> int:
    """What a client-supplied value counts against its tenant's quota: its UTF-8 bytes."""
    return 0 if value is None else utf8_len(value)


def inline_bytes(req: SubmitCall) -> int:
    """Bytes of the constant inputs a call binds inline."""
    return sum(value_bytes(b.value) for b in req.placeholders)


def _bound_template(req: SubmitCall) -> tuple[Template, dict[str, PlaceholderBinding]]:
    """``req``'s template with every placeholder's direction (its binding's, else the
    template's, else output when the binding samples or transforms) and its bindings by
    name; BindingError for a placeholder without a binding or a binding without one."""
    template = parse_template(req.template)
    bindings = _index_bindings(req.placeholders)
    missing = [n for n in template.names if n not in bindings]
    if missing:
        raise BindingError(f"placeholder(s) {missing} have no binding")
    extra = [n for n in bindings if n not in template.names]
    if extra:
        raise BindingError(f"binding(s) {extra} match no placeholder in the template")
    directions = {}
    for name, b in bindings.items():
        if b.direction is not None:
            directions[name] = b.direction
        elif template.direction_of(name) is None:
            directions[name] = "output" if (b.sampling is not None or b.transform is not None) else "input"
    return template.with_directions(directions), bindings


def _index_bindings(bindings: list[PlaceholderBinding]) -> dict[str, PlaceholderBinding]:
    out: dict[str, PlaceholderBinding] = {}
    for b in bindings:
        if not b.name:
            raise BindingError("a binding has an empty name")
        if b.name in out:
            raise BindingError(f"placeholder {b.name!r} is bound twice")
        out[b.name] = b
    return out
