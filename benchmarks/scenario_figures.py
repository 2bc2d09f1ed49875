"""`bench-drift --scenario`'s figures: each reply as the scenario keeps it, and the JSON of a run from
its phases, replies and swap markers (benchmarks/scenario.py runs it, scenario_report.py prints it).

Per phase: its times, the plateau (acceptance over the last third), `recover_s` (until a window is
back at RECOVER_FRACTION of that plateau), held-out and static acceptance, and `return_ratio` (the
first RETURN_S seconds back over the domain's last plateau); `overall` per server; the live windows.
"""

from __future__ import annotations

from dataclasses import dataclass

from adaptive_spec.formats.stats import Totals
from service.stats_queries import ratio

RECOVER_FRACTION = 0.8  # recovered: a window at this fraction of the phase's plateau
RETURN_S = 60.0  # a returning domain's acceptance is taken over its first minute back


@dataclass
class Reply:
    server: str  # "adaptive" or "static"
    phase: int
    prompt: int  # index into the phase's traffic
    end_s: float  # since the traffic began
    latency_s: float
    tokens: int
    forwards: float  # target forwards: tokens over the mean acceptance length
    drafted: int
    accepted: int
    adapter_version: str | None
    text: str


def summarize(
    settings,  # a ScenarioSettings
    phases: list[dict],
    replies: list[Reply],
    events: list[dict],
    start: str | None = None,
) -> dict:
    """The JSON of a run from its phases (times, held-out figures), live replies and swap markers;
    `start`: the version the adaptive server started from (None: the base draft)."""
    window = settings.window_s
    end = max([p["end_s"] for p in phases] + [0.0])
    windows = []
    for i in range(max(1, int(end // window) + 1)):
        inside = [r for r in replies if i * window <= r.end_s < (i + 1) * window]
        windows.append({"t_s": (i + 0.5) * window, **{s: window_figures(inside, s) for s in ("adaptive", "static")}})
    plateaus: dict[str, float | None] = {}
    for index, phase in enumerate(phases):
        mine = [r for r in replies if r.phase == index]
        tail_from = phase["end_s"] - max(2 * window, (phase["end_s"] - phase["start_s"]) / 3)
        plateau = acceptance([r for r in mine if r.server == "adaptive" and r.end_s >= tail_from])
        phase["plateau_acceptance"] = plateau
        phase["static_acceptance"] = acceptance([r for r in mine if r.server == "static"])
        phase["mean_acceptance_length"] = _mean_acceptance_length([r for r in mine if r.server == "adaptive"])
        phase["static_mean_acceptance_length"] = _mean_acceptance_length([r for r in mine if r.server == "static"])
        phase["recover_s"] = _recover_s(mine, phase["start_s"], plateau, window)
        if phase["name"] in plateaus:
            first = acceptance([r for r in mine if r.server == "adaptive" and r.end_s < phase["start_s"] + RETURN_S])
            before = plateaus[phase["name"]]
            phase["return_ratio"] = first / before if first is not None and before else None
        plateaus[phase["name"]] = plateau
    pairs = {}
    for reply in replies:
        pairs.setdefault((reply.phase, reply.prompt, reply.server), reply.text)
    live_identical = all(
        pairs.get((p, i, "static"), text) == text for (p, i, server), text in pairs.items() if server == "adaptive"
    )
    swaps = [e for e in events if e.get("kind") == "swap" and e["t_s"] >= 0]  # not a start version's load
    overall = {
        "adaptive_acceptance": acceptance([r for r in replies if r.server == "adaptive"]),
        "static_acceptance": acceptance([r for r in replies if r.server == "static"]),
        "adaptive_tok_s": tok_s([r for r in replies if r.server == "adaptive"]),
        "adaptive_mean_acceptance_length": _mean_acceptance_length([r for r in replies if r.server == "adaptive"]),
        "static_mean_acceptance_length": _mean_acceptance_length([r for r in replies if r.server == "static"]),
        "static_tok_s": tok_s([r for r in replies if r.server == "static"]),
        "requests": len(replies) // 2,
    }
    overall["speedup"] = ratio(overall["adaptive_tok_s"], overall["static_tok_s"])
    first_served = next(
        (
            r
            for r in sorted(replies, key=lambda r: r.end_s)
            if r.server == "adaptive" and r.adapter_version not in (None, start)
        ),
        None,
    )
    return {
        "phases": phases,
        "overall": overall,
        "first_promotion_s": swaps[0]["t_s"] if swaps else None,
        # adaptive requests answered before the first one an adapter drafted (the trainer's records come from these)
        "first_promotion_requests": (
            sum(r.server == "adaptive" and r.end_s < first_served.end_s for r in replies) if first_served else None
        ),
        "identical": live_identical and all(p["heldout_identical"] for p in phases),
        # what the static server serves: the base draft, or the start version frozen (--start-version)
        "start_version": settings.start_version,
        "static": "base draft" if settings.start_adapter is None else f"version {settings.start_version}, frozen",
        "first_adapter_versions": {  # what each server's first live reply drafted with
            server: next((r.adapter_version for r in replies if r.server == server), None)
            for server in ("adaptive", "static")
        },
        "events": events,
        "windows": windows,
        "window_s": window,
        "target": settings.target,
        "draft": settings.draft,
        "concurrency": settings.concurrency,
        "max_domains": settings.max_domains,
        "max_new_tokens": settings.max_new_tokens,
        "scenario": ",".join(f"{p.name}:{p.seconds:g}" for p in settings.phases),
    }


def _totals(replies: list[Reply]) -> Totals:
    return Totals(
        sum(r.drafted for r in replies),
        sum(r.accepted for r in replies),
        sum(r.tokens for r in replies),
        sum(r.forwards for r in replies),
    )


def acceptance(replies: list[Reply]) -> float | None:
    return _totals(replies).acceptance_rate


def tok_s(replies: list[Reply]) -> float | None:
    busy = sum(r.latency_s for r in replies)
    return sum(r.tokens for r in replies) / busy if busy else None


def _mean_acceptance_length(replies: list[Reply]) -> float | None:
    return _totals(replies).mean_acceptance_length


def window_figures(replies: list[Reply], server: str) -> dict:
    mine = [r for r in replies if r.server == server]
    return {
        "acceptance": acceptance(mine),
        "mean_acceptance_length": _mean_acceptance_length(mine),
        "tokens": sum(r.tokens for r in mine),
        "busy_s": round(sum(r.latency_s for r in mine), 3),
        "requests": len(mine),
    }


def _recover_s(replies: list[Reply], start_s: float, plateau: float | None, window: float) -> float | None:
    if not plateau:
        return None
    adaptive = [r for r in replies if r.server == "adaptive"]
    last = max((r.end_s for r in adaptive), default=start_s)
    i = 0
    while start_s + i * window <= last:
        inside = [r for r in adaptive if start_s + i * window <= r.end_s < start_s + (i + 1) * window]
        value = acceptance(inside)
        if value is not None and value >= RECOVER_FRACTION * plateau:
            return (i + 1) * window
        i += 1
    return None
