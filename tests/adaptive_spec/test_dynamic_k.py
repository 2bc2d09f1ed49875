"""Unit tests of the dynamic-k policy (`adaptive_spec.decoding.dynamic_k`): the expected-tokens formula, the
worked examples of its module docstring, probing, cost interpolation, and how measured costs and
per-row acceptance move the choice for a batch.

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_dynamic_k.py -q   (CPU, well under a second)

No model is involved: `observe_step` is fed synthetic wall times, in seconds, as a batch reports them.
"""

from __future__ import annotations

import itertools

import pytest

from adaptive_spec.decoding.dynamic_k import DynamicK
from adaptive_spec.decoding.estimates import Acceptance, DraftingCosts, StepCosts, expected_tokens

# The module docstring's machine: a target forward over 1 / 2 / 4 / 8 / 16 tokens, in seconds.
TARGET_S = {1: 0.031, 2: 0.032, 4: 0.047, 8: 0.076, 16: 0.107}


def docstring_policy(**kwargs) -> DynamicK:
    """The docstring's costs: those target forwards, and a draft forward 0.15 of a target forward
    over as many rows."""
    policy = DynamicK(probe_every=10**9, **kwargs)
    for tokens, seconds in TARGET_S.items():
        policy.target.observe(tokens, seconds)
    for rows in (1, 2, 4, 8):
        policy.draft.observe(rows, 0.15 * policy.target_s(rows))
    return policy


def rate(policy: DynamicK, alphas: list[float], k: int) -> float:
    """Tokens per second for the batch, as `choose` ranks them."""
    n = len(alphas)
    if k == 0:
        return n / policy.target_s(n)
    return sum(expected_tokens(a, k) for a in alphas) / (k * policy.draft_s(n) + policy.target_s(n * (k + 1)))


def observe(
    policy: DynamicK,
    steps: int,
    rows: int,
    k: int,
    accepted: int,
    draft_s_per_forward: float,
    verify_s: float,
    plain_s: float,
    alphas: list[float],
) -> list[float]:
    """`steps` drafting steps of `rows` rows with these outcomes and times, each followed by a plain
    step; returns the rows' acceptance estimates after them."""
    for _ in range(steps):
        policy.observe_step(rows, k + 1, verify_s, rows, k, k * draft_s_per_forward)
        alphas = [policy.observe_row(a, k, accepted) for a in alphas]
        policy.observe_step(rows, 1, plain_s, 0, 0, 0.0)
    return alphas


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


# --- step costs -----------------------------------------------------------------------------------


def test_step_costs_interpolate_between_measured_sizes_and_scale_outside() -> None:
    costs = StepCosts(slope=0.2)
    assert costs.estimate(4) is None  # nothing measured
    costs.observe(4, 0.047)
    costs.observe(8, 0.076)
    assert costs.estimate(4) == pytest.approx(0.047)
    assert costs.estimate(6) == pytest.approx(0.0615)  # halfway on the line between 4 and 8
    # Outside: the nearest measurement scaled by the prior shape 1 + 0.2 (tokens - 1).
    assert costs.estimate(16) == pytest.approx(0.076 * 4.0 / 2.4)
    assert costs.estimate(1) == pytest.approx(0.047 * 1.0 / 1.6)
    costs.observe(8, 0.086)  # a moving average, 0.1 of the newest
    assert costs.estimate(8) == pytest.approx(0.077)


def test_above_the_largest_size_measured_the_line_of_the_two_largest_when_it_is_cheaper() -> None:
    """bf16 verifies cost little more per token than a plain step: measured 1-3 tokens, a verify of 4 is
    estimated on their line (chosen, then measured), not at the prior's 1 + 0.2 per token, which kept a
    trained head at k = 2 for a whole run. Never below the largest measured, never above the prior."""
    costs = StepCosts(slope=0.2)
    costs.observe(1, 0.0140)
    costs.observe(2, 0.0143)
    costs.observe(3, 0.0146)
    assert costs.estimate(4) == pytest.approx(0.0149)  # 0.0146 + 0.0003, where the prior said 0.0146 * 1.6 / 1.4
    costs.observe(3, 0.0110)  # noise: 3 tokens' average (0.01424) now below 2 tokens'
    assert costs.estimate(5) == pytest.approx(costs.estimate(3))  # a falling line is taken flat
    steep = StepCosts(slope=0.2)
    steep.observe(1, 0.010)
    steep.observe(2, 0.020)
    assert steep.estimate(4) == pytest.approx(0.020 * 1.6 / 1.2)  # the prior, where the line is dearer
    policy = DynamicK()
    for tokens, seconds in ((1, 0.0140), (2, 0.0143), (3, 0.0146)):
        policy.target.observe(tokens, seconds)
    policy.draft.observe(1, 0.00077)
    assert policy.choose([[0.76, 0.64]], [8]) >= 3  # the run's profile and draft step: deeper than 2


