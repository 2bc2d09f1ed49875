"""Tests for adaptive_spec.sample.acceptance, three ways (STYLE.md §6, after vLLM's
tests/v1/sample/test_rejection_sampler.py):

1. hand-built logits and probabilities, with a comment on each row saying what must happen;
2. a slow reference written here, compared with `rejection_sample` under fixed seeds;
3. a statistical test that the emitted tokens follow the target distribution, with negative
   controls showing that the same test fails a broken sampler.

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_acceptance.py -q   (CPU, ~12 s)

scipy is not in the venv. The chi-square survival function is the regularised upper incomplete
gamma function, P(X >= x) = Q(df / 2, x / 2), which torch has as `torch.special.gammaincc`;
`test_chi_square_p_value_matches_textbook_critical_values` checks it against printed tables.
Every random test uses a fixed seed, so none of them is flaky: each either always passes or
always fails.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from acceptance_support import ALPHA, chi_square_p_value, logits_with_argmax

from adaptive_spec.sample.acceptance import Verdict, greedy_accept, greedy_accept_choices, rejection_sample
from adaptive_spec.sample.sampling import sample

pytestmark = pytest.mark.usefixtures("one_thread")

Sampler = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Generator | None], Verdict]


@pytest.mark.parametrize(
    ("df", "critical_value"),
    # Upper 0.1% points of the chi-square distribution (alpha = 0.001), from standard tables.
    [(1, 10.828), (2, 13.816), (5, 20.515), (7, 24.322), (10, 29.588), (20, 45.315), (30, 59.703), (63, 103.442)],
)
def test_chi_square_p_value_matches_textbook_critical_values(df: int, critical_value: float) -> None:
    p = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(critical_value / 2))
    assert float(p) == pytest.approx(ALPHA, rel=2e-3)


def test_chi_square_p_value_on_known_counts() -> None:
    # A fair 4-sided die: perfect counts give p = 1, a loaded one gives p ~ 0.
    uniform = torch.full((4,), 0.25)
    assert chi_square_p_value(torch.tensor([250, 250, 250, 250]), uniform) == pytest.approx(1.0)
    assert chi_square_p_value(torch.tensor([400, 200, 200, 200]), uniform) < 1e-10
    assert chi_square_p_value(torch.tensor([1, 0, 0, 0]), torch.tensor([0.0, 0.5, 0.5, 0.0])) == 0.0


# =================================================================================================
# 1. Hand-built cases
# =================================================================================================


def test_greedy_all_accepted_emits_the_bonus_token() -> None:
    target_logits = logits_with_argmax(
        [
            5,  # position 0: draft proposed 5, target's argmax 5 -> accepted
            9,  # position 1: draft proposed 9, argmax 9 -> accepted
            2,  # position 2: draft proposed 2, argmax 2 -> accepted
            7,  # bonus row: every draft was accepted, so 7 is the bonus token
        ]
    )
    assert greedy_accept(torch.tensor([5, 9, 2]), target_logits) == Verdict(num_accepted=3, next_token=7)


def test_greedy_first_rejected_recovers_the_target_argmax() -> None:
    target_logits = logits_with_argmax(
        [
            4,  # position 0: draft proposed 1, argmax 4 -> rejected; the recovered token is 4
            9,  # position 1: draft agrees (9), but nothing after a rejection counts
            2,  # position 2: agrees too, still ignored
            7,  # bonus row: never reached
        ]
    )
    assert greedy_accept(torch.tensor([1, 9, 2]), target_logits) == Verdict(num_accepted=0, next_token=4)


def test_greedy_rejection_in_the_middle() -> None:
    # The docstring's example.
    target_logits = logits_with_argmax(
        [
            5,  # position 0: draft 5 == argmax 5 -> accepted
            9,  # position 1: draft 9 == argmax 9 -> accepted
            2,  # position 2: draft 4 != argmax 2 -> rejected, recovered token 2
            7,  # bonus row: never reached
        ]
    )
    assert greedy_accept(torch.tensor([5, 9, 4]), target_logits) == Verdict(num_accepted=2, next_token=2)


def test_greedy_rejection_at_the_last_draft_token() -> None:
    target_logits = logits_with_argmax(
        [
            3,  # position 0: draft 3 -> accepted
            6,  # position 1: draft 0 != 6 -> rejected; the recovered token is 6, not the bonus
            8,  # bonus row: not used
        ]
    )
    assert greedy_accept(torch.tensor([3, 0]), target_logits) == Verdict(num_accepted=1, next_token=6)


def test_greedy_with_no_draft_returns_just_the_target_token() -> None:
    target_logits = logits_with_argmax(
        [
            8,  # the only row: no draft, so the target's own greedy token 8 is emitted
        ]
    )
    assert greedy_accept(torch.zeros(0, dtype=torch.int64), target_logits) == Verdict(num_accepted=0, next_token=8)


def test_greedy_ties_break_like_argmax() -> None:
    # Greedy equivalence (STYLE.md §7) needs speculative decoding to pick what the target alone
    # would pick, and torch's argmax picks the first of tied maxima.
    target_logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.0],  # position 0: 1 and 2 tie, argmax is 1; draft proposed 2 -> rejected
            [0.0, 0.0, 0.0, 0.0],  # bonus row: not used
        ]
    )
    assert greedy_accept(torch.tensor([2]), target_logits) == Verdict(num_accepted=0, next_token=1)


def test_a_batchs_fp32_argmax_gives_each_rows_bf16_verdict() -> None:
    """A batch takes every row's argmax at once, in fp32 (batch.py `_verify`): the verdicts equal
    `greedy_accept` on each row's own bf16 logits, ties included (bf16 logits tie often)."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(8, 5, 3000, generator=generator) * 4).round().to(torch.bfloat16)  # many ties
    choices = logits.float().argmax(dim=-1).tolist()
    for row in range(8):
        for k in range(5):
            for trial in range(3):
                draft = list(choices[row][:k])  # agree up to a point, then differ (or not)
                if trial and k:
                    draft[trial % k] = int(torch.randint(0, 3000, (1,), generator=generator))
                expected = greedy_accept(torch.tensor(draft, dtype=torch.long), logits[row, : k + 1])
                assert greedy_accept_choices(draft, choices[row][: k + 1]) == expected


