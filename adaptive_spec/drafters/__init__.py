"""Drafters propose the next tokens of every row of a batch; the target verifies them.

A drafter has two verbs (cf. transformers `candidate_generator.py`, vLLM `v1/spec_decode/`):

- `new_cache()` gives the per-batch state a drafter keeps between steps (a `BatchCache` for a
  model draft, None for prompt lookup). The batch adds, removes and rolls back its rows
  together with the target's, so the drafter never sees a row come or go;
- `propose(cache, rows, ks)` returns up to `ks[i]` tokens after `rows[i].ids` for each row.

Each row brings its context (`ids`, whose last token is the pending one), its slot in the
caches (`slot`), its sampling parameters (`params`), its random generator (`generator`) and the
adapter it drafts with (`adapter`, an `AdapterSlot`, or None for the base draft). Rows with
different adapters share the batch: a drafter runs one forward per adapter present
(`by_adapter`).

Draft specs, as `Engine.from_pretrained(draft=...)` takes them, are parsed in `spec.py`:

- `early-exit:N`: the target's first N layers, final norm and LM head (see `early_exit.py`);
- `ngram` (or `ngram:N` for the longest n-gram tried): prompt lookup, no model;
- anything else: a separate model with the target's vocabulary, loaded by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from adaptive_spec.sampling import SamplingParams


@dataclass
class Proposal:
    tokens: torch.Tensor  # [n] int64, n <= k
    probs: torch.Tensor | None  # [n, vocab] the distribution each token was drawn from; None = deterministic
    forwards: int = 0  # draft model forward passes spent on this row
    fed: int = 0  # context tokens the first forward fed: 1-2 normally, more to catch up after plain steps
    free: bool = False  # copied from the context or an n-gram index (free_first.py), no model forward


def no_proposal(device: torch.device) -> Proposal:
    return Proposal(torch.zeros(0, dtype=torch.long, device=device), None)


class DraftRow(Protocol):
    slot: int  # the row's index in the batch's caches
    ids: list[int]  # the context; its last token is pending (not yet in the target's cache)
    params: SamplingParams
    generator: torch.Generator | None
    adapter: object  # the AdapterSlot the row drafts with; None = the base draft
    constraints: object  # adaptive_spec.constraints.Constraints (penalties, grammar), or None


def by_adapter(rows: Sequence[DraftRow], indices: list[int]) -> list[tuple[object, list[int]]]:
    """`indices` grouped by their row's adapter, in order of first appearance: [(adapter, [i, ...])]."""
    groups: dict[int, tuple[object, list[int]]] = {}
    for i in indices:
        adapter = rows[i].adapter
        groups.setdefault(id(adapter), (adapter, []))[1].append(i)
    return list(groups.values())


class Drafter(Protocol):
    name: str

    def new_cache(self): ...

    def propose(self, cache, rows: Sequence[DraftRow], ks: list[int]) -> list[Proposal]: ...
