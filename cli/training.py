"""`adaptive-spec train`: the online trainer alone, as a long-lived process (trainer/process/main.py);
`adaptive-spec distill`: the same trainer offline, on a prompt file or exported records
(trainer/process/distill.py), so a deployment starts warm.

    REDIS_URL=redis://127.0.0.1:6379/0 adaptive-spec train --data-dir ./.adaptive-spec --threads 1
    adaptive-spec distill --prompts python --minutes 10        # then `adaptive-spec up` serves the version

Every flag is a field of the trainer's settings (trainer/settings.py), which also reads it from the
environment (ADAPTIVE_SPEC_<FIELD>); a flag that is given wins, and each default is the settings'.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path

from cli.options import (
    DTYPES,
    CommandError,
    confidence,
    load_engine,
    model_options,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    prompt_file,
    redis_url,
    use_data_dir,
    write_json,
)
from trainer.settings import AUTOCAST, AUTOCAST_MIN_HIDDEN, TrainerSettings

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
    train.add_argument(
        "--autocast",
        default=None,
        choices=AUTOCAST,
        help="run a training step's forwards under bf16 autocast (weights, gradients and optimiser stay fp32): "
        f"auto = where the weights are fp32, the model is at least {AUTOCAST_MIN_HIDDEN} wide and the device computes "
        "bf16 natively (AVX512-BF16, AMX), where it "
        f"trained the head 1.8x as fast here for the same held-out match (default: {DEFAULTS.autocast})",
    )
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
        "--idle-after-s",
        type=non_negative_float,
        default=None,
        help="once no record has come for this long, a lineage that has promoted a version trains on its buffer "
        "again (idle rounds, gated as any; they stop after two in a row that do not promote); 0: never "
        f"(default: {DEFAULTS.idle_after_s})",
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

    distill = commands.add_parser(
        "distill",
        help="train the draft offline from a prompt file or exported correction records, gate it on a held-out "
        "split and register it as a normal version, so a deployment starts warm",
        description="The target generates each prompt (greedy), the draft learns as the online trainer teaches it, "
        "every candidate the gate accepts on held-out records is registered and promoted in MLflow "
        "(MLFLOW_TRACKING_URI, else DATA_DIR/mlflow.db): `up` and `serve` start from it and `train` continues "
        "from it. Uses REDIS_URL, else a loopback redis-server it starts and stops (a private stream either way). "
        "Ends with a line naming the version and its held-out figures; exit status 1 when no version was registered.",
    )
    source = distill.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--prompts",
        type=prompt_file,
        help="a JSONL prompt file, as the benchmarks take it, or a shipped set's name (python, sql, tool_calls, ...)",
    )
    source.add_argument(
        "--records",
        type=Path,
        help="an export of correction records (length-prefixed encoded records: a trainer checkpoint's buffer.bin "
        "or holdout.bin, or what --save-records wrote), replayed instead of generating; records of another "
        "--target or --draft are rejected and counted, as the online trainer does",
    )
    distill.add_argument("--minutes", type=positive_float, default=10.0, help="bound on the whole run (default: 10)")
    distill.add_argument(
        "--eval-prompts",
        type=non_negative_int,
        default=12,
        help="prompts held out of training and measured at the end with the last version (default: 12; "
        "written to DATA_DIR/distill-heldout.jsonl for `bench --prompts`)",
    )
    distill.add_argument("--save-records", type=Path, default=None, help="write the generated records to this file")
    distill.add_argument("--data-dir", type=Path, default=None, help=f"default: {DEFAULTS.data_dir}")
    distill.add_argument(
        "--gate-min-positions",
        type=positive_int,
        default=None,
        help=f"held-out positions before the gate decides (default: {DEFAULTS.gate_min_positions})",
    )
    distill.add_argument(
        "--min-new-records", type=positive_int, default=None, help=f"default: {DEFAULTS.min_new_records}"
    )
    distill.add_argument("--round-steps", type=positive_int, default=None, help=f"default: {DEFAULTS.round_steps}")
    distill.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the figures to FILE")
    model_options(distill)
    distill.set_defaults(func=cmd_distill)


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
        autocast=args.autocast,
        min_new_records=args.min_new_records,
        round_steps=args.round_steps,
        max_round_steps=args.max_round_steps,
        idle_after_s=args.idle_after_s,
        gate_min_positions=args.gate_min_positions,
        gate_confidence=args.gate_confidence,
        max_domains=args.max_domains,
        checkpoint_every_s=args.checkpoint_every_s,
        budget_s=args.budget_minutes * 60 if args.budget_minutes else None,
    )
    counters = run_trainer(settings)
    print(json.dumps(counters), file=sys.stderr)
    return 0


def cmd_distill(args) -> int:
    from adaptive_spec.drafters.spec import parse_draft_spec
    from adaptive_spec.outputs.prompts import load_prompts
    from registry.client import AdapterRegistry
    from trainer.process.distill import DistillSettings, distill, format_line, load_record_file

    logging.getLogger("trainer").setLevel(logging.INFO if args.verbose else logging.WARNING)
    use_data_dir(args.data_dir)
    if not parse_draft_spec(args.draft).trainable:
        raise CommandError(f"the {args.draft} draft has no weights to train; use head, early-exit:N or a draft model")
    items = load_prompts(args.prompts) if args.prompts else None
    records = load_record_file(args.records) if args.records else None
    settings = DistillSettings(
        minutes=args.minutes,
        max_new_tokens=args.max_new_tokens,
        eval_prompts=args.eval_prompts if items else 0,
    )
    train = TrainerSettings.from_env(
        target=args.target,
        draft=args.draft,
        data_dir=args.data_dir,
        device=args.device,
        dtype=args.dtype,
        gate_min_positions=args.gate_min_positions,
        min_new_records=args.min_new_records,
        round_steps=args.round_steps,
    )
    engine = load_engine(args, k=args.k)  # --compile and --tree-budget too, which it used to drop
    with redis_url(Path(train.data_dir)) as url:
        train = dataclasses.replace(train, redis_url=url)
        registry = AdapterRegistry(train.tracking_uri, data_dir=train.data_dir, redis_url=url)
        try:
            figures = distill(
                engine,
                train,
                settings,
                prompts=items,
                records=records,
                save_records=args.save_records,
                registry=registry,
            )
        finally:
            registry.close()
    print(format_line(figures))
    write_json(args.json, figures)
    return 0 if figures["version"] else 1
