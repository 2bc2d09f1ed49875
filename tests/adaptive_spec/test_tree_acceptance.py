"""Tree acceptance (`tree_greedy_accept`, `tree_rejection_sample`), three ways, as test_acceptance.py does
for chains (STYLE.md §6):

1. hand-built trees and distributions, with a comment saying what must happen;
2. a slow reference written here: the exact probability of every outcome (path, next token) under
   recursive rejection sampling, which must equal the target's own probability of that sequence;
3. a statistical test that the emitted tokens follow the target, with a negative control.

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_tree_acceptance.py -q
"""

from __future__ import annotations

import pytest
import torch
from acceptance_support import ALPHA, chi_square_p_value, logits_with_argmax

from adaptive_spec.sample.acceptance import children_of, greedy_accept, tree_greedy_accept, tree_rejection_sample

pytestmark = pytest.mark.usefixtures("one_thread")

# Pending token, then nodes 0 (5) and 1 (8) after it; 2 (9) and 3 (2) after node 0; 4 (7) after node 3.
TOKENS = torch.tensor([5, 8, 9, 2, 7])
PARENTS = [-1, -1, 0, 0, 3]


# =================================================================================================
# 1. Hand-built
# =================================================================================================


def test_greedy_follows_the_argmax_down_the_docstring_tree() -> None:
    # rows: [after pending, after node 0, 1, 2, 3, 4]
    logits = logits_with_argmax([5, 2, 0, 0, 7, 4])
    verdict = tree_greedy_accept(TOKENS, PARENTS, logits)
    assert verdict.path == [0, 3, 4]  # 5 (node 0), then 2 (node 3, not its sibling 9), then 7 (node 4)
    assert verdict.next_token == 4  # the bonus after node 4


def test_greedy_takes_the_second_child_when_the_first_is_wrong_and_recovers_below() -> None:
    logits = logits_with_argmax([8, 0, 6, 0, 0, 0])  # wants 8 (node 1), then 6, which no node has
    verdict = tree_greedy_accept(TOKENS, PARENTS, logits)
    assert verdict.path == [1] and verdict.next_token == 6


def test_greedy_on_a_chain_is_the_chain_rule() -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        k = int(torch.randint(0, 5, (), generator=generator))
        tokens = torch.randint(0, 4, (k,), generator=generator)
        logits = torch.randn(k + 1, 4, generator=generator)
        chain = greedy_accept(tokens, logits)
        tree = tree_greedy_accept(tokens, [i - 1 for i in range(k)], logits)
        assert (len(tree.path), tree.next_token) == (chain.num_accepted, chain.next_token)
        assert tree.path == list(range(chain.num_accepted))


def rows(*distributions: dict[int, float], vocab: int = 10) -> torch.Tensor:
    out = torch.zeros(len(distributions), vocab)
    for i, distribution in enumerate(distributions):
        for token, p in distribution.items():
            out[i, token] = p
    return out


def test_sampling_skips_a_child_the_target_forbids_and_keeps_the_one_it_certainly_wants() -> None:
    # after pending: 5 impossible, 8 certain -> node 1 always; no node below it -> bonus from row 2
    probs = rows({8: 1.0}, {1: 1.0}, {3: 1.0}, {1: 1.0}, {1: 1.0}, {1: 1.0})
    for seed in range(50):
        verdict = tree_rejection_sample(TOKENS, PARENTS, probs, torch.Generator().manual_seed(seed))
        assert verdict.path == [1] and verdict.next_token == 3


def test_sampling_never_recovers_a_candidate_it_rejected() -> None:
    # after pending the target spreads over 5, 8 and 1: when both children are rejected, 1 comes out;
    # after 5 (node 0) it wants 9, which is node 2, and after that 1
    probs = rows({5: 0.2, 8: 0.3, 1: 0.5}, {9: 1.0}, {1: 1.0}, {1: 1.0}, {1: 1.0}, {1: 1.0})
    outcomes = set()
    for seed in range(400):
        verdict = tree_rejection_sample(TOKENS, PARENTS, probs, torch.Generator().manual_seed(seed))
        outcomes.add((tuple(verdict.path), verdict.next_token))
    assert outcomes == {((0, 2), 1), ((1,), 1), ((), 1)}


# =================================================================================================
# 2. The exact probability of every outcome, by enumeration
# =================================================================================================


