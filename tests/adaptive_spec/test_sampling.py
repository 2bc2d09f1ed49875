"""Tests for adaptive_spec.sample.sampling: how logits become the distribution a request samples from.

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_sampling.py -q   (CPU, about a second)
"""

from __future__ import annotations

import math

import pytest
import torch

from adaptive_spec.sample.sampling import SamplingParams, logits_to_probs, sample


def logits_of(probs: list[float]) -> torch.Tensor:
    """[1, vocab] logits whose plain softmax is `probs`, so that expected values read as probabilities."""
    return torch.tensor([probs], dtype=torch.float64).log().float()


# --- SamplingParams.validate -------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.0),  # greedy
        SamplingParams(temperature=100.0),  # upper bound is inclusive
        SamplingParams(temperature=0.7, top_p=1e-6),  # any positive top_p is allowed
        SamplingParams(temperature=0.7, top_p=1.0, top_k=0),  # both filters disabled
        SamplingParams(temperature=1.0, top_k=1, seed=3),
    ],
)
def test_validate_accepts_in_range_values(params: SamplingParams) -> None:
    params.validate()


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=100.5), "temperature"),
        (SamplingParams(temperature=math.nan), "temperature"),  # NaN fails every comparison
        (SamplingParams(temperature=1.0, top_p=0.0), "top_p"),  # would mask every token
        (SamplingParams(temperature=1.0, top_p=-0.5), "top_p"),
        (SamplingParams(temperature=1.0, top_p=1.01), "top_p"),
        (SamplingParams(temperature=1.0, top_p=math.nan), "top_p"),
        (SamplingParams(temperature=1.0, top_k=-1), "top_k"),
    ],
)
def test_validate_rejects_out_of_range_values(params: SamplingParams, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        params.validate()


def test_greedy_means_temperature_zero() -> None:
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.0, top_k=5).greedy
    assert not SamplingParams(temperature=0.01).greedy


# --- temperature -------------------------------------------------------------------------------


def test_docstring_example_at_temperature_one() -> None:
    probs = logits_to_probs(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), SamplingParams(temperature=1.0))
    torch.testing.assert_close(probs, torch.tensor([[0.6439, 0.2369, 0.0871, 0.0321]]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("temperature", [0.25, 0.5, 1.0, 2.0, 7.0])
def test_temperature_divides_the_logits(temperature: float) -> None:
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0)) * 3  # [5, 11]
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature))  # [5, 11]
    torch.testing.assert_close(probs, (logits / temperature).softmax(dim=-1))
    # The same statement in the form that matters: log-odds between two tokens shrink by 1/T.
    log_odds = probs[:, 0].log() - probs[:, 1].log()
    torch.testing.assert_close(log_odds, (logits[:, 0] - logits[:, 1]) / temperature, atol=1e-4, rtol=1e-4)


def test_higher_temperature_is_flatter() -> None:
    logits = torch.tensor([[3.0, 1.0, 0.5, -2.0]])
    entropies = []
    for temperature in [0.3, 1.0, 3.0]:
        probs = logits_to_probs(logits, SamplingParams(temperature=temperature))[0]
        entropies.append(float(-(probs * probs.log()).sum()))
    assert entropies[0] < entropies[1] < entropies[2]


def test_temperature_zero_degenerates_to_the_argmax_instead_of_dividing_by_zero() -> None:
    # Greedy requests are meant to compare argmaxes and never reach logits_to_probs; if one does,
    # it must still get a valid distribution (no NaN from 0/0) concentrated on the argmax.
    probs = logits_to_probs(torch.tensor([[0.1, 0.3, 0.2]]), SamplingParams(temperature=0.0))
    assert not probs.isnan().any()
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0]]))


# --- top-k -------------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [1, 2, 5, 9])
def test_top_k_keeps_exactly_the_k_largest_logits(top_k: int) -> None:
    # Random normal logits have no ties, so "the k largest" is a well-defined set.
    logits = torch.randn(6, 10, generator=torch.Generator().manual_seed(1))  # [6, 10]
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=top_k))  # [6, 10]
    for row in range(logits.shape[0]):
        kept = set(probs[row].nonzero().flatten().tolist())
        assert kept == set(logits[row].topk(top_k).indices.tolist())
        # The survivors keep their relative weights: a softmax over the kept logits only.
        idx = sorted(kept)
        torch.testing.assert_close(probs[row, idx], logits[row, idx].softmax(dim=-1))


def test_top_k_docstring_example() -> None:
    probs = logits_to_probs(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(probs, torch.tensor([[0.7311, 0.2689, 0.0, 0.0]]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("top_k", [0, 10, 50])
def test_top_k_zero_or_at_least_vocab_is_a_no_op(top_k: int) -> None:
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(2))  # [3, 10]
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=top_k))
    torch.testing.assert_close(probs, logits.softmax(dim=-1))


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    # Logits [3, 1, 1, 0] with top_k=2: tokens 1 and 2 tie for second place. Like transformers'
    # TopKLogitsWarper (`scores < topk(...)[-1]`), both stay, since neither has a better claim.
    probs = logits_to_probs(torch.tensor([[3.0, 1.0, 1.0, 0.0]]), SamplingParams(temperature=1.0, top_k=2))
    assert probs[0].nonzero().flatten().tolist() == [0, 1, 2]