def test_priors_before_anything_is_measured() -> None:
    policy = DynamicK()
    # In units of a one-token target forward: 1 + 0.2 per extra token; a draft forward is 0.3 of a
    # target forward over as many rows.
    assert [policy.target_s(t) for t in (1, 2, 5)] == pytest.approx([1.0, 1.2, 1.8])
    assert policy.draft_s(1) == pytest.approx(0.3)
    assert policy.draft_s(4) == pytest.approx(0.3 * 1.6)


# --- the docstring's worked examples ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "alpha", "k", "rates"),
    [
        (1, 0.7, 1, {0: 32.3, 1: 46.4, 2: 44.9}),  # k=1 beats k=2 by a little
        (1, 0.9, 3, {3: 56.4}),  # 1.75x plain decoding
        (4, 0.7, 0, {0: 85.1, 1: 81.9, 2: 83.0}),  # a verify of 4 rows x 2 tokens is compute-bound
        (4, 0.9, 4, {0: 85.1, 3: 107.3, 4: 108.7}),  # a good draft still pays at 4 rows
        (4, 0.06, 0, {1: 51.1}),  # an untrained draft never pays
    ],
)
def test_docstring_worked_examples(rows: int, alpha: float, k: int, rates: dict[int, float]) -> None:
    policy = docstring_policy()
    alphas = [alpha] * rows
    for j, value in rates.items():
        assert rate(policy, alphas, j) == pytest.approx(value, abs=0.05)
    assert policy.choose(alphas, [8] * rows) == k


def test_choose_picks_the_best_rate_for_the_batch() -> None:
    policy = docstring_policy()
    for rows, alpha in itertools.product([1, 2, 3, 4, 6, 8], [0.0, 0.3, 0.6, 0.8, 0.95]):
        alphas = [alpha] * rows
        best = max(range(9), key=lambda k: (rate(policy, alphas, k), -k))
        assert policy.choose(alphas, [8] * rows) == best, (rows, alpha)


def test_rows_that_may_not_draft_count_one_token_each() -> None:
    policy = docstring_policy()
    # Two rows that draft well beside two that may not draft this step (first step, no budget).
    alphas, limits = [0.95, 0.95, 0.95, 0.95], [8, 8, 0, 0]
    k = policy.choose(alphas, limits)
    expected = max(
        range(9),
        key=lambda j: (
            (2 * expected_tokens(0.95, j) + 2) / (j * policy.draft_s(2) + policy.target_s(4 * (j + 1)))
            if j
            else 4 / policy.target_s(4),
            -j,
        ),
    )
    assert k == expected
    assert policy.choose(alphas, [0, 0, 0, 0]) == 0


# --- free proposals (ngram+ drafts): a second source with its own acceptance and no draft cost ------


def head_policy() -> DynamicK:
    """The docstring's target costs with a head draft at 0.05 of a target forward."""
    policy = docstring_policy()
    policy.draft = StepCosts()
    for rows in (1, 2, 4, 8):
        policy.draft.observe(rows, 0.05 * policy.target_s(rows))
    return policy


