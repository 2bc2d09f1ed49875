"""`adaptive-spec bench-drift --compare-drafts`: the drift benchmark once per draft, head to head.

    adaptive-spec bench-drift --domain python --compare-drafts head,early-exit:4 --budget-minutes 30 \\
        --json compare.json --plot compare.png
    adaptive-spec bench-drift --compare-drafts head,early-exit:4 --budget-minutes 2 --eval-prompts 8  # a quick look

Each draft in turn gets the whole of bench-drift (drift.py) with `--budget-minutes` of its own: the
same held-out prompts and the same traffic in the same order (one seed splits and orders both), and
its own engine, trainer, correction stream and adapter directory, so nothing of one draft's run
reaches the next one's. The drafts run one after the other: the command takes about
`len(drafts) x --budget-minutes`.

Each draft's figures are bench-drift's single-run figures (`domain`, `before`, `after`,
`records_consumed`, ...) plus `draft` and `draft_step_fraction`: one draft forward with the adapter
it ended with, over one one-token target forward, timed side by side in that draft's own run
(draft_cost.py). Speed figures divide by the target alone timed in the same run, interleaved per
prompt, so a machine that slows down between two drafts' runs does not favour either.
"""

from __future__ import annotations

import gc
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from adaptive_spec.contracts import CORRECTION_STREAM
from adaptive_spec.drafters.early_exit import decoder_layers
from adaptive_spec.drafters.spec import DraftSpecError, parse_draft_spec
from adaptive_spec.engine import Engine
from adaptive_spec.outputs.prompts import PromptItem
from benchmarks.drift import DriftBenchSettings, run_drift
from trainer.learning.drafts import TARGET_DRAFTS

TRAINABLE = "early-exit:N, head, ngram+early-exit:N or ngram+head"


TREE = "@tree:"  # `head@tree:16`: the head drafting trees of up to 16 nodes (Engine's tree_budget)


def split_entry(entry: str) -> tuple[str, int | None]:
    """'head@tree:16' -> ('head', 16); 'early-exit:4' -> ('early-exit:4', None). The tree budget is an
    engine option, not part of the draft spec: a chain and a tree head share adapters."""
    spec, sep, budget = entry.partition(TREE)
    if not sep:
        return entry, None
    if not budget.isdigit() or int(budget) < 1:
        raise DraftSpecError(f"{entry!r}: {TREE}N needs a node budget N >= 1, e.g. head{TREE}16")
    return spec, int(budget)


def parse_draft_list(text: str) -> tuple[str, ...]:
    """'head,early-exit:4' -> ('head', 'early-exit:4'): at least two different drafts that bench-drift
    trains; an entry may draft trees (`head@tree:16`). Raises DraftSpecError naming the first bad one."""
    specs = tuple(part.strip() for part in text.split(","))
    for entry in specs:
        spec, tree = split_entry(entry)
        try:
            kind = parse_draft_spec(spec).kind
            if tree is not None and kind not in ("head", "eagle3"):
                raise DraftSpecError("only a head draft builds trees (head, eagle3)")
        except DraftSpecError as exc:
            raise DraftSpecError(f"{entry!r} is not a draft spec: {exc}") from None
        if kind not in TARGET_DRAFTS:
            raise DraftSpecError(f"{entry!r} is not a draft bench-drift trains; it trains {TRAINABLE}")
    if len(specs) < 2:
        raise DraftSpecError(f"name at least two drafts to compare, e.g. head,early-exit:4; got {text!r}")
    repeated = sorted({spec for spec in specs if specs.count(spec) > 1})
    if repeated:
        raise DraftSpecError(f"{repeated[0]!r} is named twice")
    return specs


def check_fits(specs: tuple[str, ...], target) -> None:
    """Each early-exit:N keeps 1 <= N < the target's layers, checked on the first draft's target so that a
    bad N fails before the first run, not after it."""
    layers = len(decoder_layers(target))
    for entry in specs:
        spec, _ = split_entry(entry)
        parsed = parse_draft_spec(spec)
        if parsed.kind == "early-exit" and not 1 <= parsed.layers < layers:
            raise DraftSpecError(f"{spec!r} does not fit the target: early-exit:N needs 1 <= N < {layers}")


