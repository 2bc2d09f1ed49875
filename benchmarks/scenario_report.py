"""`bench-drift --scenario`'s report: the table it prints and the plot it draws
(benchmarks/scenario.py measures)."""

from __future__ import annotations

from pathlib import Path


def _fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def format_report(result: dict) -> str:
    overall = result["overall"]
    lines = [
        f"bench-drift --scenario {result['scenario']}: {result['target']} with draft {result['draft']}, "
        f"{result['concurrency']} user(s), {result['max_new_tokens']} new tokens, greedy, dynamic k; "
        f"static: {result['static']}",
        f"{'phase':<18} {'start':>7} {'end':>7}  {'plateau':>7} {'static':>7}  {'held-out':>8} {'static':>7}  "
        f"{'recover':>8}  {'return':>6}",
    ]
    for phase in result["phases"]:
        lines.append(
            f"{phase['name']:<18} {phase['start_s']:>6.0f}s {phase['end_s']:>6.0f}s  "
            f"{_fmt(phase['plateau_acceptance']):>7} {_fmt(phase['static_acceptance']):>7}  "
            f"{_fmt(phase['heldout_acceptance']):>8} {_fmt(phase['heldout_static_acceptance']):>7}  "
            f"{_fmt(phase['recover_s'], '.0f') + 's' if phase['recover_s'] is not None else '-':>8}  "
            f"{_fmt(phase.get('return_ratio'), '.2f'):>6}"
        )
    lines.append(
        f"overall: acceptance {_fmt(overall['adaptive_acceptance'])} adaptive vs {_fmt(overall['static_acceptance'])} "
        f"static; {_fmt(overall['adaptive_tok_s'], '.1f')} vs {_fmt(overall['static_tok_s'], '.1f')} tok/s "
        f"({_fmt(overall['speedup'], '.2f')}x) over {overall['requests']} requests; mean acceptance length "
        f"{_fmt(overall['adaptive_mean_acceptance_length'])} vs {_fmt(overall['static_mean_acceptance_length'])}"
    )
    if "target_alone_ratio" in overall:
        lines.append(
            f"the two servers with the target alone on the held-out prompts: {_fmt(overall['target_alone_ratio'], '.2f')}x; "
            f"speedup net of that: {_fmt(overall['speedup_net_of_processes'], '.2f')}x"
        )
    first = result["first_promotion_s"]
    lines.append(
        f"first promoted adapter served after {_fmt(first, '.0f')} s of traffic; "
        f"{sum(e['kind'] == 'swap' for e in result['events'])} swaps, "
        f"{sum(e['kind'] == 'rollback' for e in result['events'])} rollbacks"
    )
    lines.append(f"identical (live: both servers; held-out: the target alone): {result['identical']}")
    return "\n".join(lines)


def plot(result: dict, path: str | Path) -> None:
    """Live acceptance and mean acceptance length over time, adaptive against static, the phases as
    bands, swaps and rollbacks as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acceptance, length) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, height_ratios=(3, 2))
    colours = plt.get_cmap("tab10")
    names = list(dict.fromkeys(phase["name"] for phase in result["phases"]))
    for axis in (acceptance, length):
        for phase in result["phases"]:
            colour = colours(names.index(phase["name"]) % 10)
            axis.axvspan(phase["start_s"], phase["end_s"], color=colour, alpha=0.10, lw=0)
        for event in result["events"]:
            axis.axvline(event["t_s"], color="C3" if event["kind"] == "rollback" else "C2", lw=0.9, ls=":")
        axis.grid(alpha=0.3)
    for phase in result["phases"]:
        acceptance.text(
            (phase["start_s"] + phase["end_s"]) / 2,
            1.02,
            phase["name"],
            ha="center",
            va="bottom",
            transform=acceptance.get_xaxis_transform(),
            fontsize=9,
            color=colours(names.index(phase["name"]) % 10),
        )
    styles = {"adaptive": dict(color="C0", lw=2), "static": dict(color="0.45", lw=1.5, ls="--")}
    for axis, figure in ((acceptance, "acceptance"), (length, "mean_acceptance_length")):
        for server, style in styles.items():
            points = [(w["t_s"], w[server][figure]) for w in result["windows"] if w[server].get(figure) is not None]
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", ms=3, label=server, **style)
    acceptance.plot([], [], color="C2", lw=0.9, ls=":", label="adapter swapped in")
    acceptance.set_ylabel("acceptance\n(accepted / drafted)")
    acceptance.set_ylim(0, 1)
    acceptance.legend(loc="upper left", fontsize=8)
    length.set_ylabel("mean acceptance length\n(tokens per target forward)")
    length.set_ylim(bottom=1)
    length.set_xlabel(f"seconds of traffic ({result['window_s']:.0f} s windows)")
    length.set_xlim(left=0)
    overall = result["overall"]
    fig.suptitle(
        f"adaptive-spec bench-drift --scenario {result['scenario']}\n{Path(str(result['target'])).name}, "
        f"draft {result['draft']}, dynamic k: adaptive {_fmt(overall['speedup'], '.2f')}x the static baseline's tok/s, "
        f"acceptance {_fmt(overall['adaptive_acceptance'])} vs {_fmt(overall['static_acceptance'])}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