def one_hot_rows(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def run_many(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    trials: int,
    seed: int,
) -> list[Verdict]:
    generator = torch.Generator().manual_seed(seed)
    return [rejection_sample(draft_tokens, draft_probs, target_probs, generator) for _ in range(trials)]


def test_rejection_sampling_with_no_draft_samples_the_target_row() -> None:
    target_probs = one_hot_rows([6], 8)  # the only row: all mass on 6, so the token must be 6
    for verdict in run_many(torch.zeros(0, dtype=torch.int64), None, target_probs, 20, seed=0):
        assert verdict == Verdict(0, 6)
    for verdict in run_many(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 8), target_probs, 20, seed=0):
        assert verdict == Verdict(0, 6)


def test_rejection_sampling_accepts_everything_when_draft_equals_target() -> None:
    # Acceptance probability is min(1, p / p) = 1 at every position, whatever the uniform draw.
    rows = torch.tensor(
        [
            [0.70, 0.10, 0.10, 0.10, 0.00],  # position 0: draft drew 1 (a 0.1 token) -> still accepted
            [0.05, 0.05, 0.05, 0.05, 0.80],  # position 1: draft drew 0 (0.05) -> accepted
            [0.20, 0.20, 0.20, 0.20, 0.20],  # position 2: draft drew 3 -> accepted
        ]
    )
    bonus_row = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]])  # bonus row: all mass on 2 -> bonus is 2
    target_probs = torch.cat([rows, bonus_row])  # [4, 5]
    for verdict in run_many(torch.tensor([1, 0, 3]), rows.clone(), target_probs, 300, seed=1):
        assert verdict == Verdict(3, 2)