def test_choose_sources_worked_example() -> None:
    policy = head_policy()
    model_rate = expected_tokens(0.3, 1) / (policy.draft_s(1) + policy.target_s(2))
    free_rate = expected_tokens(0.8, 3) / policy.target_s(4)
    assert (model_rate, free_rate) == (pytest.approx(38.7, abs=0.05), pytest.approx(62.8, abs=0.05))
    assert policy.choose_sources([0.3], [8], [0.8], [4]) == ([3], [True])  # copy 3 of the match's 4 tokens
    assert policy.choose_sources([0.3], [8], [0.2], [4]) == ([1], [False])  # a poor match: the model's k = 1
    assert policy.choose_sources([0.3], [8], [0.8], [0]) == ([policy.choose([0.3], [8])], [False])  # no match


def plan_rate(policy: DynamicK, ks: list[int], use_free: list[bool], alphas, free_alphas) -> float:
    """Tokens per second of a step where row i drafts ks[i] tokens from its free match or the model."""
    n, width = len(ks), max(ks) + 1
    model_rows = sum(1 for k, free in zip(ks, use_free, strict=True) if k and not free)
    gains = [
        expected_tokens(f if free else a, k) for a, f, k, free in zip(alphas, free_alphas, ks, use_free, strict=True)
    ]
    draft = max((k for k, free in zip(ks, use_free, strict=True) if not free), default=0) * policy.draft_s(model_rows)
    return sum(gains) / ((draft if model_rows else 0.0) + policy.target_s(n * width))


def test_choose_sources_picks_the_best_plan_for_the_batch() -> None:
    """Brute force over every k and every plan: the model for all rows, the model for all but the row
    with a match, or the model for none (the match copies, the others decode plainly). The plan
    chosen has the best rate, where the model's forwards are paid only when some row drafts with it."""
    policy = head_policy()
    for rows, alpha, free_alpha, length in itertools.product([1, 2, 4], [0.05, 0.5, 0.9], [0.1, 0.6, 0.95], [0, 2, 6]):
        alphas, frees, lengths = [alpha] * rows, [free_alpha] * rows, [length] + [0] * (rows - 1)
        plans = [([0] * rows, [False] * rows)]
        for k in range(1, 9):
            plans.append(([k] * rows, [False] * rows))
            if length:
                copied = min(k, length)
                plans.append(([copied] + [0] * (rows - 1), [True] + [False] * (rows - 1)))
                plans.append(([copied] + [k] * (rows - 1), [True] + [False] * (rows - 1)))
        best = max(plan_rate(policy, ks, free, alphas, frees) for ks, free in plans)
        ks, use_free = policy.choose_sources(alphas, [8] * rows, frees, lengths)
        assert not any(use_free[1:]) and (length or not use_free[0])  # only a row with a match copies
        got = plan_rate(policy, ks, use_free, alphas, frees)
        assert got == pytest.approx(best, rel=0.02), (rows, alpha, free_alpha, length, ks, use_free)


def test_free_acceptance_is_kept_apart_from_the_models() -> None:
    policy = DynamicK()
    key = ("python", "3")
    for _ in range(20):
        policy.observe_free(0.5, 4, 4, key)  # every copied token accepted
        policy.observe_row(0.5, 2, 0, key)  # every model token rejected
    assert policy.free_alpha_for(key) > 0.9
    assert policy.alpha_for(key) < 0.1
    assert policy.free_alpha_for(("sql", None)) > 0.9  # an unseen key starts from the engine-wide free figure
    assert policy.alpha_for(("sql", None)) < 0.1


def test_a_plan_without_the_model_counts_toward_its_probe() -> None:
    """An untrained model draft beside a free match: the row with the match copies on every step and
    the other decodes plainly, except every probe_every-th step, where the model drafts it one token."""
    policy = head_policy()
    policy.probe_every, policy.max_probe_backoff = 4, 1
    plans = [policy.choose_sources([0.01, 0.01], [8, 8], [1.0, 1.0], [4, 0]) for _ in range(8)]
    assert all(use_free == [True, False] and ks[0] == 4 for ks, use_free in plans)
    assert [ks[1] for ks, _ in plans] == [0, 0, 0, 1, 0, 0, 0, 1]


# --- acceptance by draft position -------------------------------------------------------------------


