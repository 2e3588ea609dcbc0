"""Constrained decoding on the engine: per-sequence grammar matchers and logit masks.

A generate whose sampling carries a :class:`~parrot.protocol.constraint.Constraint`
gets its own llguidance matcher when it starts (a fork gets its own, so forks of one
prompt each follow the grammar independently).  Before each sampling step the rows
of constrained generates have every token the grammar forbids set to ``-inf``
(greedy and sampled alike); after the step each matcher consumes the token drawn.
Unconstrained rows are left untouched, and a batch with none costs nothing.

Invariants: everything here runs on the engine's worker thread (matchers are not
shared between threads); compiled grammars are cached by ``(kind, spec)`` and each
generate deep-copies one, so compiling a constraint happens once per engine however
many requests use it; EOS is allowed exactly when the grammar accepts, and a grammar
that admits no further token (``is_stopped``) ends its generate at once.  A model
vocabulary larger than the tokenizer's (padding rows) has the extra ids masked.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from parrot.protocol.constraint import Constraint, InvalidConstraint
from parrot.protocol.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

MAX_CACHED_GRAMMARS = 64


class GrammarCache:
    """Compiled grammars of one engine's tokenizer, and the masks they give.

    The llguidance view of the tokenizer takes 0.3-0.5 s to build for a 49k-token
    vocabulary and holds the GIL all along (it would stall the process's event loop),
    so the engine builds it with :meth:`prepare` when it starts, before it serves."""

    def __init__(self, tokenizer: TextTokenizer, model_vocab: int):
        self.tokenizer = tokenizer
        self.model_vocab = model_vocab
        self._lltok: LLTokenizer | None = None
        self._compiled: OrderedDict[Constraint, LLMatcher] = OrderedDict()
        self.compiles = 0  # grammars compiled (cache misses), for tests and stats

    def prepare(self) -> None:
        """Build the llguidance view of the tokenizer now (see the class docstring)."""
        self._ll_tokenizer()

    def _ll_tokenizer(self) -> LLTokenizer:
        if self._lltok is None:
            from llguidance import LLTokenizer

            tok = self.tokenizer
            self._lltok = LLTokenizer(
                tok.to_dict()["tokenizer_json"], n_vocab=tok.vocab_size, eos_token=list(tok.eos_token_ids)
            )
        return self._lltok

    def matcher(self, constraint: Constraint) -> LLMatcher:
        """A fresh matcher at the start of ``constraint``'s language; InvalidConstraint
        if the grammar does not compile."""
        template = self._compiled.get(constraint)
        if template is None:
            from llguidance import LLMatcher

            template = LLMatcher(self._ll_tokenizer(), constraint.grammar(), log_level=0)
            if template.is_error():
                raise InvalidConstraint(
                    f"invalid {constraint.field}: {template.get_error().strip()[:500]}",
                    detail={"field": constraint.field},
                )
            self.compiles += 1
            self._compiled[constraint] = template
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(constraint)
        return template.deep_copy()

    def mask(self, logits: torch.Tensor, matchers: Sequence[LLMatcher | None]) -> torch.Tensor:
        """``logits`` [B, V] with each constrained row's forbidden tokens at ``-inf``: the same
        tensor when no row is constrained, else a new one (unconstrained rows copied as
        they are)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        batch, vocab = logits.shape
        words = (self._ll_tokenizer().vocab_size + 31) // 32
        bits = torch.empty((len(rows), words), dtype=torch.int32)  # [R, W]
        for r, i in enumerate(rows):
            m = matchers[i]
            assert m is not None
            m.unsafe_compute_mask_ptr(bits[r].data_ptr(), words * 4)
        allowed = _unpack(bits, vocab)  # [R, V] bool
        stuck = ~allowed.any(dim=1)  # a matcher in error allows nothing: let it end on EOS
        if bool(stuck.any()) and self.tokenizer.eos_token_ids:
            allowed[stuck, self.tokenizer.eos_token_ids[0]] = True
        if len(rows) < batch:  # unconstrained rows allow everything
            full = torch.ones((batch, vocab), dtype=torch.bool)
            allowed = full.index_copy_(0, torch.tensor(rows, dtype=torch.long), allowed)
        return torch.where(allowed, logits, float("-inf"))


def _unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bitmask [R, W] int32 (bit j of word w: token 32*w + j) -> bool [R, vocab]; ids past
    the bitmask (a model vocabulary padded beyond the tokenizer's) are False."""
    as_bytes = bits.numpy().astype("<i4", copy=False).view(np.uint8)  # little-endian words
    flat = torch.from_numpy(np.unpackbits(as_bytes, axis=1, bitorder="little"))  # [R, 32W] uint8
    if flat.shape[1] >= vocab:
        return flat[:, :vocab].bool()
    out = torch.zeros((bits.shape[0], vocab), dtype=torch.bool)
    out[:, : flat.shape[1]] = flat.bool()
    return out


def advance(matcher: Any, token: int) -> str | None:
    """Feed the sampled ``token`` to ``matcher``.  Returns ``"stop"`` when the grammar
    admits nothing more (its output is complete), ``"error"`` when the matcher refused the
    token or failed (its message is in ``matcher.get_error()``), else None."""
    if not matcher.consume_token(token) or matcher.is_error():
        return "error"
    return "stop" if matcher.is_stopped() else None
