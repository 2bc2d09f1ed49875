"""What the acceptance tests share (tests/adaptive_spec/test_acceptance.py, test_tree_acceptance.py,
test_trees.py): the significance level of the statistical tests, a chi-square p-value, and logits that
peak where a test wants the target's argmax.
"""

from __future__ import annotations

import torch

ALPHA = 0.001


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """P(chi-square >= observed statistic) for observed `counts` against `expected_probs`.

    Both are flattened. An outcome with expected probability 0 that was observed anyway makes the
    p-value 0. Outcomes expected fewer than 5 times are pooled into one cell (the usual validity
    rule for the chi-square approximation); df = cells - 1.
    """
    counts = counts.flatten().double()
    expected = expected_probs.flatten().double() * counts.sum()
    if counts[expected == 0].sum() > 0:
        return 0.0
    small = expected < 5
    cells_observed = torch.cat([counts[~small], counts[small].sum()[None]])
    cells_expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = cells_expected > 0
    cells_observed, cells_expected = cells_observed[keep], cells_expected[keep]
    statistic = ((cells_observed - cells_expected) ** 2 / cells_expected).sum()
    df = cells_observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2))


def logits_with_argmax(argmaxes: list[int], vocab: int = 10) -> torch.Tensor:
    """[len(argmaxes), vocab] logits, row i peaking (not one-hot) at argmaxes[i]."""
    logits = torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(len(argmaxes)))
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return logits
