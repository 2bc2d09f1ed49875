"""The benchmarks against HTTP servers: `bench-serve` (throughput and latency of servers it starts, one at a
time and batched), `bench-load` (users against a running server) and `bench-chaos` (a fleet on loopback under
random faults). The code is in benchmarks/.

    adaptive-spec bench-load --url http://127.0.0.1:8000 --users 8 --duration-s 30
    adaptive-spec bench-serve --concurrency 1,2,4,8 --json serve.json --plot serve.png
    adaptive-spec bench-chaos --minutes 20 --json chaos.json --plot chaos.png    # exits 1 when the bar fails
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cli.options import (
    adapter_option,
    k_list,
    model_options,
    model_options_of,
    non_negative_int,
    positive_float,
    positive_int,
    prompt_file,
    raise_input,
    resolve_adapter,
    write_json,
)


def add_commands(commands) -> None:
    chaos = commands.add_parser(
        "bench-chaos",
        help="a fleet on loopback (2 replicas, a trainer, mlflow server, Redis) under traffic and random faults",
        description="Start Redis, an mlflow server, two serve replicas and a trainer on loopback, send closed-loop "
        "traffic that retries on the other replica, and inject one random fault every 20-40 s (Redis killed or "
        "stopped, the trainer killed, MLflow down, a replica restarted, bad records, a forged version, a rollback "
        "racing a promotion). Reports requests, records acknowledged and lost, versions promoted and refused, "
        "swaps. See benchmarks/chaos/.",
    )
    chaos.add_argument("--minutes", type=positive_float, default=20.0, help="traffic and faults (default: %(default)s)")
    chaos.add_argument("--users", type=positive_int, default=4, help="closed-loop users (default: %(default)s)")
    chaos.add_argument("--seed", type=int, default=0, help="which faults, when (default: %(default)s)")
    chaos.add_argument(
        "--faults",
        type=fault_kinds,
        default=None,
        help="KIND,KIND: draw only from these (default: all of redis_kill, redis_stop, trainer_kill, mlflow_down, "
        "replica_restart, bad_records, forged_version, rollback_race)",
    )
    chaos.add_argument(
        "--target", default=None, help="a model for every process (default: a tiny random model built in code)"
    )
    chaos.add_argument("--draft", default="early-exit:1", help="default: %(default)s")
    chaos.add_argument("--workdir", type=Path, default=None, help="logs and data (default: a new temporary directory)")
    chaos.add_argument("--json", type=Path, default=None, help="write the figures and the timeline here")
    chaos.add_argument("--plot", type=Path, default=None, help="draw the timeline with the faults marked (PNG)")
    chaos.set_defaults(func=cmd_bench_chaos)

    load = commands.add_parser(
        "bench-load",
        help="N concurrent users against a running server for a fixed time",
        description="Closed-loop users send greedy completions to --url for --duration-s and the command prints "
        "throughput, p50/p99 latency and the responses by status. Errors are any status but 200 and the "
        "documented 429/503, plus connection failures. Exit 1 when there was one. See benchmarks/load.py.",
    )
    load.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    load.add_argument("--users", type=positive_int, default=4, help="concurrent users (default: %(default)s)")
    load.add_argument("--duration-s", type=float, default=10.0, help="default: %(default)s")
    load.add_argument("--max-tokens", type=positive_int, default=16, help="per request (default: %(default)s)")
    load.add_argument("--prompt", default="Name three rivers.", help="a text prompt (default: %(default)r)")
    load.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    load.add_argument("--json", type=Path, metavar="FILE", help="write the figures to FILE")
    load.set_defaults(func=cmd_bench_load)

    serve = commands.add_parser(
        "bench-serve",
        help="serving throughput and latency at several concurrency levels: one at a time vs batched",
        description="Start `adaptive-spec serve` on loopback once per configuration (one at a time with "
        "--max-batch 1; batched target alone; batched speculative, both with --max-batch N) and run closed-loop "
        "users at each --concurrency level for --duration-s, the servers taking turns in --rounds alternating "
        "visits so that a drift in the machine's speed touches them alike: output tokens/s, requests/s, latency and time to "
        "first token p50/p99, time per output token, errors, and whether every greedy output equals the target "
        "alone's. Prints a table; --json and --plot write the figures. See benchmarks/serve.py.",
    )
    serve.add_argument(
        "--prompts", type=prompt_file, help="a JSONL prompt file or a shipped set's name (default: chat)"
    )
    serve.add_argument("--concurrency", type=k_list, default=(1, 2, 4, 8), metavar="N[,N...]", help="default: 1,2,4,8")
    serve.add_argument(
        "--duration-s", type=float, default=60.0, help="per configuration and level (default: %(default)s)"
    )
    serve.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="visits per server and level, in alternating order (A B C, C B A, ...); each gets --duration-s / "
        "--rounds (default: %(default)s)",
    )
    serve.add_argument(
        "--max-batch", type=positive_int, default=8, help="of the batched servers (default: %(default)s)"
    )
    serve.add_argument(
        "--configs",
        default="one_at_a_time,batched_plain,batched_speculative",
        help="which configurations, comma-separated (default: all three)",
    )
    serve.add_argument(
        "--long-prompt-tokens",
        type=non_negative_int,
        default=4096,
        metavar="N",
        help="after the levels, one prompt of N tokens sent among short requests on the last configuration: the "
        "short ones' p99 time per output token while it is prefilled, against without it; 0 skips it (default: "
        "%(default)s)",
    )
    serve.add_argument("--json", type=Path, metavar="FILE", help="write the figures to FILE")
    serve.add_argument("--plot", type=Path, metavar="FILE.png", help="draw tokens/s and p50 latency against users")
    model_options(serve)
    adapter_option(serve)
    serve.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args) -> int:
    from adaptive_spec.outputs.prompts import load_prompts
    from benchmarks.prompts import shipped
    from benchmarks.serve import CONFIGS, ServeBenchSettings, run_serve_bench
    from benchmarks.serve_report import format_report, plot

    configs = tuple(name.strip() for name in args.configs.split(",") if name.strip())
    unknown = [name for name in configs if name not in CONFIGS]
    if unknown or not configs:
        raise_input(f"--configs takes {', '.join(CONFIGS)}; got {args.configs!r}")
    if args.duration_s <= 0:
        raise_input("--duration-s must be positive")
    adapter = resolve_adapter(args.adapter)
    settings = ServeBenchSettings(
        **vars(model_options_of(args)),
        adapter=str(adapter) if adapter else None,
        max_new_tokens=args.max_new_tokens,
        concurrency=args.concurrency,
        duration_s=args.duration_s,
        rounds=args.rounds,
        max_batch=args.max_batch,
        configs=configs,
        long_prompt_tokens=args.long_prompt_tokens,
    )
    items = load_prompts(args.prompts or shipped("chat"))
    figures = run_serve_bench(settings, items, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_report(figures))
    write_json(args.json, figures)
    if args.plot:
        plot(figures, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    long_failed = figures["long_prompt"] is not None and figures["long_prompt"]["status"] != 200
    return 0 if figures["identical"] and not any(run["errors"] for run in figures["runs"]) and not long_failed else 1


def cmd_bench_load(args) -> int:
    import asyncio

    from benchmarks.load import run_load

    report = asyncio.run(
        run_load(
            args.url,
            users=args.users,
            duration_s=args.duration_s,
            model=args.model,
            prompt=args.prompt,
            max_tokens=args.max_tokens,
        )
    )
    print(report.summary())
    write_json(args.json, report.as_dict())
    return 0 if report.errors == 0 else 1


def cmd_bench_chaos(args) -> int:
    from benchmarks.chaos import FAULTS, ChaosSettings, bar, plot, run_chaos, summary

    settings = ChaosSettings(
        minutes=args.minutes,
        users=args.users,
        seed=args.seed,
        faults=args.faults or FAULTS,
        target=args.target,
        draft=args.draft,
        workdir=args.workdir,
    )
    figures = run_chaos(settings)
    figures["bar"] = bar(figures)
    print(summary(figures))
    write_json(args.json, figures)
    if args.plot:
        plot(figures, args.plot)
        print(f"timeline drawn in {args.plot}", file=sys.stderr)
    return 0 if all(figures["bar"].values()) else 1


def fault_kinds(text: str) -> tuple[str, ...]:
    from benchmarks.chaos import FAULTS

    kinds = tuple(kind.strip() for kind in text.split(",") if kind.strip())
    unknown = [kind for kind in kinds if kind not in FAULTS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"unknown fault {', '.join(unknown) or '(none)'}; one of {', '.join(FAULTS)}")
    return kinds
