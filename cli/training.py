"""`adaptive-spec train`: the online trainer alone, as a long-lived process (trainer/main.py).

REDIS_URL=redis://127.0.0.1:6379/0 adaptive-spec train --data-dir ./.adaptive-spec --threads 1
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from adaptive_spec.contracts import DATA_DIR_ENV, DEFAULT_DRAFT, DEFAULT_MODEL, REDIS_URL_ENV
from cli.options import DTYPES, confidence, non_negative_int, positive_int


def add_commands(commands) -> None:
    train = commands.add_parser(
        "train",
        help="the online trainer alone: correction records in, promoted adapters out to MLflow",
        description="Read correction records from Redis (REDIS_URL or --redis-url; none is started here), train the "
        "draft's LoRA adapter, and register and promote every adapter the gate accepts in MLflow "
        "(MLFLOW_TRACKING_URI, else DATA_DIR/mlflow.db). Runs until SIGTERM or SIGINT, then "
        "checkpoints and exits. See trainer/main.py.",
    )
    train.add_argument("--target", default=DEFAULT_MODEL, help="the served target (default: %(default)s)")
    train.add_argument(
        "--draft",
        default=DEFAULT_DRAFT,
        help="the draft to train: early-exit:N, head (an EAGLE-style head; the trainer runs the target "
        "once per record for its hidden states) or a draft model (default: %(default)s)",
    )
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
    train.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    train.add_argument("--dtype", default="auto", choices=DTYPES)
    train.add_argument("--device", default="auto")
    train.add_argument(
        "--min-new-records",
        type=positive_int,
        default=16,
        help="new training records before a round (default: %(default)s)",
    )
    train.add_argument(
        "--round-steps", type=positive_int, default=20, help="optimiser steps per round (default: %(default)s)"
    )
    train.add_argument(
        "--max-round-steps",
        type=positive_int,
        default=100,
        help="while fewer than --min-new-records new records are in, a round keeps training, up to this many "
        "steps, instead of waiting idle (default: %(default)s; equal to --round-steps: fixed rounds)",
    )
    train.add_argument(
        "--gate-min-positions",
        type=positive_int,
        default=128,
        help="held-out positions (and at least 4 records) before the gate decides anything; after that it "
        "promotes a candidate once it beats the champion by more than 0.02 in greedy match with "
        "--gate-confidence (default: %(default)s)",
    )
    train.add_argument(
        "--gate-confidence",
        type=confidence,
        default=0.99,
        help="one-sided confidence, over held-out records, that the candidate's gain exceeds the margin "
        "(trainer/decision.py; default: %(default)s)",
    )
    train.add_argument(
        "--max-domains",
        type=non_negative_int,
        default=8,
        help="domains (the requests' adaptive_spec.domain tag) that get an adapter of their own, trained and "
        "gated on their own traffic and served under the alias champion-<domain>; untagged requests and "
        "further domains train the general adapter; 0: one general adapter for all traffic "
        "(default: %(default)s)",
    )
    train.add_argument("--checkpoint-every-s", type=float, default=30.0, help="default: %(default)s")
    train.add_argument("--budget-minutes", type=float, default=None, help="stop after this long (default: never)")
    train.set_defaults(func=cmd_train)


def cmd_train(args) -> int:
    from adaptive_spec.models import data_dir
    from trainer.main import TrainSettings, run_trainer

    logging.getLogger("trainer").setLevel(logging.INFO)  # a daemon: progress is its output
    if args.data_dir:
        os.environ[DATA_DIR_ENV] = str(args.data_dir)  # the model cache follows it
    settings = TrainSettings(
        target=args.target,
        draft=args.draft,
        data_dir=args.data_dir or data_dir(),
        redis_url=args.redis_url or os.environ.get(REDIS_URL_ENV),
        consumer=args.consumer,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        min_new_records=args.min_new_records,
        round_steps=args.round_steps,
        max_round_steps=max(args.max_round_steps, args.round_steps),
        gate_min_positions=args.gate_min_positions,
        gate_confidence=args.gate_confidence,
        max_domains=args.max_domains,
        checkpoint_every_s=args.checkpoint_every_s,
        budget_s=args.budget_minutes * 60 if args.budget_minutes else None,
    )
    counters = run_trainer(settings)
    print(json.dumps(counters), file=sys.stderr)
    return 0
