"""The benchmarks of one engine that compose serving and training: `bench-drift` (online training on a domain;
`--compare-drafts`, `--scenario`) and `bench-swap` (the pause of an adapter hot swap). The code is in
benchmarks/; the benchmarks against HTTP servers (bench-serve, bench-load, bench-chaos) are in
cli/server_benchmarks.py.

    adaptive-spec bench-drift --domain sql --budget-minutes 30 --json drift.json
    adaptive-spec bench-drift --domain python --compare-drafts head,early-exit:4 --json compare.json --plot compare.png
    adaptive-spec bench-swap --rank 16 --swaps 50
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cli.options import (
    k_list,
    load_engine,
    model_options,
    model_options_of,
    non_negative_int,
    positive_int,
    prompt_file,
    raise_input,
    redis_url,
    resolve_adapter,
    write_json,
)


def add_commands(commands) -> None:
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
        default=None,
        help="seconds of training allowed after the traffic ends (default: until the budget's measurements are "
        "due, or sooner once the trainer has nothing left to try: no round due and its idle rounds exhausted)",
    )
    drift.add_argument(
        "--traffic-new-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="new tokens of each traffic answer, what the trainer learns from (default: --max-new-tokens, which "
        "sizes the held-out measurements); longer answers give the trainer more of the same prompts' text",
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
        help="start warm from this registry version (MLFLOW_TRACKING_URI, else the data directory's mlflow.db; "
        "`adaptive-spec distill` registers one) or adapter directory: served from the first measurement, and the "
        "trainer trains on from it (a deployment that distilled first); with --scenario the adaptive server does so "
        "and the static server serves the same version frozen",
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
    if args.start_version and args.compare_drafts:
        raise_input("--start-version does not apply to --compare-drafts")
    if args.window_s <= 0:
        raise_input("--window-s must be positive")
    if args.budget_minutes <= 0:
        raise_input("--budget-minutes must be positive")
    if args.compare_drafts:
        return _bench_compare(args)
    items, domain, settings = _drift_inputs(args)
    settings.start_adapter = resolve_adapter(args.start_version, "--start-version")
    settings.start_version = args.start_version
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
    from benchmarks.drift import DriftBenchSettings
    from benchmarks.prompts import prompt_set

    items, domain = prompt_set(args.prompts, args.domain)
    settings = DriftBenchSettings(
        budget_minutes=args.budget_minutes,
        eval_prompts=args.eval_prompts or 24,
        max_new_tokens=args.max_new_tokens,
        traffic_new_tokens=args.traffic_new_tokens,
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
    from adaptive_spec.outputs.prompts import PromptFileError
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
    from adaptive_spec.outputs.prompts import load_prompts
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
