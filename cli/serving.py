"""`adaptive-spec up` (Redis, the trainer and the server on one machine) and `adaptive-spec serve` (the
HTTP server alone). See cli/up.py and service/server.py.

    adaptive-spec up --port 8001 --data-dir /srv/adaptive-spec
    adaptive-spec serve --host 0.0.0.0
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from cli.options import DTYPES, CommandError, non_negative_int, path_options, positive_int, use_data_dir
from service.settings import Settings

DEFAULTS = Settings()


def add_commands(commands) -> None:
    up = commands.add_parser(
        "up",
        help="the main job: Redis, the trainer and the server on this machine, in one command",
        description="Start Redis on loopback (unless REDIS_URL is set; data kept in DATA_DIR/redis), the HTTP server "
        "with the adapter registry in MLflow (MLFLOW_TRACKING_URI, else DATA_DIR/mlflow.db), and, once "
        "the server is up, the trainer as a child process. Print the chat URL, the dashboard URL and the "
        "`mlflow ui` command. Ctrl-C or SIGTERM drains the requests in flight, then stops the trainer "
        "and Redis. See cli/up.py.",
    )
    serving_options(
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
    serving_options(serve, "state directory (default: $ADAPTIVE_SPEC_DATA_DIR or ./.adaptive-spec)")
    serve.set_defaults(func=cmd_serve)


def serving_options(parser: argparse.ArgumentParser, data_dir_help: str) -> None:
    """The flags `up` and `serve` share; unset ones fall back to ADAPTIVE_SPEC_* (service/settings.py)."""
    parser.add_argument("--host", default=None, help=f"bind address (default: {DEFAULTS.host}, loopback only)")
    parser.add_argument("--port", type=int, default=None, help=f"default: {DEFAULTS.port}")
    parser.add_argument("--data-dir", type=Path, default=None, help=data_dir_help)
    models = parser.add_argument_group(
        "models (default: ADAPTIVE_SPEC_TARGET / _DRAFT / _K / _DTYPE / _COMPILE / _TREE_BUDGET, else the "
        "built-in model with the head draft, dynamic k, compiled, chains)"
    )
    models.add_argument("--target", default=None)
    models.add_argument("--draft", default=None)
    models.add_argument("--k", type=non_negative_int, default=None)
    models.add_argument("--dtype", default=None, choices=DTYPES)
    models.add_argument("--device", default=None)
    path_options(models)
    parser.add_argument(
        "--max-batch",
        type=positive_int,
        default=None,
        help="sequences decoded together, one step at a time (continuous batching); 1 decodes one "
        f"request at a time (default: $ADAPTIVE_SPEC_MAX_BATCH or {DEFAULTS.max_batch})",
    )


def serving_settings(args) -> Settings:
    """The server's settings: the flags given, over ADAPTIVE_SPEC_* and the defaults (service/settings.py)."""
    use_data_dir(args.data_dir)  # the model cache follows it
    return Settings.from_env(
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        target=args.target,
        draft=args.draft,
        k=args.k,
        dtype=args.dtype,
        device=args.device,
        compile=args.compile,
        tree_budget=args.tree_budget,
        max_batch=args.max_batch,
    )


def cmd_up(args) -> int:
    from cli.up import run_up
    from launch.redis import RedisStartError
    from service.server import StoppedWhileLoading, exit_now

    logging.getLogger("service").setLevel(logging.INFO)
    try:
        return run_up(serving_settings(args), trainer=not args.no_trainer)
    except RedisStartError as exc:
        raise CommandError(str(exc)) from None
    except StoppedWhileLoading as exc:  # run_up stopped Redis on the way out; the load is not waited for
        exit_now(0, str(exc))


def cmd_serve(args) -> int:
    from service.server import StoppedWhileLoading, exit_now, run

    try:
        run(serving_settings(args))
    except StoppedWhileLoading as exc:
        exit_now(0, str(exc))
    return 0
