"""Next-token selection for a batch of rows, each with its own sampling settings.

Invariants: a row with presence/frequency penalties first has its logits lowered
for the tokens it generated so far (OpenAI's formula, :class:`SamplingParams`);
rows without them are left bit-for-bit as they came.  Greedy rows
(``temperature == 0`` or ``top_k == 1``) return the argmax (lowest id on ties)
and consume no randomness; other rows apply, in order, temperature, top-k,
top-p (nucleus, always keeping the most likely token) and then draw with the
row's own ``torch.Generator``, consuming exactly one uniform number from it, so
a fixed seed reproduces a row whatever else is in the batch.  The returned id
always has non-zero probability after the filters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import TokenLogprob

_SEED_MASK = (1 << 64) - 1


def make_generator(seed: int | None) -> torch.Generator | None:
    """A CPU generator seeded with ``seed`` (any int; taken modulo 2**64), or None for no seed."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer or None, got {seed!r}")
    return torch.Generator(device="cpu").manual_seed(seed & _SEED_MASK)


def penalize(
    logits: Tensor, params: Sequence[SamplingParams], counts: Sequence[dict[int, int] | None]
) -> Tensor:
    """``logits`` [B, V] with OpenAI's presence/frequency penalties applied to each
    penalised row (``counts[i]``: how often row i generated each token so far); the same
    tensor when no row is penalised, else a copy."""
    rows = [i for i, p in enumerate(params) if p.penalized and counts[i]]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        seen = counts[i]
        assert seen is not None
        ids = torch.tensor(list(seen), dtype=torch.long, device=logits.device)  # [K]
        times = torch.tensor(list(seen.values()), dtype=torch.float32, device=logits.device)  # [K]
        p = params[i]
        logits[i, ids] -= times * p.frequency_penalty + p.presence_penalty
    return logits


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    counts: Sequence[dict[int, int] | None] | None = None,
) -> Tensor:
    """Pick one token per row of ``logits`` [B, V] (float32); returns int64 [B].

    ``generators[i]`` drives row i (None: torch's global generator); ``counts[i]``
    (needed for penalised rows only) maps each token row i generated so far to how
    many times it did.
    """
    if not isinstance(logits, Tensor) or logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError("logits must be a float32 tensor of shape [B, V]")
    batch, vocab = logits.shape
    if len(params) != batch or len(generators) != batch:
        raise ValueError(f"{batch} rows of logits but {len(params)} params and {len(generators)} generators")
    if vocab == 0:
        raise ValueError("logits have an empty vocabulary")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(p).__name__}")
    if counts is not None:
        if len(counts) != batch:
            raise ValueError(f"{batch} rows of logits but {len(counts)} counts")
        logits = penalize(logits, params, counts)
    # One pass over the logits: a row's max is NaN if it holds a NaN, +inf if it holds
    # +inf, -inf if it is all -inf; its index is the argmax (the first on ties).
    best, out = logits.max(dim=-1)  # [B], [B]
    if not bool(torch.isfinite(best).all()):
        if bool((torch.isnan(best) | torch.isposinf(best)).any()):
            raise ValueError("logits contain NaN or +inf")
        raise ValueError("a row of logits is entirely -inf")

    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    on = logits.device  # every tensor below lives with the logits (CPU or CUDA)
    idx = torch.tensor(rows, dtype=torch.long, device=on)  # [R]
    temps = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32, device=on)  # [R]
    top_k = torch.tensor([params[i].top_k or vocab for i in rows], dtype=torch.long, device=on)  # [R]
    top_k = top_k.clamp(max=vocab)
    top_p = torch.tensor([params[i].top_p for i in rows], dtype=torch.float32, device=on)  # [R]

    scaled = logits[idx] / temps[:, None]  # [R, V]
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [R, V] each
    ranks = torch.arange(vocab, device=on)[None, :]  # [1, V]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))  # top-k, [R, V]
    probs = torch.softmax(sorted_logits, dim=-1)  # [R, V]
    mass_before = probs.cumsum(dim=-1) - probs  # [R, V]: probability of strictly better tokens
    drop = (mass_before >= top_p[:, None]) & (ranks > 0)  # top-p, never the best token
    probs = probs.masked_fill(drop, 0.0)  # [R, V]
    cdf = probs.cumsum(dim=-1)  # [R, V], non-decreasing, cdf[:, -1] = kept mass
    # drawn on the CPU generators whatever the device: a seed gives the same draws anywhere
    u = torch.stack([torch.rand((), generator=generators[i]) for i in rows]).to(on)  # [R] in [0, 1)
    target = (u * cdf[:, -1])[:, None]  # [R, 1] in [0, kept mass)
    pick = torch.searchsorted(cdf, target, right=True).clamp(max=vocab - 1)  # [R, 1]: first cdf > target
    out[idx] = order.gather(1, pick).squeeze(1)  # [R]
    return out


def token_logprobs(logits: Tensor, tokens: Sequence[int], top: Sequence[int]) -> list[TokenLogprob]:
    """Per row of ``logits`` [B, V]: the log-probability of ``tokens[i]`` and of the
    ``top[i]`` most likely tokens (log-softmax over the whole vocabulary, most likely
    first, lowest id first on ties)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    k = min(max(top, default=0), logp.shape[-1])
    values, ids = logp.topk(k, dim=-1, sorted=True) if k else (None, None)  # [B, k] each
    picked = torch.tensor(list(tokens), dtype=torch.long, device=logp.device)[:, None]  # [B, 1]
    chosen = logp.gather(1, picked).squeeze(1).tolist()
    out = []
    for i, token in enumerate(tokens):
        pairs: list[tuple[int, float]] = []
        if top[i] and values is not None and ids is not None:
            pairs = list(zip(ids[i, : top[i]].tolist(), values[i, : top[i]].tolist(), strict=True))
        out.append(TokenLogprob(token_id=int(token), logprob=float(chosen[i]), top=pairs))
    return out


def logprobs_of(
    logits: Tensor, params: Sequence[SamplingParams], tokens: Sequence[int]
) -> list[TokenLogprob | None]:
    """Per row, the logprobs its sampling asked for (``params[i].logprobs``) of the token
    it drew, ``tokens[i]``; None for rows that did not ask (left untouched)."""
    out: list[TokenLogprob | None] = [None] * len(tokens)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if rows:
        got = token_logprobs(logits[rows], [tokens[i] for i in rows], [params[i].logprobs or 0 for i in rows])
        for i, lp in zip(rows, got, strict=True):
            out[i] = lp
    return out
