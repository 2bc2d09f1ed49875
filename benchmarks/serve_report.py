"""bench-serve's report: the table it prints and the plot it draws (benchmarks/serve.py measures)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from benchmarks.serve import CONFIGS, run_line


def format_report(result: dict) -> str:
    lines = [
        f"bench-serve: {result['target']} with draft {result['draft']}"
        f"{' and adapter ' + str(result['adapter']) if result['adapter'] else ''}, {result['prompts']} prompts, "
        f"{result['max_new_tokens']} new tokens, greedy, max batch {result['max_batch']}"
    ]
    lines += [run_line(run) for run in result["runs"]]
    by = {(run["config"], run["concurrency"]): run for run in result["runs"]}
    for (config, users), run in sorted(by.items()):
        base = by.get(("one_at_a_time", users))
        plain = by.get(("batched_plain", users))
        if config == "batched_speculative" and base and plain and base["output_tok_s"] and plain["output_tok_s"]:
            lines.append(
                f"{users} users: batched speculative {run['output_tok_s'] / base['output_tok_s']:.2f}x "
                f"one at a time, {run['output_tok_s'] / plain['output_tok_s']:.2f}x batched target alone"
            )
    long = result.get("long_prompt")
    if long:
        if long["status"] != 200:
            lines.append(f"long prompt of {long['prompt_tokens']} tokens: failed ({long['status']}: {long['error']})")
        else:
            lines.append(
                f"long prompt of {long['prompt_tokens']} tokens among {long['users']} users on {long['config']}: first "
                f"token after {long['ttft_s']} s; the short requests' p99 time per output token "
                f"{long['short_tpot_p99_s_during']} s while it was prefilled ({long['short_requests_during']} requests) "
                f"against {long['short_tpot_p99_s_quiet']} s without it"
            )
    lines.append(f"identical to the target alone in every run: {result['identical']}")
    return "\n".join(lines)


def plot(result: dict, path: str | Path) -> None:
    """Output tokens/s and p50 latency against concurrency, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (throughput, latency) = plt.subplots(1, 2, figsize=(11, 4.2))
    for config in CONFIGS:
        runs = sorted((r for r in result["runs"] if r["config"] == config), key=lambda r: r["concurrency"])
        if not runs:
            continue
        users = [r["concurrency"] for r in runs]
        label = config.replace("_", " ")
        throughput.plot(users, [r["output_tok_s"] for r in runs], marker="o", label=label)
        latency.plot(users, [r["latency_p50_s"] for r in runs], marker="o", label=label)
    for axis, title, unit in ((throughput, "output tokens/s", "tokens/s"), (latency, "p50 request latency", "s")):
        axis.set_title(title)
        axis.set_xlabel("concurrent users")
        axis.set_ylabel(unit)
        axis.set_xscale("log", base=2)
        axis.set_xticks(sorted({r["concurrency"] for r in result["runs"]}))
        axis.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.grid(alpha=0.3)
        axis.set_ylim(bottom=0)
    throughput.legend()
    # an adapter given as a directory is named by its last two parts (".../adapters/v0009"), so the title fits
    adapter = f", adapter {'/'.join(Path(str(result['adapter'])).parts[-2:])}" if result["adapter"] else ""
    title = (
        f"adaptive-spec bench-serve: {Path(str(result['target'])).name}, draft {result['draft']}{adapter}, "
        f"{result['max_new_tokens']} new tokens, greedy"
    )
    fig.suptitle(textwrap.fill(title, 100))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
