"""The benchmarks that measured what the trainer's defaults are: `bench-intake` (how many correction
records per second one trainer consumes) and `bench-head-ablation` (what each part of the head's
training recipe contributes). The code is in benchmarks/intake.py and benchmarks/head_ablation.py.

    adaptive-spec bench-intake --records 2000 --json intake.json       # the default model, about 4 min
    adaptive-spec bench-intake --target ./tiny --draft early-exit:1 --records 48 --prompt-tokens 8,16 \\
        --output-tokens 24 --topk 8 --loop-minutes 0.5                  # a few seconds on a tiny model
    adaptive-spec bench-head-ablation --domain python --train-records 128 --json ablation.json --plot ablation.png
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from adaptive_spec.options import DTYPES
from benchmarks.settings import RECIPES, AblationSettings, IntakeBenchSettings
from cli.options import MODELS, positive_float, positive_int, prompt_file, raise_input, write_json


def add_commands(commands) -> None:
    defaults = IntakeBenchSettings()
    intake = commands.add_parser(
        "bench-intake",
        help="correction records per second one online trainer consumes, with and without training rounds",
        description="How many correction records per second one online trainer consumes on this machine: "
        "fills the correction stream with synthetic records of real shape, then measures, on the same records, "
        "(1) intake alone: the trainer's loop with no training rounds, until every entry is read and "
        "acknowledged, and (2) the trainer loop with the defaults of `adaptive-spec train`, training rounds "
        "included, for --loop-minutes. With a backlog the loop reads 64 entries per round, so (2) is the most "
        "traffic one trainer keeps up with while training. A loopback redis-server is started unless REDIS_URL "
        "is set. See benchmarks/intake.py.",
    )
    intake.add_argument("--records", type=positive_int, default=defaults.records, help="default: %(default)s")
    intake.add_argument(
        "--loop-minutes",
        type=positive_float,
        default=defaults.loop_minutes,
        help="time budget of part 2; a round under way finishes first (default: %(default)s)",
    )
    intake.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the figures here")
    models = intake.add_argument_group("models (as `adaptive-spec train` takes them)")
    models.add_argument("--target", default=MODELS.target, help="default: %(default)s")
    models.add_argument(
        "--draft", type=_trainable, default=MODELS.draft, help="the draft the trainer trains (default: %(default)s)"
    )
    models.add_argument("--device", default=MODELS.device, help="default: %(default)s")
    models.add_argument("--dtype", default=MODELS.dtype, choices=DTYPES)
    models.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    shape = intake.add_argument_group("the synthetic records")
    shape.add_argument(
        "--prompt-tokens",
        type=_token_range,
        default=defaults.prompt_tokens,
        metavar="MIN,MAX",
        help="prompt length, uniform (default: 100,200)",
    )
    shape.add_argument(
        "--output-tokens", type=positive_int, default=defaults.output_tokens, help="default: %(default)s"
    )
    shape.add_argument(
        "--topk",
        type=positive_int,
        default=defaults.topk,
        help="target top-m per output token, the server's record_topk (default: %(default)s)",
    )
    shape.add_argument("--seed", type=int, default=defaults.seed, help="default: %(default)s")
    intake.set_defaults(func=cmd_bench_intake)

    recipe = AblationSettings()
    ablation = commands.add_parser(
        "bench-head-ablation",
        help="what each part of the head's training recipe contributes, on the same correction records",
        description="Generate correction records of a domain's traffic with the target (or read them back), "
        "then train one fresh head per recipe on them and score it on the same held-out records as it goes: "
        "first-token match, the chain of draft steps on its own states, and tokens accepted per round. "
        "Teacher-forced figures, not timings. See benchmarks/head_ablation.py.",
        epilog="Recipes: " + ", ".join(RECIPES),
    )
    ablation.add_argument("--target", default=recipe.target, help="default: %(default)s")
    ablation.add_argument("--domain", default=recipe.domain, help="a shipped prompt set (default: %(default)s)")
    ablation.add_argument(
        "--prompts",
        type=prompt_file,
        help="a JSONL prompt file (or a shipped set's name) instead of --domain, split as bench-drift splits it",
    )
    ablation.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated (default: all)")
    ablation.add_argument(
        "--train-records",
        type=positive_int,
        default=recipe.train_records,
        help="records trained on, after the held-out ones; of a --records-file, at most this many, so fewer "
        "train on a subset scored on the same held-out records (default: %(default)s)",
    )
    ablation.add_argument("--heldout-records", type=positive_int, default=recipe.heldout_records)
    ablation.add_argument("--max-new-tokens", type=positive_int, default=recipe.max_new_tokens)
    ablation.add_argument("--steps", type=positive_int, default=recipe.steps, help="optimiser steps per recipe")
    ablation.add_argument("--eval-every", type=positive_int, default=recipe.eval_every)
    ablation.add_argument("--batch-tokens", type=positive_int, default=recipe.batch_tokens)
    ablation.add_argument(
        "--depth", type=positive_int, default=recipe.depth, help="draft steps scored on its own states"
    )
    ablation.add_argument(
        "--eval-prompts", type=positive_int, default=recipe.eval_prompts, help="bench-drift's, left out"
    )
    ablation.add_argument("--seed", type=int, default=recipe.seed)
    ablation.add_argument("--records-file", type=Path, help="keep the generated records here, or read them")
    ablation.add_argument("--json", type=Path, metavar="FILE", help="the figures (written after each recipe)")
    ablation.add_argument("--plot", type=Path, metavar="FILE.png", help="a PNG of the curves")
    ablation.add_argument("--from-json", type=Path, nargs="+", help="plot these result files (merged), run nothing")
    ablation.set_defaults(func=cmd_bench_head_ablation)


def _trainable(text: str) -> str:
    """--draft of the intake benchmark: a draft with weights to train."""
    from adaptive_spec.drafters.spec import DraftSpecError, parse_draft_spec

    try:
        trainable = parse_draft_spec(text).trainable
    except DraftSpecError as exc:
        raise argparse.ArgumentTypeError(f"--draft {text}: {exc}") from None
    if not trainable:
        raise argparse.ArgumentTypeError(
            f"--draft {text}: no weights to train; use early-exit:N, head or a draft model"
        )
    return text


def _token_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"MIN,MAX in tokens, e.g. 100,200; got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return low, high


def cmd_bench_intake(args) -> int:
    import torch

    from benchmarks.intake import format_report, measure
    from cli.options import CommandError
    from launch.redis import RedisStartError

    logging.getLogger("trainer").setLevel(logging.INFO)  # the rounds, as `adaptive-spec train` logs them
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = IntakeBenchSettings(
        target=args.target,
        draft=args.draft,
        dtype=args.dtype,
        device=args.device,
        records=args.records,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        topk=args.topk,
        loop_minutes=args.loop_minutes,
        seed=args.seed,
    )
    try:
        figures = measure(settings)
    except RedisStartError as exc:
        raise CommandError(str(exc)) from None
    print(format_report(figures))
    write_json(args.json, figures)
    return 0


def cmd_bench_head_ablation(args) -> int:
    """Files that do not merge and records that leave nothing to train on raise ValueError: exit 2 in main()."""
    from benchmarks.head_ablation import format_report, merged, plot, run_ablation, write_figures

    if args.from_json:
        figures = merged(args.from_json)
        if args.json:
            write_figures(args.json, figures)
    else:
        try:
            settings = AblationSettings(
                target=args.target,
                domain=args.domain,
                prompts=args.prompts,
                recipes=tuple(name for name in args.recipes.split(",") if name),
                train_records=args.train_records,
                heldout_records=args.heldout_records,
                max_new_tokens=args.max_new_tokens,
                steps=args.steps,
                eval_every=args.eval_every,
                batch_tokens=args.batch_tokens,
                depth=args.depth,
                eval_prompts=args.eval_prompts,
                seed=args.seed,
                records_file=args.records_file,
                json=args.json,
            )
        except ValueError as exc:
            raise_input(str(exc))
        figures = run_ablation(settings)
        print(format_report(figures))
    if args.plot:
        plot(figures, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
