"""What each part of the head's training recipe contributes, to choose its defaults: the same correction records,
one fresh head per recipe, scored on the same held-out records.

    adaptive-spec bench-head-ablation --domain python --train-records 128 \\
        --json ablation.json --plot ablation.png --records-file /tmp/python-records.bin
        # about 8 min of generation (2 threads), then about 6 min a recipe at one thread (unroll-2: 12)
    adaptive-spec bench-head-ablation --recipes rank-16,no-regression --steps 60

1. Records: the domain's prompts (or `--prompts FILE`'s) are split as `bench-drift` splits them (its
   held-out evaluation prompts are left out here too), and the first `--train-records +
   --heldout-records` traffic prompts are generated greedily by the target with the base head
   drafting, each leaving the correction record a server would log (the target's top-16 at each
   output position). With `--records-file` they are kept there and read back by the next run, so
   recipes can be added without generating again. The records are shuffled (`--seed`), the first
   `--heldout-records` held out and the next `--train-records` trained on: a run that reads a file
   back with fewer training records trains on a subset and scores on the same held-out records, a
   learning curve over data:

    adaptive-spec bench-head-ablation --prompts stdlib.jsonl --train-records 352 --heldout-records 24 \
        --records-file stdlib.bin --recipes fused-features-rank-128-unroll-4 --json stdlib-352.json
    adaptive-spec bench-head-ablation --prompts stdlib.jsonl --train-records 88 --heldout-records 24 \
        --records-file stdlib.bin --recipes fused-features-rank-128-unroll-4 --json stdlib-88.json
2. Per recipe: a fresh `TrainableHead` on the default model and a `HeadTrainer` with the recipe's
   `HeadSettings` take `--steps` optimiser steps, each on a batch the replay buffer samples from
   the training records (`batch_tokens` input tokens, as the online trainer does). Every
   `--eval-every` steps, and at the end, the held-out records are scored:
   - `match_1`: the gate's greedy match of the first draft token (the head reads the target's true
     state), the figure the online gate decides on;
   - `chain_match`: the greedy match of draft steps 1..depth on the head's own predicted states, each
     given the steps before it were right (`TrainableHead.chain_figures`);
   - `accepted_per_round`: the draft tokens a greedy verify of k = depth would accept, per round.
3. Figures as JSON (`--json`): per recipe its settings, the curve and the final figures; `--plot`
   draws the curves (first-token match, and tokens accepted per round at k = depth).

Teacher-forced figures, not timings: the speed of a recipe comes from `bench-drift`, which serves
real traffic. Recipes (`--recipes`, any of these names), each `HeadSettings` with one change from
rank-16 (LoRA rank 16, alpha 32, regression weight 1, noise 0.1, unroll 1, lr 1e-3, the head's
defaults until rank 64 replaced rank 16):

    rank-16        the baseline
    no-regression  regression_weight 0: the KL alone
    no-noise       noise 0: the true states exactly
    noise-0.3      noise 0.3
    rank-4, rank-64  LoRA rank 4 or 64 (alpha = 2 r, the same scale); rank-64, one draft step trained,
                   was HeadSettings() until unroll-2-decay-0.5-rank-64 replaced it, and that one
                   until unroll-3-decay-0.5-rank-64, and that one until unroll-3-decay-0.5-rank-128
    unroll-2       a second draft step trained on the head's own states
    lr-3e-3        the optimiser's learning rate 3e-3
    unroll-2-rank-64  unroll 2 at rank 64
    unroll-3-rank-64  unroll 3 at rank 64
    unroll-2-decay-0.5-rank-64, unroll-2-decay-0.3-rank-64, unroll-3-decay-0.5-rank-64
                   unroll 2 or 3 at rank 64, each further step weighted 0.5 or 0.3 of the one
                   before (HeadSettings.unroll_decay; 0.8 in the others)
    unroll-3-decay-0.5-rank-128, unroll-3-decay-0.5-rank-64-lr-2e-3
                   unroll-3-decay-0.5-rank-64 with a LoRA of rank 128 (alpha 256), or a learning rate of 2e-3
    fused-features-rank-128
                   HeadSettings() of 2026-11-29 (unroll-3-decay-0.5-rank-128) on EAGLE-3's fused features: the
                   target's low, middle and last layers side by side (feeding.state_layers); every other recipe reads
                   the last layer alone (HeadSettings() until 2026-11-30)
    fused-features-rank-128-unroll-4
                   HeadSettings() since 2026-11-30: the same with four draft steps trained
    softmax-vocab  rank 64 with the KL's softmax over the whole vocabulary, not the batch's tokens
                   (every other recipe: the batch's, HeadSettings.softmax)
    eagle3         the standard EAGLE-3 layout (drafters/eagle3_head.py) as the trainer trains it (Eagle3Settings():
                   every weight of the head's own trained whole, its norm and LM head the target's, frozen; the
                   recipe of fused-features-rank-128-unroll-4 otherwise), against which the project's own head is
                   measured to choose the default draft (issue 70)
    eagle3-train-lm-head, eagle3-lr-1e-4, eagle3-lr-1e-3
                   eagle3 with its norm and LM head rows trained too, or a learning rate of 1e-4 or 1e-3 (the
                   default since 2026-12-07, so eagle3-lr-1e-3 is eagle3 now; it was 3e-4)
    default-fp32, default-bf16-autocast
                   HeadSettings() of the time (two draft steps, rank 64) with a training step's forwards in fp32 or under bf16 autocast
                   (LoraSettings.autocast; every other recipe: "auto", bf16 where the CPU has it natively)
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from adaptive_spec.cache.feeding import state_layers
from adaptive_spec.formats.record import CorrectionRecord, record_from_output
from adaptive_spec.outputs.prompts import encode_item
from benchmarks.settings import RECIPES, AblationSettings
from service.finite import finite
from trainer.intake.buffer import ReplayBuffer
from trainer.intake.examples import examples_from_record
from trainer.learning.eagle3_distill import Eagle3Settings, Eagle3Trainer
from trainer.learning.eagle3_model import TrainableEagle3Head
from trainer.learning.head_distill import HeadSettings, HeadTrainer
from trainer.learning.head_model import TrainableHead

RECORD_TOPK = 16


def generate_records(engine, prompts, max_new_tokens: int, domain: str) -> list[CorrectionRecord]:
    """Greedy generations of the prompts, each as the correction record a server would log."""
    engine.record_topk = RECORD_TOPK
    records = []
    for item in tqdm(prompts, desc="records", unit="prompt", file=sys.stderr):
        ids, response_format = encode_item(item, engine)
        out = engine.generate(ids, max_new_tokens, response_format=response_format)
        records.append(
            record_from_output(
                out,
                request_id=uuid.uuid4().hex,
                created_at=time.time(),
                domain=domain,
                target_id=engine.target_id,
                draft_id=engine.draft_id,
                temperature=0.0,
            )
        )
    engine.record_topk = 0
    return records


def save_records(path: Path, records: list[CorrectionRecord]) -> None:
    """Length-prefixed `CorrectionRecord.encode()` bytes, one after another."""
    with path.open("wb") as out:
        for record in records:
            data = record.encode()
            out.write(len(data).to_bytes(4, "little") + data)


def load_records(path: Path) -> list[CorrectionRecord]:
    data, records, at = path.read_bytes(), [], 0
    while at < len(data):
        size = int.from_bytes(data[at : at + 4], "little")
        records.append(CorrectionRecord.decode(data[at + 4 : at + 4 + size]))
        at += 4 + size
    return records


def score(head: TrainableHead | TrainableEagle3Head, heldout, depth: int) -> dict:
    chain = head.chain_figures(heldout, depth=depth)
    return {
        "match_1": head.gate_figures(heldout).greedy_match,
        "chain_match": chain["match"],
        "accepted_per_round": chain["accepted_per_round"],
    }


def run_recipe(target, name: str, train, heldout, args: AblationSettings) -> dict:
    """Train a fresh head with one recipe on `train` (examples) and score it on `heldout` as it goes."""
    torch.manual_seed(args.seed)
    recipe = dict(RECIPES[name])
    head: TrainableHead | TrainableEagle3Head
    trainer: HeadTrainer | Eagle3Trainer
    if recipe.pop("layout", "head") == "eagle3":  # the standard layout (drafters/eagle3_head.py), trained whole
        eagle3 = Eagle3Settings(**{"batch_tokens": args.batch_tokens, **recipe})
        head = TrainableEagle3Head(target)
        trainer = Eagle3Trainer(head, eagle3, target_id="target", draft_id="eagle3")
    else:
        layers = state_layers(target)
        if recipe.pop("features", "last") != "fused":
            layers = layers[-1:]
        settings = HeadSettings(**{"batch_tokens": args.batch_tokens, **recipe})
        head = TrainableHead(target, feature_layers=layers)
        trainer = HeadTrainer(head, settings, target_id="target", draft_id="head")
    buffer = ReplayBuffer(10**9)
    for example in train:
        buffer.add(example)
    rng = np.random.default_rng(args.seed)
    curve = [{"step": 0, **score(head, heldout, args.depth)}]
    train_s = 0.0  # the optimiser steps alone (with the target forwards for their states), not the scoring
    scoring_states_s = head.states.seconds  # the held-out records' states, computed once by the first score
    for step in tqdm(range(1, args.steps + 1), desc=name, unit="step", file=sys.stderr):
        started = time.monotonic()
        trainer.train_step(buffer.sample_batch(rng, args.batch_tokens))
        train_s += time.monotonic() - started
        if step % args.eval_every == 0 or step == args.steps:
            curve.append({"step": step, **score(head, heldout, args.depth)})
            print(f"{name} step {step}: {json.dumps(curve[-1])}", file=sys.stderr)
    return {
        "settings": RECIPES[name],
        "resolved_settings": dataclasses.asdict(trainer.settings),  # every field, the defaults of the day included
        "train_s": train_s,
        "state_forward_s": head.states.seconds - scoring_states_s,  # of which the target's forwards for states
        "curve": curve,
        **curve[-1],
    }


def run_ablation(settings: AblationSettings) -> dict:
    """Every recipe on the same records (generated once, or read from `records_file`); the figures."""
    from adaptive_spec.engine import Engine
    from adaptive_spec.models import load_model, resolve_device, resolve_dtype
    from benchmarks.drift import split_prompts
    from benchmarks.prompts import prompt_set
    from trainer.settings import TrainerSettings

    if settings.records_file and settings.records_file.exists():
        records = load_records(settings.records_file)
        print(f"{len(records)} records read from {settings.records_file}", file=sys.stderr)
    else:  # the default serving path (bf16 where exact, compiled) logs them, as a server would
        engine = Engine.from_pretrained(target=settings.target, draft="head")
        items, name = prompt_set(settings.prompts, settings.domain)
        _, traffic = split_prompts(items, settings.eval_prompts, settings.seed)
        wanted = settings.train_records + settings.heldout_records
        records = generate_records(engine, traffic[:wanted], settings.max_new_tokens, name)
        if settings.records_file:
            save_records(settings.records_file, records)
        del engine
    random.Random(settings.seed).shuffle(records)
    heldout = records[: settings.heldout_records]
    kept = records[settings.heldout_records : settings.heldout_records + settings.train_records]
    if not kept:
        raise ValueError(f"{len(records)} records, none left to train on after {settings.heldout_records} held out")
    if len(kept) < settings.train_records:
        print(f"{len(kept)} records to train on, not {settings.train_records}: the rest were not made", file=sys.stderr)
    train = [examples_from_record(record) for record in kept]
    # The heads train over the target `adaptive-spec train` loads (TrainerSettings' dtype and device: fp32 on
    # a CPU): the head's layers cannot read a bf16 serving target's states in fp32.
    device = resolve_device(TrainerSettings.device)
    target, _ = load_model(settings.target, device, resolve_dtype(TrainerSettings.dtype, device))
    figures: dict = {
        "domain": records[0].domain,  # a records file read back names its prompts, whatever --domain says
        "target": settings.target,
        "train_records": len(train),
        "heldout_records": len(heldout),
        "heldout_request_ids": [record.request_id for record in heldout],
        "train_tokens": sum(example.num_tokens for example in train),
        "steps": settings.steps,
        "batch_tokens": settings.batch_tokens,
        "depth": settings.depth,
        "torch_threads": torch.get_num_threads(),
        "recipes": {},
    }
    for name in settings.recipes:
        figures["recipes"][name] = run_recipe(target, name, train, heldout, settings) | {
            "recipe": name,
            "train_records": len(train),
            "train_tokens": figures["train_tokens"],
        }
        if settings.json:
            write_figures(settings.json, figures)
    return figures


def merged(paths: list[Path]) -> dict:
    """The figures of several runs' JSON files, their recipes together (the first file's other keys). A
    recipe in runs on different numbers of training records (a learning curve over data) or of steps is
    named with them, "fused-features-rank-128-unroll-4, 88 records"; `train_records` becomes the fewest
    and `train_records_most` the most. Runs scored on other held-out records are refused."""
    runs = [_result_file(path) for path in paths]
    for path, run in zip(paths[1:], runs[1:], strict=True):
        for key in ("domain", "heldout_records", "heldout_request_ids"):
            if key in run and key in runs[0] and run[key] != runs[0][key]:
                raise ValueError(f"{path}: scored on other held-out records than {paths[0]} ({key} differs)")
    results = [
        (
            result.get("recipe", name),
            result.get("train_records", run["train_records"]),
            result["curve"][-1]["step"],
            result,
        )
        for run in runs
        for name, result in run["recipes"].items()
    ]
    sizes = sorted({count for _, count, _, _ in results})
    steps = {last for _, _, last, _ in results}
    recipes: dict = {}
    for name, count, last, result in results:
        label = ", ".join([name] + [f"{count} records"] * (len(sizes) > 1) + [f"{last} steps"] * (len(steps) > 1))
        if label in recipes:
            raise ValueError(f"{label} is in two of the files: merge one of them")
        recipes[label] = result
    figures = runs[0] | {"recipes": recipes}
    if len(sizes) > 1:  # the first run's token count would name one of them
        figures |= {"train_records": sizes[0], "train_records_most": sizes[-1], "train_tokens": None}
    return figures


def _result_file(path: Path) -> dict:
    """A result file --json wrote, checked for what merging reads."""
    run = json.loads(path.read_text())
    if not all(key in run for key in ("domain", "heldout_records", "train_records", "recipes")):
        raise ValueError(f"{path}: not a bench-head-ablation result file (--json)")
    if "train_records_most" in run and any("train_records" not in result for result in run["recipes"].values()):
        raise ValueError(f"{path}: a merge of runs on different record counts whose recipes lack their counts")
    return run


def format_report(figures: dict) -> str:
    lines = []
    for name, result in figures["recipes"].items():
        chain = " ".join(f"{value:.3f}" for value in result["chain_match"])
        lines.append(
            f"{name:14s} match_1 {result['match_1']:.3f}  chain {chain}  "
            f"accepted/round {result['accepted_per_round']:.3f}  ({result['train_s']:.0f} s)"
        )
    return "\n".join(lines)


def plot(figures: dict, path: Path) -> None:
    """Two panels over optimiser steps, one line per recipe: the first draft token's match (the gate's
    figure, on the target's true state), and draft tokens accepted per round at k = depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (first, rounds) = plt.subplots(1, 2, figsize=(11, 4.5))
    for index, (name, result) in enumerate(figures["recipes"].items()):
        steps = [point["step"] for point in result["curve"]]
        style = dict(marker="o", ms=3, lw=1.8, color=f"C{index % 10}", label=name)
        first.plot(steps, [point["match_1"] for point in result["curve"]], **style)
        rounds.plot(steps, [point["accepted_per_round"] for point in result["curve"]], **style)
    first.set_ylabel("first draft token: greedy match on held-out records")
    rounds.set_ylabel(f"draft tokens accepted per round at k = {figures['depth']}")
    for axis in (first, rounds):
        axis.set_xlabel(f"optimiser steps ({figures['batch_tokens']} tokens each)")
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    first.legend(fontsize=8)
    records = figures["train_records"]
    if "train_records_most" in figures:
        records = f"{records}-{figures['train_records_most']}"
    fig.suptitle(
        f"head recipes on {records} {figures['domain']} records, scored on {figures['heldout_records']} "
        f"held-out records (teacher-forced; {Path(str(figures['target'])).name})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_figures(path: Path, figures: dict) -> None:
    path.write_text(json.dumps(finite(figures), indent=2, allow_nan=False) + "\n")