# --- top-p -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        # Base distribution, deliberately not in sorted order:
        #   token: 0     1     2     3     4
        #   prob:  0.15  0.5   0.05  0.2   0.1     sorted mass: 0.5, 0.7, 0.85, 0.95, 1.0
        (0.3, [0.0, 1.0, 0.0, 0.0, 0.0]),  # 0.5 already reaches 0.3: only the top token
        (0.6, [0.0, 5 / 7, 0.0, 2 / 7, 0.0]),  # 0.5 < 0.6 <= 0.7: tokens 1 and 3
        (0.8, [0.15 / 0.85, 0.5 / 0.85, 0.0, 0.2 / 0.85, 0.0]),  # 0.7 < 0.8 <= 0.85: adds token 0
        (0.9, [0.15 / 0.95, 0.5 / 0.95, 0.0, 0.2 / 0.95, 0.1 / 0.95]),  # 0.85 < 0.9 <= 0.95
        (1.0, [0.15, 0.5, 0.05, 0.2, 0.1]),  # disabled
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_top_p(top_p: float, expected: list[float]) -> None:
    probs = logits_to_probs(logits_of([0.15, 0.5, 0.05, 0.2, 0.1]), SamplingParams(temperature=1.0, top_p=top_p))
    torch.testing.assert_close(probs, torch.tensor([expected]), atol=1e-6, rtol=0)


def test_top_p_stops_at_a_prefix_whose_mass_equals_top_p_exactly() -> None:
    # Four equal logits give exactly 0.25 each (exp(0) = 1, sum 4), so the sorted mass is exactly
    # 0.25, 0.5, 0.75, 1.0. With top_p = 0.5 two tokens reach it; a third would not be needed.
    probs = logits_to_probs(torch.zeros(1, 4), SamplingParams(temperature=1.0, top_p=0.5))
    assert sorted(probs[0].tolist()) == [0.0, 0.0, 0.5, 0.5]


@pytest.mark.parametrize("top_p", [1e-6, 1e-300, 5e-324])  # the last two round to 0.0 in float32 (HTTP fuzzer)
def test_top_p_always_keeps_the_most_likely_token(top_p: float) -> None:
    # Even when top_p is far below the top token's probability, that token survives; an
    # all-masked row would softmax to NaN.
    logits = torch.randn(8, 12, generator=torch.Generator().manual_seed(3))  # [8, 12]
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    torch.testing.assert_close(probs, torch.nn.functional.one_hot(logits.argmax(-1), 12).float())


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("top_p", [0.2, 0.5, 0.8, 0.95])
def test_top_p_kept_set_is_minimal_on_random_rows(seed: int, top_p: float) -> None:
    logits = torch.randn(16, 20, generator=torch.Generator().manual_seed(seed)) * 2  # [16, 20]
    base = logits.softmax(dim=-1)  # [16, 20] before top-p
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))  # [16, 20]
    eps = 1e-6
    for row in range(logits.shape[0]):
        kept = probs[row] > 0
        kept_mass = float(base[row, kept].sum())
        smallest_kept = float(base[row, kept].min())
        assert kept_mass >= top_p - eps  # the kept set reaches top_p ...
        assert kept_mass - smallest_kept < top_p + eps  # ... and dropping its last member would not
        if not kept.all():  # it is a prefix in probability order
            assert smallest_kept >= float(base[row, ~kept].max())
        torch.testing.assert_close(probs[row, kept], base[row, kept] / kept_mass)


def test_top_p_applies_to_the_distribution_left_by_top_k() -> None:
    # Base probs [0.4, 0.3, 0.2, 0.1]. top_k=2 leaves [0.4, 0.3], renormalised to [4/7, 3/7].
    # top_p=0.5 is then reached by 4/7 alone, so only token 0 survives. (Applied to the raw 0.4 it
    # would keep two tokens.) This is the order of transformers' warpers and vLLM's top-k/top-p.
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.5)
    probs = logits_to_probs(logits_of([0.4, 0.3, 0.2, 0.1]), params)
    torch.testing.assert_close(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_top_p_docstring_example() -> None:
    probs = logits_to_probs(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(probs, torch.tensor([[0.7311, 0.2689, 0.0, 0.0]]), atol=1e-4, rtol=0)


# --- every output is a distribution --------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.1),
        SamplingParams(temperature=5.0, top_k=3),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=7, top_p=0.6),
        SamplingParams(temperature=1.0, top_k=1, top_p=0.01),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rows_are_float32_distributions(params: SamplingParams, dtype: torch.dtype) -> None:
    logits = (torch.randn(32, 50, generator=torch.Generator().manual_seed(4)) * 4).to(dtype)  # [32, 50]
    probs = logits_to_probs(logits, params)  # [32, 50]
    assert probs.shape == (32, 50)
    assert probs.dtype == torch.float32
    assert not probs.isnan().any()
    assert (probs >= 0).all()
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(32))


# --- sample ------------------------------------------------------------------------------------


def test_sample_returns_one_int64_token_per_row_from_the_support() -> None:
    # Row 0 can only produce token 2; row 1 only tokens 0 or 3.
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.5]])  # [2, 4]
    generator = torch.Generator().manual_seed(5)
    for _ in range(200):
        tokens = sample(probs, generator)  # [2]
        assert tokens.shape == (2,) and tokens.dtype == torch.int64
        assert tokens[0] == 2 and int(tokens[1]) in (0, 3)


def test_sample_is_reproducible_under_a_seed() -> None:
    probs = torch.full((64, 10), 0.1)  # [64, 10]
    first = sample(probs, torch.Generator().manual_seed(6))
    again = sample(probs, torch.Generator().manual_seed(6))
    other = sample(probs, torch.Generator().manual_seed(7))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_sample_frequencies_follow_probs() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])  # [4]
    draws = sample(probs.expand(40_000, 4), torch.Generator().manual_seed(8))  # [40000]
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    # Binomial standard error is at most sqrt(0.25 / 40000) = 0.0025; 0.0125 is 5 of them.
    torch.testing.assert_close(freq, probs, atol=0.0125, rtol=0)