def test_expected_tokens_of_a_profile() -> None:
    assert expected_tokens([0.7, 0.02], 1) == pytest.approx(1.7)
    assert expected_tokens([0.7, 0.02], 2) == pytest.approx(1.714)
    assert expected_tokens([0.7, 0.02], 3) == pytest.approx(1.714 + 0.7 * 0.02 * 0.02)  # the last value repeats
    for alpha, k in itertools.product([0.1, 0.6, 0.95], range(6)):
        assert expected_tokens([alpha], k) == pytest.approx(expected_tokens(alpha, k))


def test_acceptance_counts_each_position_reached() -> None:
    counts = Acceptance(0.5)
    counts.observe(1, 2, keep=1.0, k=3)  # drafted 3: first accepted, second rejected, third never verified
    counts.observe(3, 3, keep=1.0, k=3)  # all three accepted
    assert counts.reached == [2, 2, 1] and counts.kept == [2, 1, 1]
    assert counts.accepted == 4 and counts.drafted == 5
    profile = counts.profile(prior_trials=2.0)
    overall = counts.estimate(2.0)  # (4 + 0.5 * 2) / (5 + 2)
    assert profile == pytest.approx([(2 + 2 * overall) / 4, (1 + 2 * overall) / 4, (1 + 2 * overall) / 3])


def test_a_draft_accepted_only_at_its_first_position_drafts_one_token() -> None:
    """A head's measured shape: 0.8 at the first draft token, about 0 at the second. Mostly drafting
    one token, its pooled acceptance looks like 0.7 and asks for k >= 2 (then falls, then rises:
    the policy swings); by position, k = 1 throughout."""
    policy = head_policy()
    key = ("python", "3")
    for step in range(400):
        first_accepted = step % 5 != 0  # 4 in 5
        k = 2 if step % 8 == 1 else 1  # now and then a deeper draft, whose second token misses
        policy.observe_row(0.5, k, 1 if first_accepted else 0, key)
    pooled = policy.alpha_for(key)
    assert pooled > 0.68
    assert policy.choose([pooled], [8]) >= 2
    profile = policy.profile_for(key, pooled)
    assert profile[0] == pytest.approx(0.8, abs=0.08) and profile[1] < 0.2
    assert policy.choose([profile], [8]) == 1
    assert policy.profile_for(("sql", None), 0.4) == 0.4  # a key with nothing measured: its alpha alone


def test_a_row_that_met_early_rejections_still_drafts_by_its_key() -> None:
    """A row's own running estimate falls by 30% at one rejection. When it scaled the key's profile, a row
    that met two rejections drafted one token or none, and plain steps brought no evidence to climb back
    (17-19% of a trained head's steps at one user, 10% of its speed): the row now drafts by its key."""
    policy = head_policy()
    key = ("python", "9")
    for step in range(300):  # the key: 4 in 5 first tokens kept, all three kept in 3 of those 4
        accepted = 0 if step % 5 == 0 else (3 if step % 4 else 1)
        policy.observe_row(0.5, 3, accepted, key)
    row = policy.alpha_for(key)
    for _ in range(2):  # this row's first two drafts: rejected at once
        row = policy.observe_row(row, 3, 0, key)
    assert row < 0.6 * policy.alpha_for(key)  # its own running estimate fell
    assert policy.choose([policy.profile_for(key, row)], [8]) >= 2  # it scaled the profile to k = 1 before


# --- probing --------------------------------------------------------------------------------------


def plain_steps_before_each_probe(policy: DynamicK, alpha: float, probes: int) -> list[int]:
    gaps, plain = [], 0
    while len(gaps) < probes:
        k = policy.choose([alpha], [8])
        assert k in (0, 1)
        if k:
            gaps.append(plain)
            plain = 0
        else:
            plain += 1
    return gaps


@pytest.mark.parametrize("probe_every", [16, 4])
def test_probes_one_token_after_probe_every_plain_steps_then_backs_off(probe_every: int) -> None:
    policy = DynamicK(probe_every=probe_every, max_probe_backoff=8)
    # Each probe that leaves drafting unpaid doubles the wait, up to probe_every x 8.
    expected = [probe_every - 1, 2 * probe_every - 1, 4 * probe_every - 1] + [8 * probe_every - 1] * 3
    assert plain_steps_before_each_probe(policy, 0.06, 6) == expected


