"""The `adaptive-spec` command line: one module per group of commands, on the top floor because some
commands compose serving and training (`up`, the benchmarks).

    adaptive-spec generate "Write a haiku about rivers."       # one prompt, streamed (cli/generate.py)
    adaptive-spec bench --json bench.json                      # target vs speculative vs HF peer
    adaptive-spec up                                           # Redis, trainer and server (cli/serving.py)
    adaptive-spec train                                        # the online trainer (cli/training.py)
    adaptive-spec adapters list                                # the adapter registry (cli/adapters.py)
    adaptive-spec purge                                        # delete all user-derived data (cli/purge.py)
    adaptive-spec bench-drift --domain sql --json drift.json   # benchmarks (cli/benchmarks.py)
    adaptive-spec bench-serve --json serve.json                # against servers (cli/server_benchmarks.py)
    adaptive-spec bench-intake --records 2000                  # the trainer's defaults measured (cli/studies.py)
    python -m cli COMMAND ...                          # the same, without the console script

Run `adaptive-spec COMMAND --help` for each command's options. Each command imports what it uses
when it runs, so `generate` and `bench` load no Redis, FastAPI or MLflow code.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from adaptive_spec.contracts import DATA_DIR_ENV, MLFLOW_TRACKING_URI_ENV, REDIS_URL_ENV
from cli import adapters, benchmarks, generate, purge, server_benchmarks, serving, studies, training
from cli.options import CommandError, resolve_draft


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaptive-spec",
        description="Lossless speculative decoding whose draft keeps learning from live traffic.",
        epilog=f"Settings also come from the environment: {REDIS_URL_ENV}, {MLFLOW_TRACKING_URI_ENV}, {DATA_DIR_ENV}.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (generate, serving, training, adapters, benchmarks, server_benchmarks, studies, purge):
        group.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    resolve_draft(args)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # SIGTERM unwinds like Ctrl-C, so what a command started (a loopback Redis, say) is stopped by
    # its `with`/`finally`. `up`, `serve` and `train` install their own handlers for a graceful stop.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    from adaptive_spec.models import ModelLoadError

    try:
        return args.func(args) or 0
    # ValueError covers the engine's InputError, PromptFileError and DraftSpecError: bad input, exit 2
    except (CommandError, ModelLoadError, ValueError) as exc:
        print(f"adaptive-spec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)