def outcome_probabilities(tokens: list[int], parents: list[int], probs: torch.Tensor) -> dict[tuple, float]:
    """P((path, next token)) under recursive rejection sampling, computed exactly."""
    children = children_of(parents)
    result: dict[tuple, float] = {}

    def walk(node: int, path: tuple, reach: float) -> None:
        residual = probs[node + 1].double().clone()
        stay = reach  # probability of reaching this node and rejecting every child tried so far
        for child in children.get(node, []):
            total = float(residual.sum())
            keep = float(residual[tokens[child]]) / total if total > 0 else 0.0
            walk(child, (*path, child), stay * keep)
            stay *= 1 - keep
            residual[tokens[child]] = 0.0
        if stay > 0:
            for token, p in enumerate((residual / residual.sum()).tolist()):
                if p > 0:
                    result[(path, token)] = result.get((path, token), 0.0) + stay * p

    walk(-1, (), 1.0)
    return result


def target_probability(tokens: list[int], parents: list[int], probs: torch.Tensor, path: tuple, token: int) -> float:
    """The target's probability of emitting the path's tokens then `token`: a product of rows."""
    p, node = 1.0, -1
    for child in path:
        p *= float(probs[node + 1, tokens[child]])
        node = child
    return p * float(probs[node + 1, token])


@pytest.mark.parametrize("seed", range(6))
def test_every_outcome_has_exactly_the_targets_probability(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    vocab = 6
    tokens = [int(t) for t in torch.randperm(vocab, generator=generator)[:2]]  # two distinct root children
    tokens += [int(t) for t in torch.randperm(vocab, generator=generator)[:2]]  # two under node 0
    tokens += [int(torch.randint(0, vocab, (), generator=generator))]  # one under node 2
    parents = [-1, -1, 0, 0, 2]
    probs = torch.softmax(torch.randn(len(tokens) + 1, vocab, generator=generator, dtype=torch.float64) * 2, dim=-1)
    outcomes = outcome_probabilities(tokens, parents, probs)
    assert abs(sum(outcomes.values()) - 1) < 1e-9
    for (path, token), p in outcomes.items():
        assert p == pytest.approx(target_probability(tokens, parents, probs, path, token), abs=1e-9)


# =================================================================================================
# 3. Statistics
# =================================================================================================

TRIALS = 20_000


def test_the_first_and_second_tokens_follow_the_target() -> None:
    vocab = 10
    generator = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(len(TOKENS) + 1, vocab, generator=generator) * 1.5, dim=-1)
    sample_generator = torch.Generator().manual_seed(11)
    first = torch.zeros(vocab)
    second_after_5 = torch.zeros(vocab)  # token 5 is node 0: its next token follows row 1
    tokens = TOKENS.tolist()
    for _ in range(TRIALS):
        verdict = tree_rejection_sample(TOKENS, PARENTS, probs, sample_generator)
        emitted = [tokens[node] for node in verdict.path] + [verdict.next_token]
        first[emitted[0]] += 1
        if verdict.path[:1] == [0]:
            second_after_5[emitted[1]] += 1
    assert chi_square_p_value(first, probs[0]) > ALPHA
    assert chi_square_p_value(second_after_5, probs[1]) > ALPHA


def test_a_sampler_that_keeps_the_first_child_too_often_fails_the_same_test() -> None:
    """Negative control: accepting a child with probability sqrt(r(c)) instead of r(c) is biased."""
    vocab = 10
    generator = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(len(TOKENS) + 1, vocab, generator=generator) * 1.5, dim=-1)

    def biased(tokens, parents, target_probs, gen):
        boosted = target_probs.sqrt()
        return tree_rejection_sample(tokens, parents, boosted / boosted.sum(-1, keepdim=True), gen)

    sample_generator = torch.Generator().manual_seed(11)
    first = torch.zeros(vocab)
    for _ in range(TRIALS):
        verdict = biased(TOKENS, PARENTS, probs, sample_generator)
        first[([TOKENS[n].item() for n in verdict.path] + [verdict.next_token])[0]] += 1
    assert chi_square_p_value(first, probs[0]) < ALPHA


def test_the_implementation_draws_outcomes_with_the_references_probabilities() -> None:
    generator = torch.Generator().manual_seed(7)
    vocab = 6
    probs = torch.softmax(torch.randn(len(TOKENS) + 1, vocab, generator=generator) * 1.5, dim=-1)
    tokens = [t % vocab for t in TOKENS.tolist()]
    exact_outcomes = outcome_probabilities(tokens, PARENTS, probs)
    index = {outcome: i for i, outcome in enumerate(exact_outcomes)}
    counts = torch.zeros(len(index))
    sample_generator = torch.Generator().manual_seed(5)
    for _ in range(TRIALS):
        verdict = tree_rejection_sample(torch.tensor(tokens), PARENTS, probs, sample_generator)
        counts[index[(tuple(verdict.path), verdict.next_token)]] += 1
    assert chi_square_p_value(counts, torch.tensor(list(exact_outcomes.values()))) > ALPHA