def test_the_probe_wait_starts_over_when_drafting_pays_or_the_draft_changes() -> None:
    policy = DynamicK(probe_every=4, max_probe_backoff=8)
    assert plain_steps_before_each_probe(policy, 0.06, 3) == [3, 7, 15]
    assert policy.choose([0.9], [8]) >= 1  # a row that pays
    assert plain_steps_before_each_probe(policy, 0.06, 2) == [3, 7]
    policy.new_draft(None)  # an adapter swap
    assert plain_steps_before_each_probe(policy, 0.06, 1) == [3]


def test_no_probe_while_drafting_pays() -> None:
    policy = DynamicK(probe_every=2)
    assert [policy.choose([0.8], [8]) for _ in range(10)] == [policy.choose([0.8], [8])] * 10
    assert policy.choose([0.8], [8]) >= 1


# --- measured costs and acceptance move the choice ------------------------------------------------


def test_observed_costs_replace_the_priors() -> None:
    policy = DynamicK()
    policy.observe_step(rows=1, width=3, verify_s=0.013, draft_rows=1, draft_forwards=2, draft_s=0.004)
    policy.observe_step(rows=1, width=1, verify_s=0.010, draft_rows=0, draft_forwards=0, draft_s=0.0)
    assert policy.target_s(1) == pytest.approx(0.010)
    assert policy.target_s(3) == pytest.approx(0.013)
    assert policy.target_s(2) == pytest.approx(0.0115)
    assert policy.draft_s(1) == pytest.approx(0.002)


def test_a_steps_drafting_is_a_line_in_its_forwards_once_they_vary() -> None:
    """The head on an AMD EPYC: a step of 1 / 2 / 4 / 7 draft forwards took 1.42 / 1.84 / 2.75 / 4.12 ms,
    about 0.97 ms once and 0.45 a forward. While every step drafts 3 there is no line to fit: k forwards
    at the mean of one, as before."""
    policy = DynamicK()
    for _ in range(10):
        policy.observe_step(rows=1, width=4, verify_s=0.014, draft_rows=1, draft_forwards=3, draft_s=0.0023)
    assert policy.drafting.line(1) is None
    assert policy.drafting_s(1, 5) == pytest.approx(5 * 0.0023 / 3)
    for forwards, seconds in [(1, 0.00142), (2, 0.00184), (4, 0.00275), (7, 0.00412)] * 10:
        policy.observe_step(1, forwards + 1, 0.014, 1, forwards, seconds)
    first, per_forward = policy.drafting.line(1)
    assert first == pytest.approx(0.00097, abs=0.0001) and per_forward == pytest.approx(0.00045, abs=0.00003)
    assert policy.drafting_s(1, 4) == pytest.approx(first + 4 * per_forward)
    assert policy.drafting.line(2) is None and policy.drafting_s(2, 3) == pytest.approx(3 * policy.draft_s(2))
    policy.observe_step(1, 2, 0.014, 1, 1, 0.05, catch_up=True)  # a catch-up is not a draft step
    assert policy.drafting.line(1) == (first, per_forward)
    policy.new_draft(None)  # another version: measured again
    assert policy.drafting.line(1) is None


def test_a_stall_does_not_flatten_the_line() -> None:
    """One step timed at 30 ms among steps of 2-3 ms: taken at 3x what the line predicts, and a further forward
    never costs less than a quarter of the mean one, so deep drafts do not turn free."""
    costs = DraftingCosts()
    for forwards in [3, 4] * 20:
        costs.observe(1, forwards, 0.00097 + 0.00045 * forwards)
    before = costs.line(1)
    costs.observe(1, 3, 0.030)
    first, per_forward = costs.line(1)
    assert per_forward >= 0.25 * (first + 3.5 * per_forward) / 3.5
    assert first + 4 * per_forward < 1.3 * (before[0] + 4 * before[1])