def test_rejection_sampling_always_rejects_a_token_the_target_forbids() -> None:
    draft_probs = torch.tensor(
        [
            [0.6, 0.3, 0.1, 0.0],  # position 0: draft drew 0, which the target gives 0 -> always rejected
            [0.25, 0.25, 0.25, 0.25],  # position 1: never reached
        ]
    )
    target_probs = torch.tensor(
        [
            [0.0, 0.2, 0.3, 0.5],  # position 0: residual = max(0, target - draft) = [0, 0, 0.2, 0.5]
            [0.25, 0.25, 0.25, 0.25],  # position 1: never reached
            [0.25, 0.25, 0.25, 0.25],  # bonus row: never reached
        ]
    )
    verdicts = run_many(torch.tensor([0, 2]), draft_probs, target_probs, 2000, seed=2)
    assert all(v.num_accepted == 0 for v in verdicts)
    recovered = torch.tensor([v.next_token for v in verdicts])
    # Never the forbidden token 0, and never 1, which the draft over-proposes (0.3 > 0.2).
    assert set(recovered.tolist()) == {2, 3}
    # Residual renormalised: 2 with 0.2/0.7, 3 with 0.5/0.7. 2000 draws, s.e. ~0.010; 0.05 is 5 s.e.
    assert float((recovered == 2).float().mean()) == pytest.approx(2 / 7, abs=0.05)


