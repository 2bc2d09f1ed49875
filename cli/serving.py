"""`adaptive-spec up` (Redis, the trainer and the server on one machine) and `adaptive-spec serve` (the
HTTP server alone). See cli/up.py and service/server.py.

    adaptive-spec up --port 8001 --data-dir /srv/adaptive-spec
    adaptive-spec serve --host 0.0.0.0
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from adaptive_spec.contracts import DATA_DIR_ENV
from cli.options import DTYPES, CommandError, non_negative_int, positive_int


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
    parser.add_argument("--host", default=None, help="bind address (default: 127.0.0.1, loopback only)")
    parser.add_argument("--port", type=int, default=None, help="default: 8000")
    parser.add_argument("--data-dir", type=Path, default=None, help=data_dir_help)
    models = parser.add_argument_group(
        "models (default: ADAPTIVE_SPEC_TARGET / _DRAFT / _K / _DTYPE, else the "
        "built-in model with the head draft and dynamic k)"
    )
    models.add_argument("--target", default=None)
    models.add_argument("--draft", default=None)
    models.add_argument("--k", type=non_negative_int, default=None)
    models.add_argument("--dtype", default=None, choices=DTYPES)
    models.add_argument("--device", default=None)
    parser.add_argument(
        "--max-batch",
        type=positive_int,
        default=None,
        help="sequences decoded together, one step at a time (continuous batching); 1 decodes one "
        "request at a time (default: $ADAPTIVE_SPEC_MAX_BATCH or 8)",
    )


def cmd_up(args) -> int:
    from adaptive_spec.models import data_dir
    from cli.up import UpSettings, run_up
    from launch.redis import RedisStartError

    logging.getLogger("service").setLevel(logging.INFO)
    settings = UpSettings(
        host=args.host,
        port=args.port,
        data_dir=args.data_dir or data_dir(),
        target=args.target,
        draft=args.draft,
        k=args.k,
        dtype=args.dtype,
        device=args.device,
        max_batch=args.max_batch,
        trainer=not args.no_trainer,
    )
    try:
        return run_up(settings)
    except RedisStartError as exc:
        raise CommandError(str(exc)) from None


def cmd_serve(args) -> int:
    from service.server import run
    from service.settings import Settings

    if args.data_dir:
        os.environ[DATA_DIR_ENV] = str(args.data_dir)  # the model cache follows it
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
            max_batch=args.max_batch,
        )
    )
    return 0