def test_a_dear_first_draft_forward_drafts_deeper_than_its_mean_would() -> None:
    """That run's verifies (ms by tokens fed) and the python head's profile: at the mean of a forward
    (0.88 ms) a fourth draft token looks dearer than it is and k = 3; on the line, k = 4 or 5."""
    profile = [0.76, 0.795, 0.808, 0.587, 0.466]
    verify_ms = {1: 13.9, 2: 14.1, 3: 13.76, 4: 13.33, 5: 14.34, 6: 14.62, 7: 14.81, 8: 15.94}
    mean, line = DynamicK(), DynamicK()
    for policy in (mean, line):
        for tokens, ms in verify_ms.items():
            policy.target.observe(tokens, ms / 1000)
    mean.draft.observe(1, 0.00088)
    for forwards in [1, 3, 4, 5] * 5:
        line.drafting.observe(1, forwards, 0.00097 + 0.00045 * forwards)
    assert mean.choose([profile], [8]) == 3
    assert line.choose([profile], [8]) in (4, 5)


def test_cheap_drafts_that_are_always_accepted_choose_a_large_k() -> None:
    policy = DynamicK(k_max=8)
    alphas = observe(
        policy, 60, rows=1, k=4, accepted=4, draft_s_per_forward=0.0001, verify_s=0.0105, plain_s=0.010, alphas=[0.5]
    )
    assert alphas[0] > 0.99
    assert policy.choose(alphas, [8]) == 8
    assert policy.choose(alphas, [3]) == 3  # still bounded by what the budget can use


def test_expensive_drafts_choose_plain_decoding_even_when_accepted() -> None:
    policy = DynamicK(probe_every=1000)
    alphas = observe(
        policy, 60, rows=1, k=2, accepted=2, draft_s_per_forward=0.05, verify_s=0.011, plain_s=0.010, alphas=[0.5]
    )  # a draft forward costs 5 target steps
    assert alphas[0] > 0.99
    assert policy.choose(alphas, [8]) == 0


def test_the_choice_follows_when_costs_change() -> None:
    policy = DynamicK(probe_every=1000)
    alphas = observe(
        policy, 60, rows=2, k=3, accepted=3, draft_s_per_forward=0.05, verify_s=0.012, plain_s=0.010, alphas=[0.5, 0.5]
    )
    assert policy.choose(alphas, [8, 8]) == 0
    alphas = observe(
        policy, 60, rows=2, k=3, accepted=3, draft_s_per_forward=0.0005, verify_s=0.012, plain_s=0.010, alphas=alphas
    )  # the draft got 100x faster
    assert policy.choose(alphas, [8, 8]) >= 3


def test_acceptance_moves_each_row_and_the_engine_estimate() -> None:
    policy = DynamicK(probe_every=1000)
    start = policy.engine_alpha
    assert policy.observe_row(0.5, 3, 0) < 0.5  # first draft rejected: one failure
    low = observe(
        policy, 40, rows=1, k=3, accepted=0, draft_s_per_forward=0.001, verify_s=0.012, plain_s=0.010, alphas=[0.5]
    )
    assert low[0] < 0.01 and policy.choose(low, [8]) == 0
    high = observe(
        policy, 40, rows=1, k=3, accepted=3, draft_s_per_forward=0.001, verify_s=0.012, plain_s=0.010, alphas=low
    )
    assert high[0] > 0.99 and policy.choose(high, [8]) >= 3
    # The engine-wide estimate, where new rows start, moves more slowly.
    assert 0.0 < policy.engine_alpha < high[0] and policy.engine_alpha != start


def test_a_step_with_nothing_drafted_leaves_alpha_and_draft_cost_alone() -> None:
    policy = DynamicK()
    assert policy.observe_row(0.7, 0, 0) == 0.7
    policy.observe_step(rows=2, width=1, verify_s=0.02, draft_rows=0, draft_forwards=0, draft_s=0.0)
    assert policy.draft.estimate(2) is None


def test_choose_never_exceeds_the_limits_or_k_max() -> None:
    cost_settings = [(0.0001, 0.0101), (0.002, 0.012), (0.05, 0.011)]  # (draft forward, verify) seconds
    for (draft_s, verify_s), alpha, k_max in itertools.product(cost_settings, [0.0, 0.3, 0.8, 0.999, 1.0], [1, 3, 8]):
        policy = DynamicK(k_max=k_max, probe_every=3)
        observe(
            policy,
            5,
            rows=1,
            k=2,
            accepted=1,
            draft_s_per_forward=draft_s,
            verify_s=verify_s,
            plain_s=0.010,
            alphas=[alpha],
        )
        for limits in ([-2], [0], [1], [2, 0], [5, 1], [8], [20, 3]):
            for _ in range(4):  # crosses a probe when drafting does not pay
                k = policy.choose([alpha] * len(limits), limits)
                assert 0 <= k <= max(0, min(max(limits), k_max)), (draft_s, alpha, k_max, limits, k)


