"""Unit tests of the dynamic-k policy (`adaptive_spec.dynamic_k`): the expected-tokens formula, the
worked examples of its module docstring, probing, and how measured costs move the choice.

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_dynamic_k.py -q   (CPU, well under a second)

No model is involved: `observe` is fed synthetic wall times, in seconds, as the engine would report
them. A plain target step (k = 0) takes 10 ms throughout.
"""

from __future__ import annotations

import itertools

import pytest

from adaptive_spec.dynamic_k import DynamicK, expected_tokens

PLAIN_S = 0.010  # one target forward on one token


def gain(policy: DynamicK, k: int) -> float:
    """Tokens per unit of cost for drafting k, as `choose` ranks them (plain decoding scores 1)."""
    return expected_tokens(policy.alpha, k) / (k * policy.draft_cost() + policy.verify_cost(k))


def feed(policy: DynamicK, steps: int, k: int, accepted: int, draft_s_per_forward: float, verify_s: float) -> None:
    """`steps` drafting steps with these outcomes and times, each followed by a plain step."""
    for _ in range(steps):
        policy.observe(k, accepted, k * draft_s_per_forward, k, verify_s)
        policy.observe(0, 0, 0.0, 0, PLAIN_S)


# --- expected_tokens ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("alpha", "k", "tokens"),
    [
        (0.8, 3, 2.952),  # 1 + 0.8 + 0.64 + 0.512
        (0.8, 2, 2.44),  # 1 + 0.8 + 0.64
        (0.5, 1, 1.5),
        (0.5, 2, 1.75),
        (0.06, 1, 1.06),
        (0.3, 0, 1.0),  # plain decoding: one token per forward whatever alpha is
        (0.0, 5, 1.0),  # nothing is ever accepted: only the recovered token
        (1.0, 4, 5.0),  # everything is accepted: k drafts plus the bonus token
        (1.0, 0, 1.0),
    ],
)
def test_expected_tokens_values(alpha: float, k: int, tokens: float) -> None:
    assert expected_tokens(alpha, k) == pytest.approx(tokens)


def test_expected_tokens_is_the_geometric_sum() -> None:
    for alpha, k in itertools.product([0.0, 0.1, 0.5, 0.9, 0.999], range(9)):
        assert expected_tokens(alpha, k) == pytest.approx(sum(alpha**i for i in range(k + 1)))
    # Increasing in k and in alpha, and never above k + 1.
    for k in range(8):
        assert expected_tokens(0.7, k + 1) > expected_tokens(0.7, k)
        assert expected_tokens(0.8, k + 1) > expected_tokens(0.7, k + 1)
        assert expected_tokens(0.99, k) <= k + 1


# --- the docstring's worked examples, with the default priors -----------------------------------


def test_priors_are_the_docstring_costs() -> None:
    policy = DynamicK()  # nothing measured yet
    assert policy.draft_cost() == pytest.approx(0.3)
    assert [policy.verify_cost(k) for k in range(4)] == pytest.approx([1.0, 1.1, 1.2, 1.3])


@pytest.mark.parametrize(
    ("alpha", "k", "gains"),
    [
        (0.8, 2, {2: 2.44 / 1.8, 3: 2.952 / 2.2}),  # k=2 gives 1.36, k=3 1.34: k = 2
        (0.5, 1, {1: 1.5 / 1.4, 2: 1.75 / 1.8}),  # k=1 gives 1.07, k=2 0.97: k = 1
        (0.06, 0, {1: 1.06 / 1.4}),  # k=1 gives 0.76 < 1: decode plainly
    ],
)
def test_docstring_worked_examples(alpha: float, k: int, gains: dict[int, float]) -> None:
    policy = DynamicK()
    policy.alpha = alpha
    for j, value in gains.items():
        assert gain(policy, j) == pytest.approx(value)
    assert policy.choose(8) == k


# --- probing --------------------------------------------------------------------------------------


@pytest.mark.parametrize("probe_every", [16, 4])
def test_probes_one_token_after_probe_every_plain_steps(probe_every: int) -> None:
    policy = DynamicK(probe_every=probe_every)
    policy.alpha = 0.06  # drafting does not pay
    for _ in range(3):  # the pattern repeats: the count restarts after each probe
        assert [policy.choose(8) for _ in range(probe_every - 1)] == [0] * (probe_every - 1)
        assert policy.choose(8) == 1


def test_a_new_request_restarts_the_probe_count_and_alpha() -> None:
    policy = DynamicK(probe_every=4)
    policy.alpha = 0.06
    assert [policy.choose(8) for _ in range(3)] == [0, 0, 0]
    policy.engine_alpha = 0.06
    policy.start_request()
    assert policy.alpha == 0.06
    assert [policy.choose(8) for _ in range(4)] == [0, 0, 0, 1]  # counted from the request's start


def test_no_probe_while_drafting_pays() -> None:
    policy = DynamicK(probe_every=2)
    policy.alpha = 0.8
    assert [policy.choose(8) for _ in range(10)] == [2] * 10


# --- measured costs and acceptance move the choice ------------------------------------------------


