"""Prompt lookup: propose what followed the last occurrence of the context's final n-gram."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adaptive_spec.drafters import Drafter, DraftRow, Proposal


class NgramDrafter(Drafter):
    """Drafts by copying, with no model (cf. transformers `PromptLookupCandidateGenerator`).

    Example: the context ends in [..., 17, 4, 9] and earlier holds [17, 4, 9, 31, 5, 8, 2]. With
    max_ngram=3 the trigram [17, 4, 9] matches there, so k=3 proposes [31, 5, 8]. With no match
    for n = 3, 2, 1 it proposes nothing and the row's step is plain decoding. Proposals are
    deterministic, so under sampling each is accepted with the target's probability of it.
    Each row looks up in its own context only.
    """

    prior_cost = 0.0  # no forward: a proposal costs only its verify slots

    def __init__(self, max_ngram: int = 3, device: torch.device | str = "cpu"):
        if max_ngram < 1:
            raise ValueError(f"ngram size must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.device = torch.device(device)
        self.name = f"ngram:{max_ngram}"

    def propose(self, cache, rows: Sequence[DraftRow], ks: list[int], free=None, depths=None) -> list[Proposal]:
        return [
            Proposal(torch.tensor(self.lookup(row.ids, k), dtype=torch.long, device=self.device), None)
            for row, k in zip(rows, ks, strict=True)
        ]

    def lookup(self, context: list[int], k: int) -> list[int]:
        length = len(context)
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            tail = context[length - n :]
            # Most recent earlier occurrence whose continuation exists.
            for start in range(length - n - 1, -1, -1):
                if context[start : start + n] == tail:
                    return context[start + n : start + n + k]
        return []

    def lookup_index(self, context: list[int], k: int, index: dict[tuple[int, ...], list[int]]) -> list[int]:
        """What followed the context's final n-gram in a domain's recent outputs: `index` maps an
        n-gram (as a tuple, n <= max_ngram) to the tokens that most often followed it there
        (ngram_index.py builds it; a version ships it as draft_ngrams.json)."""
        for n in range(min(self.max_ngram, len(context)), 0, -1):
            follow = index.get(tuple(context[len(context) - n :]))
            if follow:
                return list(follow[:k])
        return []
