"""`adaptive-spec train`: the online trainer alone, as a long-lived process (trainer/process/main.py).

    REDIS_URL=redis://127.0.0.1:6379/0 adaptive-spec train --data-dir ./.adaptive-spec --threads 1

Every flag is a field of the trainer's settings (trainer/settings.py), which also reads it from the
environment (ADAPTIVE_SPEC_<FIELD>); a flag that is given wins, and each default is the settings'.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from cli.options import DTYPES, confidence, non_negative_int, positive_int, use_data_dir
from trainer.settings import TrainerSettings

DEFAULTS = TrainerSettings()


def add_commands(commands) -> None:
    train = commands.add_parser(
        "train",
        help="the online trainer alone: correction records in, promoted adapters out to MLflow",
        description="Read correction records from Redis (REDIS_URL or --redis-url; none is started here), train the "
        "draft's LoRA adapter, and register and promote every adapter the gate accepts in MLflow "
        "(MLFLOW_TRACKING_URI, else DATA_DIR/mlflow.db). Runs until SIGTERM or SIGINT, then "
        "checkpoints and exits. Unset flags come from ADAPTIVE_SPEC_<FLAG> (trainer/settings.py).",
    )
    train.add_argument("--target", default=None, help=f"the served target (default: {DEFAULTS.target})")
    train.add_argument(
        "--draft",
        default=None,
        help="the draft to train: early-exit:N, head (an EAGLE-style head; the trainer runs the target "
        f"once per record for its hidden states) or a draft model (default: {DEFAULTS.draft})",
    )
    train.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help=f"adapters, checkpoints and the default MLflow store (default: {DEFAULTS.data_dir})",
    )
    train.add_argument("--redis-url", default=None, help="default: $REDIS_URL")
    train.add_argument(
        "--consumer",
        default=None,
        help="consumer name in the stream's group, stable across restarts (default: trainer-<hostname>)",
    )
    train.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    train.add_argument("--dtype", default=None, choices=DTYPES, help=f"default: {DEFAULTS.dtype}")
    train.add_argument("--device", default=None, help=f"default: {DEFAULTS.device}")
    train.add_argument(
        "--min-new-records",
        type=positive_int,
        default=None,
        help=f"new training records before a round (default: {DEFAULTS.min_new_records})",
    )
    train.add_argument(
        "--round-steps",
        type=positive_int,
        default=None,
        help=f"optimiser steps per round (default: {DEFAULTS.round_steps})",
    )
    train.add_argument(
        "--max-round-steps",
        type=positive_int,
        default=None,
        help="while fewer than --min-new-records new records are in, a round keeps training, up to this many "
        f"steps, instead of waiting idle (default: {DEFAULTS.max_round_steps}; equal to --round-steps: fixed rounds)",
    )
    train.add_argument(
        "--gate-min-positions",
        type=positive_int,
        default=None,
        help="held-out positions (and at least 4 records) before the gate decides anything; after that it "
        "promotes a candidate once it beats the champion by more than 0.02 in greedy match with "
        f"--gate-confidence (default: {DEFAULTS.gate_min_positions})",
    )
    train.add_argument(
        "--gate-confidence",
        type=confidence,
        default=None,
        help="one-sided confidence, over held-out records, that the candidate's gain exceeds the margin "
        f"(trainer/evaluation/decision.py; default: {DEFAULTS.gate_confidence})",
    )
    train.add_argument(
        "--max-domains",
        type=non_negative_int,
        default=None,
        help="domains (the requests' adaptive_spec.domain tag) that get an adapter of their own, trained and "
        "gated on their own traffic and served under the alias champion-<domain>; untagged requests and "
        "further domains train the general adapter; 0: one general adapter for all traffic "
        f"(default: {DEFAULTS.max_domains})",
    )
    train.add_argument("--checkpoint-every-s", type=float, default=None, help=f"default: {DEFAULTS.checkpoint_every_s}")
    train.add_argument("--budget-minutes", type=float, default=None, help="stop after this long (default: never)")
    train.set_defaults(func=cmd_train)


def cmd_train(args) -> int:
    from trainer.process.main import run_trainer

    logging.getLogger("trainer").setLevel(logging.INFO)  # a daemon: progress is its output
    use_data_dir(args.data_dir)
    settings = TrainerSettings.from_env(
        target=args.target,
        draft=args.draft,
        data_dir=args.data_dir,
        redis_url=args.redis_url,
        consumer=args.consumer,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        min_new_records=args.min_new_records,
        round_steps=args.round_steps,
        max_round_steps=args.max_round_steps,
        gate_min_positions=args.gate_min_positions,
        gate_confidence=args.gate_confidence,
        max_domains=args.max_domains,
        checkpoint_every_s=args.checkpoint_every_s,
        budget_s=args.budget_minutes * 60 if args.budget_minutes else None,
    )
    counters = run_trainer(settings)
    print(json.dumps(counters), file=sys.stderr)
    return 0
