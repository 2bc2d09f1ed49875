"""Per-step records and the per-request summary (STYLE.md §12: record, aggregate, export).

Formulas, as a dashboard plots them (vLLM `v1/spec_decode/metrics.py`):

    acceptance_rate         = accepted / drafted
    mean_acceptance_length  = emitted tokens / target forwards while decoding
                            = (accepted + one recovered or bonus token per forward) / forwards
    tokens_verified_per_step = drafted / forwards   (a chain's length, a tree's size)
    acceptance_by_depth[d]  = steps that accepted d + 1 tokens or more / steps whose draft reached depth d + 1

Example: 10 steps that drafted 4 tokens each and accepted 30 in all emit 30 + 10 = 40 tokens,
so acceptance_rate = 30 / 40 = 0.75 and mean_acceptance_length = 40 / 10 = 4.0. Plain decoding
(k = 0) has mean_acceptance_length 1.0 and no acceptance rate. The prompt's prefill is not a
decoding forward and is counted apart.

A draft tree of 12 nodes and depth 4 verifies 12 tokens but can be accepted at 4 positions at most:
it counts 12 drafted tokens and reaches depths 1-4 once each. A chain of 4 reaches the same depths,
so acceptance by depth compares a chain and a tree on the same footing, while acceptance_rate (per
verified token) is lower for the tree by design.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import zip_longest


@dataclass
class StepStats:
    drafted: int  # draft tokens verified this step
    accepted: int  # of which the target kept
    emitted: int  # accepted + 1, less whatever a stop condition cut
    draft_forwards: int
    draft_s: float
    verify_s: float
    free: bool = False  # the drafted tokens were a free proposal (copied, no model forward)
    reach: int | None = None  # depths it could be accepted at: a tree's depth; None = a chain, `drafted`


@dataclass
class Totals:
    """Sums over steps, requests or windows, and the two figures every report derives from them, here
    once: a request's stats, a benchmark's run, the dashboard's buckets and the drift alert's window."""

    drafted: float = 0  # draft tokens verified
    accepted: float = 0  # of which the target kept
    emitted: float = 0  # tokens emitted by decoding forwards (accepted + one recovered or bonus each)
    target_forwards: float = 0  # decoding forwards (verifications); the prefill is counted apart
    accepted_per_pos: list[int] = field(default_factory=list)  # [depth] steps that accepted past depth i
    drafted_per_pos: list[int] = field(default_factory=list)  # [depth] steps whose draft reached depth i + 1

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted; None when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """emitted / target forwards; None before the first forward."""
        return self.emitted / self.target_forwards if self.target_forwards else None

    @property
    def tokens_verified_per_step(self) -> float | None:
        """drafted / target forwards: the draft tokens one verify checks (a tree's size); None before the first."""
        return self.drafted / self.target_forwards if self.target_forwards else None

    @property
    def acceptance_by_depth(self) -> list[float]:
        """[depth - 1] the share of drafts reaching that depth whose token there was accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos, strict=True)]

    def include(self, other: Totals) -> Totals:
        """Add another's sums (a RequestStats is one) into these; returns self."""
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.emitted += other.emitted
        self.target_forwards += other.target_forwards
        self.accepted_per_pos = _summed(self.accepted_per_pos, other.accepted_per_pos)
        self.drafted_per_pos = _summed(self.drafted_per_pos, other.drafted_per_pos)
        return self

    def figures(self) -> dict:
        """The derived figures every report prints, under the names the JSON contracts use."""
        return {
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "tokens_verified_per_step": self.tokens_verified_per_step,
            "acceptance_by_depth": self.acceptance_by_depth,
        }


def _summed(mine: list[int], theirs: list[int]) -> list[int]:
    return [a + b for a, b in zip_longest(mine, theirs, fillvalue=0)]


@dataclass
class RequestStats(Totals):
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    target_forwards: int = 0  # decoding forwards (verifications); the prefill is counted apart
    draft_forwards: int = 0
    prefill_s: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache (prefix_cache.py)
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0
    adapter_version: str | None = None
    free_drafted: int = 0  # of `drafted`, tokens of free proposals (ngram+ drafts: copied, no forward)
    free_accepted: int = 0  # of `accepted`, those the free proposals got

    def add(self, step: StepStats) -> None:
        self.drafted += step.drafted
        self.accepted += step.accepted
        self.emitted += step.emitted
        self.target_forwards += 1
        self.draft_forwards += step.draft_forwards
        self.draft_s += step.draft_s
        self.verify_s += step.verify_s
        if step.free:
            self.free_drafted += step.drafted
            self.free_accepted += step.accepted
        reach = step.drafted if step.reach is None else step.reach
        grow = reach - len(self.drafted_per_pos)
        if grow > 0:
            self.drafted_per_pos += [0] * grow
            self.accepted_per_pos += [0] * grow
        for pos in range(reach):
            self.drafted_per_pos[pos] += 1
            self.accepted_per_pos[pos] += pos < step.accepted

    def as_dict(self) -> dict:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "wall_s": self.wall_s,
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "adapter_version": self.adapter_version,
            "accepted_per_pos": list(self.accepted_per_pos),
            "drafted_per_pos": list(self.drafted_per_pos),
            "free_drafted": self.free_drafted,
            "free_accepted": self.free_accepted,
        }