def test_a_new_draft_starts_from_its_gated_acceptance_and_remeasures_its_cost() -> None:
    policy = DynamicK()
    policy.observe_step(rows=1, width=3, verify_s=0.012, draft_rows=1, draft_forwards=2, draft_s=0.06)
    assert policy.draft_s(1) == pytest.approx(0.03)
    policy.new_draft(0.7)
    assert policy.engine_alpha == 0.7 and policy.draft.estimate(1) is None
    policy.new_draft(None)  # unknown: keep what was measured of acceptance
    assert policy.engine_alpha == 0.7


def test_a_catch_up_forward_is_not_billed_as_a_draft_step() -> None:
    policy = DynamicK()
    policy.observe_step(rows=1, width=2, verify_s=0.011, draft_rows=1, draft_forwards=1, draft_s=0.05, catch_up=True)
    assert policy.draft.estimate(1) is None
    policy.observe_step(rows=1, width=2, verify_s=0.011, draft_rows=1, draft_forwards=1, draft_s=0.012)
    assert policy.draft_s(1) == pytest.approx(0.012)


def test_a_draft_that_misses_is_believed_by_the_next_requests_of_its_key() -> None:
    """An untrained draft (acceptance ~0.06): a request drafts until its key's estimate says stop,
    and the key's estimate, where the next request starts, has learnt from it, so by the third
    request the key decodes plainly from the first step (it used to start near 0.5 for a dozen
    requests, each paying a few rejected drafts)."""
    policy, key = docstring_policy(), ("chat", None)
    drafted_steps = []
    for _ in range(3):
        start, steps = policy.alpha_for(key), 0
        while policy.choose([policy.profile_for(key, start)], [8]):  # as Batch._choose_k asks
            policy.observe_row(start, 1, 0, key)
            steps += 1
        drafted_steps.append(steps)
    assert drafted_steps[0] <= 4 and drafted_steps[1] <= 1 and drafted_steps[2] == 0, drafted_steps
    # And a key that does pay is not dragged down by it: its rows start from their own figure.
    good = ("python", None)
    for _ in range(20):
        policy.observe_row(0.8, 3, 3, good)
    assert policy.alpha_for(good) > 0.9 and policy.choose([policy.alpha_for(good)], [8]) >= 3


def test_a_keys_estimate_is_the_recent_share_accepted() -> None:
    policy, key = DynamicK(window=100), ("d", "v1")
    for _ in range(300):  # 3 windows at 0.25 ...
        policy.observe_row(0.5, 4, 1, key)  # 1 accepted then a rejection: 2 trials, 1 success
    assert policy.alpha_for(key) == pytest.approx(0.5, abs=0.01)
    for _ in range(300):  # ... then the draft improves: the old evidence fades
        policy.observe_row(0.5, 4, 4, key)
    assert policy.alpha_for(key) > 0.95


def test_one_slow_plain_step_does_not_lock_the_batch_into_drafting() -> None:
    """Seen on the default model at 2 rows: one plain step timed at 123 ms (a stall) against 90 ms
    for a 4-token verify. Taken at face value, drafting one token with an untrained draft looks
    cheaper than a plain step, so every step drafts and no plain step is timed again to correct
    it. A forward over fewer tokens is never estimated dearer than one over more."""
    policy = DynamicK()
    policy.target.observe(2, 0.123)
    policy.target.observe(4, 0.090)
    policy.draft.observe(2, 0.016)
    assert policy.target_s(2) == pytest.approx(0.090) and policy.target_s(3) == pytest.approx(0.090)
    assert policy.choose([0.0, 0.01], [8, 8]) == 0
    for _ in range(40):  # the plain steps it now takes are timed, and the outlier fades
        policy.target.observe(2, 0.050)
    assert policy.target_s(2) == pytest.approx(0.050, rel=0.05)
