"""Free drafts first: copy from the context when it has a match, draft with the model otherwise.

    Engine.from_pretrained(draft="ngram+head")          # or ngram+early-exit:4
    drafter = FreeFirstDrafter(NgramDrafter(3), HeadDrafter(target))

Answers often quote their prompt: identifiers, code, JSON keys, table names. Prompt lookup
(`ngram.py`) proposes such continuations with no forward at all. For each row that drafts, this
drafter first looks up the row's own context, then the n-gram index its adapter learnt from
recent outputs of its domain (`AdapterSlot.ngrams`, when the trainer shipped one). A match of at
least `min_match` tokens (`free_proposals`) is a free proposal. With dynamic k the policy decides, row
by row, whether the row copies its match or drafts with the model, each source judged by its own
measured acceptance and cost (dynamic_k.py `choose_sources`); with a fixed k a match is always
copied. Only the rows that do not copy go through the model draft, in one batched forward per
draft token as usual. Example: a row whose context ends in
`SELECT name FROM` and holds `SELECT name FROM users WHERE` earlier proposes `users WHERE`
for free, while a chat row in the same batch drafts with the head.

It is the model draft in every other respect (its adapters, caches and vocabulary); the model's
cache of a row that used a free proposal catches up on its next model proposal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adaptive_spec.drafters import Drafter, DraftRow, Proposal
from adaptive_spec.drafters.ngram import NgramDrafter

MIN_MATCH = 2  # a shorter copy is not worth a verify slot over the model's own guess


class FreeFirstDrafter(Drafter):
    """Every hook but proposing is the model draft's (its cache, its states, its adapters)."""

    def __init__(self, lookup: NgramDrafter, model: Drafter, min_match: int = MIN_MATCH):
        self.lookup = lookup
        self.model = model
        self.min_match = min_match
        self.name = f"{lookup.name}+{model.name}"
        self.wants_target_hidden = model.wants_target_hidden
        self.takes_adapters = model.takes_adapters
        self.prior_cost = model.prior_cost
        self.builds_trees = model.builds_trees

    def new_cache(self):
        return self.model.new_cache()

    def models(self):
        return self.model.models()

    def compile(self):
        self.model.compile()

    def on_prefill(self, row, hidden):
        self.model.on_prefill(row, hidden)

    def on_copy_row(self, source, row):
        self.model.on_copy_row(source, row)

    def on_commit(self, cache, row, before, kept_hidden):
        self.model.on_commit(cache, row, before, kept_hidden)

    def build_weights(self, config, tensors):
        return self.model.build_weights(config, tensors)

    def new_vocab(self, weights=None):
        return self.model.new_vocab(weights)

    def free_proposals(self, rows: Sequence[DraftRow], limits: list[int]) -> list[list[int]]:
        """Each row's free proposal of at most `limits[i]` tokens: [] where it has no match worth a
        verify slot. The policy (dynamic_k.py `choose_sources`) decides which rows use theirs."""
        free = [self._free(row, k) if k else [] for row, k in zip(rows, limits, strict=True)]
        return [tokens if len(tokens) >= min(self.min_match, k) else [] for tokens, k in zip(free, limits, strict=True)]

    def propose(
        self,
        cache,
        rows: Sequence[DraftRow],
        ks: list[int],
        free: list[list[int]] | None = None,
        depths: list[int] | None = None,
    ) -> list[Proposal]:
        """Up to ks[i] tokens per row: `free[i]` when given and not empty (the policy chose the row's
        match), else the model's. Without `free`, every row with a match uses it."""
        if free is None:
            free = self.free_proposals(rows, ks)
        free = [tokens[:k] for tokens, k in zip(free, ks, strict=True)]
        model_ks = [0 if tokens else k for tokens, k in zip(free, ks, strict=True)]
        proposals = self.model.propose(cache, rows, model_ks, depths=depths)
        for i, tokens in enumerate(free):
            if tokens:
                proposals[i] = Proposal(
                    torch.tensor(tokens, dtype=torch.long, device=self.lookup.device), None, free=True
                )
        return proposals

    def _free(self, row: DraftRow, k: int) -> list[int]:
        tokens = self.lookup.lookup(row.ids, k)
        index = getattr(row.adapter, "ngrams", None)
        if len(tokens) < min(self.min_match, k) and index:
            tokens = self.lookup.lookup_index(row.ids, k, index) or tokens
        return tokens
