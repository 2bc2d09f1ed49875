"""Per-step records and the per-request summary (STYLE.md §12: record, aggregate, export).

Formulas, as a dashboard plots them (vLLM `v1/spec_decode/metrics.py`):

    acceptance_rate         = accepted / drafted
    mean_acceptance_length  = emitted tokens / target forwards while decoding
                            = (accepted + one recovered or bonus token per forward) / forwards

Example: 10 steps that drafted 4 tokens each and accepted 30 in all emit 30 + 10 = 40 tokens,
so acceptance_rate = 30 / 40 = 0.75 and mean_acceptance_length = 40 / 10 = 4.0. Plain decoding
(k = 0) has mean_acceptance_length 1.0 and no acceptance rate. The prompt's prefill is not a
decoding forward and is counted apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    drafted: int  # draft tokens verified this step
    accepted: int  # of which the target kept
    emitted: int  # accepted + 1, less whatever a stop condition cut
    draft_forwards: int
    draft_s: float
    verify_s: float
    free: bool = False  # the drafted tokens were a free proposal (copied, no model forward)


@dataclass
class Totals:
    """Sums over steps, requests or windows, and the two figures every report derives from them, here
    once: a request's stats, a benchmark's run, the dashboard's buckets and the drift alert's window."""

    drafted: float = 0  # draft tokens verified
    accepted: float = 0  # of which the target kept
    emitted: float = 0  # tokens emitted by decoding forwards (accepted + one recovered or bonus each)
    target_forwards: float = 0  # decoding forwards (verifications); the prefill is counted apart

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted; None when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """emitted / target forwards; None before the first forward."""
        return self.emitted / self.target_forwards if self.target_forwards else None

    def include(self, other: Totals) -> Totals:
        """Add another's sums (a RequestStats is one) into these; returns self."""
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.emitted += other.emitted
        self.target_forwards += other.target_forwards
        return self


@dataclass
class RequestStats(Totals):
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    target_forwards: int = 0  # decoding forwards (verifications); the prefill is counted apart
    draft_forwards: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0
    adapter_version: str | None = None
    free_drafted: int = 0  # of `drafted`, tokens of free proposals (ngram+ drafts: copied, no forward)
    free_accepted: int = 0  # of `accepted`, those the free proposals got
    accepted_per_pos: list[int] = field(default_factory=list)  # [k_max] accepted at draft position i
    drafted_per_pos: list[int] = field(default_factory=list)  # [k_max] drafted at draft position i

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
        grow = step.drafted - len(self.drafted_per_pos)
        if grow > 0:
            self.drafted_per_pos += [0] * grow
            self.accepted_per_pos += [0] * grow
        for pos in range(step.drafted):
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
