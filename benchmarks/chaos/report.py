"""The report on a run's figures: the bar it must hold, the timeline plot, the summary lines."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks.chaos.settings import FAULTS


def bar(figures: dict) -> dict[str, bool]:
    """The issue's bar, checked on the figures: what a 20-minute run must show."""
    requests, records, versions = figures["requests"], figures["records"], figures["versions"]
    return {
        "no acknowledged record lost": records["lost"] == 0,
        "no request failed on both replicas": requests["failed_on_both"] == 0,
        "no 5xx from a live replica": requests["5xx_from_a_live_replica"] == 0,
        "a version promoted": versions["promoted_by_the_trainer"] >= 1,
        "every forged or NaN version refused by both replicas": versions["forged_refused_by_both"]
        == len(versions["forged"]),
    }


def plot(figures: dict, path: Path) -> None:
    """Requests answered per 5 s, failures, promotions and swaps on one time axis, each fault a shaded span."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seconds = figures["minutes"] * 60
    bins = np.arange(0, seconds // 5 * 5 + 1, 5)  # whole 5 s bins: a partial last one would read as a drop
    fig, ax = plt.subplots(figsize=(13, 5))
    answered, _ = np.histogram(figures["answered_at"], bins)
    ax.plot(bins[:-1], answered / 5, color="tab:blue", label="requests answered / s")
    if figures["failed_at"]:
        ax.scatter(
            figures["failed_at"], [0] * len(figures["failed_at"]), color="red", marker="x", label="failed on both"
        )
    colours = {kind: plt.get_cmap("tab10")(i) for i, kind in enumerate(FAULTS)}
    top = max(1.0, float(answered.max() / 5) if len(answered) else 1.0)
    for fault in figures["faults"]:
        ax.axvspan(
            fault["start"], max(fault["end"], fault["start"] + 1), color=colours.get(fault["kind"], "grey"), alpha=0.25
        )
        ax.text(fault["start"], top * 1.02, fault["kind"], rotation=60, fontsize=7, va="bottom")
    for t in figures["promotions_at"]:
        ax.axvline(t, color="green", linestyle="--", linewidth=0.8)
    ax.plot([], [], color="green", linestyle="--", label="promotion")
    ax.set_xlabel("seconds")
    ax.set_ylabel("requests / s")
    ax.set_ylim(0, top * 1.35)
    held = bar(figures)
    ax.set_title(
        f"bench-chaos: {len(figures['faults'])} faults, {figures['requests']['answered']} answered, "
        f"{figures['requests']['failed_on_both']} failed on both, {figures['records']['lost']} records lost, "
        f"bar {'held' if all(held.values()) else 'NOT held'}",
        fontsize=10,
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(figures: dict) -> str:
    requests, records, versions = figures["requests"], figures["records"], figures["versions"]
    kinds = Counter(f["kind"] for f in figures["faults"])
    lines = [
        f"bench-chaos: {figures['minutes']} min, faults {dict(kinds)} ({sum(not f['ok'] for f in figures['faults'])} not ok)",
        f"  requests: {requests['sent']} sent, {requests['answered']} answered, {requests['failed_on_both']} failed on "
        f"both replicas, {requests['retried_on_the_other']} retried on the other, "
        f"{requests['5xx_from_a_live_replica']} 5xx from a live replica",
        f"  records: {records['acknowledged_by_redis']} acknowledged by Redis, {records['in_stream']} in the stream, "
        f"{records['lost']} lost; {records['bad_injected']} bad ones injected",
        f"  versions: {versions['promoted_by_the_trainer']} promoted by the trainer, {len(versions['forged'])} forged, "
        f"{versions['forged_refused_by_both']} refused by both; rollback races {len(versions['rollback_races'])} "
        f"({sum(r['consistent'] for r in versions['rollback_races'])} consistent); swaps {figures['swaps']}",
    ]
    if figures["unplanned_exits"]:
        lines.append(f"  exited without a fault (restarted): {figures['unplanned_exits']}")
    lines += [f"  bar: {name}: {'yes' if held else 'NO'}" for name, held in bar(figures).items()]
    return "\n".join(lines)
