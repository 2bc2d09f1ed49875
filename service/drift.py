"""The drift alert: is the served adapter still as good on live traffic as its gate said?

    state = check(sums, gate_candidate, "4", DriftSettings(window_s=600, fraction=0.7, min_drafts=200), now)
    state.alert, state.reason   # True, "first-token acceptance 0.301 < 0.7 x gated 0.622"

Over the last `window_s`, the served version's first-token acceptance, summed
over all replicas, is compared with what the gate measured for it on held-out traffic. The
first draft token of a step is scored in exactly the context the gate used (teacher forcing),
so the comparable figures are the gate's greedy match for greedy requests and its expected
acceptance (sum of min(draft, target) probabilities) for sampled ones, weighted by the window's
mix. Example: gate greedy match 0.63, expected acceptance 0.55, a window of 900 greedy and 100
sampled drafting steps -> expected 0.622; the alert fires below 0.7 x 0.622 = 0.435, and only
when the window holds at least `min_drafts` drafting steps.

The store (service/stats_store.py) sums the window over every replica's buckets; Prometheus
exports the last state as `adaptive_spec:drift_alert` (service/metrics.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.stats_queries import BASE, ratio, totals_of


@dataclass(frozen=True)
class DriftSettings:
    window_s: float = 600.0
    fraction: float = 0.7
    min_drafts: int = 200


@dataclass
class DriftState:
    """What the alert saw last: `alert` is True only with a reference and enough traffic."""

    version: str | None = None
    alert: bool = False
    reason: str = "not evaluated yet"
    acceptance_rate: float | None = None  # accepted / drafted over the window
    first_token_acceptance: float | None = None  # accepted_first / drafts over the window
    expected: float | None = None  # the gate's figure, mixed by the window's greedy share
    threshold: float | None = None  # fraction * expected
    drafts: int = 0
    evaluated_at: float | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def check(sums: dict[str, float], candidate: dict, label: str, settings: DriftSettings, now: float) -> DriftState:
    """The alert for the served version `label` from the window's summed fields (service/stats_queries.py
    FIELDS) and its gate's figures on the candidate side (`greedy_match`, `expected_acceptance`)."""
    drafts = int(sums.get("drafts", 0))
    state = DriftState(
        version=label,
        drafts=drafts,
        evaluated_at=now,
        acceptance_rate=totals_of(sums).acceptance_rate,
        first_token_acceptance=ratio(sums.get("accepted_first", 0.0), sums.get("drafts")),
    )
    greedy_match, expected_acceptance = candidate.get("greedy_match"), candidate.get("expected_acceptance")
    if greedy_match is None and expected_acceptance is None:
        state.reason = "base draft: no gate" if label == BASE else "no gate figures for the served version"
        return state
    greedy_share = sums.get("drafts_greedy", 0.0) / drafts if drafts else 1.0
    greedy_match = expected_acceptance if greedy_match is None else greedy_match
    expected_acceptance = greedy_match if expected_acceptance is None else expected_acceptance
    state.expected = greedy_share * greedy_match + (1 - greedy_share) * expected_acceptance
    state.threshold = settings.fraction * state.expected
    if drafts < settings.min_drafts:
        state.reason = f"{drafts} drafting steps in the window, the alert needs {settings.min_drafts}"
        return state
    state.alert = state.first_token_acceptance < state.threshold
    state.reason = (
        f"first-token acceptance {state.first_token_acceptance:.3f} "
        f"{'<' if state.alert else '>='} {settings.fraction} x gated {state.expected:.3f}"
    )
    return state