def run_compare(
    engine_for: Callable[[str], Engine],
    specs: tuple[str, ...],
    items: list[PromptItem],
    domain: str,
    settings: DriftBenchSettings,
    redis_url: str,
    workdir: Path,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """bench-drift for each draft spec in turn; `engine_for(spec)` loads an engine drafting with it.
    One engine is held at a time: each is dropped before the next loads."""
    started = time.monotonic()
    try:
        engine = engine_for(specs[0])
    except DraftSpecError as exc:
        raise DraftSpecError(f"{specs[0]!r}: {exc}") from None
    check_fits(specs, engine.target)
    drafts = []
    for number, spec in enumerate(specs, 1):
        if engine is None:
            engine = engine_for(spec)
        log(f"draft {number} of {len(specs)}: {spec}, {settings.budget_minutes:g} minutes")
        draft_dir = workdir / spec.replace(":", "-").replace("@", "-")
        draft_dir.mkdir(parents=True, exist_ok=True)
        stream = f"{CORRECTION_STREAM}:compare-{uuid.uuid4().hex[:8]}"  # a fresh one per draft, deleted after
        figures = run_drift(engine, items, domain, settings, redis_url, draft_dir, progress, stream_name=stream)
        drafts.append(figures | {"draft": spec})
        engine = None
        gc.collect()
    return {
        "domain": domain,
        "drafts": drafts,
        "identical": all(d["before"]["identical"] and d["after"]["identical"] for d in drafts),
        "budget_minutes": settings.budget_minutes,  # each draft's
        "eval_prompts": drafts[0]["eval_prompts"],
        "max_new_tokens": settings.max_new_tokens,
        "k": settings.k if settings.k is not None else "dynamic",
        "seed": settings.seed,
        "window_s": settings.window_s,
        "target": drafts[0]["target"],
        "elapsed_minutes": (time.monotonic() - started) / 60,
    }


def _fmt(value, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def format_report(result: dict) -> str:
    """The drafts side by side: before -> after for each figure, then the cost and the training."""
    drafts = result["drafts"]
    width = max(20, *(len(d["draft"]) + 2 for d in drafts))

    def row(label: str, cell) -> str:
        return f"  {label:<26}" + "".join(f"{cell(d):<{width}}" for d in drafts).rstrip()

    def change(phase_key: str, spec: str, suffix: str = "") -> Callable[[dict], str]:
        return lambda d: f"{_fmt(d['before'][phase_key], spec)}{suffix} -> {_fmt(d['after'][phase_key], spec)}{suffix}"

    return "\n".join(
        [
            f"bench-drift --compare-drafts on {result['domain']}: {result['target']}, the same {result['eval_prompts']} "
            f"held-out prompts and traffic for each draft, {result['budget_minutes']:g} minutes each, k {result['k']}, "
            f"{result['max_new_tokens']} new tokens",
            row("", lambda d: d["draft"]),
            row("acceptance rate", change("acceptance_rate", ".3f")),
            row("mean acceptance length", change("mean_acceptance_length", ".2f")),
            row("tokens verified / step", change("tokens_verified_per_step", ".2f")),
            *(
                row(f"acceptance at depth {depth}", lambda d, i=depth - 1: _at_depth(d, i))
                for depth in range(1, 1 + max(len(d["after"]["acceptance_by_depth"]) for d in drafts))
            ),
            row("speedup vs target", change("speedup_vs_target", ".2f", "x")),
            row("draft step / target step", lambda d: _fmt(d["draft_step_fraction"])),
            row(
                "  (medians, ms)",
                lambda d: f"{_fmt(d['draft_step_ms'], '.2f')} / {_fmt(d['target_step_ms'], '.2f')}",
            ),
            row("identical to target", lambda d: f"{d['before']['identical']} / {d['after']['identical']}"),
            row("traffic prompts served", lambda d: str(d["traffic_prompts_served"])),
            row("records consumed", lambda d: str(d["records_consumed"])),
            row("adapters promoted", lambda d: str(d["adapters_promoted"])),
            row("training s", lambda d: f"{d['train_s']:.0f}"),
            f"  (before -> after training; the draft step is timed after training, with the adapter served, at "
            f"k={drafts[0]['cost_k']})",
        ]
    )


def _at_depth(draft: dict, index: int) -> str:
    rates = [draft[phase]["acceptance_by_depth"] for phase in ("before", "after")]
    return " -> ".join(_fmt(r[index] if index < len(r) else None, ".2f") for r in rates)


def plot(result: dict, path: str | Path) -> None:
    """Left: live acceptance of each draft's traffic over the seconds since its trainer started, dotted
    lines where a promoted adapter was swapped in. Right: each draft's held-out acceptance by depth,
    before (dashed) and after training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (axis, by_depth) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [2, 1]})
    for index, draft in enumerate(result["drafts"]):
        colour = f"C{index % 10}"
        points = [(w["t_s"], w["acceptance_rate"]) for w in draft["live"] if w["acceptance_rate"] is not None]
        label = (
            f"{draft['draft']}: held-out {_fmt(draft['before']['acceptance_rate'])} -> "
            f"{_fmt(draft['after']['acceptance_rate'])}, {_fmt(draft['after']['speedup_vs_target'], '.2f')}x after, "
            f"draft step {_fmt(draft['draft_step_fraction'], '.2f')} of a target step"
        )
        if points:
            axis.plot(*zip(*points, strict=True), marker="o", ms=3, lw=2, color=colour, label=label)
        else:
            axis.plot([], [], color=colour, lw=2, label=f"{label} (drafted nothing live)")
        for t in draft["promoted_s"]:
            axis.axvline(t, color=colour, lw=0.9, ls=":")
    axis.plot([], [], color="0.4", lw=0.9, ls=":", label="adapter promoted and swapped in")
    axis.set_ylim(0, 1)
    axis.set_xlim(left=0)
    axis.set_ylabel("acceptance of the traffic\n(accepted / drafted)")
    axis.set_xlabel(f"seconds since the draft's trainer started ({result['window_s']:g} s windows)")
    axis.grid(alpha=0.3)
    axis.legend(loc="upper left", fontsize=8)
    for index, draft in enumerate(result["drafts"]):
        for phase, style in (("before", "--"), ("after", "-")):
            rates = draft[phase]["acceptance_by_depth"]
            if rates:
                label = f"{draft['draft']} {phase}"
                by_depth.plot(range(1, len(rates) + 1), rates, style, marker="o", color=f"C{index % 10}", label=label)
    by_depth.set_ylim(0, 1)
    by_depth.set_xlabel("draft depth (a tree's level, a chain's position)")
    by_depth.set_ylabel("held-out acceptance at that depth\n(drafts reaching it whose token was kept)")
    by_depth.grid(alpha=0.3)
    by_depth.legend(fontsize=8)
    fig.suptitle(
        f"adaptive-spec bench-drift --compare-drafts on {result['domain']}: {Path(str(result['target'])).name}, "
        f"{result['budget_minutes']:g} minutes per draft, k {result['k']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
