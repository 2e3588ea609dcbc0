"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from parrot.engine.sampler import make_generator, penalize, sample
from parrot.protocol.errors import InvalidSampling
from parrot.protocol.sampling import SamplingParams

GREEDY = SamplingParams()


def _logits(batch: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed))


def _draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    g = make_generator(seed)
    return [int(sample(logits, [params], [g])[0]) for _ in range(n)]


def test_greedy_is_argmax() -> None:
    logits = _logits()
    out = sample(logits, [GREEDY] * 3, [None] * 3)
    assert out.dtype == torch.long and out.shape == (3,)
    assert torch.equal(out, logits.argmax(dim=-1))


def test_top_k_one_is_greedy_even_when_hot() -> None:
    logits = _logits(vocab=200)
    hot = SamplingParams(temperature=5.0, top_k=1)
    for seed in range(5):
        assert torch.equal(sample(logits, [hot] * 3, [make_generator(seed)] * 3), logits.argmax(dim=-1))


def test_fixed_seed_reproduces_and_seeds_differ() -> None:
    logits = torch.zeros(1, 1000)  # uniform: any difference between seeds shows
    params = SamplingParams(temperature=1.0, seed=7)
    a, b = _draw(logits, params, 20, seed=7), _draw(logits, params, 20, seed=7)
    assert a == b
    assert _draw(logits, params, 20, seed=8) != a
    assert len(set(a)) > 10  # it is really sampling


def test_row_reproducible_whatever_the_batch() -> None:
    logits = _logits(batch=1, vocab=500)
    hot = SamplingParams(temperature=2.0, seed=3)
    alone = [int(sample(logits, [hot], [g])[0]) for g in [make_generator(3)] for _ in range(10)]
    g, noise = make_generator(3), make_generator(99)
    batch = torch.cat([_logits(batch=1, vocab=500, seed=5), logits, _logits(batch=1, vocab=500, seed=6)])
    mixed = [int(sample(batch, [hot, hot, GREEDY], [noise, g, None])[1]) for _ in range(10)]
    assert mixed == alone


def test_tiny_top_p_keeps_only_the_best() -> None:
    logits = _logits(batch=2, vocab=100)
    p = SamplingParams(temperature=3.0, top_p=1e-6)
    for seed in range(10):
        assert torch.equal(sample(logits, [p, p], [make_generator(seed), None]), logits.argmax(dim=-1))


def test_top_p_boundary() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    counts = Counter(_draw(logits, SamplingParams(temperature=1.0, top_p=0.6), 300))
    assert set(counts) == {0, 1}  # 0.5 < 0.6 so token 1 is kept; 0.8 >= 0.6 so token 2 is not
    assert counts[0] / 300 == pytest.approx(0.5 / 0.8, abs=0.08)


def test_top_k_restricts_to_best_k() -> None:
    logits = _logits(batch=1, vocab=100, seed=2)
    best = set(logits[0].topk(5).indices.tolist())
    drawn = set(_draw(logits, SamplingParams(temperature=10.0, top_k=5), 200))
    assert drawn == best


def test_distribution_follows_temperature() -> None:
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = torch.log(probs)[None, :]
    n = 3000
    counts = Counter(_draw(logits, SamplingParams(temperature=1.0), n, seed=1))
    for tok, p in enumerate(probs.tolist()):
        assert counts[tok] / n == pytest.approx(p, abs=0.03)
    hot = Counter(_draw(logits, SamplingParams(temperature=2.0), n, seed=2))
    sharpened = torch.softmax(torch.log(probs) / 2.0, dim=0)
    assert hot[2] / n == pytest.approx(float(sharpened[2]), abs=0.03)


def test_masked_tokens_never_drawn() -> None:
    logits = torch.full((1, 10), -math.inf)
    logits[0, 3], logits[0, 7] = 0.0, 0.0
    assert set(_draw(logits, SamplingParams(temperature=1.0), 100)) == {3, 7}