def test_rejection_at_a_later_position_uses_that_positions_residual() -> None:
    vocab = 6
    target_probs = torch.tensor(
        [
            [0.0, 1.0, 0.0, 0.0, 0.0, 0.0],  # position 0: draft drew 1 with draft prob 1 -> accepted
            [0.0, 0.0, 0.0, 0.5, 0.5, 0.0],  # position 1: draft drew 2, target gives 0 -> rejected;
            # residual = [0, 0, 0, 0.5, 0.5, 0] - [0, 0, 1, 0, 0, 0] clamped -> recovered is 3 or 4
            [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # position 2: never reached
            [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # bonus row: never reached
        ]
    )
    draft_probs = one_hot_rows([1, 2, 5], vocab)  # a confident draft: [1, 2, 5] with probability 1
    verdicts = run_many(torch.tensor([1, 2, 5]), draft_probs, target_probs, 300, seed=3)
    assert {v.num_accepted for v in verdicts} == {1}
    assert {v.next_token for v in verdicts} == {3, 4}


def test_deterministic_draft_is_accepted_with_the_target_probability() -> None:
    # draft_probs=None is a one-hot draft, so acceptance probability = min(1, target / 1) = target.
    target_probs = torch.tensor(
        [
            [0.3, 0.5, 0.2, 0.0],  # position 0: draft proposed 0 -> accepted with probability 0.3;
            # on rejection the residual is target with token 0 removed -> 1 w.p. 5/7, 2 w.p. 2/7
            [0.0, 0.0, 0.0, 1.0],  # bonus row: all mass on 3 -> every acceptance emits bonus 3
        ]
    )
    verdicts = run_many(torch.tensor([0]), None, target_probs, 4000, seed=4)
    accepted = [v for v in verdicts if v.num_accepted == 1]
    recovered = torch.tensor([v.next_token for v in verdicts if v.num_accepted == 0])
    # 4000 Bernoulli(0.3) draws: s.e. 0.0072; 0.035 is about 5 s.e.
    assert len(accepted) / len(verdicts) == pytest.approx(0.3, abs=0.035)
    assert {v.next_token for v in accepted} == {3}
    assert set(recovered.tolist()) == {1, 2}  # never the rejected draft token 0
    # ~2800 recoveries, s.e. 0.0085 around 5/7; 0.045 is about 5 s.e.
    assert float((recovered == 1).float().mean()) == pytest.approx(5 / 7, abs=0.045)


@pytest.mark.parametrize(
    ("target_row", "always_accepted"),
    [
        ([0.0, 1.0, 0.0], True),  # the target is certain of the proposed token 1 -> always kept
        ([0.5, 0.0, 0.5], False),  # the target forbids 1 -> never kept
    ],
)
def test_deterministic_draft_extremes(target_row: list[float], always_accepted: bool) -> None:
    target_probs = torch.tensor([target_row, [1.0, 0.0, 0.0]])  # [2, 3]; bonus row: always 0
    verdicts = run_many(torch.tensor([1]), None, target_probs, 300, seed=5)
    if always_accepted:
        assert set(verdicts) == {Verdict(1, 0)}
    else:
        assert {v.num_accepted for v in verdicts} == {0}
        assert {v.next_token for v in verdicts} == {0, 2}


def test_residual_matches_the_docstring_example() -> None:
    # Target A 0.6, B 0.4; draft A 0.9, B 0.1; draft drew A. Accepted w.p. 0.6/0.9 = 2/3; otherwise
    # the residual max(0, [0.6 - 0.9, 0.4 - 0.1]) = [0, 0.3] recovers B, always.
    draft_probs = torch.tensor([[0.9, 0.1]])
    target_probs = torch.tensor(
        [
            [0.6, 0.4],  # position 0: draft token A=0 accepted w.p. 2/3, else B=1 recovered
            [0.0, 1.0],  # bonus row: always B
        ]
    )
    verdicts = run_many(torch.tensor([0]), draft_probs, target_probs, 3000, seed=6)
    assert set(verdicts) == {Verdict(1, 1), Verdict(0, 1)}
    # s.e. of the acceptance rate over 3000 draws is 0.0086; 0.04 is about 5 s.e.
    assert sum(v.num_accepted for v in verdicts) / len(verdicts) == pytest.approx(2 / 3, abs=0.04)


def test_same_seed_gives_the_same_verdicts() -> None:
    generator = torch.Generator().manual_seed(0)
    draft_probs = torch.rand(3, 7, generator=generator).softmax(-1)  # [3, 7]
    target_probs = torch.rand(4, 7, generator=generator).softmax(-1)  # [4, 7]
    draft_tokens = torch.tensor([2, 5, 1])
    assert run_many(draft_tokens, draft_probs, target_probs, 50, seed=9) == run_many(
        draft_tokens, draft_probs, target_probs, 50, seed=9
    )


# =================================================================================================
# 2. A slow reference, compared under fixed seeds
# =================================================================================================
#
# The reference below does not sample. Written as python loops over positions and tokens, straight
# from Leviathan et al. 2023 (Alg. 1), it computes the exact probability of every verdict
# (num_accepted, next_token) for given draft tokens. Comparing samples of `rejection_sample` with
# those probabilities (chi-square, alpha = 0.001, fixed seed) checks the whole output
# distribution, not one path through the code; and it does not depend on the order in which the
# implementation consumes random numbers, which is not part of its contract. Outcomes the reference
# calls impossible must never occur, however many trials. The reference itself is checked against
# the paper's guarantee in `test_reference_is_lossless`.


def reference_verdict_probs(
    draft_tokens: list[int],
    draft_probs: list[list[float]] | None,
    target_probs: list[list[float]],
) -> list[list[float]]:
    """Exact P(verdict = (n, x)) as a [k + 1][vocab] table. draft_probs None means one-hot rows."""
    k, vocab = len(draft_tokens), len(target_probs[0])
    if draft_probs is None:
        draft_probs = [[1.0 if x == token else 0.0 for x in range(vocab)] for token in draft_tokens]
    table = [[0.0] * vocab for _ in range(k + 1)]
    reach = 1.0  # probability that positions 0..i-1 were all accepted
    for i in range(k):
        token = draft_tokens[i]
        assert draft_probs[i][token] > 0, "the draft cannot have drawn a token it gives probability 0"
        accept = min(1.0, target_probs[i][token] / draft_probs[i][token])
        residual = [max(0.0, target_probs[i][x] - draft_probs[i][x]) for x in range(vocab)]
        residual_mass = sum(residual)
        if accept < 1.0:
            for x in range(vocab):
                table[i][x] += reach * (1.0 - accept) * residual[x] / residual_mass
        reach *= accept
    for x in range(vocab):
        table[k][x] += reach * target_probs[k][x]
    return table


def random_rows(rows: int, vocab: int, generator: torch.Generator, sharpness: float = 1.5) -> torch.Tensor:
    return (torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * sharpness).softmax(-1)


def test_reference_is_lossless() -> None:
    # Summed over every draft sequence the draft could propose (6^3 of them), the first emitted
    # token must follow target_probs[0] exactly. This is the theorem the reference must satisfy.
    vocab, k = 6, 3
    generator = torch.Generator().manual_seed(10)
    draft_probs = random_rows(k, vocab, generator).tolist()
    target_probs = random_rows(k + 1, vocab, generator).tolist()
    first_token = [0.0] * vocab
    for draft_tokens in itertools.product(range(vocab), repeat=k):
        weight = 1.0
        for i, token in enumerate(draft_tokens):
            weight *= draft_probs[i][token]
        table = reference_verdict_probs(list(draft_tokens), draft_probs, target_probs)
        first_token[draft_tokens[0]] += weight * sum(sum(row) for row in table[1:])  # position 0 accepted
        for x in range(vocab):
            first_token[x] += weight * table[0][x]  # position 0 rejected, x recovered
    assert first_token == pytest.approx(target_probs[0], abs=1e-12)
    # A deterministic draft needs no sum: any proposed token gives the target's row.
    table = reference_verdict_probs([4, 0, 2], None, target_probs)
    first_token = [table[0][x] + (sum(sum(row) for row in table[1:]) if x == 4 else 0.0) for x in range(vocab)]
    assert first_token == pytest.approx(target_probs[0], abs=1e-12)


def forbid(target_probs: torch.Tensor, position: int, token: int) -> torch.Tensor:
    """target_probs with `token` given probability 0 at `position`, renormalised."""
    target_probs = target_probs.clone()
    target_probs[position, token] = 0.0
    target_probs[position] /= target_probs[position].sum()
    return target_probs


@pytest.mark.parametrize(
    ("case", "k", "deterministic_draft", "seed"),
    [
        ("random draft and target", 3, False, 20),
        ("random draft and target", 1, False, 21),
        ("deterministic draft", 2, True, 22),
        ("target forbids the second draft token", 3, False, 23),
        ("draft equals target at position 0", 2, False, 24),
    ],
)
def test_rejection_sample_matches_reference(case: str, k: int, deterministic_draft: bool, seed: int) -> None:
    vocab, trials = 6, 3000
    generator = torch.Generator().manual_seed(seed)
    draft_probs = random_rows(k, vocab, generator)  # [k, vocab]
    target_probs = random_rows(k + 1, vocab, generator)  # [k + 1, vocab]
    draft_tokens = torch.multinomial(draft_probs, 1, generator=generator).squeeze(-1)  # [k]
    if case == "target forbids the second draft token":
        target_probs = forbid(target_probs, 1, int(draft_tokens[1]))  # verdicts with n >= 2 impossible
    if case == "draft equals target at position 0":
        target_probs[0] = draft_probs[0]  # n = 0 impossible
    if deterministic_draft:
        draft_probs = None
    expected = torch.tensor(
        reference_verdict_probs(
            draft_tokens.tolist(), None if draft_probs is None else draft_probs.tolist(), target_probs.tolist()
        )
    )  # [k + 1, vocab]

    counts = torch.zeros(k + 1, vocab)  # [k + 1, vocab]
    as_float = None if draft_probs is None else draft_probs.float()
    for verdict in run_many(draft_tokens, as_float, target_probs.float(), trials, seed):
        counts[verdict.num_accepted, verdict.next_token] += 1

    impossible = expected == 0
    assert counts[impossible].sum() == 0, f"{case}: impossible verdicts {impossible.nonzero().tolist()} occurred"
    p = chi_square_p_value(counts, expected)
    assert p > ALPHA, f"{case}: p = {p:.2e}\nexpected\n{expected * trials}\ncounts\n{counts}"


# =================================================================================================
# 3. Emitted tokens follow the target distribution
# =================================================================================================
#
# A toy language: the target and the draft are bigram models, [vocab, vocab] tables with row c the
# next-token distribution after token c. One speculative step from context c drafts k tokens by
# sampling the draft's chain, builds draft_probs / target_probs from the same rows a real model
# would produce, and emits num_accepted + 1 tokens. Steps repeat until two tokens are out. If
# the acceptance math is lossless, the first two tokens are distributed exactly like two steps of
# the target alone:
#   P(first = a)               = target[START, a]
#   P(first = a, second = b)   = target[START, a] * target[a, b]
# The second token is a bonus token only when k = 1 and a recovered token at position 1 only when
# k >= 2, hence one case of each; section 2 checks every position against exact probabilities.

VOCAB = 8
START = 0
TRIALS = 20_000


def bigram(logits: torch.Tensor) -> torch.Tensor:
    return logits.softmax(dim=-1)  # [vocab, vocab]


def strongly_disagreeing_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """After every context the draft puts 94-99% of its mass on tokens 0-3 and the target 96-99% on
    4-7, so their overlap, the acceptance probability at a position, is only 2-9%."""
    generator = torch.Generator().manual_seed(30)
    low = torch.tensor([0.97 / 4] * 4 + [0.03 / 4] * 4)  # [vocab]
    target = bigram(torch.randn(VOCAB, VOCAB, generator=generator)) * low.flip(0)
    draft = bigram(torch.randn(VOCAB, VOCAB, generator=generator)) * low
    return target / target.sum(-1, keepdim=True), draft / draft.sum(-1, keepdim=True)


def sharp_target() -> torch.Tensor:
    """A target whose favourite next token has probability 0.32-0.97, depending on the context."""
    return bigram(2 * torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(31)))


def deterministic_guess(target: torch.Tensor) -> torch.Tensor:
    """A prompt-lookup-like draft that always proposes the target's favourite: [vocab] guess table.

    The guess is accepted exactly as often as the target would pick it; at a rejection the
    recovered token must come from the target's other tokens.
    """
    return target.argmax(dim=-1)


def draw_draft_chains(draft: torch.Tensor, k: int, trials: int, generator: torch.Generator) -> torch.Tensor:
    """[2, vocab, trials, k + 1]: for step s, context c and trial j, c then the k tokens drafted after it.

    Drawn up front, vectorised, and independently for each step, so that a second step from the
    same context as the first does not reuse the first step's draft. `draft` is either a bigram
    table [vocab, vocab] (sampled) or a guess table [vocab] (deterministic).
    """
    context = torch.arange(VOCAB)[None, :, None].expand(2, VOCAB, trials).reshape(-1)  # [2 * vocab * trials]
    chain = [context]
    for _ in range(k):
        if draft.dim() == 1:
            context = draft[context]
        else:
            context = torch.multinomial(draft[context], 1, generator=generator).squeeze(-1)
        chain.append(context)
    return torch.stack(chain, dim=-1).reshape(2, VOCAB, trials, k + 1)


def first_two_tokens(
    accept: Sampler, target: torch.Tensor, draft: torch.Tensor, k: int, seed: int, trials: int = TRIALS
) -> torch.Tensor:
    """[trials, 2]: the first two tokens each of `trials` independent speculative generations emit."""
    generator = torch.Generator().manual_seed(seed)
    chains = draw_draft_chains(draft, k, trials, generator)  # [2, vocab, trials, k + 1]
    deterministic = draft.dim() == 1
    emitted = []
    for trial in range(trials):
        tokens: list[int] = []
        context = START
        for step in range(2):
            contexts = chains[step, context, trial]  # [k + 1]: the context, then the draft tokens
            draft_tokens = contexts[1:]  # [k]
            draft_probs = None if deterministic else draft[contexts[:k]]  # [k, vocab]
            target_probs = target[contexts]  # [k + 1, vocab]
            verdict = accept(draft_tokens, draft_probs, target_probs, generator)
            tokens += [*draft_tokens[: verdict.num_accepted].tolist(), verdict.next_token]
            context = tokens[-1]
            if len(tokens) >= 2:
                break
        emitted.append(tokens[:2])
    return torch.tensor(emitted)


def losslessness_p_values(emitted: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    """p-values of the first emitted token and of the first two jointly against the target alone."""
    first = torch.bincount(emitted[:, 0], minlength=VOCAB)  # [vocab]
    pairs = torch.bincount(emitted[:, 0] * VOCAB + emitted[:, 1], minlength=VOCAB * VOCAB)  # [vocab * vocab]
    joint = target[START][:, None] * target  # [vocab, vocab]: P(a) * P(b | a)
    return chi_square_p_value(first, target[START]), chi_square_p_value(pairs, joint)


def accept_every_draft(draft_tokens, draft_probs, target_probs, generator) -> Verdict:
    """Broken: emits the draft unchecked, plus a bonus token."""
    k = draft_tokens.shape[0]
    return Verdict(k, int(sample(target_probs[k : k + 1], generator)[0]))


def recover_from_the_target(draft_tokens, draft_probs, target_probs, generator) -> Verdict:
    """Broken in a plausible way: correct acceptance test, but at the first rejection it draws the
    recovered token from target_probs instead of the residual max(0, target - draft)."""
    verdict = rejection_sample(draft_tokens, draft_probs, target_probs, generator)
    if verdict.num_accepted == draft_tokens.shape[0]:
        return verdict
    return Verdict(verdict.num_accepted, int(sample(target_probs[verdict.num_accepted][None], generator)[0]))


def scenario(case: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(target bigram [vocab, vocab], draft bigram [vocab, vocab] or guess table [vocab])."""
    if case == "strong disagreement":
        return strongly_disagreeing_pair()
    target = sharp_target()
    return target, deterministic_guess(target)


@pytest.mark.parametrize(
    ("case", "k", "seed"),
    [
        ("strong disagreement", 3, 41),  # 2-9% of draft tokens accepted: mostly recovered tokens
        ("deterministic draft", 1, 43),  # draft_probs None; accepted 63% of the time, then a bonus
    ],
)
def test_emitted_tokens_follow_the_target(case: str, k: int, seed: int) -> None:
    target, draft = scenario(case)
    emitted = first_two_tokens(rejection_sample, target, draft, k, seed)  # [TRIALS, 2]
    p_first, p_joint = losslessness_p_values(emitted, target)
    assert p_first > ALPHA, f"{case}, k={k}: first token p = {p_first:.2e}"
    assert p_joint > ALPHA, f"{case}, k={k}: first two tokens p = {p_joint:.2e}"


@pytest.mark.parametrize(
    ("broken", "case", "k"),
    [
        (accept_every_draft, "strong disagreement", 3),
        (recover_from_the_target, "deterministic draft", 1),
    ],
)
def test_the_statistical_test_detects_a_broken_sampler(broken: Sampler, case: str, k: int) -> None:
    # Negative control: the simulation and threshold above reject a sampler that is not lossless,
    # so a pass there is evidence, not a test that cannot fail. A quarter of the trials is
    # already plenty (p < 1e-60 for both), and with more trials a real discrepancy only grows
    # more visible.
    target, draft = scenario(case)
    emitted = first_two_tokens(broken, target, draft, k, seed=50, trials=TRIALS // 4)  # [TRIALS // 4, 2]
    p_first, p_joint = losslessness_p_values(emitted, target)
    assert p_first < ALPHA and p_joint < ALPHA, f"{broken.__name__} passed: p = {p_first:.2e}, {p_joint:.2e}"