def test_observed_costs_replace_the_priors() -> None:
    policy = DynamicK()
    feed(policy, 1, k=2, accepted=1, draft_s_per_forward=0.002, verify_s=0.013)
    # One observation of each: the moving averages start at the observed values.
    assert policy.draft_cost() == pytest.approx(0.2)  # 2 ms / 10 ms
    assert policy.verify_cost(0) == pytest.approx(1.0)
    assert policy.verify_cost(2) == pytest.approx(1.3)
    # Unmeasured k extrapolate along the measured slope, (1.3 - 1) / 2 = 0.15 per verified token.
    assert policy.verify_cost(4) == pytest.approx(1.6)
    assert policy.verify_cost(1) == pytest.approx(1.15)


def test_cheap_drafts_that_are_always_accepted_choose_a_large_k() -> None:
    policy = DynamicK(k_max=8)
    feed(policy, 60, k=4, accepted=4, draft_s_per_forward=0.0001, verify_s=0.0105)
    assert policy.alpha > 0.99 and policy.draft_cost() == pytest.approx(0.01)
    assert policy.choose(8) == 8
    assert policy.choose(3) == 3  # still bounded by what the budget can use


def test_expensive_drafts_choose_plain_decoding_even_when_accepted() -> None:
    policy = DynamicK(probe_every=1000)
    feed(policy, 60, k=2, accepted=2, draft_s_per_forward=0.05, verify_s=0.011)  # a draft forward costs 5 target steps
    assert policy.alpha > 0.99 and policy.draft_cost() == pytest.approx(5.0)
    assert policy.choose(8) == 0


def test_the_choice_follows_when_costs_change() -> None:
    policy = DynamicK(probe_every=1000)
    feed(policy, 60, k=3, accepted=3, draft_s_per_forward=0.05, verify_s=0.011)
    assert policy.choose(8) == 0
    feed(policy, 60, k=3, accepted=3, draft_s_per_forward=0.0005, verify_s=0.011)  # the draft got 100x faster
    assert policy.choose(8) >= 4


def test_acceptance_moves_alpha_and_the_choice() -> None:
    policy = DynamicK(probe_every=1000)
    start = policy.alpha
    policy.observe(3, 0, 0.003, 3, 0.012)  # first draft rejected: one failure
    assert policy.alpha < start
    feed(policy, 40, k=3, accepted=0, draft_s_per_forward=0.001, verify_s=0.012)
    assert policy.alpha < 0.01 and policy.choose(8) == 0
    feed(policy, 40, k=3, accepted=3, draft_s_per_forward=0.001, verify_s=0.012)
    assert policy.alpha > 0.99 and policy.choose(8) >= 3
    # The engine-wide estimate moves more slowly, and a new request starts from it.
    assert 0.0 < policy.engine_alpha < policy.alpha
    policy.start_request()
    assert policy.alpha == policy.engine_alpha


def test_a_step_with_nothing_drafted_leaves_alpha_alone() -> None:
    policy = DynamicK()
    policy.alpha = 0.7
    policy.observe(0, 0, 0.0, 0, PLAIN_S)
    assert policy.alpha == 0.7 and policy.draft_s is None


def test_choose_never_exceeds_the_limit_or_k_max() -> None:
    cost_settings = [(0.0001, 0.0101), (0.002, 0.012), (0.05, 0.011)]  # (draft forward, verify) seconds
    for (draft_s, verify_s), alpha, k_max in itertools.product(cost_settings, [0.0, 0.3, 0.8, 0.999, 1.0], [1, 3, 8]):
        policy = DynamicK(k_max=k_max, probe_every=3)
        feed(policy, 5, k=2, accepted=1, draft_s_per_forward=draft_s, verify_s=verify_s)
        policy.alpha = alpha
        for limit in [-2, 0, 1, 2, 5, 8, 20]:
            for _ in range(4):  # crosses a probe when drafting does not pay
                k = policy.choose(limit)
                assert 0 <= k <= max(0, min(limit, k_max)), (draft_s, alpha, k_max, limit, k)


def test_a_draft_that_got_better_is_noticed_within_a_few_probes() -> None:
    policy = DynamicK()
    policy.alpha = 0.05  # an untrained draft: plain decoding
    assert policy.choose(8) == 0
    for _ in range(2):  # two one-token probes, both accepted (the adapter improved the draft)
        policy.observe(1, 1, 0.02, 1, 0.11)
    assert policy.alpha > 0.5
    assert policy.choose(8) >= 1


def test_a_new_draft_starts_from_its_gated_acceptance_and_remeasures_its_cost() -> None:
    policy = DynamicK()
    policy.observe(2, 0, 0.06, 2, 0.12)
    assert policy.draft_s == pytest.approx(0.03)
    policy.new_draft(0.7)
    assert policy.alpha == policy.engine_alpha == 0.7 and policy.draft_s is None
    policy.start_request()
    assert policy.alpha == 0.7 and policy.choose(8) >= 1
    policy.new_draft(None)  # unknown: keep what was measured of acceptance
    assert policy.alpha == 0.7


def test_a_catch_up_forward_is_not_billed_as_a_draft_step() -> None:
    policy = DynamicK()
    policy.observe(1, 1, 0.05, 1, 0.11, catch_up=True)  # 16 backlog tokens fed in the probe's forward
    assert policy.draft_s is None and policy.draft_cost() == policy.prior_draft_cost
    policy.observe(1, 1, 0.012, 1, 0.11)
    assert policy.draft_s == pytest.approx(0.012)