def test_make_generator() -> None:
    assert make_generator(None) is None
    g = make_generator(-5)  # negative seeds are fine (taken modulo 2**64)
    assert isinstance(g, torch.Generator)
    assert make_generator(2**70) is not None
    for bad in (True, 1.5, "1"):
        with pytest.raises(ValueError, match="seed"):
            make_generator(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("logits", "params", "gens", "needle"),
    [
        (torch.zeros(2, 5, dtype=torch.float64), [GREEDY] * 2, [None] * 2, "float32"),
        (torch.zeros(5), [GREEDY], [None], r"\[B, V\]"),
        (torch.zeros(2, 5), [GREEDY], [None] * 2, "rows"),
        (torch.zeros(2, 5), [GREEDY] * 2, [None], "rows"),
        (torch.tensor([[0.0, math.nan]]), [GREEDY], [None], "NaN"),
        (torch.tensor([[0.0, math.inf]]), [GREEDY], [None], r"\+inf"),
        (torch.full((1, 3), -math.inf), [GREEDY], [None], "entirely -inf"),
        # one bad row among good ones (a NaN next to the row's max, a NaN in a row with +inf)
        (torch.tensor([[0.0, 1.0], [5.0, math.nan]]), [GREEDY] * 2, [None] * 2, "NaN"),
        (torch.tensor([[math.inf, math.nan], [0.0, 1.0]]), [GREEDY] * 2, [None] * 2, "NaN"),
        (torch.tensor([[-math.inf, 1.0], [-math.inf, -math.inf]]), [GREEDY] * 2, [None] * 2, "entirely -inf"),
        (torch.zeros(1, 3), [{"temperature": 1.0}], [None], "SamplingParams"),
    ],
)
def test_invalid_inputs(logits: torch.Tensor, params: list, gens: list, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        sample(logits, params, gens)


def test_greedy_takes_the_lowest_id_on_ties_and_skips_minus_inf() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0], [-math.inf, -math.inf, -5.0]])
    assert sample(logits, [GREEDY] * 3, [None] * 3).tolist() == [1, 0, 2]


# ------------------------------------------------------------------ penalties


def test_penalties_follow_openais_formula() -> None:
    logits = _logits(batch=2, vocab=10)
    pen = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5)
    counts: list[dict[int, int] | None] = [{3: 2, 5: 1}, None]
    out = penalize(logits, [pen, GREEDY], counts)
    expected = logits.clone()
    expected[0, 3] -= 2 * 0.5 + 1.0
    expected[0, 5] -= 1 * 0.5 + 1.0
    assert torch.equal(out, expected)
    assert torch.equal(out[1], logits[1])  # the row without penalties is untouched


def test_rows_without_penalties_are_bit_identical() -> None:
    logits = _logits(batch=3, vocab=40)
    before = logits.clone()
    params = [GREEDY, SamplingParams(temperature=0.8, seed=1), GREEDY]
    assert penalize(logits, params, [{1: 3}, {2: 1}, None]) is logits  # no row is penalised: no copy
    plain = sample(logits, params, [None, make_generator(5), None])
    counted = sample(logits, params, [None, make_generator(5), None], counts=[{1: 3}, {2: 1}, None])
    assert torch.equal(plain, counted) and torch.equal(logits, before)


def test_a_penalty_moves_the_greedy_choice_off_a_repeated_token() -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0, -1.0]])
    assert int(sample(logits, [GREEDY], [None])[0]) == 0
    repeat = SamplingParams(frequency_penalty=0.3)
    assert int(sample(logits, [repeat], [None], counts=[{0: 1}])[0]) == 0  # 1.7 still beats 1.5
    assert int(sample(logits, [repeat], [None], counts=[{0: 2}])[0]) == 1  # 1.4 does not
    encourage = SamplingParams(presence_penalty=-2.0)  # a negative penalty favours what was generated
    assert int(sample(logits, [encourage], [None], counts=[{1: 1}])[0]) == 1


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [2.01, -2.5, float("nan"), float("inf")])
def test_penalties_outside_minus_two_to_two_are_invalid(field: str, value: float) -> None:
    with pytest.raises(InvalidSampling, match=field):
        SamplingParams(**{field: value})


def test_zero_penalties_stay_off_the_wire() -> None:
    assert "presence_penalty" not in SamplingParams().to_dict()  # an older engine takes it
    wire = SamplingParams(presence_penalty=0.5).to_dict()
    assert wire["presence_penalty"] == 0.5 and "frequency_penalty" not in wire
    assert SamplingParams.from_dict(wire) == SamplingParams(presence_penalty=0.5)
