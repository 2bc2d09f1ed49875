"""The `adaptive-spec` command line.

    adaptive-spec generate "Write a haiku about rivers."       # one prompt, streamed
    adaptive-spec bench --json bench.json                      # target vs speculative vs HF peer
    adaptive-spec bench-drift --domain sql --json drift.json   # before/after online training
    adaptive-spec train                                        # the online trainer (REDIS_URL)
    adaptive-spec adapters list                                # the adapter registry; rollback, promote V

Run `adaptive-spec COMMAND --help` for each command's options.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

from adaptive_spec.models import DEFAULT_MODEL

DEFAULT_DRAFT = "early-exit:4"


def _model_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("models")
    group.add_argument(
        "--target",
        default=DEFAULT_MODEL,
        help=f"target model: the built-in {DEFAULT_MODEL!r}, a Hugging Face id or local directory, "
        f"or a .gguf file (default: %(default)s)",
    )
    group.add_argument(
        "--draft",
        default=DEFAULT_DRAFT,
        help="draft: early-exit:N (the target's first N layers), ngram (prompt lookup), or a "
        "model with the target's vocabulary (default: %(default)s)",
    )
    group.add_argument(
        "--k",
        type=_non_negative_int,
        default=None,
        help="tokens drafted per step; omit it for dynamic k, which adapts to measured acceptance "
        "and cost and falls back to plain decoding when drafting does not pay",
    )
    group.add_argument("--max-new-tokens", type=_positive_int, default=64, help="default: %(default)s")
    group.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16", "fp16"],
        help="auto = bf16 on a GPU, fp32 on the CPU (exact greedy equality holds in fp32)",
    )
    group.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _serving_options(parser: argparse.ArgumentParser, data_dir_help: str) -> None:
    """The flags `up` and `serve` share; unset ones fall back to ADAPTIVE_SPEC_* (service/settings.py)."""
    parser.add_argument("--host", default=None, help="bind address (default: 127.0.0.1, loopback only)")
    parser.add_argument("--port", type=int, default=None, help="default: 8000")
    parser.add_argument("--data-dir", type=Path, default=None, help=data_dir_help)
    models = parser.add_argument_group(
        "models (default: ADAPTIVE_SPEC_TARGET / _DRAFT / _K / _DTYPE, else the "
        "built-in model with early-exit:4 and dynamic k)"
    )
    models.add_argument("--target", default=None)
    models.add_argument("--draft", default=None)
    models.add_argument("--k", type=_non_negative_int, default=None)
    models.add_argument("--dtype", default=None, choices=["auto", "fp32", "bf16", "fp16"])
    models.add_argument("--device", default=None)


def _k_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers, got {text!r}") from None
    if any(k < 1 for k in values):
        raise argparse.ArgumentTypeError(f"each k must be >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaptive-spec",
        description="Lossless speculative decoding whose draft keeps learning from live traffic.",
        epilog="Settings also come from the environment: REDIS_URL, MLFLOW_TRACKING_URI, ADAPTIVE_SPEC_DATA_DIR.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = commands.add_parser(
        "generate",
        help="generate for one prompt from the terminal, streamed",
        description="Generate for one prompt and stream the text to stdout. Figures for speculation go to stderr.",
    )
    gen.add_argument("prompt", nargs="?", help="the prompt; read from stdin when omitted")
    gen.add_argument(
        "--raw", action="store_true", help="send the text as is, without the chat template (default: as a user message)"
    )
    gen.add_argument("--prompts", type=Path, help="a JSONL prompt file: generate for each prompt in turn")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 disables it")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--no-speculative", action="store_true", help="run the target alone (the baseline)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    _model_options(gen)
    gen.set_defaults(func=cmd_generate)

    bench = commands.add_parser(
        "bench",
        help="tokens/s of the target alone vs speculative vs Hugging Face assisted generation",
        description="Time the target alone, our speculative engine and the Hugging Face assisted-generation peer "
        "on the same prompts in one run, and check that every output equals the target alone's.",
    )
    bench.add_argument("--prompts", type=Path, help="JSONL prompt file (default: the shipped chat set)")
    bench.add_argument(
        "--num-prompts", type=_positive_int, default=8, help="use the first N prompts (default: %(default)s)"
    )
    bench.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default), where `identical` is checked"
    )
    bench.add_argument("--json", type=Path, metavar="FILE", help="write the figures to FILE")
    _model_options(bench)
    bench.set_defaults(func=cmd_bench)

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
    drift.add_argument("--prompts", type=Path, help="a JSONL prompt file instead of a shipped domain; split internally")
    drift.add_argument(
        "--budget-minutes", type=float, default=30.0, help="bound on the whole run (default: %(default)s)"
    )
    drift.add_argument(
        "--eval-prompts",
        type=_positive_int,
        default=24,
        help="held-out prompts measured before and after (default: %(default)s)",
    )
    drift.add_argument(
        "--train-tail-s",
        type=float,
        default=120.0,
        help="seconds of training allowed after the traffic ends (default: %(default)s)",
    )
    drift.add_argument(
        "--after-k",
        type=_k_list,
        default=(),
        metavar="K[,K...]",
        help="also measure the held-out prompts after training at these fixed k, e.g. 1,3 "
        "(the budget reserves time for them)",
    )
    drift.add_argument("--json", type=Path, metavar="FILE", help="write the figures to FILE")
    _model_options(drift)
    drift.set_defaults(func=cmd_bench_drift)

    up = commands.add_parser(
        "up",
        help="the main job: Redis, the trainer and the server on this machine, in one command",
        description="Start Redis on loopback (unless REDIS_URL is set; data kept in DATA_DIR/redis), the HTTP server "
        "with the adapter registry in MLflow (MLFLOW_TRACKING_URI, else DATA_DIR/mlflow.db), and, once "
        "the server is up, the trainer as a child process. Print the chat URL, the dashboard URL and the "
        "`mlflow ui` command. Ctrl-C or SIGTERM drains the requests in flight, then stops the trainer "
        "and Redis. See service/up.py.",
    )
    _serving_options(
        up,
        "Redis data, MLflow's sqlite file, adapters, checkpoints, logs and the model cache "
        "(default: $ADAPTIVE_SPEC_DATA_DIR or ./.adaptive-spec)",
    )
    up.add_argument("--no-trainer", action="store_true", help="serve and follow the registry, but train nothing here")
    up.set_defaults(func=cmd_up)

    serve = commands.add_parser(
        "serve",
        help="the HTTP server alone: OpenAI-compatible API, /health, /metrics",
        description="Serve POST /v1/chat/completions and /v1/completions (OpenAI-compatible, with stream: true), "
        "GET /v1/models, /health and /metrics. Correction records go to REDIS_URL when it is set. "
        "Flags override the ADAPTIVE_SPEC_* environment; see service/settings.py.",
    )
    _serving_options(serve, "state directory (default: $ADAPTIVE_SPEC_DATA_DIR or ./.adaptive-spec)")
    serve.set_defaults(func=cmd_serve)

    train = commands.add_parser(
        "train",
        help="the online trainer alone: correction records in, promoted adapters out to MLflow",
        description="Read correction records from Redis (REDIS_URL or --redis-url; none is started here), train the "
        "draft's LoRA adapter, and register and promote every adapter the gate accepts in MLflow "
        "(MLFLOW_TRACKING_URI, else DATA_DIR/mlflow.db). Runs until SIGTERM or SIGINT, then "
        "checkpoints and exits. See trainer/main.py.",
    )
    train.add_argument("--target", default=DEFAULT_MODEL, help="the served target (default: %(default)s)")
    train.add_argument("--draft", default=DEFAULT_DRAFT, help="early-exit:N or a draft model (default: %(default)s)")
    train.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="adapters, checkpoints and the default MLflow store (default: ./.adaptive-spec)",
    )
    train.add_argument("--redis-url", default=None, help="default: $REDIS_URL")
    train.add_argument(
        "--consumer",
        default=None,
        help="consumer name in the stream's group, stable across restarts (default: trainer-<hostname>)",
    )
    train.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: torch's)")
    train.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    train.add_argument("--device", default="auto")
    train.add_argument(
        "--min-new-records",
        type=_positive_int,
        default=16,
        help="new training records before a round (default: %(default)s)",
    )
    train.add_argument(
        "--round-steps", type=_positive_int, default=20, help="optimiser steps per round (default: %(default)s)"
    )
    train.add_argument(
        "--gate-min-positions",
        type=_positive_int,
        default=1000,
        help="held-out positions the gate needs before it may promote (default: %(default)s)",
    )
    train.add_argument("--checkpoint-every-s", type=float, default=30.0, help="default: %(default)s")
    train.add_argument("--budget-minutes", type=float, default=None, help="stop after this long (default: never)")
    train.set_defaults(func=cmd_train)

    load = commands.add_parser(
        "bench-load",
        help="N concurrent users against a running server for a fixed time",
        description="Closed-loop users send greedy completions to --url for --duration-s and the command prints "
        "throughput, p50/p99 latency and the responses by status. Errors are any status but 200 and the "
        "documented 429/503, plus connection failures. Exit 1 when there was one. See service/loadtest.py.",
    )
    load.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    load.add_argument("--users", type=_positive_int, default=4, help="concurrent users (default: %(default)s)")
    load.add_argument("--duration-s", type=float, default=10.0, help="default: %(default)s")
    load.add_argument("--max-tokens", type=_positive_int, default=16, help="per request (default: %(default)s)")
    load.add_argument("--prompt", default="Name three rivers.", help="a text prompt (default: %(default)r)")
    load.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    load.add_argument("--json", type=Path, metavar="FILE", help="write the figures to FILE")
    load.set_defaults(func=cmd_bench_load)

    adapters = commands.add_parser(
        "adapters",
        help="the adapter registry: list, rollback, promote",
        description="The draft's adapters in MLflow (MLFLOW_TRACKING_URI, else DATA_DIR/mlflow.db). Servers follow "
        "the 'champion' alias within seconds. Rollbacks and promotions are recorded with who made them.",
    )
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument(
        "--data-dir", type=Path, default=None, help="default: $ADAPTIVE_SPEC_DATA_DIR or ./.adaptive-spec"
    )
    where.add_argument("--registered-model", default=None, help="default: adaptive-spec-draft")
    actions = adapters.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", parents=[where], help="versions with created time, gate figures and aliases")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    back = actions.add_parser("rollback", parents=[where], help="champion <- previous, or <- --to VERSION")
    back.add_argument("--to", default=None, metavar="VERSION")
    forward = actions.add_parser("promote", parents=[where], help="champion <- VERSION, previous <- the old champion")
    forward.add_argument("version", metavar="VERSION")
    adapters.set_defaults(func=cmd_adapters)

    swap = commands.add_parser(
        "bench-swap",
        help="how long an adapter hot swap holds decoding, under steady traffic",
        description="Swap between two random LoRA adapters of the draft --swaps times while client threads keep "
        "generating, and print the max / p50 pause, the failed requests and whether every output "
        "equalled the target alone. See trainer/bench_swap.py.",
    )
    swap.add_argument("--swaps", type=_positive_int, default=20, help="default: %(default)s")
    swap.add_argument(
        "--clients", type=_positive_int, default=2, help="threads sending requests (default: %(default)s)"
    )
    swap.add_argument(
        "--rank",
        type=_positive_int,
        default=32,
        help="LoRA rank; 32 on early-exit:4 of the default model is ~5 MB (default: %(default)s)",
    )
    swap.add_argument("--interval-s", type=float, default=0.25, help="between swaps (default: %(default)s)")
    swap.add_argument("--num-prompts", type=_positive_int, default=4, help="default: %(default)s")
    swap.add_argument("--json", type=Path, metavar="FILE", help="write the figures to FILE")
    _model_options(swap)
    swap.set_defaults(func=cmd_bench_swap, max_new_tokens=32)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # SIGTERM unwinds like Ctrl-C, so what a command started (a loopback Redis, say) is stopped by
    # its `with`/`finally`. `up`, `serve` and `train` install their own handlers for a graceful stop.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    from adaptive_spec.drafters.early_exit import DraftSpecError
    from adaptive_spec.engine import InputError
    from adaptive_spec.models import ModelLoadError
    from adaptive_spec.prompts import PromptFileError
    from service.local_redis import RedisStartError

    try:
        return args.func(args) or 0
    except (InputError, ModelLoadError, PromptFileError, DraftSpecError, RedisStartError, ValueError) as exc:
        print(f"adaptive-spec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _load_engine(args):
    from adaptive_spec.engine import Engine

    print(f"loading {args.target} with draft {args.draft} ...", file=sys.stderr)
    return Engine.from_pretrained(target=args.target, draft=args.draft, device=args.device, dtype=args.dtype)


def cmd_generate(args) -> int:
    from adaptive_spec.prompts import PromptItem, load_prompts

    if args.prompts:
        items = load_prompts(args.prompts)
    else:
        text = args.prompt if args.prompt is not None else sys.stdin.read()
        if not text.strip():
            raise_input("give a prompt as an argument or on stdin")
        items = [PromptItem(text if args.raw else [{"role": "user", "content": text}])]
    engine = _load_engine(args)
    for item in items:
        kwargs = dict(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            k=args.k,
            stop=args.stop,
            speculative=not args.no_speculative,
        )
        if args.json:
            out = engine.generate(item.prompt, **kwargs)
            print(
                json.dumps(
                    {
                        "text": out.text,
                        "token_ids": out.token_ids,
                        "finish_reason": out.finish_reason,
                        "stats": out.stats.as_dict(),
                    }
                )
            )
            continue
        out = _stream_text(engine, item.prompt, kwargs)
        s = out.stats
        rate = f"{s.acceptance_rate:.2f}" if s.acceptance_rate is not None else "n/a"
        print(
            f"[{len(out.token_ids)} tokens in {s.wall_s:.2f} s, {len(out.token_ids) / s.wall_s:.1f} tok/s; "
            f"acceptance {rate}, mean acceptance length {s.mean_acceptance_length:.2f}, "
            f"{s.target_forwards} target forwards, finish {out.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def _stream_text(engine, prompt, kwargs):
    """Print text as steps finish, never half a character or the start of a stop string."""
    from adaptive_spec.textstream import IncrementalText

    text = IncrementalText(engine, kwargs.get("stop"))
    for chunk in engine.stream(prompt, **kwargs):
        sys.stdout.write(text.push(chunk.token_ids) if chunk.output is None else text.finish(chunk.output.text) + "\n")
        sys.stdout.flush()
        if chunk.output is not None:
            return chunk.output
    raise AssertionError("stream ended without an output")


def raise_input(message: str):
    from adaptive_spec.engine import InputError

    raise InputError(message)


def cmd_bench(args) -> int:
    from adaptive_spec.bench import format_report, run_bench
    from adaptive_spec.prompts import load_prompts, shipped

    items = load_prompts(args.prompts or shipped("chat"))[: args.num_prompts]
    engine = _load_engine(args)
    figures = run_bench(engine, items, args.max_new_tokens, args.k, args.temperature, args.dtype)
    print(format_report(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"figures written to {args.json}", file=sys.stderr)
    return 0 if figures["identical"] in (True, None) else 1


def cmd_bench_drift(args) -> int:
    from adaptive_spec.models import data_dir
    from adaptive_spec.prompts import load_prompts, shipped
    from trainer.bench_drift import DriftSettings, format_report, run_drift, temporary_workdir

    if args.budget_minutes <= 0:
        raise_input("--budget-minutes must be positive")
    items = load_prompts(args.prompts or shipped(args.domain))
    domain = args.prompts.stem if args.prompts else args.domain
    settings = DriftSettings(
        budget_minutes=args.budget_minutes,
        eval_prompts=args.eval_prompts,
        max_new_tokens=args.max_new_tokens,
        k=args.k,
        train_tail_s=args.train_tail_s,
        after_k=args.after_k,
    )
    engine = _load_engine(args)
    workdir = temporary_workdir(data_dir())
    with _redis_url(workdir) as redis_url:
        try:
            figures = run_drift(engine, items, domain, settings, redis_url, workdir)
        finally:
            print(f"adapters and logs kept in {workdir}", file=sys.stderr)
    print(format_report(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"figures written to {args.json}", file=sys.stderr)
    return 0 if figures["before"]["identical"] and figures["after"]["identical"] else 1


def cmd_up(args) -> int:
    from adaptive_spec.models import data_dir
    from service.up import UpSettings, run_up

    logging.getLogger("service").setLevel(logging.INFO)
    return run_up(
        UpSettings(
            host=args.host,
            port=args.port,
            data_dir=args.data_dir or data_dir(),
            target=args.target,
            draft=args.draft,
            k=args.k,
            dtype=args.dtype,
            device=args.device,
            trainer=not args.no_trainer,
        )
    )


def cmd_serve(args) -> int:
    from service.server import run
    from service.settings import Settings

    if args.data_dir:
        os.environ["ADAPTIVE_SPEC_DATA_DIR"] = str(args.data_dir)  # the model cache follows it
    run(
        Settings.from_env(
            host=args.host,
            port=args.port,
            data_dir=args.data_dir,
            target=args.target,
            draft=args.draft,
            k=args.k,
            dtype=args.dtype,
            device=args.device,
        )
    )
    return 0


def cmd_train(args) -> int:
    from adaptive_spec.models import data_dir
    from trainer.main import TrainSettings, run_trainer

    logging.getLogger("trainer").setLevel(logging.INFO)  # a daemon: progress is its output
    if args.data_dir:
        os.environ["ADAPTIVE_SPEC_DATA_DIR"] = str(args.data_dir)  # the model cache follows it
    settings = TrainSettings(
        target=args.target,
        draft=args.draft,
        data_dir=args.data_dir or data_dir(),
        redis_url=args.redis_url or os.environ.get("REDIS_URL"),
        consumer=args.consumer,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        min_new_records=args.min_new_records,
        round_steps=args.round_steps,
        gate_min_positions=args.gate_min_positions,
        checkpoint_every_s=args.checkpoint_every_s,
        budget_s=args.budget_minutes * 60 if args.budget_minutes else None,
    )
    counters = run_trainer(settings)
    print(json.dumps(counters), file=sys.stderr)
    return 0


def cmd_bench_load(args) -> int:
    import asyncio

    from service.loadtest import run_load

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
    if args.json:
        args.json.write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    return 0 if report.errors == 0 else 1


def cmd_adapters(args) -> int:
    from adaptive_spec.contracts import MODEL_NAME
    from adaptive_spec.models import data_dir
    from trainer.registry import AdapterRegistry, RegistryUnavailable, actor

    registry = AdapterRegistry(
        data_dir=args.data_dir or data_dir(),
        redis_url=os.environ.get("REDIS_URL"),
        model_name=args.registered_model or MODEL_NAME,
    )
    try:
        if args.action == "list":
            versions = registry.versions()
            if args.json:
                print(json.dumps([v.as_dict() for v in versions], indent=2))
            else:
                print(_adapter_table(versions) if versions else f"no versions of {registry.model_name} in {registry!r}")
            return 0
        if args.action == "rollback":
            event = registry.rollback(to=args.to, by=actor("cli"))
        else:
            event = registry.promote(args.version, by=actor("cli"))
    except RegistryUnavailable as exc:
        print(f"adaptive-spec: error: {exc}", file=sys.stderr)
        return 3
    finally:
        registry.close()
    moved = (
        f"{event['from'] or 'none'} -> {event['version']}" if event.get("changed") else f"already {event['version']}"
    )
    print(f"{event['event']}: champion {moved} (by {event['by']})")
    return 0


def _adapter_table(versions) -> str:
    import time as _time

    def figure(value):
        return "-" if value is None else f"{value:.3f}"

    rows = [("VERSION", "CREATED", "GATE MATCH", "CHAMPION MATCH", "LOSS", "ALIASES", "LAST ACTION")]
    for v in versions:
        action = v.tags.get("adaptive_spec.last_action")
        rows.append(
            (
                v.version,
                _time.strftime("%Y-%m-%d %H:%M:%S", _time.localtime(v.created_at)),
                figure(v.candidate_greedy_match),
                figure(v.champion_greedy_match),
                figure(v.loss),
                ",".join(v.aliases) or "-",
                f"{action} by {v.tags.get('adaptive_spec.last_action_by')}" if action else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def cmd_bench_swap(args) -> int:
    from adaptive_spec.prompts import load_prompts, shipped
    from trainer.bench_swap import format_report, run_swap_bench

    prompts = [item.prompt for item in load_prompts(shipped("chat"))[: args.num_prompts]]
    engine = _load_engine(args)
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
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if figures["passes"] else 1


class _redis_url:
    """REDIS_URL when set; else a loopback redis-server started here and stopped on exit."""

    def __init__(self, workdir: Path):
        self.workdir, self.server = workdir, None

    def __enter__(self) -> str:
        if os.environ.get("REDIS_URL"):
            return os.environ["REDIS_URL"]
        from service.local_redis import started_server

        self.server = started_server(self.workdir)
        print(f"started redis-server on {self.server.url} (pid {self.server.process.pid})", file=sys.stderr)
        return self.server.url

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.stop()


if __name__ == "__main__":
    sys.exit(main())
