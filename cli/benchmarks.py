"""The benchmarks that compose serving and training: `bench-drift` (online training on a domain),
`bench-swap` (the pause of an adapter hot swap), `bench-load` (users against a running server) and
`bench-serve` (throughput and latency of servers it starts, one at a time and batched) and `bench-chaos`
(a fleet on loopback under random faults). The code is in benchmarks/.

    adaptive-spec bench-drift --domain sql --budget-minutes 30 --json drift.json
    adaptive-spec bench-drift --domain python --compare-drafts head,early-exit:4 --json compare.json --plot compare.png
    adaptive-spec bench-swap --rank 16 --swaps 50
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
    load_engine,
    model_options,
    model_options_of,
    non_negative_int,
    positive_float,
    positive_int,
    prompt_file,
    raise_input,
    redis_url,
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

    drift = commands.add_parser(
        "bench-drift",
        help="acceptance and speed on a domain before and after online training on its traffic",
        description="Measure acceptance and speed on held-out prompts of a domain, serve the domain's traffic "
        "prompts with correction records going to Redis while the trainer learns a LoRA adapter for "
        "the draft, then measure the same held-out prompts again. Starts a loopback redis-server "
        "unless REDIS_URL is set.",
    )
    drift.add_argument(
        "--domain",
        default="json_extraction",
        help="a shipped prompt set: json_extraction, sql, python, casual_chat (default: %(default)s)",
    )
    drift.add_argument(
        "--prompts",
        type=prompt_file,
        help="a JSONL prompt file (or a shipped set's name, such as json_schema) instead of a shipped domain; "
        "split internally",
    )
    drift.add_argument(
        "--budget-minutes", type=float, default=30.0, help="bound on the whole run (default: %(default)s)"
    )
    drift.add_argument(
        "--eval-prompts",
        type=positive_int,
        default=None,
        help="held-out prompts measured before and after (default: 24), or per prompt set at each phase's end "
        "with --scenario (default: 8)",
    )
    drift.add_argument(
        "--train-tail-s",
        type=float,
        default=120.0,
        help="seconds of training allowed after the traffic ends (default: %(default)s)",
    )
    drift.add_argument(
        "--after-k",
        type=k_list,
        default=(),
        metavar="K[,K...]",
        help="also measure the held-out prompts after training at these fixed k, e.g. 1,3 "
        "(the budget reserves time for them)",
    )
    drift.add_argument(
        "--scenario",
        metavar="PHASES",
        help="drift that comes and goes: phases NAME:SECONDS, comma-separated, e.g. python:600,sql:600,python:300,mix:600; "
        "NAME is a shipped set, a JSONL prompt file, or mix (all the sets named). Traffic goes through a real "
        "server with the trainer running and through a static one (the base draft, no training) side by side; "
        "--budget-minutes, --prompts, --domain and --after-k do not apply",
    )
    drift.add_argument(
        "--start-version",
        metavar="VERSION|DIR",
        help="--scenario: start warm from this registry version (MLFLOW_TRACKING_URI, else the data directory's "
        "mlflow.db; `adaptive-spec distill` registers one) or adapter directory: the adaptive server serves it from "
        "the first request and the trainer trains on from it, and the static server serves the same version frozen",
    )
    drift.add_argument(
        "--concurrency", type=positive_int, default=1, help="users sending traffic (--scenario; default: %(default)s)"
    )
    drift.add_argument(
        "--window-s",
        type=float,
        default=30.0,
        help="live acceptance windows (--scenario, and --compare-drafts' plot; default: %(default)s)",
    )
    drift.add_argument(
        "--max-domains",
        type=non_negative_int,
        default=8,
        help="--scenario: the trainer's --max-domains, domains with an adapter of their own; 0 trains one general "
        "adapter on all traffic, the comparison for per-domain adapters (default: %(default)s)",
    )
    drift.add_argument("--json", type=Path, metavar="FILE", help="write the figures to FILE")
    drift.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="draw live acceptance over time (--scenario; --compare-drafts: each draft's on one axis)",
    )
    model_options(drift).add_argument(
        "--compare-drafts",
        type=_draft_list,
        metavar="SPEC,SPEC",
        help="run the whole measurement once per draft, e.g. head,early-exit:4: the same held-out prompts and "
        "traffic, --budget-minutes each, one after the other; prints them side by side, with each draft's "
        "step as a fraction of a target step (instead of --draft)",
    )
    drift.set_defaults(func=cmd_bench_drift)

    swap = commands.add_parser(
        "bench-swap",
        help="how long an adapter hot swap holds decoding, under steady traffic",
        description="Swap between two random LoRA adapters of the draft --swaps times while client threads keep "
        "generating, and print the max / p50 pause, the failed requests and whether every output "
        "equalled the target alone. See benchmarks/swap.py.",
    )
    swap.add_argument("--swaps", type=positive_int, default=20, help="default: %(default)s")
    swap.add_argument("--clients", type=positive_int, default=2, help="threads sending requests (default: %(default)s)")
    swap.add_argument(
        "--rank",
        type=positive_int,
        default=32,
        help="LoRA rank; 32 is ~5 MB on early-exit:4 of the default model (default: %(default)s)",
    )
    swap.add_argument("--interval-s", type=float, default=0.25, help="between swaps (default: %(default)s)")
    swap.add_argument("--num-prompts", type=positive_int, default=4, help="default: %(default)s")
    swap.add_argument("--json", type=Path, metavar="FILE", help="write the figures to FILE")
    model_options(swap)
    swap.set_defaults(func=cmd_bench_swap, max_new_tokens=32)

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


def _draft_list(text: str) -> tuple[str, ...]:
    from adaptive_spec.drafters.spec import DraftSpecError
    from benchmarks.compare import parse_draft_list

    try:
        return parse_draft_list(text)
    except DraftSpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_bench_drift(args) -> int:
    from adaptive_spec.models import data_dir
    from benchmarks.drift import format_report, run_drift, temporary_workdir

    if args.scenario:
        if args.compare_drafts:
            raise_input("--compare-drafts does not apply to --scenario")
        return _bench_scenario(args)
    if args.plot and not args.compare_drafts:
        raise_input("--plot draws a --scenario run or a --compare-drafts run")
    if args.start_version:
        raise_input("--start-version applies to --scenario")
    if args.window_s <= 0:
        raise_input("--window-s must be positive")
    if args.budget_minutes <= 0:
        raise_input("--budget-minutes must be positive")
    if args.compare_drafts:
        return _bench_compare(args)
    items, domain, settings = _drift_inputs(args)
    engine = load_engine(args)
    workdir = temporary_workdir(data_dir())
    with redis_url(workdir) as url:
        try:
            figures = run_drift(engine, items, domain, settings, url, workdir)
        finally:
            print(f"adapters and logs kept in {workdir}", file=sys.stderr)
    print(format_report(figures))
    write_json(args.json, figures)
    return 0 if figures["before"]["identical"] and figures["after"]["identical"] else 1


def _drift_inputs(args):
    """(prompts, domain name, DriftBenchSettings) of a bench-drift run, single or --compare-drafts."""
    from adaptive_spec.prompts import load_prompts
    from benchmarks.drift import DriftBenchSettings
    from benchmarks.prompts import shipped

    items = load_prompts(args.prompts or shipped(args.domain))
    domain = args.prompts.stem if args.prompts else args.domain
    settings = DriftBenchSettings(
        budget_minutes=args.budget_minutes,
        eval_prompts=args.eval_prompts or 24,
        max_new_tokens=args.max_new_tokens,
        k=args.k,
        train_tail_s=args.train_tail_s,
        after_k=args.after_k,
        window_s=args.window_s,
    )
    return items, domain, settings


def _bench_compare(args) -> int:
    from adaptive_spec.models import data_dir
    from benchmarks.compare import format_report, plot, run_compare, split_entry
    from benchmarks.drift import temporary_workdir

    items, domain, settings = _drift_inputs(args)

    def engine_for(entry: str):
        spec, tree = split_entry(entry)
        return load_engine(argparse.Namespace(**{**vars(args), "draft": spec, "tree_budget": tree or args.tree_budget}))

    workdir = temporary_workdir(data_dir())
    with redis_url(workdir) as url:
        try:
            result = run_compare(
                engine_for,
                args.compare_drafts,
                items,
                domain,
                settings,
                url,
                workdir,
                log=lambda line: print(line, file=sys.stderr, flush=True),
            )
        finally:
            print(f"adapters and logs kept in {workdir}", file=sys.stderr)
    print(format_report(result))
    write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0 if result["identical"] else 1


def _bench_scenario(args) -> int:
    from adaptive_spec.prompts import PromptFileError
    from benchmarks.scenario import ScenarioSettings, parse_scenario, run_scenario
    from benchmarks.scenario_report import format_report, plot

    if args.window_s <= 0:
        raise_input("--window-s must be positive")
    try:
        phases = parse_scenario(args.scenario)
    except (ValueError, PromptFileError) as exc:
        raise_input(str(exc))
    settings = ScenarioSettings(
        **vars(model_options_of(args)),
        phases=tuple(phases),
        concurrency=args.concurrency,
        max_new_tokens=args.max_new_tokens,
        eval_prompts=args.eval_prompts or 8,
        window_s=args.window_s,
        max_domains=args.max_domains,
        start_adapter=resolve_adapter(args.start_version, "--start-version"),
        start_version=args.start_version,
    )
    figures = run_scenario(settings, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_report(figures))
    write_json(args.json, figures)
    if args.plot:
        plot(figures, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0 if figures["identical"] else 1


def cmd_bench_swap(args) -> int:
    from adaptive_spec.prompts import load_prompts
    from benchmarks.prompts import shipped
    from benchmarks.swap import format_report, run_swap_bench

    prompts = [item.prompt for item in load_prompts(shipped("chat"))[: args.num_prompts]]
    engine = load_engine(args)
    figures = run_swap_bench(
        engine,
        prompts,
        swaps=args.swaps,
        clients=args.clients,
        rank=args.rank,
        max_new_tokens=args.max_new_tokens,
        interval_s=args.interval_s,
        k=args.k,
    )
    print(format_report(figures))
    write_json(args.json, figures)
    return 0 if figures["passes"] else 1


def cmd_bench_serve(args) -> int:
    from adaptive_spec.prompts import load_prompts
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
